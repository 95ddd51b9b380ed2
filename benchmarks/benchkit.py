"""What the benchmark scripts share: how a script runs (its errors and exit status), its child
processes, argument checks, and loading a script as a module (tests).

A script is a parent that measures in child processes (a fresh process per measurement: RSS is a
high-water mark, and the parent stays free of torch). Between the two:
- a failure the user can fix is one line ``<script>: error: <message>`` on stderr and exit status 2
  (:func:`main`, as r1fit's own ``r1fit: error: ``); the parent finds that line in the child's
  stderr and raises it with what it was doing (:func:`run_child`);
- a child's result is one line ``<script>: result: <JSON>`` on stdout (:func:`print_result`,
  :func:`read_result`), found among whatever else the child (or torchrun) prints.

The scripts run standalone (``python benchmarks/<name>.py``), which puts this folder first on
``sys.path``, so they import this file as ``benchkit``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from r1fit.errors import R1fitError, one_line  # plain Python: the parents stay free of torch

FOLDER = Path(__file__).resolve().parent
TAIL_LINES = 30  # of a failed child's stderr; torchrun's own summary alone takes about 20
CAUSE_LINES = 12  # at most, of the lines before the tail that name a cause (see failure_text)
# what a line naming a failure's cause holds: a C++ abort (gloo's "terminate called after
# throwing ...", then "what(): ..."), a Python exception's last line, a signal
CAUSE_MARKERS = ("terminate called", "what():", "Error", "Exception", "Aborted", "Signal ")


class BenchmarkError(ValueError):
    """Bad benchmark arguments or a run that failed; the message names the culprit."""


def error_prefix(name: str) -> str:
    """How script ``name``'s one-line errors start."""
    return f"{name}: error: "


def result_prefix(name: str) -> str:
    """How script ``name``'s result lines start."""
    return f"{name}: result: "


def main(name: str, parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
         run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """A script's entry point: ``run(parse_args(argv))`` and its exit status (each script says
    what 0 and 1 mean: every target met, one missed). Bad arguments exit with 2 through argparse.
    A :class:`BenchmarkError` or an r1fit error (:class:`R1fitError`: a cause the user can fix) is
    printed as ``<name>: error: <message>`` and gives 2; anything else is a bug and keeps its
    traceback."""
    args = parse_args(argv)
    try:
        return run(args)
    except BenchmarkError as exc:
        message = str(exc)  # ours: one line, or a failed child's stderr meant to be read whole
    except R1fitError as exc:
        message = one_line(exc)  # folded, so a parent reading this line gets all of it
    print(error_prefix(name) + message, file=sys.stderr)
    return 2


def dispatch(args: argparse.Namespace, prepare: Callable[[argparse.Namespace], int],
             one: Callable[[argparse.Namespace], int],
             parent: Callable[[argparse.Namespace], int]) -> int:
    """The mode the arguments name: a child's ``--prepare`` or ``--one``, else the parent."""
    if args.prepare:
        return prepare(args)
    return one(args) if args.one is not None else parent(args)


def child_error(stderr: str, name: str) -> str | None:
    """The message of the last one-line error script ``name`` printed in ``stderr``, or None.
    The line may start with something else: torchrun puts ``[rank1]:`` before its ranks' lines."""
    prefix = error_prefix(name)
    ours = [line for line in stderr.splitlines() if prefix in line]
    return ours[-1].split(prefix, 1)[1] if ours else None


def run_child(command: Sequence[str], what: str, name: str, *,
              env: Mapping[str, str] | None = None, timeout: float | None = None,
              log: Path | None = None, group: bool = False) -> str:
    """Run ``command`` to its end (output captured) and return its stdout. ``what`` says what the
    child does, for the errors; ``name`` is the script (or program: ``r1fit``) whose one-line
    errors the child prints. ``log``: a file the child's stdout and stderr are appended to line by
    line as it prints them, under a ``==== <what> ====`` header and closed by a
    ``==== <what> (exit N) ====`` line, so a child killed at a timeout (or a parent killed with
    it) leaves in the log what it had printed. ``group``: the child leads a process group of its
    own, and a timeout kills the whole group (the processes it started too, which would
    otherwise run on holding memory).

    A failed child raises :class:`BenchmarkError`: ``<what>: <message>`` with the child's own
    one-line error when it printed one, else ``<what> failed (exit N):`` and the last
    :data:`TAIL_LINES` lines of its stderr (a traceback); ``<what>: no result in T s`` when it
    runs longer than ``timeout`` seconds."""
    append_log(log, what)
    with subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace", env=env, start_new_session=group) as proc:
        outputs: dict[str, list[str]] = {"stdout": [], "stderr": []}
        readers = [threading.Thread(target=_copy_lines, args=(stream, outputs[key], log),
                                    daemon=True)
                   for key, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
            _join(readers)
            append_log(log, f"{what} (no result in {timeout:.0f} s)")
            raise BenchmarkError(f"{what}: no result in {timeout:.0f} s") from None
        _join(readers)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(outputs["stdout"]),
                                       "".join(outputs["stderr"]))
    append_log(log, f"{what} (exit {done.returncode})")
    if done.returncode == 0:
        return done.stdout
    own = child_error(done.stderr, name)
    if own is not None:
        raise BenchmarkError(f"{what}: {own}")
    raise BenchmarkError(f"{what} failed (exit {done.returncode}):\n"
                         + failure_text(done.stderr))


def _copy_lines(stream: Any, into: list[str], log: Path | None) -> None:
    """Read ``stream`` to its end, keeping each line in ``into`` and appending it to ``log``
    (opened once, line-buffered: each line reaches the file as it is read)."""
    with contextlib.nullcontext() if log is None else open(log, "a", encoding="utf-8",
                                                            buffering=1) as f:
        for line in stream:
            into.append(line)
            if f is not None:
                f.write(line if line.endswith("\n") else line + "\n")


def _join(readers: list[threading.Thread]) -> None:
    """Wait for the readers; a grandchild that outlives its killed parent and keeps the pipe
    open (a process group not killed) must not hang the caller: give up after a few seconds."""
    for reader in readers:
        reader.join(timeout=5)


def append_log(log: Path | None, header: str, *texts: str | bytes | None) -> None:
    """Append ``texts`` (a child's outputs; a timeout's may be bytes or None) to ``log``."""
    if log is None:
        return
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"==== {header} ====\n")
        for text in texts:
            if isinstance(text, bytes):
                text = text.decode("utf-8", "replace")
            if text:
                f.write(text if text.endswith("\n") else text + "\n")


