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


def test_a_launch_without_master_addr_is_one_line(monkeypatch):
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(DistributedError, match="^WORLD_SIZE=2 but MASTER_ADDR is not set; start "
                                               "the processes with torchrun$"):
        init_distributed("cpu")


def test_joining_says_when_it_waits_and_its_failure_is_one_line(monkeypatch, capsys):
    """Variables left from another launch waited silently for the group's 30 minutes; a failed
    join was a raw traceback."""
    import time

    import torch.distributed as dist

    import r1fit.processes as processes

    for key, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "10.0.0.9"), ("MASTER_PORT", "29777")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(processes, "JOIN_NOTICE_SECONDS", 0.05)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def slow_then_refused(*args, **kwargs):
        time.sleep(0.5)
        raise dist.DistNetworkError("The client socket has timed out after 1800000ms\nmore")

    monkeypatch.setattr(dist, "init_process_group", slow_then_refused)
    with pytest.raises(DistributedError, match=r"^rank 1 could not join the process group of 2 "
                                               r"processes at 10\.0\.0\.9:29777: The client "
                                               r"socket has timed out after 1800000ms$"):
        init_distributed("cpu")
    err = capsys.readouterr().err
    assert err.startswith("r1fit: rank 1 has waited 0 s for the other 1 of WORLD_SIZE=2 "
                          "processes at 10.0.0.9:29777 (is every process started?")


def test_processes_whose_configs_differ_are_refused(monkeypatch):
    """Each node parses its own command line: another train.max_steps hung the run at its end,
    another learning rate trained each shard differently with rank 0's on record."""
    import r1fit.processes as processes
    from r1fit.config import load_config

    mine = load_config(None, ["train.max_steps=4"]).to_dict()
    theirs = load_config(None, ["train.max_steps=6", "train.learning_rate=0.01"]).to_dict()
    monkeypatch.setattr(processes, "_WORLD", World(rank=0, size=2))
    monkeypatch.setattr(processes, "all_gather_objects", lambda obj: [obj, theirs])
    with pytest.raises(DistributedError, match=r"^rank 1's config differs from rank 0's "
                                               r"\(train.learning_rate: 0.003 vs 0.01, "
                                               r"train.max_steps: 4 vs 6\); every process must "
                                               "run the same command"):
        processes.check_same_config(mine)
    monkeypatch.setattr(processes, "all_gather_objects", lambda obj: [obj, obj])
    processes.check_same_config(mine)  # the same: nothing said


def test_a_rank_that_lost_another_says_so_in_one_line(monkeypatch):
    """The survivor of a failed rank printed gloo's 33-line traceback."""
    import r1fit.cli as cli
    import r1fit.processes as processes
    import r1fit.train.grpo as grpo
    from r1fit.config import load_config

    def lost(cfg):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
                           "closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(grpo, "train_grpo", lost)
    monkeypatch.setattr(processes, "_WORLD", World(rank=1, size=2))
    with pytest.raises(DistributedError, match=r"^rank 1 lost another process of the run, which "
                                               r"stopped \(its own error is above; RuntimeError: "):
        cli._run("train", load_config(None, []))
    assert processes.lost_peer(RuntimeError("NCCL error in: ...")) and \
        not processes.lost_peer(RuntimeError("shape mismatch"))

    def bug(cfg):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(grpo, "train_grpo", bug)
    monkeypatch.setattr(processes, "_WORLD", World(rank=1, size=2))
    with pytest.raises(RuntimeError, match="^shape mismatch$"):  # a bug keeps its traceback
        cli._run("train", load_config(None, []))
