"""``memory.micro_batch: auto`` / ``memory.generation_batch: auto`` /
``memory.gradient_checkpointing: auto``: take the planner's answer for the device the run starts
on (CUDA: the free memory at start-up; CPU: ``memory.budget``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from r1fit.distributed.context import all_max, world
from r1fit.errors import R1fitError
from r1fit.memory.sizes import ChunkSizes
from r1fit.units import format_bytes, parse_bytes

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


def resolve_checkpointing(cfg: Any, device: torch.device) -> bool:
    """Whether the run recomputes layer activations in backward: ``memory.gradient_checkpointing``,
    or for ``auto`` the planner's choice for this device (see :func:`choose_checkpointing`), the
    same on every process (on if any process needs it)."""
    setting = cfg.memory.gradient_checkpointing
    if setting != "auto":
        return bool(setting)
    if not cfg.memory.budget and device.type != "cuda":
        log.info("memory.gradient_checkpointing=auto: on (no memory.budget on %s to plan "
                 "against)", device)
        return True
    on, reason = choose_checkpointing(cfg, budget=device_budget(cfg.memory, device),
                                      device_type=device.type, gpus=world().size)
    if world().distributed:
        on = all_max([float(on)])[0] > 0
    log.info("memory.gradient_checkpointing=auto: %s (%s)", "on" if on else "off", reason)
    return on


def choose_checkpointing(cfg: Any, *, budget: int, device_type: str, gpus: int
                         ) -> tuple[bool, str]:
    """The planner's choice for ``memory.gradient_checkpointing=auto`` and why. Checkpointing
    costs one more forward of every layer in backward (about a third more update compute), so it
    is off when the step fits without it: with a fixed ``memory.micro_batch``, when the plan
    without it fits the budget; with ``micro_batch=auto``, when the largest micro-batch that fits
    without it is at least half the one that fits with it (a micro-batch half as large costs less
    than recomputing every layer; only whole-model checkpointing is chosen, not per layer)."""
    from r1fit.memory.planner import plan_memory

    off, on = (plan_memory(cfg.with_values({"memory.gradient_checkpointing": value}),
                           device_memory_bytes=budget, device_type=device_type, gpus=gpus)
               for value in (False, True))
    if cfg.memory.micro_batch != "auto":
        planned = (f"planned peak without it {format_bytes(off.peak_bytes)}, usable "
                   f"{format_bytes(off.usable_bytes)}")
        return (False, planned) if off.fits else (True, planned)
    sizes = (f"largest micro_batch without it {off.max_micro_batch}, with it "
             f"{on.max_micro_batch}")
    return (False, sizes) if off.max_micro_batch * 2 >= max(on.max_micro_batch, 1) else \
        (True, sizes)


def resolve_sizes(cfg: Any, device: torch.device) -> ChunkSizes:
    """The chunk sizes the run starts with: the config's, with ``auto`` replaced by the largest
    the planner fits. Over several processes every rank must run as many micro-batches, so the
    smallest answer of all ranks wins."""
    memory = cfg.memory
    asked = {"micro_batch": memory.micro_batch, "generation_batch": memory.generation_batch}
    chosen = dict(asked)
    if "auto" in asked.values():
        from r1fit.memory.planner import plan_memory

        budget = device_budget(memory, device)
        # over several processes: one device of the FSDP run (sharded states, 1/N of the rows)
        plan = plan_memory(cfg, device_memory_bytes=budget, device_type=device.type,
                           gpus=world().size)
        if not plan.max_micro_batch or not plan.max_generation_batch:
            raise AutoFitError(f"even memory.micro_batch=1 does not fit {format_bytes(budget)} on "
                               f"{device}: {'; '.join(plan.advice) or 'see r1fit plan'}")
        answers = {"micro_batch": plan.max_micro_batch,
                   "generation_batch": plan.max_generation_batch}
        picked = [key for key, value in asked.items() if value == "auto"]
        for key in picked:
            chosen[key] = int(answers[key])
        if world().distributed:
            smallest = all_max([-chosen["micro_batch"], -chosen["generation_batch"]])
            chosen = {"micro_batch": int(-smallest[0]), "generation_batch": int(-smallest[1])}
        log.info("auto-fit for %s on %s: %s (planned peak %s)", format_bytes(budget), device,
                 ", ".join(f"memory.{key}={chosen[key]}" for key in picked),
                 format_bytes(plan.peak_bytes))
    return ChunkSizes(chosen["micro_batch"], chosen["generation_batch"], asked)
