"""Peak-memory readings (CUDA max allocated/reserved where CUDA runs, else the process's peak RSS)
and CUDA allocator hygiene."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
from typing import Any

import torch

from r1fit.processes import all_max

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


def glibc(name: str) -> Any:
    """glibc's function ``name`` through ctypes, or None where there is none (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


#: mallopt's parameter number for the mmap threshold (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
#: blocks this large and larger are mapped on their own and unmapped when freed
RELEASE_FREED_THRESHOLD = 1 << 20
MMAP_THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up


def configure_host_allocator(release_freed: bool | str, budget: str, device: torch.device) -> bool:
    """``memory.release_freed``: fix glibc's mmap threshold at 1 MiB, so freed blocks of that size
    and larger go back to the system at once. glibc's default raises the threshold up to 32 MiB as
    large blocks are freed, after which such blocks come from its heaps and stay resident when
    freed: a CPU step's many short-lived activation-sized tensors then leave hundreds of MiB of
    freed heap in the RSS (docs/memory.md, "Freed host memory").
    Fixing it costs a page fault per page of each large block. 'auto' is on for a CPU run with
    ``memory.budget`` (a cap on RSS). Returns whether the threshold was set; the environment's
    ``MALLOC_MMAP_THRESHOLD_`` wins, and where glibc's ``mallopt`` is missing (macOS, musl) this
    warns and does nothing."""
    on = release_freed is True or (release_freed == "auto" and bool(budget)
                                   and device.type == "cpu")
    if not on:
        return False
    if MMAP_THRESHOLD_VAR in os.environ:
        log.info("memory.release_freed: %s=%s is set; glibc uses it", MMAP_THRESHOLD_VAR,
                 os.environ[MMAP_THRESHOLD_VAR])
        return False
    if (mallopt := glibc("mallopt")) is None:
        log.warning("memory.release_freed: no glibc mallopt here (%s); freed memory stays with "
                    "the allocator", sys.platform)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, RELEASE_FREED_THRESHOLD) != 1:
        log.warning("memory.release_freed: glibc refused mallopt(M_MMAP_THRESHOLD, %d)",
                    RELEASE_FREED_THRESHOLD)
        return False
    log.info("memory.release_freed: freed host blocks of >= 1 MiB go back to the system at once "
             "(glibc's mmap threshold fixed at 1 MiB)")
    return True


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
        from r1fit.memory.probe import TensorProbe

        _probe = TensorProbe()
    else:
        _probe = None


def tensor_probe_on() -> bool:
    """Whether CPU peaks are measured by the tensor probe (``memory.cpu_peak: tensors``), which
    keeps torch.profiler running: a second profiler (``report.profile_step``) cannot start."""
    return _probe is not None


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
