"""The OOM guard on its own: which size it halves, deterministic redo, giving up, the CPU budget."""

from __future__ import annotations

import pytest
import torch

from r1fit.memory.guard import OOMGuard, OutOfMemory
from r1fit.memory.sizes import ChunkSizes
from r1fit.memory.telemetry import current_rss_bytes
from r1fit.rng import RngState


def make_guard(micro_batch: int = 8, generation_batch: int = 8, budget: str = "",
               baseline: int = 0) -> tuple[OOMGuard, torch.nn.Parameter]:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    sizes = ChunkSizes(micro_batch, generation_batch,
                       asked={"micro_batch": micro_batch, "generation_batch": generation_batch})
    optimizer = torch.optim.SGD([weight], lr=0.1)
    return OOMGuard(sizes, budget, torch.device("cpu"), optimizer,
                    baseline_rss_bytes=baseline), weight


def test_oom_in_generation_halves_generation_batch_and_redoes_deterministically():
    guard, weight = make_guard()
    draws, grads_at_start = [], []

    def attempt() -> str:
        grads_at_start.append(weight.grad)
        draws.append(torch.rand(3).tolist())  # the step's randomness (sampling)
        weight.grad = torch.ones(2)           # the attempt leaves gradients behind
        with guard.phase("generation"):
            if guard.sizes.generation_batch > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "done"

    assert guard.run_step(attempt, restore=[RngState()]) == "done"
    assert guard.sizes.generation_batch == 2 and guard.sizes.micro_batch == 8
    assert guard.retries == 2
    assert draws[0] == draws[1] == draws[2]          # RNG put back before each redo
    assert grads_at_start[1] is None and grads_at_start[2] is None  # gradients zeroed


def test_oom_in_micro_batches_halves_micro_batch():
    guard, _ = make_guard(micro_batch=4)

    def attempt() -> int:
        with guard.phase("micro_batch"):
            if guard.sizes.micro_batch > 1:
                raise torch.OutOfMemoryError("out of memory")
        return guard.sizes.micro_batch

    assert guard.run_step(attempt, restore=[]) == 1 and guard.retries == 2


