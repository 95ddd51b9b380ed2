"""memory.*_batch=auto takes the planner's answer for the device's budget."""

from __future__ import annotations

import pytest
import torch

from r1fit.config import load_config
from r1fit.memory.autofit import AutoFitError, resolve_sizes
from r1fit.memory.planner import plan_memory

CPU = torch.device("cpu")
BASE = ["model.path=builtin:tiny", "algo.num_generations=8", "train.prompts_per_step=4",
        "data.shapes.image_size=56", "data.max_pixels=3136"]


def test_auto_sizes_are_the_planners_largest_fit(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.generation_batch=auto",
                             "memory.budget=12MiB"])
    expected = plan_memory(load_config(None, [*BASE, "memory.budget=12MiB"]),
                           device_memory_bytes=12 << 20, device_type="cpu")
    sizes = resolve_sizes(cfg, CPU)
    assert (sizes.micro_batch, sizes.generation_batch) == (
        expected.max_micro_batch, expected.max_generation_batch)
    assert 1 <= sizes.micro_batch < 32  # the budget binds: not every row of the step
    # and the plan at the chosen size fits the budget
    chosen = cfg.with_values({"memory.micro_batch": sizes.micro_batch,
                              "memory.generation_batch": sizes.generation_batch})
    assert plan_memory(chosen, device_memory_bytes=12 << 20, device_type="cpu").fits
    # the config keeps what the user asked for
    assert (cfg.memory.micro_batch, cfg.memory.generation_batch) == ("auto", "auto")
    assert sizes.asked == {"micro_batch": "auto", "generation_batch": "auto"}


def test_fixed_sizes_are_left_alone(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.micro_batch=3"])
    sizes = resolve_sizes(cfg, CPU)
    assert (sizes.micro_batch, sizes.generation_batch) == (3, 64)


def test_auto_on_cpu_needs_a_budget(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto"])
    with pytest.raises(AutoFitError, match="needs memory.budget"):
        resolve_sizes(cfg, CPU)


def test_nothing_fits(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.budget=1MiB"])
    with pytest.raises(AutoFitError, match="even memory.micro_batch=1 does not fit 1.00 MiB"):
        resolve_sizes(cfg, CPU)
