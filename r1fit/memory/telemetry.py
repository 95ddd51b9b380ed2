"""Peak-memory readings: CUDA max allocated where CUDA runs, else the process's peak RSS."""

from __future__ import annotations

import resource
import sys

import torch


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
    and the peak then stays the process-lifetime peak."""
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
    """The number logged as ``peak_memory_bytes``: CUDA max allocated, else process peak RSS
    (both since the last :func:`reset_peak`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
