"""Peak memory and speed of GRPO steps against the group size G, at fixed chunk sizes.

Command (a few minutes on 2 CPU cores):

    python benchmarks/memory_vs_group.py
    # = --generations 2 4 8 16 --micro-batch 1 --generation-batch 2 --steps 3 --max-new-tokens 32
    #   --beta 0.04
    #   --model builtin:small-realvocab --repeats 1

Target: peak memory over the loaded model at the largest G (16) is at most 1.10 x that at the
smallest G (2). Also printed (no target here): each G's peak over the RSS before the model loaded,
as a multiple of the floor (weights + gradients + AdamW states + one row's activations,
``benchkit.floor_bytes``); with ``--beta`` > 0 the frozen reference copy is part of the peak and not
of the floor. r1fit generates ``memory.generation_batch`` rows at a time and back-propagates
``memory.micro_batch`` rows at a time, so the group size should only change how many chunks a step
runs, not how much memory a chunk needs. Exit status: 0 when the target is met, 1 when it is
missed (the failing comparison is printed), 2 on bad arguments or a failed run.

Why micro-batch 1 by default: every G then runs at least two micro-batches, so every run pays the
same gradient-accumulation transient (autograd adds each micro-batch's dense gradient of the
151,936 x 256 embedding and LM head into ``.grad``: about +180 MiB while both exist). With
``--micro-batch 2``, G=2 is a single micro-batch that skips it: measured here 1,291 MiB at G=2,
then a flat 1,465 / 1,468 / 1,467 MiB at G=4 / 8 / 16 (ratio 1.136, target missed), i.e. a one-off
step from one to two micro-batches, not growth with G.

How it measures (see /work/shared/PITFALLS.md, "Measuring honestly"):
- every (G, repeat) runs ``train_grpo`` in a fresh child process (``--one G``), because RSS is a
  high-water mark and glibc keeps freed memory: a process that ran G=16 cannot measure G=2 after;
- peak memory of a run = max over its steps of the per-step ``peak_memory_bytes`` in
  metrics.jsonl (RSS high-water mark, reset at the start of each step) minus
  ``rss_after_load_bytes`` from summary.json (RSS right after the model was loaded). Gradients and
  AdamW states are therefore counted as the training's own; they do not depend on G;
- one prompt per step, no SFT warm-up, no evaluation, CPU only (on CUDA the loop would log
  allocator peaks, which do not compare with an RSS baseline);
- tokens/s and seconds/step are medians over steps 2.. (step 1 pays one-off costs such as
  allocating the optimizer states). Speeds move with whatever else runs on the machine; memory does
  not. With ``--repeats`` > 1, the reported peak is the median of the repeats' peaks;
- the parent imports neither torch nor the model: on Linux a child's ``ru_maxrss`` starts from its
  parent's peak RSS (the kernel carries it across exec), so the parent must stay small.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
from benchkit import BenchmarkError, floor_bytes, positive, print_result, read_result, run_child

NAME = "memory_vs_group"
MIB = 2**20


@dataclass
class RunResult:
    """What one child run measured (bytes and seconds)."""

    num_generations: int
    rss_after_load_bytes: int
    step_peaks_over_load: list[int]  # per step: peak RSS of that step minus RSS after load
    tokens_per_second: list[float]  # per step, steps 2..
    seconds_per_step: list[float]  # per step, steps 2..
    loaded_bytes: int = 0  # RSS after load minus RSS before: what loading the model(s) added
    floor_bytes: int = 0  # weights + gradients + AdamW + one row's activations (benchkit)

    @property
    def peak_over_load(self) -> int:
        return max(self.step_peaks_over_load)

    @property
    def floor_ratio(self) -> float:
        """The step's peak over the RSS before the model loaded, over the floor."""
        return (self.peak_over_load + self.loaded_bytes) / self.floor_bytes if self.floor_bytes \
            else float("nan")


