"""clip_and_step: a finite gradient steps the optimizer and the schedule; one that is not finite
is skipped (weights, AdamW moments and schedule as they were, gradients freed), and the run stops
at train.max_skipped_updates in a row."""

from __future__ import annotations

import logging

import pytest
import torch

from r1fit.train.optim import (
    DivergedError,
    SkippedUpdates,
    build_optimizer,
    build_scheduler,
    clip_and_step,
)


def setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = build_optimizer(model, lr=0.1, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, "linear", warmup=0, total=10)
    return model, optimizer, scheduler


def backward(model: torch.nn.Module, scale: float) -> None:
    (model(torch.ones(1, 3)).sum() * scale).backward()


def test_a_finite_gradient_steps_and_one_that_is_not_is_skipped(caplog) -> None:
    model, optimizer, scheduler = setup()
    skipped = SkippedUpdates(limit=3)
    backward(model, 2.0)  # d/dw of 2 * (w . 1) = [2, 2, 2]: norm sqrt(12)
    norm, skip = clip_and_step(optimizer, scheduler, 0.0, skipped, "step 1")
    assert norm == pytest.approx(12 ** 0.5) and not skip
    after_one = model.weight.detach().clone()
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    lr = scheduler.get_last_lr()[0]
    assert lr == pytest.approx(0.1 * (0.1 + 0.9 * 0.9))  # one of 10 updates of linear decay
    for scale, shown in ((float("nan"), "nan"), (float("inf"), "inf")):
        backward(model, scale)
        with caplog.at_level(logging.WARNING, logger="r1fit"):
            norm, skip = clip_and_step(optimizer, scheduler, 1.0, skipped, "step 2")
        assert skip and str(norm) == shown
        assert torch.equal(model.weight, after_one) and model.weight.grad is None
        assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in moments.items())
        assert scheduler.get_last_lr()[0] == lr
    assert skipped.in_a_row == 2
    assert caplog.records[-1].getMessage() == (
        "step 2: gradient norm inf (not finite): update skipped, no optimizer or schedule step "
        "(2 in a row; the run stops at train.max_skipped_updates=3)")
    backward(model, 1.0)  # a finite update ends the run of skips
    assert clip_and_step(optimizer, scheduler, 1.0, skipped, "step 3")[1] is False
    assert skipped.in_a_row == 0 and not torch.equal(model.weight, after_one)


def test_the_limit_in_a_row_stops_the_run_and_zero_never_does() -> None:
    model, optimizer, scheduler = setup()
    skipped = SkippedUpdates(limit=2)
    backward(model, float("nan"))
    clip_and_step(optimizer, scheduler, 1.0, skipped, "step 1")
    backward(model, float("nan"))
    with pytest.raises(DivergedError, match=r"^step 2: 2 updates in a row had a gradient norm "
                                            r"that is not finite \(nan\), each skipped; the run "
                                            r"stops \(train.max_skipped_updates=2\)"):
        clip_and_step(optimizer, scheduler, 1.0, skipped, "step 2")
    never = SkippedUpdates(limit=0)
    for step in range(50):
        assert never.skip(float("nan"), f"step {step}")
    assert never.in_a_row == 50
