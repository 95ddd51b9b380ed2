"""The metrics sink: one JSON object per line in ``<output_dir>/metrics.jsonl``, each row passed
on to the trackers of ``report.to`` (:mod:`r1fit.report.sinks`)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r1fit.report.sinks import Trackers


def plain(value: Any) -> Any:
    """A tensor's or numpy scalar's Python value; NaN and infinities as None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null says "not a number" honestly
    return value


class MetricsWriter:
    """Appends metric rows and flushes each one, so a crash loses at most the row being written."""

    def __init__(self, path: Path, *, active: bool = True, trackers: Trackers | None = None) -> None:
        """``active=False`` (ranks other than 0) counts rows without writing them; ``trackers``
        receive every row written (and are closed with this writer)."""
        self.path = Path(path)
        self.trackers = trackers
        # rows already there (a resumed run continues the file); checkpoints record the count
        self.lines = (sum(1 for _ in self.path.open(encoding="utf-8"))
                      if self.path.is_file() else 0)
        self._file = None
        if active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: plain(v) for k, v in row.items()}) + "\n")
            self._file.flush()
        if self.trackers is not None:
            self.trackers.write(row)
        self.lines += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.trackers is not None:
            self.trackers.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for_device() -> None:
    """Wait for the work queued on this process's CUDA device, if it has used one. CUDA kernels
    run after the Python that queued them returns, so without this a phase's GPU time lands in
    whichever later phase first waits for a result (a ``.item()``, a copy to the CPU). Looked up in
    ``sys.modules``: this module stays free of torch (benchmark parents read metrics with it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time (seconds) to ``into[key]``: on a GPU, of the work it queued, by
    waiting for the device at both ends (two synchronisations per timed phase)."""
    wait_for_device()
    start = time.perf_counter()
    try:
        yield
    finally:
        wait_for_device()
        into[key] = into.get(key, 0.0) + time.perf_counter() - start
