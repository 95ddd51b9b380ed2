"""``R1FIT_ONE_PROCESS_GROUP=1``: a one-process torchrun run joins a process group of its own (the
multi-GPU code paths on one device: benchmarks/gpu_check.py's fsdp stage); without it torchrun
with one process is a plain run."""

from __future__ import annotations

import socket

import pytest
import torch

from r1fit.processes import (
    ONE_PROCESS_GROUP,
    DistributedError,
    World,
    all_gather_rows,
    all_sum,
    close_distributed,
    init_distributed,
)


def _torchrun_env(monkeypatch, *, rank: bool = True) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    if rank:
        monkeypatch.setenv("RANK", "0")
    else:
        monkeypatch.delenv("RANK", raising=False)


def test_one_torchrun_process_is_plain_unless_asked(monkeypatch):
    _torchrun_env(monkeypatch)
    monkeypatch.delenv(ONE_PROCESS_GROUP, raising=False)
    assert init_distributed("cpu") == World() and not World().distributed
    assert not torch.distributed.is_initialized()


def test_asked_it_joins_a_gloo_group_of_one(monkeypatch):
    _torchrun_env(monkeypatch)
    monkeypatch.setenv(ONE_PROCESS_GROUP, "1")
    try:
        w = init_distributed("cpu")
        assert (w.rank, w.size, w.main, w.distributed) == (0, 1, True, True)
        assert torch.distributed.get_backend() == "gloo"
        assert all_sum([1, 2.5]) == [1.0, 2.5]  # through the group
        assert torch.equal(all_gather_rows(torch.arange(3)), torch.arange(3))
    finally:
        close_distributed()
    assert not torch.distributed.is_initialized()


def test_asked_without_torchrun_is_one_line(monkeypatch):
    _torchrun_env(monkeypatch, rank=False)
    monkeypatch.setenv(ONE_PROCESS_GROUP, "1")
    with pytest.raises(DistributedError, match=f"{ONE_PROCESS_GROUP}=1 but RANK is not set"):
        init_distributed("cpu")
