"""The calibration's fixed costs of r1fit's own GRPO step: two short runs of builtin:tiny that
differ only in micro-batch size, against the time model's prediction for each."""

from __future__ import annotations

import pytest
import torch

import r1fit.doctor.steps as steps
from r1fit.config import load_config
from r1fit.memory.rates import calibrate


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


def test_a_real_run_misses_a_positive_time_per_micro_batch(use_tiny_cache, tmp_path):
    calibrate(torch.device("cpu"), quick=True)  # the plan's rates, cached in the test's cache
    missed = {n: steps.missed_update_seconds(torch.device("cpu"), n, tmp_path)
              for n in (steps.ROWS, 1)}
    # eight micro-batches of one row cost more than the model counts for them: the model's
    # own positions, masks and loss, per micro-batch
    assert missed[1] > missed[steps.ROWS], missed
