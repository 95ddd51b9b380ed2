"""The process's generators: a restored state reproduces what would have come next."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import torch

from r1fit.checkpoint.files import load_state, save_state
from r1fit.rng import RngState


def draws() -> tuple:
    return (random.random(), float(np.random.rand()), float(np.random.randn()),
            torch.rand(3).tolist())


def test_rng_state_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    save_state(tmp_path, "rng", RngState().state_dict())
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RngState().load_state_dict(load_state(tmp_path, "rng"))
    assert draws() == expected


def test_restart_seeds_from_seed_step_and_rank():
    point = SimpleNamespace(step=4)
    RngState(seed=10, rank=1).restart(point)
    first = draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    RngState(seed=10, rank=1).restart(point)
    assert draws() == first
    RngState(seed=10, rank=0).restart(point)  # another rank: another stream
    assert draws() != first


def test_deterministic_kernels_switch_on_and_back_off(monkeypatch):
    from r1fit.rng import CUBLAS_DETERMINISTIC, use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own setting wins
        use_deterministic_kernels(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic


def test_draws_inside_rng_untouched_leave_the_global_stream_where_it_was():
    from r1fit.rng import rng_untouched

    torch.manual_seed(3)
    expected = torch.rand(4)
    for device in ("cpu", None):  # no device: the CPU's generator
        torch.manual_seed(3)
        with rng_untouched(device):
            torch.randn(100)
        assert torch.equal(torch.rand(4), expected)


def test_cuda_state_is_the_run_devices_own(monkeypatch):
    """Only the current (run's) device's CUDA state is restored; a checkpoint of every visible
    device's states (the older layout) gives that device's by its index, or nothing where the
    resuming machine's device index was not saved."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(int(s[0])))
    base = RngState().state_dict()
    for saved, expected in ((torch.tensor([5]), [5]),
                            ([torch.tensor([6]), torch.tensor([7])], [7]),
                            ([torch.tensor([8])], [])):
        restored.clear()
        RngState().load_state_dict({**base, "cuda": saved})
        assert restored == expected
