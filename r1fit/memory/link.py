"""The link between processes, measured: what FSDP2's all-gathers and reduce-scatters cost
(:mod:`r1fit.memory.rates` keeps the result; :mod:`r1fit.memory.planner.timing` reads it).

:func:`measure_link` starts two processes (spawned: a fresh interpreter each, torch alone
imported) in a process group on ``gloo`` (CPU) or ``nccl`` (two GPUs), as torchrun's workers
would be, and times in each ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` over a
tensor of a few bytes (the fixed cost of a collective) and of ``LINK_BYTES`` (the bandwidth).
Bandwidth is the bus bandwidth, as NCCL's tests report it: the whole tensor's bytes x (n-1)/n
over the collective's seconds, the bytes each process sends and receives. One GPU cannot
measure it (NCCL puts no two ranks on one device): :func:`r1fit.memory.rates.calibrate` then
keeps the data sheet's figure and says so.
"""

from __future__ import annotations

import multiprocessing
import queue
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

#: the large collective's bytes (the whole tensor), by device type
LINK_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}
#: timed repeats of each collective (the fastest counts), after two untimed ones
REPEATS = 3
#: seconds the two processes may take, start-up included, before the measurement is given up
TIMEOUT = 90.0


@dataclass(frozen=True)
class Link:
    """A measured link: bus bandwidth (bytes/s, the mean of the all-gather's and the
    reduce-scatter's) and a collective's fixed seconds (the mean of the two over a few bytes)."""

    bytes_per_s: float
    collective_s: float
    backend: str


def _best(run: Callable[[], object], device: torch.device) -> float:
    """The fastest of ``REPEATS`` timed calls of ``run`` after two untimed, in seconds, each
    started together on both processes (a barrier)."""
    best = float("inf")
    for i in range(2 + REPEATS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _collectives(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds over a whole tensor of about ``nbytes`` bytes."""
    world = dist.get_world_size()
    shard = torch.ones(max(nbytes // 4 // world, 1), device=device)
    whole = torch.empty(shard.numel() * world, device=device)
    # torch 2.14 renamed them (the old names warn); torch >= 2.6 has the old ones
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return (_best(lambda: gather(whole, shard), device),
            _best(lambda: scatter(shard, whole), device))


def _worker(rank: int, world: int, store: str, device_type: str,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """One process of the measurement; rank 0 puts (small, large) timings in ``results``."""
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            **({"device_id": device} if device_type == "cuda" else {}))
    try:
        small = _collectives(device, 4 * world)
        large = _collectives(device, LINK_BYTES[device_type])
        if rank == 0:
            results.put((small, large))
    finally:
        dist.destroy_process_group()


def measure_link(device_type: str) -> Link | None:
    """The link between two processes on ``device_type`` ('cpu': gloo; 'cuda': NCCL between
    GPUs 0 and 1), or None when it cannot be measured (one GPU; the processes failed or took
    longer than ``TIMEOUT``)."""
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        return None
    world = 2
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="r1fit-link-") as folder:
        store = str(Path(folder) / "store")
        procs = [context.Process(target=_worker, args=(rank, world, store, device_type, results),
                                 daemon=True) for rank in range(world)]
        for p in procs:
            p.start()
        try:
            small, large = results.get(timeout=TIMEOUT)
        except queue.Empty:
            small = large = None
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if small is None or large is None:
        return None
    shard = max(LINK_BYTES[device_type] // 4 // world, 1)
    moved = shard * world * 4 * (world - 1) / world
    return Link(bytes_per_s=moved / (sum(large) / 2), collective_s=sum(small) / 2,
                backend="nccl" if device_type == "cuda" else "gloo")
