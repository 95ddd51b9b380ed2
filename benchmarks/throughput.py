"""GRPO step speed, MFU and peak memory of the per-row path against the shared-prefix path (and
shared prefix + token packing, when r1fit has ``memory.micro_batch_tokens``), at real-scale
proportions.

Command (slow on a CPU: one G=8 run took 14-18 minutes on 2 busy cores, and the default grid is 36
runs, G=16 ones longer; builds builtin:bench-1024, 0.41B parameters, on first use):

    python benchmarks/throughput.py
    # = --model builtin:bench-1024 --generations 8 16 --modes full lora --steps 3 --repeats 3
    #   --max-new-tokens 128 --image-size 448 --micro-batch-per-group 1 --iterations 2
    python benchmarks/throughput.py --quick      # builtin:tiny, G=4, full, 2 steps, 1 repeat

The workload: one prompt per step (a 448 px ``builtin:shapes`` image = 256 image tokens and a
question), G completions of ``--max-new-tokens`` tokens, ``algo.num_iterations=2`` (so each step
runs two updates, and in r1fit before the reuse of the first update's log-probs an old-policy
log-prob pass: the update phase the issue names), no KL
reference, one micro-batch per group (``memory.micro_batch`` = G), gradient checkpointing on,
float32 on CPU. Variants, each a fresh child process with the same seed:

- ``per_row``: ``memory.share_prefix=false``, one padded row per completion;
- ``shared``: ``memory.share_prefix=true``, the group's prompt once with its G completions after it;
- ``packed``: shared + ``memory.micro_batch_tokens`` (only when r1fit has that key);
- suffixes, in this order, only when named in ``--variants`` (e.g. ``shared+recompute``):
  ``+recompute``, that variant with ``memory.fused_loss=false`` (the LM head recomputes its
  chunks in backward instead of making its gradient in forward); ``+chunk256``, with
  ``memory.logits_chunk=256``; ``+release_freed``, with ``memory.release_freed=true`` (glibc
  hands freed blocks of 1 MiB and more back at once: the RSS follows the live tensors, at the
  cost of page faults); ``+row_prefill``, with ``rollout.share_prefill=false`` (generation
  prefills every row's prompt instead of each distinct prompt once), to measure both sides of
  each trade; ``+tensors``, with ``memory.cpu_peak=tensors``: the peak is then the live tensors'
  (the probe, r1fit/memory/probe.py: what r1fit logs on a GPU, ``max_memory_allocated``, and
  what ``r1fit plan`` predicts), every weight counted, so no unread bytes are added; the probe
  slows every op, so its speeds are not comparable with the other variants';
- ``per_row@base`` (with ``--baseline-src DIR``): the per-row path of the r1fit package in DIR,
  e.g. a git worktree of the commit an issue was filed against (``git worktree add /tmp/base
  <commit>``), run from this script with DIR first on the child's PYTHONPATH.

Per run, medians over steps 2.. (step 1 pays one-off costs): ``seconds_generate`` (the
rollouts), ``seconds_update`` (old log-probs +
updates), tokens/s (completion tokens per second of the whole step), ``mfu`` (r1fit's own per-step
MFU, r1fit/memory/flops.py); and the peak memory of the run: the largest per-step
``peak_memory_bytes`` (RSS) minus the RSS before the model loaded. The floor is what any step of
that run must hold: weights, gradients and AdamW states (their exact bytes, from the loaded model)
plus the planner's activations of one micro-batch of one row (``r1fit plan``'s ``activations``
part at ``memory.micro_batch=1``, per-row path). The RSS holds only the pages of the lazily
mapped checkpoint that were read (with LoRA, the frozen embedding's rows of tokens that never
occurred stay on disk), where the floor counts every weight, as a GPU holds them; the run's
mapped checkpoint bytes still not resident at its end (``unread``, sampled from
/proc/self/smaps) are added to its peak for the floor target.

Targets (exit 1 when one is missed): at G=8 the ``shared`` and ``packed`` update phases take
<= 0.6x the ``per_row`` one (``--max-update-ratio``; against ``per_row@base`` when it runs),
and every variant's peak + unread is <= 1.25x the floor (``--max-floor-ratio``). MFU is printed, not
targeted. Exit 2 on bad arguments or a failed run. Speeds move with whatever else runs on the
machine; repeats interleave the variants (A B C A B C) so slow phases hit all alike.
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
from benchkit import (
    BenchmarkError,
    RepeatedRuns,
    UnreadWeights,
    floor_bytes,
    positive,
    print_result,
    read_result,
    run_child,
)

NAME = "throughput"
MIB = 2**20
VARIANTS = ("per_row", "shared", "packed")
BASELINE = "per_row@base"  # the per-row path of another r1fit source tree (--baseline-src)
MODES = ("full", "lora")
#: a variant name may end in any of these, in this order: the same run with more overrides, e.g.
#: ``shared+recompute+release_freed``: ``memory.fused_loss=false`` (the LM head recomputes its
#: chunks in backward instead of making its gradient in forward), ``memory.logits_chunk=256``,
#: ``memory.release_freed=true`` (glibc hands freed blocks of 1 MiB and more back at once)
SUFFIXES = {"+recompute": "memory.fused_loss=false", "+chunk256": "memory.logits_chunk=256",
            "+release_freed": "memory.release_freed=true",
            "+row_prefill": "rollout.share_prefill=false",
            "+tensors": "memory.cpu_peak=tensors"}


def base_variant(variant: str) -> str:
    """``variant`` without its suffixes (``SUFFIXES``)."""
    return variant.split("+", 1)[0]


def suffix_overrides(variant: str) -> list[str]:
    """The overrides of ``variant``'s suffixes; ValueError on an unknown or misordered one."""
    rest, out, order = variant[len(base_variant(variant)):], [], list(SUFFIXES)
    while rest:
        suffix = next((s for s in order if rest.startswith(s)), None)
        if suffix is None:
            raise ValueError(f"unknown suffix in {variant!r}: choose from {', '.join(SUFFIXES)}, "
                             "in that order")
        out.append(SUFFIXES[suffix])
        order, rest = order[order.index(suffix) + 1:], rest[len(suffix):]
    return out


