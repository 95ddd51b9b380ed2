"""AdamW over the trainable parameters and the learning-rate schedule."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from r1fit.errors import R1fitError

log = logging.getLogger("r1fit")


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (check model.lora.r and "
                         "model.freeze_vision)")
    # fused AdamW updates in place: no temporary copy of all parameters at optimizer.step()
    # (measured on builtin:small-realvocab: -300 MiB peak, 5x faster step than foreach)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # a device/dtype the fused kernel does not cover
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def lr_lambda(schedule: str, warmup: int, total: int, floor: float = 0.1):
    """Multiplier of the peak rate at update ``i``: linear warm-up, then constant/cosine/linear
    decay to ``floor`` of the peak at ``total`` updates."""

    def factor(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup: int,
                    total: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup, total))


class DivergedError(R1fitError):
    """Updates in a row had gradients that are not finite (``train.max_skipped_updates``)."""


@dataclass
class SkippedUpdates:
    """The updates skipped for a gradient norm that is not finite, as verl's actor skips them:
    ``in_a_row`` of them now; at ``limit`` in a row (``train.max_skipped_updates``; 0: never)
    the run stops."""

    limit: int
    in_a_row: int = 0

    def skip(self, grad_norm: float, where: str) -> bool:
        """Whether the update at ``where`` (e.g. "step 12") is skipped: its ``grad_norm`` is not
        finite (warned); ``DivergedError`` when that makes ``limit`` in a row."""
        if math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            raise DivergedError(
                f"{where}: {self.in_a_row} updates in a row had a gradient norm that is not "
                f"finite ({grad_norm}), each skipped; the run stops (train.max_skipped_updates="
                f"{self.limit}). The weights are those of the last finite update (so are a "
                "checkpoint's saved since). Usual causes: a learning rate too high "
                "(train.learning_rate, sft.learning_rate), a loss overflowing in 16-bit, a bad "
                "batch")
        log.warning("%s: gradient norm %s (not finite): update skipped, no optimizer or schedule "
                    "step (%d in a row%s)", where, grad_norm, self.in_a_row,
                    f"; the run stops at train.max_skipped_updates={self.limit}" if self.limit
                    else "")
        return True


def clip_and_step(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                  max_grad_norm: float, skipped: SkippedUpdates, where: str) -> tuple[float, bool]:
    """Clip the accumulated gradients (0 = no clipping), step optimizer and schedule, unless
    their norm is not finite (then ``skipped`` decides: no step, or the run stops); returns the
    gradient norm before clipping and whether the update was skipped. ``where``: the update's
    name in messages."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.item()  # the same on every process: they skip together
    skip = skipped.skip(grad_norm, where)
    if not skip:
        optimizer.step()
        scheduler.step()
    # free the gradients now, not at the next update: evaluation and generation run without them
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skip