def failure_text(stderr: str) -> str:
    """What a failed child's ``stderr`` says: its last :data:`TAIL_LINES` lines, after (up to
    :data:`CAUSE_LINES` of) the earlier lines that name a cause. Under torchrun the tail is the
    launcher's own summary; the rank that failed printed its cause (a Python error, or a C++
    abort's ``terminate called ...`` / ``what(): ...``) above it."""
    lines = stderr.strip().splitlines()
    earlier = [line for line in lines[:-TAIL_LINES]
               if any(marker in line for marker in CAUSE_MARKERS)][-CAUSE_LINES:]
    return "\n".join(([*earlier, "..."] if earlier else []) + lines[-TAIL_LINES:])


def print_result(name: str, result: Any) -> None:
    """A child's result, as the one line ``<name>: result: <JSON>`` on stdout."""
    print(result_prefix(name) + json.dumps(result), flush=True)


def read_result(stdout: str, name: str, what: str) -> Any:
    """The result a child of script ``name`` printed (:func:`print_result`): the last result line
    in its ``stdout``, whatever else is there. ``what`` says what the child did, for the errors."""
    prefix = result_prefix(name)
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if not lines:
        raise BenchmarkError(f"{what}: no result line in the output")
    try:
        return json.loads(lines[-1][len(prefix):])
    except json.JSONDecodeError as exc:
        raise BenchmarkError(f"{what}: bad result line ({exc})") from None


class RepeatedRuns:
    """Medians over a setting's repeated runs: ``runs`` holds results with per-step lists (steps
    2..) and a ``peak_bytes``. A base of the scripts' ``Setting`` dataclasses."""

    runs: list[Any]

    def median(self, key: str) -> float:
        """The median over runs of each run's median of ``key``'s per-step values."""
        return statistics.median(statistics.median(getattr(r, key)) for r in self.runs)

    @property
    def peak(self) -> float:
        return statistics.median(r.peak_bytes for r in self.runs)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def floor_bytes(cfg: Any) -> int:
    """What any GRPO step of ``cfg`` must hold at least: the weights, gradients and AdamW states
    of its model plus the activations of one micro-batch of one row (per-row path), as the
    planner counts them (the first three exact: parameter counts of the model built on the meta
    device). Called in a measuring child (it imports torch)."""
    from r1fit.memory.planner import plan_memory

    values: dict[str, Any] = {"memory.micro_batch": 1, "memory.share_prefix": False}
    if hasattr(cfg.memory, "micro_batch_tokens"):  # rows, not packed tokens (an older r1fit
        values["memory.micro_batch_tokens"] = None  # has no such key)
    one_row = cfg.with_values(values)
    parts = plan_memory(one_row, device_type="cpu").parts
    return int(sum(parts[k] for k in ("weights", "gradients", "optimizer", "activations")))


