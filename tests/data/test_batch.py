"""Collation layout: [left pads | prompt | completion | right pads], per-token extras zero on text."""

from types import SimpleNamespace

import torch

from r1fit.data.batch import Prompt, collate, consecutive_groups, cut_after_eos, micro_batches, split_too_long
from r1fit.data.sample import Sample

PAD = 0


def prompt(ids, types, pixels):
    sample = Sample(images=[], problem="q", solution="a", source="test")
    return Prompt(torch.tensor(ids), {"mm_token_type_ids": torch.tensor(types)},
                  {"pixel_values": torch.full((pixels, 3), float(pixels)),
                   "image_grid_thw": torch.tensor([[1, pixels, 1]])}, sample)


def test_collate_layout():
    a = prompt([5, 6, 7], [0, 1, 0], 2)
    b = prompt([8, 9], [1, 0], 3)
    batch = collate([a, b], [torch.tensor([11, 12]), torch.tensor([13])], PAD)
    assert batch.prompt_len == 3
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7, 11, 12], [PAD, 8, 9, 13, PAD]]
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert batch.inputs["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert batch.completion_ids.tolist() == [[11, 12], [13, PAD]]
    assert batch.completion_mask.tolist() == [[1, 1], [1, 0]]
    # image tensors of the rows are concatenated in row order
    assert batch.inputs["pixel_values"].shape == (5, 3)
    assert batch.inputs["pixel_values"][:, 0].tolist() == [2, 2, 3, 3, 3]
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 2, 1], [1, 3, 1]]


def test_collate_without_completions_is_a_generation_batch():
    batch = collate([prompt([5, 6, 7], [0, 1, 0], 1), prompt([8], [0], 1)], None, PAD)
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert batch.completion_ids.shape == (2, 0)


def test_collate_without_images_keeps_the_token_columns():
    rows = [prompt([5, 6, 7], [0, 1, 0], 2), prompt([8, 9], [1, 0], 3)]
    full, text = collate(rows, None, PAD), collate(rows, None, PAD, images=False)
    assert set(full.inputs) - set(text.inputs) == {"pixel_values", "image_grid_thw"}
    for key, value in text.inputs.items():
        assert torch.equal(value, full.inputs[key]), key


def test_text_only_prompt_next_to_image_prompt():
    text_only = Prompt(torch.tensor([4, 4]), {}, {}, Sample([], "q", "a", "t"))
    batch = collate([prompt([5, 6], [1, 0], 2), text_only], None, PAD)
    assert batch.inputs["mm_token_type_ids"].tolist() == [[1, 0], [0, 0]]
    assert batch.inputs["pixel_values"].shape == (2, 3)


def test_cut_after_eos():
    assert cut_after_eos(torch.tensor([3, 4, 9, 0, 0]), [9]).tolist() == [3, 4, 9]
    assert cut_after_eos(torch.tensor([3, 4, 5]), [9]).tolist() == [3, 4, 5]
    assert cut_after_eos(torch.tensor([7, 9, 7]), [9, 7]).tolist() == [7]


def test_split_too_long_keeps_short_prompts_and_names_long_ones():
    short, long_ = prompt([1, 2, 3], [0, 0, 0], 1), prompt([1] * 5, [0] * 5, 1)
    long_.sample.source = "train.jsonl:7"
    kept, errors = split_too_long([short, long_, short], max_tokens=4)
    assert kept == [short, short]
    assert errors == ["train.jsonl:7: the prompt has 5 tokens, more than "
                      "data.max_prompt_tokens=4"]
    assert split_too_long([short, long_], max_tokens=None) == ([short, long_], [])


def test_collate_takes_a_completion_mask_where_given():
    batch = collate([prompt([5], [0], 1), prompt([6], [0], 1)],
                    [torch.tensor([11, 12, 13]), torch.tensor([14, 15])], PAD,
                    [torch.tensor([1.0, 0.0, 1.0]), None])
    assert batch.completion_mask.tolist() == [[1, 0, 1], [1, 1, 0]]


def test_chat_messages_put_images_at_their_placeholders_and_keep_the_rows_system_turn():
    from r1fit.data.batch import chat_messages

    turns = (("system", "Be brief."), ("user", "<image>left, <image>right: same?"),
             ("assistant", "no"))
    sample = Sample(images=[], problem="left, right: same?", solution="no", source="t",
                    turns=turns)
    assert chat_messages(sample, "ignored: the row has its own") == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "left, "},
                                     {"type": "image"}, {"type": "text", "text": "right: same?"}]}]
    # a sample without turns: its images, then its question, after the system prompt
    plain = Sample(images=[object(), object()], problem="q?", solution="a", source="t")
    assert chat_messages(plain, "sys") == [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "q?"}]}]


def test_micro_batches_cover_the_rows_in_order():
    rows, comps = list("abcde"), [torch.tensor([i]) for i in range(5)]
    pieces = [(p, r) for p, r, _ in micro_batches(rows, comps, 2)]
    assert pieces == [(slice(0, 2), ["a", "b"]), (slice(2, 4), ["c", "d"]), (slice(4, 5), ["e"])]


def _token_rows():
    """Two groups: prompt A (10 tokens) x completions of 3, 4, 5; prompt B (6 tokens) x 2, 7."""
    a, b = SimpleNamespace(length=10), SimpleNamespace(length=6)
    rows = [a, a, a, b, b]
    comps = [torch.zeros(n, dtype=torch.long) for n in (3, 4, 5, 2, 7)]
    return rows, comps


def test_micro_batches_by_tokens_without_sharing():
    """Each row costs its prompt + completion: 13, 14, 15, 8, 13 tokens. A budget of 30 takes
    13 + 14 = 27 (adding 15 would be 42), then 15 + 8 = 23 (+13 = 36), then 13."""
    rows, comps = _token_rows()
    pieces = [p for p, _, _ in micro_batches(rows, comps, 99, tokens=30)]
    assert pieces == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_micro_batches_by_tokens_with_sharing():
    """A group's prompt counts once per micro-batch: 10 + 3 + 4 + 5 = 22 for group A, then
    B's 6 + 2 = 8 fits a budget of 30 (22 + 8 = 30); B's next row 7 would make 37, so it starts
    a new micro-batch that holds B's prompt again: 6 + 7 = 13."""
    rows, comps = _token_rows()
    pieces = [p for p, _, _ in micro_batches(rows, comps, 99, tokens=30, shared=True)]
    assert pieces == [slice(0, 4), slice(4, 5)]
    # a budget below one row: every row alone, none dropped
    pieces = [p for p, _, _ in micro_batches(rows, comps, 99, tokens=5, shared=True)]
    assert pieces == [slice(i, i + 1) for i in range(5)]


def test_consecutive_groups_follow_prompt_identity():
    rows, comps = _token_rows()
    unique, groups = consecutive_groups(rows, comps)
    assert unique == [rows[0], rows[3]]
    assert [[int(c.shape[0]) for c in g] for g in groups] == [[3, 4, 5], [2, 7]]