@dataclass
class Setting:
    """All repeats of one group size, reduced to the numbers in the table."""

    num_generations: int
    micro_batch: int
    generation_batch: int
    runs: list[RunResult] = field(default_factory=list)

    @property
    def peak_over_load(self) -> float:
        return statistics.median(r.peak_over_load for r in self.runs)

    @property
    def rss_after_load(self) -> float:
        return statistics.median(r.rss_after_load_bytes for r in self.runs)

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(statistics.median(r.tokens_per_second) for r in self.runs)

    @property
    def seconds_per_step(self) -> float:
        return statistics.median(statistics.median(r.seconds_per_step) for r in self.runs)

    @property
    def floor_ratio(self) -> float:
        return statistics.median(r.floor_ratio for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {"num_generations": self.num_generations, "micro_batch": self.micro_batch,
                "generation_batch": self.generation_batch,
                "peak_over_load_bytes": self.peak_over_load,
                "rss_after_load_bytes": self.rss_after_load,
                "tokens_per_second": self.tokens_per_second,
                "seconds_per_step": self.seconds_per_step, "floor_ratio": self.floor_ratio,
                "runs": [asdict(r) for r in self.runs]}


# ----------------------------------------------------------------------------------------------
# child: one GRPO run


def run_overrides(args: argparse.Namespace, num_generations: int, output_dir: Path) -> list[str]:
    """The config overrides of one measured run (everything but G is the same for all runs)."""
    return [f"model.path={args.model}",
            f"algo.num_generations={num_generations}",
            f"memory.micro_batch={args.micro_batch}",
            f"memory.generation_batch={args.generation_batch}",
            "train.prompts_per_step=1",
            f"algo.max_new_tokens={args.max_new_tokens}",
            "sft.format_warmup_steps=0",
            f"algo.beta={args.beta}",
            "data.eval=null",
            "data.shapes.train_size=64",  # a few steps need a few rows; keeps set-up short
            f"train.max_steps={args.steps}",
            "train.device=cpu",  # the baseline is RSS, so the peaks must be RSS too
            "checkpoint.every=0",
            f"train.output_dir={output_dir}",
            "train.overwrite=true"]


def run_one(args: argparse.Namespace) -> int:
    """``--one G``: train in this process, then print the run's measurements as the result
    line."""
    from r1fit.config import load_config
    from r1fit.train.grpo import train_grpo

    out = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="r1fit-mem-"))
    cfg = load_config(None, run_overrides(args, args.one, out))
    train_grpo(cfg)
    result = summarise_run(out, args.one)
    result.floor_bytes = floor_bytes(cfg)
    print_result(NAME, asdict(result))
    return 0


def summarise_run(out: Path, num_generations: int) -> RunResult:
    """Read one run's metrics.jsonl and summary.json into a :class:`RunResult`."""
    from r1fit.report.metrics import grpo_step_rows  # plain json; no torch

    summary = json.loads((out / "summary.json").read_text())
    if "rss_after_load_bytes" not in summary:
        raise BenchmarkError(f"{out / 'summary.json'} has no rss_after_load_bytes; this r1fit is "
                             "too old for this benchmark")
    base = int(summary["rss_after_load_bytes"])
    before = int(summary.get("rss_before_load_bytes", base))
    steps = grpo_step_rows(out / "metrics.jsonl", last_per_step=True)
    if len(steps) < 2:
        raise BenchmarkError(f"{out}: {len(steps)} step rows in metrics.jsonl, need >= 2")
    later = steps[1:]  # step 1 pays one-off costs (optimizer states, first-call caches)
    return RunResult(
        num_generations=num_generations, rss_after_load_bytes=base, loaded_bytes=base - before,
        step_peaks_over_load=[int(r["peak_memory_bytes"]) - base for r in steps],
        tokens_per_second=[float(r["tokens_per_second"]) for r in later],
        seconds_per_step=[sum(float(r[k]) for k in ("seconds_generate", "seconds_score",
                                                     "seconds_update")) for r in later])


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: build a built-in model into the cache, in a process of its own, so that no
    measured run pays for the build (or keeps the memory the build freed)."""
    from r1fit.models.builtin import ensure_builtin

    ensure_builtin(args.model.split(":", 1)[1])
    return 0


# ----------------------------------------------------------------------------------------------
# parent: runs, table, target


def child_env(pairs: Sequence[str]) -> dict[str, str]:
    """This process's environment plus ``--child-env KEY=VALUE`` pairs (allocator experiments)."""
    env = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BenchmarkError(f"--child-env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def child_command(args: argparse.Namespace, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every run shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--model", args.model,
            "--micro-batch", str(args.micro_batch), "--generation-batch", str(args.generation_batch),
            "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
            "--beta", str(args.beta)]


def prepare_model(args: argparse.Namespace) -> None:
    """Build a built-in model before any measured run (see :func:`run_prepare`)."""
    if not args.model.startswith("builtin:"):
        return
    run_child(child_command(args, "--prepare"), f"--model {args.model}", NAME)