def test_the_cpu_allocators_failure_is_an_oom_the_guard_shrinks():
    """torch raises the CPU allocator's failure as a plain RuntimeError (a bare traceback before):
    inside a phase it is an out-of-memory, halved and redone; other RuntimeErrors pass."""
    guard, _ = make_guard(micro_batch=4)

    def attempt() -> int:
        with guard.phase("micro_batch"):
            if guard.sizes.micro_batch > 2:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                                   "can't allocate memory: you tried to allocate 85899345920 bytes.")
        return guard.sizes.micro_batch

    assert guard.run_step(attempt, restore=[]) == 2 and guard.retries == 1

    def bug() -> None:
        with guard.phase("micro_batch"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        guard.run_step(bug, restore=[])


def test_gives_up_at_size_one_with_advice():
    guard, _ = make_guard(micro_batch=2)

    def attempt() -> None:
        with guard.phase("micro_batch"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB\nmore")

    with pytest.raises(OutOfMemory, match=r"even with memory.micro_batch=1 \(CUDA out of memory. "
                                          r"Tried to allocate 9.00 GiB\)\. Lower data.max_pixels"):
        guard.run_step(attempt, restore=[])


def test_after_an_applied_update_only_that_update_is_redone():
    guard, _ = make_guard(micro_batch=4)
    calls = {"step": 0, "accumulate": 0}

    def accumulate() -> int:
        calls["accumulate"] += 1
        if guard.updates_done == 1 and guard.sizes.micro_batch > 2:
            raise torch.OutOfMemoryError("out of memory")
        return guard.sizes.micro_batch

    def attempt() -> list[int]:
        calls["step"] += 1
        sizes = []
        for _ in range(2):  # num_iterations = 2
            sizes.append(guard.run_update(accumulate))
            guard.updates_done += 1
        return sizes

    assert guard.run_step(attempt, restore=[]) == [4, 2]
    assert calls == {"step": 1, "accumulate": 3}  # the first update is not applied twice


def test_cpu_budget_raises_the_cuda_error_type():
    guard, _ = make_guard(budget="1MiB", baseline=current_rss_bytes() - (64 << 20))
    with pytest.raises(torch.OutOfMemoryError, match="CPU out of memory: peak RSS .* exceeds "
                                                     "memory.budget=1MiB"):
        with guard.phase("micro_batch"):
            pass
    assert guard.failed_phase == "micro_batch"
    roomy, _ = make_guard(budget="1TiB", baseline=current_rss_bytes())
    with roomy.phase("generation"):
        pass  # within budget: no error


def test_packed_micro_batches_halve_their_tokens_down_to_one_sequence():
    """With memory.micro_batch_tokens the micro-batch phase halves the tokens, not the rows, and
    gives up once a micro-batch holds one sequence (halving further would change nothing)."""
    guard, _ = make_guard(micro_batch=4)
    guard.sizes.micro_batch_tokens = 1000
    guard.sizes.note_sequence(300)  # the longest [prompt | completion] of the step

    def attempt() -> None:
        with guard.phase("micro_batch"):
            raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(OutOfMemory, match=r"even with memory.micro_batch_tokens=250 "):
        guard.run_step(attempt, restore=[])
    # 1000 -> 500 -> 250, then 250 <= 300: no third redo; micro_batch untouched
    assert (guard.sizes.micro_batch_tokens, guard.sizes.micro_batch, guard.retries) == (250, 4, 2)


class FakeCuda:
    """torch.cuda's calls the guard makes with a budget, on a card of ``total`` bytes, recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, total: int) -> None:
        self.fractions: list[tuple[float, torch.device]] = []
        self.reserved = 0
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: type("Props", (), {"total_memory": total})())
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, device: self.fractions.append((fraction, device)))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: self.reserved)


def cuda_guard(budget: str) -> OOMGuard:
    weight = torch.nn.Parameter(torch.ones(2))
    sizes = ChunkSizes(8, 8, asked={"micro_batch": 8, "generation_batch": 8})
    return OOMGuard(sizes, budget, torch.device("cuda", 0), torch.optim.SGD([weight], lr=0.1),
                    baseline_rss_bytes=0)


def test_cuda_budget_caps_the_allocator_at_the_budget_less_the_context(monkeypatch):
    cuda = FakeCuda(monkeypatch, total=80 << 30)
    guard = cuda_guard("20GiB")
    # 20 GiB - 768 MiB (the planner's CUDA context) = 19.25 GiB of an 80 GiB card
    assert guard.cuda_cap == (20 << 30) - (768 << 20)
    assert cuda.fractions == [(19.25 / 80, torch.device("cuda", 0))]
    cuda.reserved = guard.cuda_cap  # exactly at the cap: fine
    with guard.phase("generation"):
        pass
    cuda.reserved = guard.cuda_cap + 1  # over it (the cap did not hold): the guard's own error
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory: .* reserved exceeds "
                                                     r"memory.budget=20GiB less the CUDA context"):
        with guard.phase("micro_batch"):
            pass
    assert guard.failed_phase == "micro_batch"


def test_cuda_budget_over_the_card_is_no_cap_and_one_under_the_context_is_refused(monkeypatch):
    cuda = FakeCuda(monkeypatch, total=16 << 30)
    assert cuda_guard("1TiB").cuda_cap == 16 << 30
    assert cuda.fractions[-1][0] == 1.0
    with pytest.raises(OutOfMemory, match=r"memory.budget=512.00 MiB does not cover the CUDA "
                                          r"context \(768.00 MiB\)"):
        cuda_guard("512MiB")
    assert cuda_guard("").cuda_cap is None and len(cuda.fractions) == 1  # no budget: no cap
