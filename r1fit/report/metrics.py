"""The metrics sink: one JSON object per line in ``<output_dir>/metrics.jsonl``, each row passed
on to the trackers of ``report.to`` (:mod:`r1fit.report.sinks`)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from r1fit.errors import R1fitError, naming, one_line

log = logging.getLogger("r1fit.report")


def plain(value: Any) -> Any:
    """A tensor's or numpy scalar's Python value; NaN and infinities as None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null says "not a number" honestly
    return value


class RowSink(Protocol):
    """Where a metrics row goes besides the file: the trackers of ``report.to``
    (:class:`r1fit.report.sinks.Trackers`)."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class OutputRemoved(R1fitError):
    """The run's metrics file was deleted while the run wrote it (its folder removed)."""


class MetricsWriter:
    """Appends metric rows and flushes each one, so a crash loses at most the row being written."""

    def __init__(self, path: Path, *, active: bool = True, trackers: RowSink | None = None) -> None:
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
            with naming(self.path):
                self._file.write(json.dumps({k: plain(v) for k, v in row.items()}) + "\n")
                self._file.flush()
            if os.fstat(self._file.fileno()).st_nlink == 0:
                # rows written into a file no folder holds are lost, and the next checkpoint
                # would make the folder anew, holding no metrics, log or lock
                raise OutputRemoved(f"{self.path} was deleted while the run wrote it (its "
                                    "folder removed?); stopping: no further row or checkpoint "
                                    "would be seen")
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


class JsonLines(NamedTuple):
    """What :func:`read_json_lines` read: the rows, and one ``"<file>:<line>: <why>"`` per line
    skipped."""

    rows: list[dict[str, Any]]
    skipped: list[str]


def counters(*keys: str) -> Callable[[dict[str, Any]], str | None]:
    """A row check for :func:`read_json_lines`: the ``keys`` a row holds (a metrics row's
    ``step``, an SFT warm-up row's ``warmup/step``: a key or ``<prefix>/key``) are whole
    numbers; the reason when one is not. Pages and plots place rows by them."""
    prefixed = tuple(f"/{key}" for key in keys)

    def check(row: dict[str, Any]) -> str | None:
        for key, value in row.items():
            counter = key in keys or key.endswith(prefixed)
            if counter and (isinstance(value, bool) or not isinstance(value, int)):
                return f"its {key!r} is {value!r}, not a whole number"
        return None
    return check


def read_json_lines(path: Path, required: Sequence[str] = (),
                    check: Callable[[dict[str, Any]], str | None] | None = None) -> JsonLines:
    """The JSON object of each whole line of a JSON-lines file (``metrics.jsonl``, saved
    rollouts), blank lines ignored. A line that is not one is skipped, named and warned about once
    per file: a half-written last line (the run was killed while writing it; a resume drops it
    too) or a corrupt line further up; so is an object without the ``required`` keys, or one that
    ``check`` gives a reason against (see :func:`counters`). Reads bytes, so a line cut inside a
    UTF-8 character spoils that line only."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            last = number == len(lines)  # no newline after it: the writer never finished it
            why = ("a half-written last line (the run stopped while writing it)" if last
                   else f"not JSON ({one_line(exc, 80)})")
            skipped.append(f"{path}:{number}: {why}")
            continue
        if not isinstance(row, dict):
            skipped.append(f"{path}:{number}: not a JSON object but {type(row).__name__}")
            continue
        missing = [key for key in required if key not in row]
        why = f"no {', '.join(map(repr, missing))}" if missing else check(row) if check else None
        if why:
            skipped.append(f"{path}:{number}: {why}")
            continue
        rows.append(row)
    if skipped:
        shown = "; ".join(skipped[:3]) + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        log.warning("%s: skipped %d unreadable line%s, read %d rows: %s", path, len(skipped),
                    "" if len(skipped) == 1 else "s", len(rows), shown)
    return JsonLines(rows, skipped)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file, skipping (with a warning) lines that are not whole JSON
    objects or whose step is not a whole number (:func:`read_json_lines`)."""
    return read_json_lines(path, check=counters("step")).rows


#: a key that only GRPO step rows of metrics.jsonl hold (not SFT, eval-only or summary rows)
GRPO_STEP_KEY = "reward_mean"


def grpo_step_rows(path: Path, *, last_per_step: bool = False) -> list[dict[str, Any]]:
    """The GRPO step rows of a metrics.jsonl file, in file order; ``last_per_step``: one row per
    step, the last one written (a step redone after an OOM or a crash may be logged twice), in
    step order."""
    rows = [row for row in read_metrics(path) if GRPO_STEP_KEY in row]
    if not last_per_step:
        return rows
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


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
        # a named range in a profile (report.profile_step): r1fit/generate, r1fit/update, ...
        torch = sys.modules.get("torch")
        profiler = getattr(torch, "profiler", None)
        with (profiler.record_function("r1fit/" + key.removeprefix("seconds_"))
              if profiler is not None else nullcontext()):
            yield
    finally:
        wait_for_device()
        into[key] = into.get(key, 0.0) + time.perf_counter() - start
