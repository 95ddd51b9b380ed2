import random

from r1fit.data.sample import Sample
from r1fit.train.sft import build_targets, target_text


def test_target_text_wraps_bare_and_tagged_solutions():
    assert target_text("red", "look") == "<think>look</think><answer>red</answer>"
    assert target_text("<answer> 3 </answer>", "look") == "<think>look</think><answer>3</answer>"
    full = "<think>two circles</think><answer>2</answer>"
    assert target_text(full, "look") == full


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
    import torch

    from r1fit.train.sft import cut_answers

    targets = [torch.arange(5), torch.arange(3), torch.arange(7)]
    masks = [None, torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1, 1, 0, 1, 1])]
    cut_targets, cut_masks, cut = cut_answers(targets, masks, 4)
    assert cut == [0, 2]
    assert [t.tolist() for t in cut_targets] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]]
    assert cut_masks[0] is None
    assert [m.tolist() for m in cut_masks[1:]] == [[0, 1, 1], [0, 0, 1, 1]]
    assert cut_answers([torch.arange(4)], [None], 4)[2] == []  # at the limit: kept whole
