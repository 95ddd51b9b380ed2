"""The calibration's fixed costs of r1fit's own GRPO step: two short runs of builtin:tiny that
differ only in micro-batch size, against the time model's prediction for each."""

from __future__ import annotations

import statistics

import pytest
import torch

import r1fit.doctor.steps as steps
from r1fit.config import load_config


def test_the_two_runs_differ_only_in_micro_batch():
    whole, split = (steps.step_overrides(torch.device("cpu"), n) for n in (steps.ROWS, 1))
    assert [v for v in whole if v not in split] == [f"memory.micro_batch={steps.ROWS}"]
    cfg = load_config(None, whole)
    assert cfg.train.prompts_per_step * cfg.algo.num_generations == steps.ROWS


def test_the_missed_seconds_split_into_micro_batch_and_update(monkeypatch, tmp_path):
    # made-up misses: 40 ms with every row in one micro-batch, 110 ms with one row each (70 ms
    # over 7 more micro-batches: 10 ms each; the 30 ms left of the first run: the update's)
    missed = {steps.ROWS: 0.04, 1: 0.11}
    monkeypatch.setattr(steps, "missed_update_seconds", lambda device, n, work: missed[n])
    assert steps.measure_step_fixed(torch.device("cpu")) == (pytest.approx(0.01),
                                                              pytest.approx(0.03))
    missed[1] = 0.0  # noise the other way: never below zero
    assert steps.measure_step_fixed(torch.device("cpu")) == (0.0, 0.04)


def test_a_real_run_misses_its_measured_update_less_the_plans(use_tiny_cache, tmp_path):
    """On a real run: the median update of the steps after the first, less the time model's
    prediction for the run's config. (Which of the two sizes misses more is a timing: the
    calibration measures it, no test asserts it; on a loaded machine it went either way.)"""
    from r1fit.memory.planner import plan_memory
    from r1fit.memory.prediction import StepPrediction
    from r1fit.report.metrics import grpo_step_rows

    device = torch.device("cpu")
    missed = steps.missed_update_seconds(device, 1, tmp_path)
    rows = grpo_step_rows(tmp_path / "micro_batch_1" / "metrics.jsonl", last_per_step=True)
    assert [r["micro_batch"] for r in rows] == [1] * len(rows) and len(rows) >= 3
    measured = statistics.median(r["seconds_update"] for r in rows[1:])
    predicted = StepPrediction.of(plan_memory(load_config(None, steps.step_overrides(device, 1)),
                                              device_type="cpu").time, "grpo")
    assert missed == pytest.approx(measured - predicted.seconds["seconds_update"])
