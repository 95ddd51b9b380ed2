"""Host memory of loading a model over N processes: the ranks' summed peak RSS growth under
r1fit's rank-0 loading, against every rank loading the full weights.

Command (about 4 minutes on 2 CPU cores):

    python benchmarks/load_scaling.py
    # = --model builtin:small-realvocab --dtype float32 --processes 1,2,4 --repeats 3
    #   --every-rank-repeats 1 --max-ratio 2.2

What runs: for each N, ``python -m torch.distributed.run --standalone --nproc-per-node N
benchmarks/load_scaling.py --child MODE ...`` (N=1 through torchrun too, so every setting starts
alike; ``WORLD_SIZE=1`` makes r1fit load as one process), one torch thread per rank
(``OMP_NUM_THREADS=1``), gloo on CPU. Modes:
- ``rank0``: what r1fit does, ``r1fit.distributed.loading.load_policy_on_ranks``. One process: a
  plain ``from_pretrained``. N > 1: rank 0 alone reads the weights, every rank builds the model on
  the meta device, shards it (FSDP2 ``fully_shard``) and rank 0 sends each rank only its own shard
  of every tensor, point to point (``r1fit.distributed.parallelize.materialize``). Expected sum:
  rank 0's full copy plus N shards, about 2 x one load. (torch's
  ``set_model_state_dict(broadcast_from_rank0=True)``, used first, receives every tensor whole on
  each rank before keeping its shard, so every rank also peaked at the largest tensor, the 156 MB
  embedding of small-realvocab: 3.49 x at N=4, measured with this script);
- ``every-rank`` (N > 1 only; at N=1 it is the same load as ``rank0``): every rank calls
  ``r1fit.models.load.load_policy(device="cpu")``, the plain full load r1fit avoids: >= N x.

Target: the summed peak growth of ``rank0`` loading at the largest N (4) <= ``--max-ratio`` x its
growth at N=1. Exit status: 0 when met, 1 when missed (the verdict line says so), 2 on bad
arguments or a failed run.

How each rank measures (see /work/shared/PITFALLS.md, "Measuring honestly"):
- after its imports, the config, ``init_distributed("cpu")`` and a barrier, it takes its baseline
  (current RSS, /proc/self/statm) and resets the kernel's RSS high-water mark (``clear_refs``);
- it loads, then sums every local weight and buffer (its FSDP shards, or the whole model), so
  pages that are only memory-mapped are read and count;
- peak growth = peak RSS during the load - baseline. ``ru_maxrss`` is a high-water mark since the
  process started, and on Linux it even starts at the peak of the process that started it
  (torchrun, which imports torch): it names the load's peak only when the load raised it, so
  ``peak_growth`` falls back to ``VmHWM`` (reset at the baseline) otherwise; see there;
- rank 0 gathers every rank's figures (``all_gather_object``) and prints one JSON line;
- the parent imports neither torch nor transformers, and reads the weight files once before each
  launch so every load reads from the page cache.

RSS counts memory-mapped file pages: a float32 checkpoint loaded as float32 stays mapped from the
safetensors file (``RssFile``), so the N copies of ``every-rank`` share one page cache and
physically cost less than their summed RSS. The "after load" columns split the sum into anonymous
and file pages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
from benchkit import BenchmarkError, positive, print_result, read_result, run_child

NAME = "load_scaling"
MB = 1e6
MODES = ("rank0", "every-rank")


# ----------------------------------------------------------------------------------------------
# child (one rank under torchrun)


def peak_growth(baseline: int, maxrss_before: int, maxrss_after: int,
                hwm_after: int | None) -> tuple[int, str]:
    """The load's peak RSS over ``baseline`` (bytes), and how it is known.

    ``maxrss_*`` are ``ru_maxrss`` in bytes right before and after the load; ``hwm_after`` is
    ``VmHWM`` after the load when the high-water mark was reset at the baseline (else None).
    ``ru_maxrss`` is the highest RSS since the process started (on Linux it can even start at the
    peak of the process that exec'd it): when the imports peaked above the load, it does not move
    during the load and says nothing about it. So: if the load raised ``ru_maxrss``
    (after > before), its new value is the load's own peak ("ru_maxrss"). Else the reset
    high-water mark gives it ("VmHWM"). Without either, ``ru_maxrss`` - baseline is only an upper
    bound ("upper bound")."""
    if maxrss_after > maxrss_before:
        return maxrss_after - baseline, "ru_maxrss"
    if hwm_after is not None:
        return hwm_after - baseline, "VmHWM"
    return maxrss_after - baseline, "upper bound"


def rss_split() -> dict[str, int]:
    """Anonymous and file-backed resident bytes now (/proc/self/status; 0 where absent)."""
    split = {"rss_anon": 0, "rss_file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "RssFile"):
                    split[name.replace("Rss", "rss_").lower()] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return split


def run_rank(args: argparse.Namespace) -> int:
    """``--child MODE``: one rank's load, measured; rank 0 prints every rank's figures."""
    import resource

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig

    from r1fit.config import load_config
    from r1fit.distributed.loading import load_policy_on_ranks
    from r1fit.memory.telemetry import current_rss_bytes, peak_rss_bytes, reset_peak
    from r1fit.models.load import load_policy
    from r1fit.processes import all_gather_objects, close_distributed, init_distributed

    def maxrss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={args.model}", f"model.dtype={args.dtype}"])
    w = init_distributed("cpu")
    if w.distributed:
        dist.barrier()  # the group is up on every rank before anyone measures
    # the modeling module imports lazily on first use: import it before the baseline
    getattr(transformers, AutoConfig.from_pretrained(args.model).architectures[0])
    baseline, maxrss_before, split_before = current_rss_bytes(), maxrss(), rss_split()
    hwm_reset = reset_peak(torch.device("cpu"))
    started = time.perf_counter()
    if args.child == "rank0":
        model, _, _ = load_policy_on_ranks(
            cfg.model, torch.device("cpu"),
            activation_checkpointing=cfg.memory.gradient_checkpointing)
    else:
        m = cfg.model
        model, _ = load_policy(m.path, lora_r=m.lora.r, lora_alpha=m.lora.alpha,
                               lora_dropout=m.lora.dropout, lora_target=m.lora.target,
                               freeze_vision=m.freeze_vision, dtype=m.dtype, device="cpu",
                               gradient_checkpointing=False,
                               attn_implementation=m.attn_implementation)
    # read every local weight: mapped pages count once read (the sum only keeps the reads; it
    # differs between process counts by float32 summation order)
    with torch.no_grad():
        weights_sum = sum(float((t.to_local() if isinstance(t, DTensor) else t).sum())
                       for t in (*model.parameters(), *model.buffers()))
    seconds = time.perf_counter() - started
    maxrss_after = maxrss()
    hwm_after = peak_rss_bytes() if hwm_reset else None
    growth, how = peak_growth(baseline, maxrss_before, maxrss_after, hwm_after)
    split_after = rss_split()
    mine = {"rank": w.rank, "baseline": baseline, "growth": growth, "how": how,
            "maxrss_before": maxrss_before, "maxrss_after": maxrss_after, "hwm_after": hwm_after,
            "rss_after": current_rss_bytes() - baseline,
            **{f"{k}_after": split_after[k] - split_before[k] for k in split_after},
            "seconds": seconds, "weights_sum": weights_sum}
    ranks = all_gather_objects(mine)
    if w.main:
        print_result(NAME, {"mode": args.child, "processes": w.size, "ranks": ranks})
    close_distributed()
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: the model's folder (a builtin: model is built on first use) and bytes."""
    from r1fit.models.load import resolve_model_path

    folder = Path(resolve_model_path(args.model))
    if not folder.is_dir():
        raise BenchmarkError("not a local folder (download it first)")
    print_result(NAME, {"folder": str(folder), "weight_bytes": weight_bytes(folder)})
    return 0


# ----------------------------------------------------------------------------------------------
# parent: launches, table, target


@dataclass
class Setting:
    """One (mode, N): every repeat's per-rank figures (dicts from the child's JSON)."""

    mode: str
    processes: int
    runs: list[list[dict[str, Any]]] = field(default_factory=list)  # repeat -> ranks, rank order

    def _median(self, key: str) -> float:
        return statistics.median(sum(r[key] for r in ranks) for ranks in self.runs)

    @property
    def summed_growth(self) -> float:
        """Median over repeats of the ranks' summed peak growth (bytes)."""
        return self._median("growth")

    @property
    def rank_growths(self) -> list[float]:
        """Each rank's median peak growth (bytes), in rank order."""
        return [statistics.median(ranks[i]["growth"] for ranks in self.runs)
                for i in range(self.processes)]

    @property
    def after(self) -> tuple[float, float, float]:
        """Medians of the ranks' summed RSS over their baselines right after the load, and of
        its anonymous and file-backed parts, bytes."""
        return (self._median("rss_after"), self._median("rss_anon_after"),
                self._median("rss_file_after"))

    @property
    def seconds(self) -> float:
        """Median over repeats of the slowest rank's load seconds."""
        return statistics.median(max(r["seconds"] for r in ranks) for ranks in self.runs)

    @property
    def how(self) -> str:
        """How the peaks are known (``peak_growth``), every source seen."""
        return "/".join(sorted({r["how"] for ranks in self.runs for r in ranks}))


def parse_child_output(stdout: str, mode: str, processes: int) -> list[dict[str, Any]]:
    """Every rank's figures from rank 0's result line (the last one) in a launch's stdout."""
    result = read_result(stdout, NAME, f"{mode} N={processes}")
    ranks = result.get("ranks") or []
    if result.get("mode") != mode or result.get("processes") != processes or \
            [r.get("rank") for r in ranks] != list(range(processes)):
        raise BenchmarkError(f"{mode} N={processes}: the result is for {result.get('mode')} "
                             f"N={result.get('processes')} with ranks "
                             f"{[r.get('rank') for r in ranks]}")
    return ranks


def launch(mode: str, processes: int, folder: str, dtype: str, timeout: float
           ) -> list[dict[str, Any]]:
    """One torchrun launch of ``processes`` ranks in ``mode``; every rank's figures."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(processes), os.path.abspath(__file__), "--child", mode, "--model", folder,
               "--dtype", dtype]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    what = f"{mode} N={processes}"
    try:
        stdout = run_child(command, what, NAME, env=env, timeout=timeout)
    except BenchmarkError as exc:
        if not killed_by_signal(str(exc)):
            raise
        # a rank killed by a signal measured nothing: one more launch, the first one's cause
        # printed (CI once saw a rank SIGABRT at N=2 that no rerun here reproduced)
        print(f"{NAME}: {what}: a rank was killed by a signal; launching once more. "
              f"What the launch printed:\n{exc}", file=sys.stderr, flush=True)
        stdout = run_child(command, what, NAME, env=env, timeout=timeout)
    return parse_child_output(stdout, mode, processes)


def killed_by_signal(message: str) -> bool:
    """Whether a failed torchrun launch's message (:func:`benchkit.run_child`'s) says a rank was
    killed by a signal (torchrun's summary: ``Signal 6 (SIGABRT) received by PID ...``), not that
    it failed with an error of its own."""
    return " failed (exit " in message and re.search(r"Signal \d+ \(SIG[A-Z]+\)", message) \
        is not None


def warm_page_cache(folder: Path) -> None:
    """Read every weight file once, so each load reads from the page cache."""
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def reference(settings: Sequence[Setting]) -> Setting:
    """The N=1 setting every ratio is taken against."""
    return next(s for s in settings if s.mode == "rank0" and s.processes == 1)


def print_table(settings: Sequence[Setting], weight_bytes: int, title: str) -> None:
    """The results table (rich renders it; plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    one = reference(settings).summed_growth
    table = Table(title=title)
    for name in ("loading", "N", "runs", "sum peak MB", "x N=1", "x weights", "per rank MB",
                 "sum after MB", "anon MB", "file MB", "load s", "peak from"):
        text = name in ("loading", "per rank MB", "peak from")
        table.add_column(name, justify="left" if text else "right", no_wrap=text)
    for s in settings:
        after, anon, file = s.after
        table.add_row(s.mode, str(s.processes), str(len(s.runs)), f"{s.summed_growth / MB:.0f}",
                      f"{s.summed_growth / one:.2f}", f"{s.summed_growth / weight_bytes:.2f}",
                      " ".join(f"{g / MB:.0f}" for g in s.rank_growths), f"{after / MB:.0f}",
                      f"{anon / MB:.0f}", f"{file / MB:.0f}", f"{s.seconds:.1f}", s.how)
    Console(width=max(150, Console().width)).print(table)
    print("sum peak: the ranks' peak RSS growths over their baselines, summed (per rank: each "
          "one); x N=1: over rank0 at N=1; x weights: over the weight files' bytes;\nsum after: "
          "the RSS growth still resident after the load, summed, and its anonymous / file-backed "
          "(mapped weights) parts; load s: the slowest rank's; peak from: see peak_growth.")


def check_target(settings: Sequence[Setting], max_ratio: float) -> tuple[bool, str]:
    """Rank-0 loading: summed peak growth at the largest N <= max_ratio x that at N=1."""
    one = reference(settings)
    top = max((s for s in settings if s.mode == "rank0"), key=lambda s: s.processes)
    ratio = top.summed_growth / one.summed_growth
    met = ratio <= max_ratio
    return met, (f"rank0 loading: summed peak growth at N={top.processes} "
                 f"{top.summed_growth / MB:.0f} MB = {ratio:.2f} x N=1 "
                 f"({one.summed_growth / MB:.0f} MB); target <= {max_ratio:.2f} x -> "
                 f"{'met' if met else 'MISSED'}")


def plan(processes: Sequence[int], repeats: int, every_rank_repeats: int
         ) -> list[tuple[str, int, int]]:
    """The (mode, N, launches) settings, in table order."""
    settings = [("rank0", n, repeats) for n in processes]
    if every_rank_repeats:
        settings += [("every-rank", n, every_rank_repeats) for n in processes if n > 1]
    return settings


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def prepare(model: str) -> dict[str, Any]:
    """The model's folder and weight bytes: a local folder as it is, anything else through
    ``--prepare`` in a child (which builds a builtin: model; the parent stays free of torch)."""
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        return {"folder": str(folder.resolve()), "weight_bytes": weight_bytes(folder)}
    what = f"preparing {model}"
    stdout = run_child([sys.executable, os.path.abspath(__file__), "--prepare", "--model", model],
                       what, NAME)
    return read_result(stdout, NAME, what)


def run_parent(args: argparse.Namespace, argv: Sequence[str]) -> int:
    started = time.perf_counter()
    print("command: " + " ".join([Path(sys.executable).name, os.path.relpath(__file__), *argv]),
          flush=True)
    prepared = prepare(args.model)
    folder = Path(prepared["folder"])
    todo = plan(args.processes, args.repeats, args.every_rank_repeats)
    settings = [Setting(mode, n) for mode, n, _ in todo]
    for repeat in range(max(runs for _, _, runs in todo)):  # outermost: drift hits every setting
        for s, (_, _, runs) in zip(settings, todo):
            if repeat >= runs:
                continue
            warm_page_cache(folder)
            ranks = launch(s.mode, s.processes, str(folder), args.dtype, args.timeout)
            s.runs.append(ranks)
            print(f"{s.mode} N={s.processes} ({repeat + 1}/{runs}): summed peak growth "
                  f"{sum(r['growth'] for r in ranks) / MB:.0f} MB ("
                  + " ".join(f"{r['growth'] / MB:.0f}" for r in ranks) + ")",
                  file=sys.stderr, flush=True)
    print_table(settings, prepared["weight_bytes"],
                f"Summed peak RSS growth of N ranks loading {args.model} ({args.dtype}, weights "
                f"{prepared['weight_bytes'] / MB:.0f} MB); medians over 'runs' launches")
    met, verdict = check_target(settings, args.max_ratio)
    print(verdict)
    print(f"{time.perf_counter() - started:.0f} s in all.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": list(argv), "target_met": met, "verdict": verdict,
             "weight_bytes": prepared["weight_bytes"],
             "settings": [asdict(s) | {"summed_growth": s.summed_growth} for s in settings]},
            indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def process_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(counts))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:small-realvocab",
                   help="builtin:<name> or a local Hugging Face model folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                   help="model.dtype; keep the saved dtype, or the load copies every tensor")
    p.add_argument("--processes", type=process_counts, default=[1, 2, 4],
                   help="comma-separated process counts N; must include 1 (the reference)")
    p.add_argument("--repeats", type=positive, default=3,
                   help="launches per setting; the table shows medians")
    p.add_argument("--max-ratio", type=float, default=2.2,
                   help="target: rank0 summed peak growth at the largest N <= this x N=1")
    p.add_argument("--every-rank-repeats", type=int, default=1, metavar="R",
                   help="launches per N > 1 of the comparison 'every rank loads the full "
                   "weights' (0: skip it). One by default: its ranks' peaks are plain loads, "
                   "the same as rank0 N=1's, and three would add ~2 minutes")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one rank, under torchrun
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if 1 not in args.processes or len(args.processes) < 2:
        p.error("--processes must include 1 (the reference) and at least one N > 1")
    if args.max_ratio <= 0:
        p.error("--max-ratio must be > 0")
    if args.every_rank_repeats < 0:
        p.error("--every-rank-repeats must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def run(args: argparse.Namespace) -> int:
        """The child mode the arguments name, else the parent (which prints ``argv``)."""
        if args.child:
            return run_rank(args)
        if args.prepare:
            return run_prepare(args)
        return run_parent(args, argv)

    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
