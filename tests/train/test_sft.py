import random
from dataclasses import replace

import pytest
import torch

from r1fit.data.batch import encode_prompts
from r1fit.data.sample import Sample
from r1fit.train.sft import build_targets, target_text

SYSTEM = "Zoom, then answer."


def test_target_text_wraps_bare_and_tagged_solutions():
    assert target_text("red", "look") == "<think>look</think><answer>red</answer>"
    assert target_text("<answer> 3 </answer>", "look") == "<think>look</think><answer>3</answer>"
    full = "<think>two circles</think><answer>2</answer>"
    assert target_text(full, "look") == full
    # a solution with its own thinking and a bare answer (DeepSeek-R1's layout) keeps its
    # thinking, and the answer gets the tags; before, it was nested inside <answer>
    assert target_text("<think>two red\ncircles</think>\n\nThe answer is 2\n", "look") == \
        "<think>two red\ncircles</think><answer>The answer is 2</answer>"


def test_answers_are_learnt_as_written_unless_think_is_set():
    # sft.think unset (the default for user data): nothing is rewritten
    for solution in ("red", "<answer> 3 </answer>", "It is 3.\n"):
        assert target_text(solution, None) == solution.strip()
    samples = [Sample([], "q", "red", "t"), Sample([], "q", "<answer>blue</answer>", "t")]
    assert build_targets(samples, None, None) == ["red", "<answer>blue</answer>"]
    # the format warm-up teaches the format all the same, with an empty think block
    warm = build_targets(samples, None, random.Random(0))
    assert set(warm) <= {"<think></think><answer>red</answer>", "<think></think><answer>blue</answer>"}


def test_format_only_targets_use_answers_of_the_batch_not_the_row():
    samples = [Sample([], f"q{i}", answer, "t") for i, answer in
               enumerate(["red", "blue", "green", "yellow"] * 25)]
    own = build_targets(samples, "x", None)
    assert own == [f"<think>x</think><answer>{s.solution}</answer>" for s in samples]
    shuffled = build_targets(samples, "x", random.Random(0))
    answers = {t.split("<answer>")[1].split("</answer>")[0] for t in shuffled}
    assert answers == {"red", "blue", "green", "yellow"}
    matches = sum(a == b for a, b in zip(own, shuffled))
    assert matches < 50  # about a quarter match by chance, not all


def test_cut_answers_cuts_targets_and_masks_past_the_limit_only():
    from r1fit.train.sft import cut_answers

    targets = [torch.arange(5), torch.arange(3), torch.arange(7)]
    masks = [None, torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1, 1, 0, 1, 1])]
    cut_targets, cut_masks, cut = cut_answers(targets, masks, 4)
    assert cut == [0, 2]
    assert [t.tolist() for t in cut_targets] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]]
    assert cut_masks[0] is None
    assert [m.tolist() for m in cut_masks[1:]] == [[0, 1, 1], [0, 0, 1, 1]]
    assert cut_answers([torch.arange(4)], [None], 4)[2] == []  # at the limit: kept whole


def test_balance_turns_splits_the_row_weight_evenly_over_its_turns():
    from r1fit.train.sft import balance_turns

    # a call of 3 tokens, a tool turn (context), an answer of 1 token: 4 tokens, 2 turns of 2
    got = balance_turns(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0]))
    assert got.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 0.0, 0.0, 2.0])
    got = balance_turns(torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]))
    assert got.tolist() == pytest.approx([0, 2, 0, 2 / 3, 2 / 3, 2 / 3, 0, 1, 1])  # 6 over 3
    one = torch.tensor([0.0, 1.0, 1.0])
    assert balance_turns(one) is one  # one turn: unchanged


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_the_loss_of_a_tool_demonstration_is_the_cross_entropy_of_its_conversation(
        tiny_dir, float64_model, packed, fused, balance):
    """SFT's loss on a batch of a zoom demonstration (its tool turn's image in the completion)
    and a plain row, collated or packed (memory.micro_batch_tokens), with the LM head's loss fused
    or not: the cross-entropy of the scored tokens from one forward of each whole conversation as
    the processor encodes it, over the batch's scored tokens (float64, builtin:tiny); with
    ``sft.balance_turns`` each token's term weighted as its mask says."""
    from r1fit.data.batch import chat_messages
    from r1fit.data.conversation import conversation_target
    from r1fit.data.dataset import load_dataset
    from r1fit.data.shapes import ShapesSpec
    from r1fit.tools import ToolRunner
    from r1fit.tools.demonstrations import ToolDemonstrations
    from r1fit.train.forward import BatchLayout
    from r1fit.train.sft import micro_batch_loss

    model, processor, _ = float64_model(tiny_dir, checkpointing=False, indices=())
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=2, max_bad_fraction=0.0, seed=0, size=2,
                        shapes=ShapesSpec(image_size=56, kinds=["zoom"]), keep_source_images=True)
    runner = ToolRunner(["zoom"], timeout=5.0, min_pixels=784, max_pixels=3136)
    shown = ToolDemonstrations.of(["zoom"], runner).write(data[0])
    answer = "<think>x</think>" + shown.solution
    prompt, ids, mask = conversation_target(processor, shown, SYSTEM, answer, end_of_turn=end)
    if balance:
        from r1fit.train.sft import balance_turns

        mask = balance_turns(mask)
        assert len(set(mask.tolist())) == 3  # the call's weight, the answer's, 0
    plain = replace(data[1], source_images=())
    (plain_prompt,) = encode_prompts(processor, [plain], SYSTEM)
    plain_ids = torch.tensor(processor.tokenizer("<answer>red</answer>")["input_ids"] + [end])
    rows, targets, masks = [prompt, plain_prompt], [ids, plain_ids], [mask, None]
    for row in rows:
        row.image_inputs["pixel_values"] = row.image_inputs["pixel_values"].double()
    total = round(float(mask.sum())) + len(plain_ids)
    batch = BatchLayout(False).inputs(model, rows, targets, pad_id=0, device=torch.device("cpu"),
                                      packed=packed, masks=masks)
    loss = micro_batch_loss(model, batch, total, fused=fused, chunk_size=16)

    expected = 0.0
    for sample, row, completion, scored in ((shown, prompt, ids, mask),
                                            (plain, plain_prompt, plain_ids, None)):
        if scored is None:
            text = processor.apply_chat_template(chat_messages(sample, SYSTEM), tokenize=False,
                                                 add_generation_prompt=True) + \
                "<answer>red</answer><|im_end|>"
        else:
            messages = chat_messages(replace(sample, turns=(*sample.turns[:-1],
                                                            ("assistant", answer))),
                                     SYSTEM, answer=True)
            text = processor.apply_chat_template(messages, tokenize=False)
        enc = processor(text=[text], images=sample.images, return_tensors="pt")
        n, length = row.length, len(completion)
        assert enc["input_ids"][0, :n + length].tolist() == row.input_ids.tolist() + \
            completion.tolist()
        enc["pixel_values"] = enc["pixel_values"].double()
        with torch.no_grad():
            logits = model(**enc).logits[0].double()
        logp = torch.log_softmax(logits[n - 1:n - 1 + length], dim=-1).gather(
            -1, completion.unsqueeze(-1)).squeeze(-1)
        expected -= float((logp * (1.0 if scored is None else scored)).sum())
    assert mask.sum() < len(mask) - 4  # the tool turn (its image tokens) is context
    assert loss.item() == pytest.approx(expected / total, rel=1e-5)