@dataclass
class RunResult:
    """What one child run measured."""

    seconds_update: list[float]  # per step, steps 2..
    seconds_generate: list[float]  # per step, steps 2..
    tokens_per_second: list[float]  # per step, steps 2..
    mfu: list[float]  # per step, steps 2..
    peak_bytes: int  # largest per-step peak RSS minus the RSS before the model loaded (+tensors:
    # the largest per-step peak of live tensors)
    floor_bytes: int
    completion_len_mean: float
    # mapped checkpoint bytes not resident at the run's end (benchkit.UnreadWeights): weights a
    # GPU would hold that the RSS does not
    unread_weight_bytes: int = 0


@dataclass
class Setting(RepeatedRuns):
    """All repeats of one (mode, G, variant)."""

    mode: str
    generations: int
    variant: str
    runs: list[RunResult] = field(default_factory=list)

    @property
    def floor(self) -> float:
        return statistics.median(r.floor_bytes for r in self.runs)

    @property
    def unread(self) -> float:
        return statistics.median(r.unread_weight_bytes for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "generations": self.generations, "variant": self.variant,
                "seconds_generate": self.median("seconds_generate"),
                "seconds_update": self.median("seconds_update"),
                "tokens_per_second": self.median("tokens_per_second"),
                "mfu": self.median("mfu"), "peak_bytes": self.peak, "floor_bytes": self.floor,
                "unread_weight_bytes": self.unread,
                "runs": [asdict(r) for r in self.runs]}


# ----------------------------------------------------------------------------------------------
# child: one GRPO run


def run_overrides(args: argparse.Namespace, mode: str, generations: int, variant: str,
                  output_dir: Path) -> list[str]:
    """The config overrides of one measured run."""
    size = args.image_size
    overrides = [f"model.path={args.model}", f"algo.num_generations={generations}",
                 f"memory.micro_batch={generations * args.micro_batch_per_group}",
                 f"memory.generation_batch={generations}", "train.prompts_per_step=1",
                 f"algo.max_new_tokens={args.max_new_tokens}",
                 f"algo.num_iterations={args.iterations}", "algo.beta=0",
                 "sft.format_warmup_steps=0", "data.eval=null", "data.shapes.train_size=64",
                 f"data.shapes.image_size={size}", f"data.max_pixels={size * size}",
                 f"train.max_steps={args.steps}", "train.device=cpu", "checkpoint.every=0",
                 "report.rollouts_every=0", f"train.output_dir={output_dir}",
                 "train.overwrite=true",
                 f"memory.share_prefix={'false' if variant.startswith('per_row') else 'true'}"]
    if mode == "lora":
        overrides.append("model.lora.r=16")
    if base_variant(variant) == "packed":
        overrides.append(f"memory.micro_batch_tokens={args.micro_batch_tokens}")
    return overrides + suffix_overrides(variant) + list(args.set)


