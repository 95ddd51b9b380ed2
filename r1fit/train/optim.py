"""AdamW over the trainable parameters and the learning-rate schedule."""

from __future__ import annotations

import math

import torch


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


def clip_and_step(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                  max_grad_norm: float) -> float:
    """Clip the accumulated gradients (0 = no clipping), step optimizer and schedule; returns the
    gradient norm before clipping."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.item()
    optimizer.step()
    scheduler.step()
    # free the gradients now, not at the next update: evaluation and generation run without them
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
