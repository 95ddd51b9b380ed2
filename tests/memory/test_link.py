"""The link between two processes (gloo on a CPU) measured as FSDP2's collectives use it."""

from __future__ import annotations

import pytest
import torch

from r1fit.memory.link import measure_link


def test_two_processes_measure_the_link():
    link = measure_link("cpu")
    assert link is not None and link.backend == "gloo"
    # loopback moves at least a megabyte a second; a collective of a few bytes under a second
    assert link.bytes_per_s > 1e6
    assert 0 < link.collective_s < 1.0


def test_one_gpu_cannot_measure_it():
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: NCCL's link is measured (r1fit doctor --calibrate)")
    assert measure_link("cuda") is None