def run_one(args: argparse.Namespace) -> int:
    """``--one MODE G VARIANT``: train in this process, print the run's measurements."""
    from r1fit.config import load_config
    from r1fit.train.grpo import train_grpo

    mode, generations, variant = args.one[0], int(args.one[1]), args.one[2]
    out = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="r1fit-tp-"))
    cfg = load_config(None, run_overrides(args, mode, generations, variant, out))
    with UnreadWeights() as unread:
        train_grpo(cfg)
    tensors = cfg.memory.cpu_peak == "tensors"
    print_result(NAME, asdict(summarise_run(out, floor_bytes(cfg), 0 if tensors else unread.bytes,
                                            tensors=tensors)))
    return 0


def summarise_run(out: Path, floor: int, unread: int = 0, *, tensors: bool = False) -> RunResult:
    """One run's metrics.jsonl and summary.json reduced to a :class:`RunResult`. ``tensors``:
    the run logged live-tensor peaks (``memory.cpu_peak=tensors``), which count every tensor the
    process holds, so nothing is subtracted from them."""
    from r1fit.report.metrics import grpo_step_rows  # plain json; no torch

    summary = json.loads((out / "summary.json").read_text())
    if "rss_before_load_bytes" not in summary:
        raise BenchmarkError(f"{out / 'summary.json'} has no rss_before_load_bytes; this r1fit is "
                             "too old for this benchmark")
    rss_before_load = int(summary["rss_before_load_bytes"])
    steps = grpo_step_rows(out / "metrics.jsonl", last_per_step=True)
    if len(steps) < 2:
        raise BenchmarkError(f"{out}: {len(steps)} step rows in metrics.jsonl, need >= 2")
    later = steps[1:]
    return RunResult(
        seconds_update=[float(r["seconds_update"]) for r in later],
        seconds_generate=[float(r["seconds_generate"]) for r in later],
        tokens_per_second=[float(r["tokens_per_second"]) for r in later],
        mfu=[float(r["mfu"]) for r in later],
        peak_bytes=max(int(r["peak_memory_bytes"]) for r in steps) - (0 if tensors else
                                                                       rss_before_load),
        floor_bytes=floor,
        completion_len_mean=statistics.mean(float(r["completion_len_mean"]) for r in steps),
        unread_weight_bytes=unread)


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: build the built-in model in a process of its own, and say whether this
    r1fit has ``memory.micro_batch_tokens`` (the packed variant)."""
    from r1fit.config import Config
    from r1fit.models.builtin import ensure_builtin

    if args.model.startswith("builtin:"):
        ensure_builtin(args.model.split(":", 1)[1])
    print_result(NAME, {"packing": hasattr(Config().memory, "micro_batch_tokens")})
    return 0


# ----------------------------------------------------------------------------------------------
# parent: runs, table, targets


def child_command(args: argparse.Namespace, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every run shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--model", args.model,
            "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
            "--image-size", str(args.image_size), "--iterations", str(args.iterations),
            "--micro-batch-per-group", str(args.micro_batch_per_group),
            "--micro-batch-tokens", str(args.micro_batch_tokens),
            *(f"--set={item}" for item in args.set)]


def measure(args: argparse.Namespace, mode: str, generations: int, variant: str) -> RunResult:
    what = f"{mode} G={generations} {variant}"
    env = None
    if variant == BASELINE:  # the other tree's r1fit package first on the child's path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(args.baseline_src).resolve()), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="r1fit-tp-") as tmp:
        command = child_command(args, "--one", mode, str(generations), variant,
                                "--output-dir", str(Path(tmp) / "run"))
        stdout = run_child(command, what, NAME, env=env)
    return RunResult(**read_result(stdout, NAME, what))


def print_table(settings: list[Setting]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GRPO step: per-row vs shared prefix (medians over repeats)")
    baseline = any(s.variant == BASELINE for s in settings)
    for name in ("mode", "G", "variant", "generate s", "update s", "x per_row",
                 *(("x " + BASELINE,) if baseline else ()), "tokens/s", "mfu",
                 "peak (MiB)", "unread (MiB)", "floor (MiB)", "peak / floor",
                 "+ unread / floor"):
        table.add_column(name, justify="left" if name in ("mode", "variant") else "right")
    by_key = {(s.mode, s.generations, s.variant): s for s in settings}

    def ratio(s: Setting, of: str) -> str:
        ref = by_key.get((s.mode, s.generations, of))
        return f"{s.median('seconds_update') / ref.median('seconds_update'):.2f}" if ref else "-"

    for s in settings:
        table.add_row(s.mode, str(s.generations), s.variant,
                      f"{s.median('seconds_generate'):.2f}", f"{s.median('seconds_update'):.2f}",
                      ratio(s, "per_row"), *((ratio(s, BASELINE),) if baseline else ()),
                      f"{s.median('tokens_per_second'):.1f}", f"{s.median('mfu'):.4f}",
                      f"{s.peak / MIB:,.0f}", f"{s.unread / MIB:,.0f}", f"{s.floor / MIB:,.0f}",
                      f"{s.peak / s.floor:.2f}", f"{(s.peak + s.unread) / s.floor:.2f}")
    Console(width=max(140, Console().width)).print(table)


def check_targets(settings: list[Setting], max_update_ratio: float,
                  max_floor_ratio: float) -> tuple[bool, list[str]]:
    """The update-phase target at G=8 (each mode: the shared and packed variants against the
    per-row path of --baseline-src when given, the issue's "today's path", else this tree's) and
    the floor target (every setting)."""
    verdicts, met = [], True
    by_key = {(s.mode, s.generations, s.variant): s for s in settings}
    for (mode, g, variant), s in by_key.items():
        of = BASELINE if (mode, g, BASELINE) in by_key else "per_row"
        if g != 8 or variant not in ("shared", "packed") or (mode, g, of) not in by_key:
            continue
        ratio = s.median("seconds_update") / by_key[(mode, g, of)].median("seconds_update")
        ok = ratio <= max_update_ratio
        met &= ok
        verdicts.append(f"{mode} G=8: {variant} update phase {ratio:.2f}x {of} (target <= "
                        f"{max_update_ratio:.2f}) -> {'met' if ok else 'MISSED'}")
    for s in settings:  # the weights a GPU would hold count, read or not
        ratio = (s.peak + s.unread) / s.floor
        ok = ratio <= max_floor_ratio
        met &= ok
        unread = (f", counting {s.unread / MIB:,.0f} MiB of mapped weights the RSS never held"
                  if s.unread else "")
        verdicts.append(f"{s.mode} G={s.generations} {s.variant}: peak {ratio:.2f}x the floor"
                        f"{unread} (target <= {max_floor_ratio:.2f}) -> "
                        f"{'met' if ok else 'MISSED'}")
    return met, verdicts


def run_parent(args: argparse.Namespace) -> int:
    prepared = read_result(run_child(child_command(args, "--prepare"), "prepare", NAME),
                           NAME, "prepare")
    variants = [v for v in args.variants if base_variant(v) != "packed" or prepared["packing"]]
    if args.baseline_src:
        variants.insert(0, BASELINE)
    if not prepared["packing"]:
        print("note: this r1fit has no memory.micro_batch_tokens; the packed variant is left out",
              file=sys.stderr)
    keys = [(m, g, v) for m in args.modes for g in args.generations for v in variants]
    settings = {k: Setting(*k) for k in keys}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for key in keys:  # interleaved: every setting once per repeat
            t0 = time.perf_counter()
            result = measure(args, *key)
            settings[key].runs.append(result)
            print(f"{' '.join(map(str, key))} repeat {repeat + 1}/{args.repeats}: update "
                  f"{statistics.median(result.seconds_update):.2f} s, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    ordered = [settings[k] for k in keys]
    print_table(ordered)
    met, verdicts = check_targets(ordered, args.max_update_ratio, args.max_floor_ratio)
    print("\n".join(verdicts))
    print(f"model {args.model}, {args.image_size} px image, {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, {args.repeats} repeat(s), {time.perf_counter() - started:.0f} s "
          "in all. Speeds depend on other load on this machine.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "targets_met": met, "verdicts": verdicts,
             "settings": [s.to_dict() for s in ordered]}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="builtin:tiny, G=4, full only, 2 steps, 1 repeat, 112 px, 16 new tokens "
                   "(checks that the script runs; its numbers mean little)")
    p.add_argument("--model", default=None, help="model.path (default builtin:bench-1024)")
    p.add_argument("--generations", type=positive, nargs="+", default=None,
                   help="group sizes G (default 8 16)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="full and/or lora fine-tuning (default both)")
    p.add_argument("--steps", type=positive, default=None, help="GRPO steps per run (>= 2)")
    p.add_argument("--repeats", type=positive, default=None, help="runs per setting (default 3)")
    p.add_argument("--max-new-tokens", type=positive, default=None, help="default 128")
    p.add_argument("--image-size", type=positive, default=None,
                   help="builtin:shapes image side in px (default 448: 256 image tokens)")
    p.add_argument("--iterations", type=positive, default=2, help="algo.num_iterations")
    p.add_argument("--micro-batch-per-group", type=positive, default=1,
                   help="memory.micro_batch = this x G")
    p.add_argument("--micro-batch-tokens", type=positive, default=8192,
                   help="memory.micro_batch_tokens of the packed variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="VARIANT",
                   help=f"of {', '.join(VARIANTS)}, each also with suffixes of "
                   f"{', '.join(SUFFIXES)} in that order (e.g. shared+recompute: the run with "
                   "memory.fused_loss=false); default: the three without")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more r1fit config override for every run (repeatable), e.g. "
                   "memory.logits_chunk=256")
    p.add_argument("--max-update-ratio", type=float, default=0.6)
    p.add_argument("--max-floor-ratio", type=float, default=1.25)
    p.add_argument("--baseline-src", metavar="DIR",
                   help="also run the per-row path of the r1fit package in DIR (e.g. a git "
                   "worktree of an older commit) as variant per_row@base, interleaved with the "
                   "others; the update-phase target is then taken against it")
    p.add_argument("--json", metavar="PATH", help="also write the table and raw numbers here")
    p.add_argument("--one", nargs=3, metavar=("MODE", "G", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--output-dir", help=argparse.SUPPRESS)
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = dict(model="builtin:tiny", generations=[4], modes=["full"], steps=2, repeats=1,
                 max_new_tokens=16, image_size=112)
    full = dict(model="builtin:bench-1024", generations=[8, 16], modes=list(MODES), steps=3,
                repeats=3, max_new_tokens=128, image_size=448)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 2:
        p.error("--steps: need >= 2 (step 1 is left out of the medians)")
    if any(g < 2 for g in args.generations):
        p.error(f"--generations: every G must be >= 2, got {args.generations}")
    if args.image_size % 28:
        p.error(f"--image-size: must be a multiple of 28 px (Qwen2.5-VL), got {args.image_size}")
    for variant in args.variants:
        if base_variant(variant) not in VARIANTS:
            p.error(f"--variants: unknown {variant!r}; choose from {', '.join(VARIANTS)}")
        try:
            suffix_overrides(variant)
        except ValueError as exc:
            p.error(f"--variants: {exc}")
    if bad := [item for item in args.set if "=" not in item]:
        p.error(f"--set: expected KEY=VALUE, got {bad}")
    if args.one is not None and (args.one[0] not in MODES or (
            args.one[2] != BASELINE and base_variant(args.one[2]) not in VARIANTS)):
        p.error(f"--one: expected MODE G VARIANT, got {args.one}")
    if args.baseline_src and not (Path(args.baseline_src) / "r1fit" / "__init__.py").is_file():
        p.error(f"--baseline-src: {args.baseline_src} holds no r1fit package (r1fit/__init__.py)")
    return args


def run(args: argparse.Namespace) -> int:
    return benchkit.dispatch(args, run_prepare, run_one, run_parent)


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
