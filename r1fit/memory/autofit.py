"""``memory.micro_batch: auto`` / ``memory.generation_batch: auto``: take the planner's answer for
the device the run starts on (CUDA: the free memory at start-up; CPU: ``memory.budget``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from r1fit.units import format_bytes, parse_bytes
from r1fit.errors import R1fitError

log = logging.getLogger("r1fit.memory")


class AutoFitError(R1fitError, ValueError):
    """The sizes cannot be chosen automatically; the message says why."""


def device_budget(memory: Any, device: torch.device) -> int:
    """Bytes the run may use: ``memory.budget`` when set, else CUDA's free memory; on CPU a
    budget is required."""
    if memory.budget:
        return parse_bytes(memory.budget)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    raise AutoFitError("memory.micro_batch/generation_batch=auto on CPU needs memory.budget "
                       "(e.g. memory.budget=16GiB)")


def resolve_auto_sizes(cfg: Any, device: torch.device) -> None:
    """Replace ``auto`` chunk sizes in ``cfg.memory`` with the largest the planner fits."""
    memory = cfg.memory
    if "auto" not in (memory.micro_batch, memory.generation_batch):
        return
    from r1fit.distributed.context import world
    from r1fit.memory.planner import plan_memory

    budget = device_budget(memory, device)

    # over several processes: one device of the FSDP run (sharded states, 1/N of the rows)
    plan = plan_memory(cfg, device_memory_bytes=budget, device_type=device.type,
                       gpus=world().size)
    if not plan.max_micro_batch or not plan.max_generation_batch:
        raise AutoFitError(f"even memory.micro_batch=1 does not fit {format_bytes(budget)} on "
                           f"{device}: {'; '.join(plan.advice) or 'see r1fit plan'}")
    chosen = []
    for key, value in (("micro_batch", plan.max_micro_batch),
                       ("generation_batch", plan.max_generation_batch)):
        if getattr(memory, key) == "auto":
            setattr(memory, key, int(value))
            chosen.append(f"memory.{key}={value}")
    log.info("auto-fit for %s on %s: %s (planned peak %s)", format_bytes(budget), device,
             ", ".join(chosen), format_bytes(plan.peak_bytes))
