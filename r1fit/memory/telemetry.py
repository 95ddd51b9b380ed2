"""Peak-memory readings (CUDA max allocated/reserved where CUDA runs, else the process's peak RSS)
and CUDA allocator hygiene."""

from __future__ import annotations

import logging
import os
import resource
import sys
from typing import Any

import torch

from r1fit.distributed.context import all_max

log = logging.getLogger("r1fit.memory")

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
GiB = 1 << 30


def configure_cuda_allocator() -> None:
    """Use expandable segments (fewer "reserved but unallocated" gaps from fragmentation) unless
    the user configured the allocator. Must run before CUDA initialises; the CLI calls it first."""
    if any(var in os.environ for var in ALLOC_CONF_VARS):
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("CUDA was initialised before r1fit could set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; set it yourself")
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory since start or the last
    :func:`reset_peak`.

    Linux: ``VmHWM`` of /proc/self/status, which ``clear_refs`` resets. ``ru_maxrss`` is not used
    there because a child inherits its parent's peak in it (a run started from a notebook that
    holds a model would never log less than the notebook's peak). Elsewhere ``ru_maxrss``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak(device: torch.device) -> bool:
    """Start a new peak-memory window (each step logs its own peak). On CPU this resets the
    kernel's RSS high-water mark (Linux ``clear_refs``); returns False where that is impossible,
    and the peak then stays the process-lifetime peak. With the tensor probe on (CPU), a new
    profiled window starts."""
    if _probe is not None and device.type == "cpu":
        _probe.start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """The number logged as ``peak_memory_bytes`` since the last :func:`reset_peak`: CUDA max
    allocated; on CPU the process's peak RSS, or with the tensor probe on (``memory.cpu_peak:
    tensors``) the peak bytes of live tensors, the CPU counterpart of CUDA's figure."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if _probe is not None and _probe.active:
        return _probe.peak()
    return peak_rss_bytes()


_probe: Any = None  # r1fit.memory.probe.TensorProbe when memory.cpu_peak is "tensors"


def use_tensor_probe(on: bool) -> None:
    """Switch CPU peak measurement to live tensor bytes (``memory.cpu_peak: tensors``) or back to
    peak RSS."""
    global _probe
    if _probe is not None:
        _probe.stop()
    if on:
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's C++ logs are noise here
        from r1fit.memory.probe import TensorProbe

        _probe = TensorProbe()
    else:
        _probe = None


def step_memory(device: torch.device, prefix: str = "") -> dict[str, int | None]:
    """``peak_memory_bytes`` and ``peak_reserved_bytes`` since the last :func:`reset_peak`, of the
    busiest process when there are several. On CPU the reserved figure does not exist (null): the
    peak is the process's peak RSS."""
    reserved = (int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None)
    memory = {f"{prefix}peak_memory_bytes": peak_memory_bytes(device),
              f"{prefix}peak_reserved_bytes": reserved}
    keys = [k for k, v in memory.items() if v is not None]
    return {**memory, **{k: int(v) for k, v in zip(keys, all_max([memory[k] for k in keys]))}}


def warn_if_fragmented(device: torch.device, threshold_gib: float, step: int) -> bool:
    """Log a warning when the CUDA allocator holds more than ``threshold_gib`` reserved but
    unallocated (fragmentation); returns whether it warned. CPU: nothing to check."""
    if device.type != "cuda" or not threshold_gib:
        return False
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if idle <= threshold_gib * GiB:
        return False
    log.warning("step %d: %.1f GiB reserved but unallocated on %s (fragmentation); "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it, a smaller "
                "memory.micro_batch too", step, idle / GiB, device)
    return True
