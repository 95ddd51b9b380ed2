"""The processes of a run: torchrun's environment, the process group, and the few collectives the
loops need (sums, gathers, a barrier).

A run started without torchrun is one process and every helper here is a no-op, so the loops call
them unconditionally. Under ``torchrun --nproc-per-node N`` (or several nodes through torchrun's
rendezvous) each process joins one process group: NCCL on CUDA, gloo on CPU.

``torchrun --nproc-per-node 1`` is one process like a plain run, unless ``R1FIT_ONE_PROCESS_GROUP=1``
is set (:data:`ONE_PROCESS_GROUP`): then the one process joins a process group of its own and runs
the distributed path whole (rank-0 loading from the meta device, FSDP2 and its mixed precision,
sharded checkpoints, the collectives over one rank). No user needs that; it shows the code paths of
a sharded run on a machine with one device (benchmarks/gpu_check.py's ``fsdp`` stage).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from r1fit.config.schema import uneven_split
from r1fit.config.values import config_changes
from r1fit.errors import R1fitError, one_line

log = logging.getLogger("r1fit.distributed")


class DistributedError(R1fitError, RuntimeError):
    """The processes cannot be set up or do not agree; the message says what to change."""


@dataclass(frozen=True)
class World:
    """Where this process stands: its rank among ``size`` processes and its rank on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    #: in a process group though alone in it (``R1FIT_ONE_PROCESS_GROUP=1`` under torchrun)
    grouped: bool = False

    @property
    def main(self) -> bool:
        """Rank 0 reads the weights, writes the logs, metrics and checkpoint metadata."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """In a process group: the model is sharded and the helpers below communicate."""
        return self.size > 1 or self.grouped

    def share(self, n: int, what: str = "rows") -> slice:
        """This rank's contiguous share of ``n`` items; ``n`` must split evenly, because every
        rank must run the same number of forward and backward passes (FSDP's collectives)."""
        problem = uneven_split(n, what, self.size)
        if problem is not None:
            raise DistributedError(problem)
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


_WORLD = World()
#: the environment variable that makes a one-process torchrun run join a process group anyway
ONE_PROCESS_GROUP = "R1FIT_ONE_PROCESS_GROUP"


def check_split(cfg: Any, kind: str, w: World) -> None:
    """Before anything loads: every batch the run will split over ``w`` splits evenly (GRPO's
    rows per step, the SFT batch, the warm-up's batch)."""
    problems = cfg.split_problems(kind, w.size)
    if problems:
        raise DistributedError(problems[0])


def world() -> World:
    """This process's place in the run (rank 0 of 1 without torchrun)."""
    return _WORLD


def init_distributed(device_type: str) -> World:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``); one process without torchrun, or with one process unless
    :data:`ONE_PROCESS_GROUP` is ``1``. The backend: NCCL on CUDA, gloo on the CPU."""
    global _WORLD
    size = int(os.environ.get("WORLD_SIZE", "1"))
    grouped = size == 1 and os.environ.get(ONE_PROCESS_GROUP) == "1"
    if size <= 1 and not grouped:
        _WORLD = World()
        return _WORLD
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except KeyError as exc:
        why = f"{ONE_PROCESS_GROUP}=1" if grouped else f"WORLD_SIZE={size}"
        raise DistributedError(f"{why} but {exc.args[0]} is not set; start the processes with "
                               "torchrun") from exc
    if not dist.is_initialized():
        _join_group(device_type, rank, size, local_rank)
    _WORLD = World(rank=rank, size=size, local_rank=local_rank, grouped=grouped)
    return _WORLD


#: seconds a process waits for the others to join before it says it is waiting
JOIN_NOTICE_SECONDS = 30.0


def _join_group(device_type: str, rank: int, size: int, local_rank: int) -> None:
    """``init_process_group`` from torchrun's environment: its failures as one line, and a
    notice when the others are long in coming (variables left over from another launch wait for
    processes that never come, for the group's 30-minute timeout)."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise DistributedError(f"WORLD_SIZE={size} but {' and '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} not set; start the "
                               "processes with torchrun")
    notice = threading.Timer(JOIN_NOTICE_SECONDS, lambda: print(
        f"r1fit: rank {rank} has waited {JOIN_NOTICE_SECONDS:.0f} s for the other {size - 1} of "
        f"WORLD_SIZE={size} processes at {where} (is every process started? WORLD_SIZE, RANK "
        "and MASTER_ADDR left in the environment by another launch wait for processes that "
        "never come)", file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    timeout = datetime.timedelta(minutes=30)
    try:
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            # device_id binds the group to this GPU: NCCL's barrier then needs no guess of the
            # device (it warns without one)
            dist.init_process_group("nccl", timeout=timeout,
                                    device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo", timeout=timeout)
    except (ValueError, RuntimeError) as exc:  # DistError and its kinds are RuntimeErrors
        raise DistributedError(f"rank {rank} could not join the process group of {size} "
                               f"processes at {where}: {one_line(exc, 300, first_line=True)}"
                               ) from exc
    finally:
        notice.cancel()


def check_same_config(config: dict[str, Any]) -> None:
    """Every process runs the same config (``config``: this process's, as a dict): each node
    parses its own command line and files, and a setting that differs between them would hang
    the run at its end (another step count) or train each shard differently with rank 0's
    settings on record (another learning rate). Every rank raises the same one line."""
    if not world().distributed:
        return
    configs = all_gather_objects(config)
    for rank, other in enumerate(configs[1:], start=1):
        if changes := config_changes(configs[0], other):
            shown = ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in list(changes.items())[:3])
            more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
            raise DistributedError(f"rank {rank}'s config differs from rank 0's ({shown}{more}); "
                                   "every process must run the same command with the same "
                                   "config files")


#: how a collective reports a process that went away (gloo's transport, NCCL, the store)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL error", "NCCL communicator", "ProcessGroupGloo", "ProcessGroupNCCL",
              "gloo/transport")


def lost_peer(exc: BaseException) -> bool:
    """True when ``exc`` says another process of the run went away (it failed or was killed:
    its own error is its own to say)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOST)


def close_distributed(*, barrier: bool = False) -> None:
    """Leave the process group of a torchrun run (at its end; a crash leaves it to torchrun).
    A one-process run has none of its own; a group a library made (vLLM makes one for its engine)
    is the library's to close. ``barrier`` (a run that finished on every process): wait for the
    others first, so that no process tears its gloo connections down while another still works
    (rank 0 writes the report last); once, a rank that left first aborted at exit
    ("terminate called without an active exception")."""
    global _WORLD
    if _WORLD.distributed and dist.is_initialized():
        if barrier:
            dist.barrier()
            dist.destroy_process_group()
        elif dist.get_backend() == "nccl":
            # a failed rank may leave collectives its peers never matched; NCCL's destroy waits
            # for them (torch's own note: "for a bad program, a hang is expected" there), so the
            # rank would hang until the group's timeout instead of exiting for torchrun to see
            abort_group()
        else:
            dist.destroy_process_group()
    _WORLD = World()


def abort_group() -> None:
    """Tear the default process group down without waiting for its pending collectives (NCCL's
    abort; torch has it as a private function only), or destroy it where this torch lacks one."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def pick_device(name: str) -> torch.device:
    """``train.device``: 'auto' is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DistributedError(f"train.device={name} but CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise DistributedError(f"train.device={name} but this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 is the first)")
    return device


def device_for(requested: torch.device, w: World) -> torch.device:
    """The process's device for ``train.device`` (as :func:`pick_device` reads it): over several
    processes one GPU each (``cuda:<local rank>``), one process the GPU asked for (``cuda:N``,
    else ``cuda:0``); made the current device, so that what runs on "the current device" (CUDA
    graphs, memory statistics, the RNG state a checkpoint keeps) runs on it. Every process
    shares the CPU."""
    if requested.type != "cuda":
        return torch.device("cpu")
    index = w.local_rank if w.distributed else (requested.index or 0)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: Sequence[float], op: Any) -> list[float]:
    if not world().distributed:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def all_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sums over all processes (float64, so counts and loss shares add exactly)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_max(values: Sequence[float]) -> list[float]:
    """Element-wise maxima over all processes (peak memory of the busiest rank)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every process's rows (same shape on every rank) in rank order."""
    if not world().distributed:
        return t
    local = t.to(_comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(world().size)]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order."""
    if not world().distributed:
        return [obj]
    out: list[Any] = [None] * world().size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not world().distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world().distributed:
        dist.barrier()
