"""One GRPO step under torch.profiler (``report.profile_step``): where a step's time goes, as a
table of operators and kernels by total time, written beside the run's other outputs. The phase
timers (:func:`r1fit.report.metrics.timed`) name their ranges ``r1fit/generate``, ``r1fit/score``
and ``r1fit/update``, so the table holds one row per phase too. No trace file: a step of 128 rows
x 512 decode steps on a GPU is millions of kernel events."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("r1fit")

#: rows of the table
PROFILE_ROWS = 60


@contextmanager
def native_stderr_quiet() -> Iterator[None]:
    """The process's file descriptor 2 sent to /dev/null for the block (Python's own stderr
    flushed first): kineto prints a ``USDT: ... profiler_start`` / ``profiler_stop`` line at
    every profiler start and stop whatever KINETO_LOG_LEVEL says (torch 2.14), noise on a
    user's console. Keep the block short: anything else written to fd 2 meanwhile is lost."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to quiet
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_file(out: Path, step: int) -> Path:
    return out / f"profile-step-{step}.txt"


@contextmanager
def step_profile(profile_step: int, step: int, out: Path, device: torch.device,
                 *, main: bool = True) -> Iterator[None]:
    """Profile the block when ``step`` is ``profile_step`` (CUDA kernels too on a GPU) and write
    its table to ``profile-step-N.txt`` (rank 0: ``main``); else run it as it is."""
    if step != profile_step or not main:
        yield
        return
    cuda = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    with native_stderr_quiet():  # kineto's start line
        prof.__enter__()
    try:
        yield
    finally:
        with native_stderr_quiet():  # and its stop line
            prof.__exit__(None, None, None)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=key, row_limit=PROFILE_ROWS)
    # the phases, whatever their rank in the table
    phases = [f"{event.key}: CPU {event.cpu_time_total / 1e3:,.1f} ms"
              + (f", CUDA {getattr(event, 'device_time_total', 0) / 1e3:,.1f} ms" if cuda else "")
              for event in averages if event.key.startswith("r1fit/")]
    path = profile_file(out, step)
    path.write_text(f"step {step}, sorted by {key}\nphases: " + "; ".join(phases)
                    + f"\n{table}\n")
    log.info("step %d profiled: %s", step, path)
