"""One process needs no process group: the helpers are identities, and a step's rows split evenly
or not at all (every rank must run the same number of forward passes)."""

from __future__ import annotations

import pytest
import torch

from r1fit.processes import (
    DistributedError,
    World,
    all_gather_objects,
    all_gather_rows,
    all_max,
    all_sum,
    broadcast_object,
    init_distributed,
    world,
)


def test_shares_are_contiguous_and_even():
    rows = list(range(8))
    shares = [rows[World(rank=r, size=4).share(8)] for r in range(4)]
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert World().share(5) == slice(0, 5)


def test_uneven_split_names_the_fix():
    with pytest.raises(DistributedError, match="6 rows do not split evenly over 4 processes; "
                                               "make it a multiple of 4"):
        World(rank=1, size=4).share(6)


def test_one_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = init_distributed("cpu")
    assert (w.rank, w.size, w.main, w.distributed) == (0, 1, True, False)
    assert world() == w
    assert all_sum([1, 2.5]) == [1.0, 2.5] and all_max([3]) == [3.0]
    t = torch.arange(3)
    assert all_gather_rows(t) is t
    assert all_gather_objects({"a": 1}) == [{"a": 1}] and broadcast_object(7) == 7


def test_torchrun_env_without_rank_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(DistributedError, match="WORLD_SIZE=2 but RANK is not set"):
        init_distributed("cpu")


def test_every_split_is_checked_before_loading():
    from r1fit.config import load_config
    from r1fit.processes import check_split

    two = World(rank=0, size=2)
    cfg = load_config(None, ["train.prompts_per_step=3", "algo.num_generations=3",
                             "sft.batch_size=4"])
    with pytest.raises(DistributedError, match=r"9 rows \(train.prompts_per_step x "
                                               r"algo.num_generations\) do not split evenly"):
        check_split(cfg, "grpo", two)
    check_split(cfg, "sft", two)  # 4 rows: fine
    cfg = load_config(None, ["algo.num_generations=4", "sft.batch_size=3"])
    with pytest.raises(DistributedError, match=r"sft.batch_size \(the format warm-up\)"):
        check_split(cfg, "grpo", two)
    check_split(load_config(None, ["algo.num_generations=4", "sft.batch_size=3",
                                   "sft.format_warmup_steps=0"]), "grpo", two)


def test_one_process_runs_on_the_gpu_it_was_given(monkeypatch):
    from r1fit.processes import device_for

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert device_for(torch.device("cpu"), World()) == torch.device("cpu")
    assert device_for(torch.device("cuda", 1), World()) == torch.device("cuda", 1)
    assert device_for(torch.device("cuda"), World()) == torch.device("cuda", 0)
    # under torchrun a process takes its local rank's GPU, whatever train.device names
    assert device_for(torch.device("cuda", 1), World(rank=3, size=4, local_rank=3)) == \
        torch.device("cuda", 3)
    assert chosen == [torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cuda", 3)]


def test_a_failed_nccl_rank_aborts_instead_of_waiting_for_its_peers(monkeypatch):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import r1fit.processes as processes

    calls = []
    monkeypatch.setattr(processes, "_WORLD", World(rank=0, size=2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    processes.close_distributed(barrier=False)
    assert calls == ["abort"] and not processes.world().distributed
    monkeypatch.setattr(processes, "_WORLD", World(rank=0, size=2))
    processes.close_distributed(barrier=True)  # a finished run waits for the others, then leaves
    assert calls == ["abort", "barrier", "destroy"]
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(processes, "_WORLD", World(rank=0, size=2))
    processes.close_distributed(barrier=False)  # gloo's destroy does not wait
    assert calls[-1] == "destroy"
