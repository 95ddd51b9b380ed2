"""The calibration's rates that only r1fit's own GRPO step can measure: what a training
micro-batch and an update cost beyond what the time model counts from the other rates (the
model's own positions, masks and embedding, r1fit's loss and its statistics, the optimizer's
call).

Two short runs of ``builtin:tiny`` that differ only in ``memory.micro_batch`` (every row in one
micro-batch, then one row each): each run's update seconds (median of the steps after the first)
less the time model's prediction with these two rates at zero is what the model misses; the
difference between the runs, per extra micro-batch, is a micro-batch's share, and what remains
of the one-micro-batch run is the update's.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from r1fit.config import load_config
from r1fit.doctor.env import half_dtype
from r1fit.doctor.selfcheck import run_train
from r1fit.memory.prediction import StepPrediction
from r1fit.report.metrics import grpo_step_rows

#: rows of a step in the two runs (2 prompts x 4 completions)
ROWS = 8
STEPS = 4


def step_overrides(device: torch.device, micro_batch: int) -> list[str]:
    """One of the two runs: ``STEPS`` GRPO steps of builtin:tiny on ``device`` (float32 on a
    CPU, its 16-bit dtype on a GPU), ``ROWS`` rows of 16 forced tokens, ``micro_batch`` rows a
    micro-batch, no KL, no evaluation, no checkpoint."""
    dtype = "float32" if device.type == "cpu" else str(half_dtype(device)).removeprefix("torch.")
    return ["model.path=builtin:tiny", f"model.dtype={dtype}", "model.lora.r=0",
            f"train.device={device.type}", f"train.max_steps={STEPS}", "train.prompts_per_step=2",
            "algo.num_generations=4", "algo.max_new_tokens=16", "rollout.min_new_tokens=16",
            "algo.beta=0", "algo.num_iterations=1", "rollout.engine=hf",
            f"memory.micro_batch={micro_batch}", f"memory.generation_batch={ROWS}",
            "memory.share_prefix=false", "memory.gradient_checkpointing=true",
            "sft.format_warmup_steps=0", "data.train=builtin:shapes", "data.eval=null",
            "eval.every=0", "eval.before_train=false", "data.shapes.image_size=56",
            "data.max_pixels=3136", "checkpoint.every=0", "report.to=[]", "train.overwrite=true"]


def missed_update_seconds(device: torch.device, micro_batch: int, work: Path) -> float:
    """A run's measured update seconds (median of its steps after the first) less the time
    model's prediction for it (on the rates cached for ``device``)."""
    from r1fit.memory.planner import plan_memory

    values = step_overrides(device, micro_batch)
    out = run_train(values, work / f"micro_batch_{micro_batch}")
    rows = grpo_step_rows(out / "metrics.jsonl", last_per_step=True)[1:]
    measured = statistics.median(r["seconds_update"] for r in rows)
    predicted = StepPrediction.of(plan_memory(load_config(None, values),
                                              device_type=device.type).time, "grpo")
    return measured - predicted.seconds["seconds_update"]


def measure_step_fixed(device: torch.device) -> tuple[float, float]:
    """(seconds per training micro-batch, seconds per update) that the time model misses on
    ``device``, from r1fit's own GRPO step (the module docstring); never below zero."""
    with tempfile.TemporaryDirectory(prefix="r1fit-calibrate-") as folder:
        whole = missed_update_seconds(device, ROWS, Path(folder))
        split = missed_update_seconds(device, 1, Path(folder))
    micro_batch = max((split - whole) / (ROWS - 1), 0.0)
    return micro_batch, max(whole - micro_batch, 0.0)
