"""SFT steps with micro-batches of padded rows against micro-batches packed by tokens
(``memory.micro_batch_tokens``), on conversations whose answers differ a lot in length.

Command (24 minutes on 2 CPU cores, measured 1,433 s):

    python benchmarks/sft_packing.py
    # = --model builtin:bench-1024 --rows 64 --batch 16 --steps 4 --repeats 3 --image-size 112

The data is built here: ``--rows`` LLaVA-format conversations (one image, one question, one
answer) whose answers are ``--min-words`` to ``--max-words`` words, log-uniform, from a fixed
seed, so most rows are short and a few are long, as real answers are. Both variants train the
same steps on the same rows (full fine-tuning, float32, CPU, gradient checkpointing on):

- ``rows``: ``memory.micro_batch=--batch``, the step's rows in one micro-batch, each prompt
  left-padded and each answer right-padded to the longest;
- ``packed``: ``memory.micro_batch_tokens=--tokens``, the step's rows one after another in one
  row with no padding (each sees only itself).

Per run, medians over steps 2.. (step 1 pays one-off costs): ``tokens_per_second`` (scored
answer tokens per second of the step) and ``mfu``; and the run's peak: the largest per-step
``peak_memory_bytes`` (RSS) minus the RSS before the model loaded. Every run is a fresh child
process, and repeats interleave the variants (rows, packed, rows, packed, ...).

Targets (exit 1 when one is missed): the packed variant's tokens/s >= ``--min-speedup`` (1.2) x
the rows variant's, its peak <= the rows variant's, and every step's loss equal between the two
(relative 1e-4: the same work, packed or not). Exit 2 on bad arguments or a failed run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import benchkit
from benchkit import BenchmarkError, RepeatedRuns, positive, print_result, read_result, run_child

NAME = "sft_packing"
MIB = 2**20
VARIANTS = ("rows", "packed")
LOSS_TOLERANCE = 1e-4
WORDS = ("the square is red blue green large small near far left right top bottom a of and "
         "colour shape image edge corner").split()
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


@dataclass
class RunResult:
    """What one child run measured."""

    tokens_per_second: list[float]  # per step, steps 2..
    mfu: list[float]  # per step, steps 2..
    losses: list[float]  # per step, all steps
    peak_bytes: int  # largest per-step peak RSS minus the RSS before the model loaded


@dataclass
class Setting(RepeatedRuns):
    """All repeats of one variant."""

    variant: str
    runs: list[RunResult] = field(default_factory=list)


def answer_words(rows: int, least: int, most: int, seed: int) -> list[int]:
    """Words per answer: log-uniform between ``least`` and ``most``, from ``seed``."""
    rng = random.Random(seed)
    return [round(least * (most / least) ** rng.random()) for _ in range(rows)]


def write_data(folder: Path, args: argparse.Namespace) -> Path:
    """The conversations (LLaVA's JSON list) and their images in ``folder``; returns the JSON."""
    from PIL import Image

    rng = random.Random(args.seed + 1)
    names = list(COLOURS)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (args.image_size, args.image_size), rgb).save(folder / f"{name}.png")
    rows = []
    for i, n in enumerate(answer_words(args.rows, args.min_words, args.max_words, args.seed)):
        rows.append({"id": str(i), "image": f"{names[i % len(names)]}.png", "conversations": [
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(n))}]})
    path = folder / "conversations.json"
    path.write_text(json.dumps(rows))
    return path


# ----------------------------------------------------------------------------------------------
# child: one SFT run


def run_overrides(args: argparse.Namespace, variant: str, data: Path,
                  output_dir: Path) -> list[str]:
    """The config overrides of one measured run."""
    size = args.image_size
    sizes = (f"memory.micro_batch={args.batch}" if variant == "rows"
             else f"memory.micro_batch_tokens={args.tokens}")
    return [f"model.path={args.model}", f"data.train={data}", "data.eval=null",
            f"data.max_pixels={size * size}", f"sft.steps={args.steps}",
            f"sft.batch_size={args.batch}", "train.device=cpu", "checkpoint.every=0",
            f"train.output_dir={output_dir}", "train.overwrite=true", f"train.seed={args.seed}",
            sizes]


