"""Collation layout: [left pads | prompt | completion | right pads], per-token extras zero on text."""

import torch

from r1fit.data.batch import Prompt, collate, cut_after_eos, split_too_long
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
