"""``memory.micro_batch: auto`` / ``memory.micro_batch_tokens: auto`` /
``memory.generation_batch: auto`` /
``memory.gradient_checkpointing: auto``: take the planner's answer for the device the run starts
on (CUDA: the free memory at start-up; CPU: ``memory.budget``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from r1fit.errors import R1fitError
from r1fit.memory.sizes import ChunkSizes
from r1fit.processes import all_max, world
from r1fit.units import format_bytes, format_seconds, parse_bytes

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


def resolve_checkpointing(cfg: Any, device: torch.device, kind: str = "grpo") -> dict[str, Any]:
    """How the run recomputes layer activations in backward, as config values
    (``memory.gradient_checkpointing``, ``memory.checkpoint_every``): the config's, or for
    ``auto`` the planner's choice for this device (see :func:`choose_checkpointing`), the same on
    every process (the most checkpointing any process needs). ``kind``: the run's steps, "grpo"
    or "sft" (planned as :func:`r1fit.memory.planner.sft_step` says)."""
    memory = cfg.memory
    if memory.gradient_checkpointing != "auto":
        return {"memory.gradient_checkpointing": bool(memory.gradient_checkpointing),
                "memory.checkpoint_every": memory.checkpoint_every}
    if not memory.budget and device.type != "cuda":
        log.info("memory.gradient_checkpointing=auto: on (no memory.budget on %s to plan "
                 "against)", device)
        return {"memory.gradient_checkpointing": True, "memory.checkpoint_every": 1}
    chosen, reason = choose_checkpointing(cfg, budget=device_budget(memory, device),
                                          device_type=device.type, gpus=world().size, kind=kind)
    if world().distributed:  # off < every n-th layer < every layer: the most any rank needs
        on, every = chosen["memory.gradient_checkpointing"], chosen["memory.checkpoint_every"]
        most = all_max([1.0 / every if on else 0.0])[0]
        chosen = {"memory.gradient_checkpointing": most > 0,
                  "memory.checkpoint_every": round(1 / most) if most > 0 else 1}
    log.info("memory.gradient_checkpointing=auto: %s (%s)", describe_checkpointing(chosen),
             reason)
    return chosen


def describe_checkpointing(values: dict[str, Any]) -> str:
    """'off', 'on' or 'on, every n-th layer' for the values :func:`choose_checkpointing` gives."""
    if not values["memory.gradient_checkpointing"]:
        return "off"
    every = values["memory.checkpoint_every"]
    return "on" if every == 1 else f"on, 1 layer in {every} (memory.checkpoint_every={every})"


def choose_checkpointing(cfg: Any, *, budget: int, device_type: str, gpus: int,
                         kind: str = "grpo") -> tuple[dict[str, Any], str]:
    """The planner's choice for ``memory.gradient_checkpointing=auto`` and why, as config values.
    Checkpointing costs one more forward of every checkpointed layer in backward (about a third
    more update compute when all are), so it is off when the step fits without it. With a fixed
    ``memory.micro_batch`` that does not fit without it, only every n-th layer recomputes, for
    the largest n whose plan fits (transformers' every_n_layers counts vision blocks and decoder
    layers together; n = 1 is every layer). With ``micro_batch=auto``: whichever of off (at the
    largest micro-batch that fits without it) and every layer (at the largest that fits with it)
    the time model predicts the faster step for: recomputing costs a third more update
    compute, more and smaller micro-batches cost their fixed per-forward work."""
    from r1fit.memory.planner import model_facts, plan_memory

    def plan(on: bool, every: int = 1) -> Any:
        values = {"memory.gradient_checkpointing": on, "memory.checkpoint_every": every}
        return plan_memory(cfg.with_values(values), device_memory_bytes=budget,
                           device_type=device_type, gpus=gpus, kind=kind)

    def choice(on: bool, every: int = 1) -> dict[str, Any]:
        return {"memory.gradient_checkpointing": on, "memory.checkpoint_every": every}

    off = plan(False)
    # the size that sets a training micro-batch: packed tokens when set, else rows
    tokens = cfg.memory.micro_batch_tokens
    sized_by = "micro_batch" if tokens is None else "micro_batch_tokens"
    if (cfg.memory.micro_batch if tokens is None else tokens) != "auto":
        planned = (f"planned peak without it {format_bytes(off.peak_bytes)}, usable "
                   f"{format_bytes(off.usable_bytes)}")
        if off.fits:
            return choice(False), planned
        facts = model_facts(cfg.model.path, cfg.model.lora.target)
        layers = len(facts.checkpoint_order) or facts.text.layers
        # the largest n that fits; n with the same layers as a larger one checkpoint more
        for every in range(layers, 1, -1):
            if facts.checkpointed(every) == facts.checkpointed(every + 1):
                continue
            candidate = plan(True, every)
            if candidate.fits:
                text, _ = facts.checkpointed(every)
                return choice(True, every), (f"{planned}; 1 layer in {every} recomputing "
                                             f"({text} of {facts.text.layers} decoder layers): "
                                             f"peak {format_bytes(candidate.peak_bytes)}")
        return choice(True), planned
    on = plan(True)
    largest_off, largest_on = (getattr(p, f"max_{sized_by}") for p in (off, on))
    sizes = f"largest {sized_by} without it {largest_off}, with it {largest_on}"
    if not largest_off:
        return choice(True), sizes
    # each plan is of the run at its own largest size ('auto' plans what it will pick)
    seconds_off, seconds_on = (p.time["step_seconds"] for p in (off, on))
    return choice(seconds_on < seconds_off), (
        f"{sizes}; predicted step {format_seconds(seconds_off)} without, "
        f"{format_seconds(seconds_on)} with")


def resolve_sizes(cfg: Any, device: torch.device, kind: str = "grpo") -> ChunkSizes:
    """The chunk sizes the run starts with: the config's, with ``auto`` replaced by what the
    planner fits for the run's ``kind`` of step ("grpo" or "sft"): the fewest micro-batches or
    generation chunks that fit, evenly filled (:func:`r1fit.memory.planner.estimate.even_size`);
    ``memory.micro_batch_tokens=auto``: the most packed tokens. Over several processes every
    rank must run as many micro-batches, so the smallest answer of all ranks wins."""
    memory = cfg.memory
    asked = {"micro_batch": memory.micro_batch, "generation_batch": memory.generation_batch}
    if memory.micro_batch_tokens is not None:
        asked["micro_batch_tokens"] = memory.micro_batch_tokens
    chosen = dict(asked)
    if "auto" in asked.values():
        from r1fit.memory.planner import SAFETY_MARGIN, plan_memory

        budget = device_budget(memory, device)
        # over several processes: one device of the FSDP run (sharded states, 1/N of the rows)
        plan = plan_memory(cfg, device_memory_bytes=budget, device_type=device.type,
                           gpus=world().size, kind=kind)
        picked = [key for key, value in asked.items() if value == "auto"]
        answers = {key: plan.auto_size(key) for key in picked}
        if any(not answers[key] for key in picked):
            failed = next(key for key in picked if not answers[key])
            what = ("memory.micro_batch_tokens (one row alone)" if failed == "micro_batch_tokens"
                    else f"memory.{failed}=1")
            raise AutoFitError(
                f"even {what} does not fit {format_bytes(budget)} on {device}: planned peak "
                f"{format_bytes(plan.peak_bytes)}, usable {format_bytes(plan.usable_bytes)} "
                f"({SAFETY_MARGIN:.0%} of the budget kept free); the plan's advice: "
                f"{'; '.join(plan.advice) or 'see r1fit plan'}")
        for key in picked:
            chosen[key] = int(answers[key])
        if world().distributed:
            keys = list(chosen)
            smallest = all_max([-float(chosen[key]) for key in keys])
            chosen = {key: int(-value) for key, value in zip(keys, smallest)}
        rows = int(plan.details["rows_per_gpu"])
        log.info("auto-fit for %s on %s: %s (planned peak %s)", format_bytes(budget), device,
                 ", ".join(f"memory.{key}={chosen[key]}" + (
                     f" ({-(-rows // chosen[key])} even chunks of the {rows} rows; the largest "
                     f"that fits is {plan.largest(key)})"
                     if key != "micro_batch_tokens" and plan.largest(key) != chosen[key] else "")
                           for key in picked),
                 format_bytes(plan.peak_bytes))
    return ChunkSizes(chosen["micro_batch"], chosen["generation_batch"], asked,
                      micro_batch_tokens=chosen.get("micro_batch_tokens"))