def run_one(args: argparse.Namespace) -> int:
    """``--one VARIANT``: train in this process, print the run's measurements."""
    from r1fit.config import load_config
    from r1fit.train.sft import train_sft

    out = Path(args.output_dir)
    train_sft(load_config(None, run_overrides(args, args.one, Path(args.data), out)))
    print_result(NAME, asdict(summarise_run(out)))
    return 0


def summarise_run(out: Path) -> RunResult:
    """One run's metrics.jsonl and summary.json reduced to a :class:`RunResult`."""
    from r1fit.report.metrics import read_metrics  # plain json; no torch

    summary = json.loads((out / "summary.json").read_text())
    before = int(summary["rss_before_load_bytes"])
    steps = sorted((r for r in read_metrics(out / "metrics.jsonl") if "loss" in r),
                   key=lambda r: r["step"])
    if len(steps) < 2:
        raise BenchmarkError(f"{out}: {len(steps)} step rows in metrics.jsonl, need >= 2")
    return RunResult(tokens_per_second=[float(r["tokens_per_second"]) for r in steps[1:]],
                     mfu=[float(r["mfu"]) for r in steps[1:]],
                     losses=[float(r["loss"]) for r in steps],
                     peak_bytes=max(int(r["peak_memory_bytes"]) for r in steps) - before)


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: build the built-in model in a process of its own."""
    from r1fit.models.builtin import ensure_builtin

    if args.model.startswith("builtin:"):
        ensure_builtin(args.model.split(":", 1)[1])
    print_result(NAME, {})
    return 0


# ----------------------------------------------------------------------------------------------
# parent: runs, table, targets


def child_command(args: argparse.Namespace, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every run shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--model", args.model,
            "--batch", str(args.batch), "--steps", str(args.steps), "--tokens", str(args.tokens),
            "--image-size", str(args.image_size), "--seed", str(args.seed)]


def measure(args: argparse.Namespace, variant: str, data: Path) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="r1fit-sftp-") as tmp:
        command = child_command(args, "--one", variant, "--data", str(data),
                                "--output-dir", str(Path(tmp) / "run"))
        stdout = run_child(command, variant, NAME)
    return RunResult(**read_result(stdout, NAME, variant))


def check_targets(rows: Setting, packed: Setting, min_speedup: float) -> tuple[bool, list[str]]:
    """Packed against rows: speed, peak, and equal losses in every run."""
    speedup = packed.median("tokens_per_second") / rows.median("tokens_per_second")
    fast, small = speedup >= min_speedup, packed.peak <= rows.peak
    reference = rows.runs[0].losses
    gaps = [abs(a / b - 1) for run in rows.runs + packed.runs
            for a, b in zip(run.losses, reference, strict=True)]
    same = max(gaps) <= LOSS_TOLERANCE
    verdicts = [
        f"packed {speedup:.2f}x the rows' tokens/s (target >= {min_speedup:g}) -> "
        f"{'met' if fast else 'MISSED'}",
        f"packed peak {packed.peak / rows.peak:.2f}x the rows' (target <= 1) -> "
        f"{'met' if small else 'MISSED'}",
        f"losses of every step and run within {max(gaps):.1e} relative (target <= "
        f"{LOSS_TOLERANCE:g}: the same work) -> {'met' if same else 'MISSED'}"]
    return fast and small and same, verdicts


def print_table(settings: dict[str, Setting]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SFT steps: padded rows vs packed by tokens (medians over repeats)")
    for name in ("variant", "tokens/s", "x rows", "mfu", "peak (MiB)", "x rows "):
        table.add_column(name, justify="left" if name == "variant" else "right")
    rows = settings["rows"]
    for s in settings.values():
        table.add_row(s.variant, f"{s.median('tokens_per_second'):.1f}",
                      f"{s.median('tokens_per_second') / rows.median('tokens_per_second'):.2f}",
                      f"{s.median('mfu'):.3f}", f"{s.peak / MIB:,.0f}",
                      f"{s.peak / rows.peak:.2f}")
    Console(width=max(100, Console().width)).print(table)


def run_parent(args: argparse.Namespace) -> int:
    run_child(child_command(args, "--prepare"), "prepare", NAME)
    settings = {v: Setting(v) for v in VARIANTS}
    started = time.perf_counter()
    words = answer_words(args.rows, args.min_words, args.max_words, args.seed)
    with tempfile.TemporaryDirectory(prefix="r1fit-sftp-data-") as tmp:
        data = write_data(Path(tmp), args)
        for repeat in range(args.repeats):
            for variant in VARIANTS:  # interleaved
                t0 = time.perf_counter()
                result = measure(args, variant, data)
                settings[variant].runs.append(result)
                print(f"{variant} repeat {repeat + 1}/{args.repeats}: "
                      f"{statistics.median(result.tokens_per_second):.1f} tokens/s, peak "
                      f"{result.peak_bytes / MIB:,.0f} MiB, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    print_table(settings)
    met, verdicts = check_targets(settings["rows"], settings["packed"], args.min_speedup)
    print("\n".join(verdicts))
    print(f"model {args.model}, {args.rows} conversations with answers of {min(words)}-"
          f"{max(words)} words (median {statistics.median(words):g}), {args.image_size} px "
          f"images, {args.batch} rows per step, {args.steps} steps, {args.repeats} repeat(s), "
          f"{time.perf_counter() - started:.0f} s in all. Speeds depend on other load on this "
          "machine.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "targets_met": met, "verdicts": verdicts,
             "settings": {v: {"tokens_per_second": s.median("tokens_per_second"),
                              "mfu": s.median("mfu"), "peak_bytes": s.peak,
                              "runs": [asdict(r) for r in s.runs]}
                          for v, s in settings.items()}}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:bench-1024", help="model.path")
    p.add_argument("--rows", type=positive, default=64, help="conversations in the data")
    p.add_argument("--min-words", type=positive, default=5)
    p.add_argument("--max-words", type=positive, default=300)
    p.add_argument("--batch", type=positive, default=16, help="sft.batch_size")
    p.add_argument("--tokens", type=positive, default=16384,
                   help="memory.micro_batch_tokens of the packed variant (default: a step's "
                   "rows in one micro-batch, as the rows variant has them)")
    p.add_argument("--steps", type=positive, default=4, help="SFT steps per run (>= 2)")
    p.add_argument("--repeats", type=positive, default=3, help="runs per variant")
    p.add_argument("--image-size", type=positive, default=112,
                   help="image side in px (a multiple of 28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-speedup", type=float, default=1.2)
    p.add_argument("--json", metavar="PATH", help="also write the table and raw numbers here")
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--output-dir", help=argparse.SUPPRESS)
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps: need >= 2 (step 1 is left out of the medians)")
    if args.min_words > args.max_words:
        p.error(f"--min-words ({args.min_words}) is above --max-words ({args.max_words})")
    if args.batch > args.rows:
        p.error(f"--batch ({args.batch}) is larger than --rows ({args.rows})")
    if args.image_size % 28:
        p.error(f"--image-size: must be a multiple of 28 px (Qwen2.5-VL), got {args.image_size}")
    if args.one is not None and not (args.data and args.output_dir):
        p.error("--one needs --data and --output-dir")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, lambda a: benchkit.dispatch(a, run_prepare, run_one,
                                                                       run_parent), argv)


if __name__ == "__main__":
    sys.exit(main())
