"""What is live at the peak of a CUDA run, by call site, from the caching allocator's recorded
history (``torch.cuda.memory._record_memory_history`` then ``torch.cuda.memory._snapshot()``).

The history is a list of events per device: ``alloc`` and ``free_completed`` (with ``addr``,
``size`` and, for allocations, the Python ``frames``, innermost first), among others this
ignores. The history may have lost its oldest events (``max_entries`` is a ring), so the bytes
allocated when it begins are worked out backwards from the bytes allocated when the snapshot was
taken. A block freed in the history but allocated before it counts against that starting amount.
Replaying the events finds the highest point. A second replay up to that event gives the blocks
live there, grouped by where they were allocated: the innermost frame outside torch, after the
innermost frame in r1fit that led to it.

Used by benchmarks/gpu_check.py's ``memtrace`` stage; plain Python (no torch), tested on made-up
histories in tests/benchmarks/test_cuda_peak.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: the events that change the allocated bytes (the others: segment maps, frees requested, OOMs)
ALLOC, FREE = "alloc", "free_completed"
BEFORE = "(allocated before the recorded history)"


@dataclass
class PeakBreakdown:
    """The highest allocated point of a history and what was live there."""

    peak_bytes: int
    start_bytes: int  # allocated when the recorded history begins
    events: int
    peak_event: int  # index of the event that reached the peak (-1: the start was the peak)
    #: (call site, bytes, blocks) at the peak, largest first; BEFORE holds what the history
    #: does not show being allocated
    sites: list[tuple[str, int, int]] = field(default_factory=list)

    def to_dict(self, top: int = 25) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes,
                "events": self.events, "peak_event": self.peak_event,
                "sites": [{"where": w, "bytes": b, "blocks": n} for w, b, n in self.sites[:top]],
                "other_sites_bytes": sum(b for _, b, _ in self.sites[top:])}


def frame_text(frame: dict[str, Any]) -> str:
    """``file.py:line function`` with the file's path cut to what follows ``site-packages/`` or
    the repository's ``r1fit/``."""
    name = str(frame.get("filename", "?"))
    for marker in ("site-packages/", "dist-packages/"):
        if marker in name:
            name = name.split(marker, 1)[1]
    if "/r1fit/" in name:
        name = "r1fit/" + name.rsplit("/r1fit/", 1)[1]
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def call_site(frames: Sequence[dict[str, Any]]) -> str:
    """Where a block was allocated: the innermost frame that is not torch's own, and the
    innermost r1fit frame above it when that is another one (``site < r1fit frame``)."""
    texts = [frame_text(f) for f in frames]
    outside = next((t for t in texts if not t.startswith("torch/")), None)
    ours = next((t for t in texts if t.startswith("r1fit/")), None)
    if outside is None:
        return ours or (texts[0] if texts else "(no frames)")
    return outside if ours in (None, outside) else f"{outside} < {ours}"


def peak_breakdown(trace: Sequence[dict[str, Any]], allocated_at_end: int) -> PeakBreakdown:
    """The peak of ``trace`` (one device's events, oldest first) and the blocks live there by
    :func:`call_site`; ``allocated_at_end``: ``torch.cuda.memory_allocated()`` when the
    snapshot was taken."""
    net = sum(e["size"] if e["action"] == ALLOC else -e["size"]
              for e in trace if e["action"] in (ALLOC, FREE))
    start = allocated_at_end - net
    current = peak = start
    peak_event = -1
    for i, event in enumerate(trace):
        if event["action"] in (ALLOC, FREE):
            current += event["size"] if event["action"] == ALLOC else -event["size"]
            if current > peak:
                peak, peak_event = current, i
    live: dict[int, tuple[int, str]] = {}
    before = start
    for event in trace[:peak_event + 1]:
        if event["action"] == ALLOC:
            live[event["addr"]] = (event["size"], call_site(event.get("frames") or []))
        elif event["action"] == FREE:
            if live.pop(event["addr"], None) is None:
                before -= event["size"]  # allocated before the history began
    sites: dict[str, list[int]] = {}
    for size, site in live.values():
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(((w, b, n) for w, (b, n) in sites.items()), key=lambda x: -x[1])
    if before:
        ranked.insert(0, (BEFORE, before, 0))
    return PeakBreakdown(peak, start, len(trace), peak_event, ranked)