def measure(args: argparse.Namespace, num_generations: int, env: dict[str, str]) -> RunResult:
    """One fresh child process training at group size ``num_generations``."""
    what = f"run at G={num_generations}"
    with tempfile.TemporaryDirectory(prefix=f"r1fit-mem-g{num_generations}-") as tmp:
        command = child_command(args, "--one", str(num_generations), "--output-dir",
                                str(Path(tmp) / "run"))
        stdout = run_child(command, what, NAME, env=env)
    return RunResult(**read_result(stdout, NAME, what))


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def print_table(settings: list[Setting]) -> None:
    """The results table (rich renders it; plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    base = settings[0].peak_over_load
    table = Table(title="GRPO memory vs group size (peak RSS over the loaded model)")
    for name in ("G", "micro_batch", "generation_batch", "RSS after load (MiB)",
                 "peak over load (MiB)", f"x G={settings[0].num_generations}",
                 "per-step peaks over load (MiB)", "x floor", "tokens/s", "s/step"):
        table.add_column(name, justify="left" if name.startswith("per-step") else "right")
    for s in settings:
        per_step = "; ".join(" / ".join(mib(p) for p in r.step_peaks_over_load) for r in s.runs)
        table.add_row(str(s.num_generations), str(s.micro_batch), str(s.generation_batch),
                      mib(s.rss_after_load), mib(s.peak_over_load),
                      f"{s.peak_over_load / base:.3f}" if base > 0 else "-", per_step,
                      f"{s.floor_ratio:.2f}", f"{s.tokens_per_second:.1f}",
                      f"{s.seconds_per_step:.2f}")
    Console(width=max(160, Console().width)).print(table)


def check_target(settings: list[Setting], max_ratio: float) -> tuple[bool, str]:
    """peak(largest G) <= max_ratio x peak(smallest G); returns (met, one-line verdict)."""
    small, large = settings[0], settings[-1]
    limit = max_ratio * small.peak_over_load
    met = large.peak_over_load <= limit
    verdict = (f"target peak(G={large.num_generations}) <= {max_ratio:.2f} x "
               f"peak(G={small.num_generations}): {mib(large.peak_over_load)} MiB vs limit "
               f"{mib(limit)} MiB ({mib(small.peak_over_load)} MiB x {max_ratio:.2f}) -> "
               f"{'met' if met else 'MISSED'}")
    return met, verdict


def run_parent(args: argparse.Namespace) -> int:
    """Measure every G (fresh process each, repeats interleaved), print the table, check."""
    env = child_env(args.child_env)
    generations = sorted(set(args.generations))
    if generations[0] < max(args.micro_batch, args.generation_batch):
        print(f"warning: G={generations[0]} (one prompt per step) does not fill a chunk of "
              f"micro_batch={args.micro_batch} / generation_batch={args.generation_batch}; "
              "the comparison then favours the small G", file=sys.stderr)
    prepare_model(args)
    settings = {g: Setting(g, args.micro_batch, args.generation_batch) for g in generations}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        # repeats interleave the settings, so slow phases of a busy machine hit all G alike
        for g in generations:
            t0 = time.perf_counter()
            result = measure(args, g, env)
            settings[g].runs.append(result)
            print(f"G={g} repeat {repeat + 1}/{args.repeats}: peak over load "
                  f"{mib(result.peak_over_load)} MiB, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    ordered = [settings[g] for g in generations]
    print_table(ordered)
    met, verdict = check_target(ordered, args.max_ratio)
    print(verdict)
    print(f"model {args.model}, {args.steps} steps of 1 prompt x G, {args.max_new_tokens} new "
          f"tokens, {args.repeats} repeat(s), {time.perf_counter() - started:.0f} s in all"
          + (f", child env {' '.join(args.child_env)}" if args.child_env else "")
          + ". Speeds depend on other load on this machine; memory does not.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "target_met": met, "verdict": verdict,
             "max_ratio": args.max_ratio, "child_env": args.child_env,
             "settings": [s.to_dict() for s in ordered]}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generations", type=positive, nargs="+", default=[2, 4, 8, 16],
                   help="group sizes G to measure (each >= 2; the target compares the largest "
                   "with the smallest)")
    p.add_argument("--micro-batch", type=positive, default=1, help="memory.micro_batch, all runs")
    p.add_argument("--beta", type=float, default=0.04,
                   help="algo.beta, all runs (> 0: a frozen reference copy is loaded and its "
                        "log-probs computed in micro-batches every step)")
    p.add_argument("--generation-batch", type=positive, default=2,
                   help="memory.generation_batch, all runs")
    p.add_argument("--steps", type=positive, default=3, help="GRPO steps per run (>= 2)")
    p.add_argument("--max-new-tokens", type=positive, default=32, help="algo.max_new_tokens")
    p.add_argument("--model", default="builtin:small-realvocab", help="model.path")
    p.add_argument("--repeats", type=positive, default=1,
                   help="runs per G; the reported peak is their median")
    p.add_argument("--max-ratio", type=float, default=1.10,
                   help="target: peak(largest G) <= this x peak(smallest G)")
    p.add_argument("--child-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra environment of the measured runs, e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--json", metavar="PATH", help="also write the table and raw numbers here")
    p.add_argument("--one", type=int, metavar="G", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--output-dir", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # build the model
    args = p.parse_args(argv)
    if args.one is not None and args.one < 2:
        p.error(f"--one: G must be >= 2 (GRPO needs a group), got {args.one}")
    if any(g < 2 for g in args.generations):
        p.error(f"--generations: every G must be >= 2 (GRPO needs a group), got {args.generations}")
    if args.one is None and not args.prepare and len(set(args.generations)) < 2:
        p.error("--generations: give at least two different group sizes to compare")
    if args.steps < 2:
        p.error("--steps: need >= 2 (step 1 is left out of the speed medians)")
    if args.max_ratio <= 0:
        p.error(f"--max-ratio: must be > 0, got {args.max_ratio}")
    return args


def run(args: argparse.Namespace) -> int:
    return benchkit.dispatch(args, run_prepare, run_one, run_parent)


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