def unread_mapped_bytes(suffix: str = ".safetensors",
                        smaps: str = "/proc/self/smaps") -> tuple[int, int] | None:
    """(bytes mapped, bytes of them not resident) over this process's mappings of files whose
    name ends in ``suffix``; None where ``smaps`` cannot be read. transformers maps a
    checkpoint's weights in lazily, so a CPU process's RSS holds only the pages read so far (of
    a frozen embedding: the rows of tokens that occurred), where a GPU holds every weight."""
    mapped = resident = 0
    counting = False
    try:
        with open(smaps) as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header
                    counting = len(fields) == 6 and fields[5].rstrip("\n").endswith(suffix)
                elif counting and fields[0] in ("Size:", "Rss:"):
                    kib = int(fields[1]) * 1024
                    if fields[0] == "Size:":
                        mapped += kib
                    else:
                        resident += kib
    except (OSError, ValueError, IndexError):
        return None
    return mapped, mapped - resident


class UnreadWeights:
    """Samples :func:`unread_mapped_bytes` every ``interval`` seconds in a thread while the
    ``with`` block runs. ``bytes``: the non-resident part of the last sample that found weights
    mapped (0 if none did). Pages only become resident over a run, so this is at most what was
    missing at any earlier moment, the run's peak included."""

    def __init__(self, interval: float = 2.0, suffix: str = ".safetensors") -> None:
        self.interval, self.suffix, self.bytes = interval, suffix, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while True:
            sample = unread_mapped_bytes(self.suffix)
            if sample is not None and sample[0] > 0:
                self.bytes = sample[1]
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> UnreadWeights:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_ticks() -> tuple[int, int] | None:
    """(busy clock ticks of the whole machine, this process's own user + system ticks), or None
    where /proc is missing. Busy: user, nice, system, irq, softirq and steal time (not idle or
    iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; skip it
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    # /proc/<pid>/stat fields 14 and 15 (utime, stime); own[0] is field 3
    return user + nice + system + irq + softirq + steal, int(own[11]) + int(own[12])


def other_cores(before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float,
                ticks_per_second: float) -> float | None:
    """Cores used on average by every process but this one between two :func:`cpu_ticks`."""
    if before is None or after is None or seconds <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / ticks_per_second / seconds)


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (for tests of its pure parts)."""
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


#: the SFT'd tool-calling policy (:func:`zoom_policy`): its config and steps
ZOOM_CONFIG = FOLDER.parent / "configs" / "zoom-tools.yaml"
ZOOM_SFT_STEPS = 600
#: where benchmarks keep what they build once (the SFT'd policy)
CACHE = Path.home() / ".cache" / "r1fit" / "benchmarks"


def zoom_policy(cache: Path = CACHE) -> Path:
    """A policy that calls its tool: builtin:tiny after ``r1fit sft configs/zoom-tools.yaml
    sft.steps=600`` (about 4 minutes on 2 cores; a random-weight policy writes no call; after
    these steps about two thirds of its GRPO rows call the zoom), trained once into ``cache``
    and its ``final`` folder returned."""
    final = cache / f"zoom-sft-{ZOOM_SFT_STEPS}" / "final"
    if (final / "config.json").is_file():
        return final
    print(f"training the tool-calling policy: r1fit sft {ZOOM_CONFIG.name} "
          f"sft.steps={ZOOM_SFT_STEPS} (about 4 min)", file=sys.stderr, flush=True)
    run_child([sys.executable, "-m", "r1fit", "sft", str(ZOOM_CONFIG),
               f"sft.steps={ZOOM_SFT_STEPS}", f"train.output_dir={final.parent}",
               "train.overwrite=true"], "the tool-calling SFT policy", "r1fit")
    return final
