"""Peak-memory readings: CUDA max allocated where CUDA runs, else the process's peak RSS."""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """The number logged as ``peak_memory_bytes``: CUDA max allocated, else process peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
