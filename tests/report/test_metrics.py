"""The step timers: wall time per phase, and on a GPU the phase's own device work (a
synchronisation at each end)."""

from __future__ import annotations

import time

import torch

from r1fit.report.metrics import timed


def test_timed_adds_wall_time_per_key():
    times: dict[str, float] = {}
    for _ in range(2):
        with timed(times, "seconds_generate"):
            time.sleep(0.01)
    assert set(times) == {"seconds_generate"} and 0.02 <= times["seconds_generate"] < 1


def test_timed_waits_for_the_gpu_at_both_ends_once_cuda_is_in_use(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU run
    times: dict[str, float] = {}
    with timed(times, "seconds_update"):
        calls.append("body")
    assert calls == ["body"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with timed(times, "seconds_update"):
        calls.append("body")
    assert calls == ["body", "sync", "body", "sync"]


def test_timed_counts_the_block_even_when_it_raises():
    times: dict[str, float] = {}
    try:
        with timed(times, "seconds_score"):
            raise RuntimeError("out of memory")
    except RuntimeError:
        pass
    assert times["seconds_score"] >= 0
