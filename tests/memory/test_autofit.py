"""memory.*_batch=auto takes the planner's answer for the device's budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from r1fit.config import load_config
from r1fit.memory.autofit import (
    AutoFitError,
    choose_checkpointing,
    resolve_checkpointing,
    resolve_sizes,
)
from r1fit.memory.planner import SAFETY_MARGIN, even_size, model_facts, plan_memory
from r1fit.units import format_bytes

CPU = torch.device("cpu")
# no evaluation: its eval.batch rows would set the generation peak these tests size by the step
BASE = ["model.path=builtin:tiny", "algo.num_generations=8", "train.prompts_per_step=4",
        "data.shapes.image_size=56", "data.max_pixels=3136", "data.eval=null"]


def test_auto_sizes_are_the_planners_fit_evened_out(use_tiny_cache, caplog):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.generation_batch=auto",
                             "memory.budget=12MiB"])
    expected = plan_memory(load_config(None, [*BASE, "memory.budget=12MiB"]),
                           device_memory_bytes=12 << 20, device_type="cpu")
    with caplog.at_level("INFO", logger="r1fit"):
        sizes = resolve_sizes(cfg, CPU)
    # the fewest chunks of the 32 rows that the largest fitting size allows, evenly filled
    assert (sizes.micro_batch, sizes.generation_batch) == (
        even_size(expected.max_micro_batch, 32, 8), even_size(expected.max_generation_batch, 32, 8))
    assert 1 <= sizes.micro_batch < 32  # the budget binds: not every row of the step
    assert -(-32 // sizes.micro_batch) == -(-32 // expected.max_micro_batch)
    assert f"memory.micro_batch={sizes.micro_batch}" in caplog.text
    if sizes.micro_batch != expected.max_micro_batch:  # the log names the largest too
        assert f"the largest that fits is {expected.max_micro_batch}" in caplog.text
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
    with pytest.raises(AutoFitError, match="even memory.micro_batch=1 does not fit 1.00 MiB") as err:
        resolve_sizes(cfg, CPU)
    # the message gives the planned peak at micro_batch 1 and what the margin leaves usable
    one = plan_memory(cfg.with_values({"memory.micro_batch": 1}), device_memory_bytes=2**20,
                      device_type="cpu")
    assert f"planned peak {format_bytes(one.peak_bytes)}, usable {format_bytes(one.usable_bytes)} " \
        "(10% of the budget kept free)" in str(err.value)


def test_nothing_fits_names_the_auto_key(use_tiny_cache):
    """Only generation_batch is auto: the message names it, not micro_batch."""
    cfg = load_config(None, [*BASE, "memory.generation_batch=auto", "memory.budget=1MiB"])
    with pytest.raises(AutoFitError, match="^even memory.generation_batch=1 does not fit "
                       "1.00 MiB on cpu: .*; the plan's advice: "):
        resolve_sizes(cfg, CPU)


def _peaks(cfg, budget):
    """The planned peaks without and with checkpointing, and the usable bytes of ``budget``."""
    plans = [plan_memory(cfg.with_values({"memory.gradient_checkpointing": on}),
                         device_memory_bytes=budget, device_type="cpu") for on in (False, True)]
    return plans[0].peak_bytes, plans[1].peak_bytes, plans[0].usable_bytes


def test_auto_checkpointing_is_off_only_when_the_step_fits_without_it(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.micro_batch=8", "memory.gradient_checkpointing=auto",
                             "memory.budget=1GiB"])
    off_peak, on_peak, _ = _peaks(cfg, 1 << 30)
    assert on_peak < off_peak  # what checkpointing saves on this step
    off = {"memory.gradient_checkpointing": False, "memory.checkpoint_every": 1}
    assert choose_checkpointing(cfg, budget=1 << 30, device_type="cpu", gpus=1)[0] == off
    assert resolve_checkpointing(cfg, CPU) == off
    # a budget whose usable part lies between the two peaks: only checkpointing fits
    margin_free = (off_peak + on_peak) // 2
    budget = int(margin_free / (1 - SAFETY_MARGIN))
    _, _, usable = _peaks(cfg, budget)
    assert on_peak <= usable < off_peak
    chosen, why = choose_checkpointing(cfg, budget=budget, device_type="cpu", gpus=1)
    assert chosen["memory.gradient_checkpointing"] is True and "planned peak without it" in why
    tight = cfg.with_values({"memory.budget": f"{budget}B"})
    assert resolve_checkpointing(tight, CPU) == chosen


def test_auto_checkpointing_recomputes_every_nth_layer_when_that_is_enough(use_tiny_cache):
    """builtin:tiny's checkpointed layers in module order: 2 vision blocks, then 2 decoder layers
    ("vvtt"). every_n_layers 3 recomputes blocks 0 and decoder layer 1 (index 3): a budget between
    its peak and the step without checkpointing picks it; one under it picks every layer."""
    cfg = load_config(None, [*BASE, "memory.micro_batch=8", "memory.gradient_checkpointing=auto"])

    def peak(on: bool, every: int = 1) -> int:
        values = {"memory.gradient_checkpointing": on, "memory.checkpoint_every": every}
        return plan_memory(cfg.with_values(values), device_memory_bytes=1 << 30,
                           device_type="cpu").peak_bytes

    assert peak(True) < peak(True, 3) < peak(False)
    assert model_facts("builtin:tiny").checkpointed(3) == (1, 1)
    budget = int((peak(True, 3) + peak(False)) / 2 / (1 - SAFETY_MARGIN))
    chosen, why = choose_checkpointing(cfg, budget=budget, device_type="cpu", gpus=1)
    assert chosen == {"memory.gradient_checkpointing": True, "memory.checkpoint_every": 3}
    assert "1 layer in 3 recomputing (1 of 2 decoder layers)" in why
    budget = int((peak(True) + peak(True, 3)) / 2 / (1 - SAFETY_MARGIN))
    chosen, _ = choose_checkpointing(cfg, budget=budget, device_type="cpu", gpus=1)
    assert chosen == {"memory.gradient_checkpointing": True, "memory.checkpoint_every": 1}


def test_auto_checkpointing_with_auto_micro_batch_picks_the_faster_step(use_tiny_cache,
                                                                       monkeypatch):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.gradient_checkpointing=auto"])
    choices = []
    # 9 MiB: only checkpointing fits a micro-batch; 12 MiB: 3 rows without it, 5 with it;
    # 1 GiB: every row either way (recomputing is then pure cost)
    for budget in (9 << 20, 12 << 20, 1 << 30):
        off, on = (plan_memory(cfg.with_values({"memory.gradient_checkpointing": value}),
                               device_memory_bytes=budget, device_type="cpu")
                   for value in (False, True))
        values, why = choose_checkpointing(cfg, budget=budget, device_type="cpu", gpus=1)
        chosen = values["memory.gradient_checkpointing"]
        assert values["memory.checkpoint_every"] == 1  # whole-model only with micro_batch=auto
        assert f"without it {off.max_micro_batch}, with it {on.max_micro_batch}" in why
        if off.max_micro_batch:
            assert chosen is (on.time["step_seconds"] < off.time["step_seconds"])
            assert "predicted step" in why
        choices.append(chosen)
    assert choices[0] is True and choices[2] is False
    # at 12 MiB the choice follows the time model: a device whose forwards cost a lot of fixed
    # time favours the larger micro-batch that checkpointing fits (one forward of 5 rows instead
    # of two), one with free forwards the step without recomputation
    import r1fit.memory.rates as rates

    measured = rates.device_rates("cpu")
    for layer_step, expected in ((1.0, True), (0.0, False)):
        monkeypatch.setattr(rates, "device_rates", lambda *a, s=layer_step, **k: replace(
            measured, layer_step_s=[(1, s), (16, s)], launch_s=0.0))
        values, _ = choose_checkpointing(cfg, budget=12 << 20, device_type="cpu", gpus=1)
        assert values["memory.gradient_checkpointing"] is expected, layer_step


def test_auto_checkpointing_without_a_cpu_budget_stays_on(use_tiny_cache):
    cfg = load_config(None, [*BASE, "memory.gradient_checkpointing=auto"])
    assert resolve_checkpointing(cfg, CPU)["memory.gradient_checkpointing"] is True
    assert resolve_checkpointing(cfg.with_values({"memory.gradient_checkpointing": False}),
                                 CPU)["memory.gradient_checkpointing"] is False


def test_auto_tokens_are_the_planners_largest_fit(use_tiny_cache):
    """memory.micro_batch_tokens=auto: the most packed tokens whose plan fits the budget."""
    cfg = load_config(None, [*BASE, "memory.micro_batch_tokens=auto", "memory.budget=12MiB",
                             "memory.generation_batch=auto"])
    plan = plan_memory(cfg, device_memory_bytes=12 << 20, device_type="cpu")
    sizes = resolve_sizes(cfg, CPU)
    assert sizes.micro_batch_tokens == plan.max_micro_batch_tokens > 0
    assert sizes.asked["micro_batch_tokens"] == "auto"
    cfg = cfg.with_values({"memory.generation_batch": sizes.generation_batch})
    fits = cfg.with_values({"memory.micro_batch_tokens": sizes.micro_batch_tokens})
    assert plan_memory(fits, device_memory_bytes=12 << 20, device_type="cpu").fits
    over = cfg.with_values({"memory.micro_batch_tokens": 2 * sizes.micro_batch_tokens})
    assert not plan_memory(over, device_memory_bytes=12 << 20, device_type="cpu").fits


def test_sft_auto_sizes_come_from_the_sft_plan(use_tiny_cache):
    """`r1fit sft` (kind="sft") sizes its micro-batches by a plan of its own steps:
    sft.batch_size rows with answers of sft.max_answer_tokens, not a GRPO step's rows."""
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.budget=12MiB",
                             "sft.batch_size=24", "sft.max_answer_tokens=96"])
    sft = plan_memory(cfg, device_memory_bytes=12 << 20, device_type="cpu", kind="sft")
    grpo = plan_memory(cfg, device_memory_bytes=12 << 20, device_type="cpu")
    assert resolve_sizes(cfg, CPU, "sft").micro_batch == sft.auto_size("micro_batch")
    assert resolve_sizes(cfg, CPU).micro_batch == grpo.auto_size("micro_batch")
    # longer rows: fewer fit in the same budget
    assert 1 <= sft.max_micro_batch < grpo.max_micro_batch
