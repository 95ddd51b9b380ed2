"""Do a turn's tool calls run at once? ``rollout.tool_workers`` against one call at a time, in
GRPO steps of a policy that calls its tool.

Command (on a machine with nothing else running; about 4 minutes for the policy, built once and
cached, then about 30 s a run):

    python benchmarks/tool_workers.py            # --latency 0.1 --workers 8 --steps 3 --repeats 3

The policy: builtin:tiny after ``r1fit sft configs/zoom-tools.yaml sft.steps=600`` (a
random-weight policy writes no call; after these steps about two thirds of the rows call the
zoom), kept under ``--cache`` (``benchkit.zoom_policy``). The tools, each called ``zoom`` as the
policy learned: the built-in zoom, and the same behind a fixed wait of ``--latency`` seconds (a
remote service's round trip; a module written at run time, ``remote_tools:zoom``). Each arm
(tool x 1 or ``--workers`` workers) runs ``r1fit train configs/zoom-tools.yaml`` from that
policy for ``--steps`` steps, the arms interleaved, ``--repeats`` times. Reported per arm: the
medians, over the steps after the first and the repeats, of ``tools/seconds`` (the step's wall
time of tool calls) and ``seconds_generate``. A run beside more than ``--max-other-cores`` busy
cores of other processes is marked disturbed and left out of the medians.

Targets: with the latency tool, ``--workers`` workers' ``tools/seconds`` at most a quarter of one
worker's; every step's turns, calls and rewards equal across the worker counts (the trajectories
do not depend on them). Exit status: 0 when met, 1 when missed, 2 on a failed run.
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
from pathlib import Path

import benchkit
from benchkit import BenchmarkError, cpu_ticks, positive, run_child

NAME = "tool_workers"
CONFIG = benchkit.ZOOM_CONFIG
SPEEDUP_TARGET = 4.0
#: the figures that must not depend on the worker count, per step
SAME = ("turns_mean", "tool_calls_mean", "tool_errors_mean", "reward_mean", "loss")
REMOTE = """
import time

from r1fit.tools import zoom as local_zoom


def zoom(context, x, y, factor=2.0, image=0):
    time.sleep({latency!r})  # a remote service's round trip
    return local_zoom(context, x=x, y=y, factor=factor, image=image)
"""
REMOTE_TOOL = "remote_tools:zoom"
COMMON = ["eval.every=0", "eval.before_train=false", "checkpoint.every=0", "train.overwrite=true"]


def _own_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(model: Path, tool: str, workers: int, steps: int, env: dict[str, str],
            folder: Path) -> dict:
    """One run's steps (their metrics rows) and the other processes' load beside it."""
    out = folder / f"{tool.replace(':', '_')}-{workers}"
    before, mine, began = cpu_ticks(), _own_seconds(), time.perf_counter()
    run_child([sys.executable, "-m", "r1fit", "train", str(CONFIG), f"model.path={model}",
               f"train.output_dir={out}", f"train.max_steps={steps}", f"tools=[{tool}]",
               f"rollout.tool_workers={workers}", *COMMON],
              f"r1fit train with {tool}, {workers} worker(s)", "r1fit", env=env)
    seconds, after = time.perf_counter() - began, cpu_ticks()
    others = None
    if before is not None and after is not None:
        busy = (after[0] - before[0]) / os.sysconf("SC_CLK_TCK")
        others = max(0.0, busy - (_own_seconds() - mine)) / seconds
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r for r in rows if "reward_mean" in r], "other_cores": others}


def summary(runs: list[dict], key: str) -> float | None:
    """The median over the runs of each run's median of ``key`` over its steps after the
    first."""
    values = [statistics.median(s[key] for s in run["steps"][1:]) for run in runs]
    return statistics.median(values) if values else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", type=float, default=0.1, help="seconds the remote tool waits")
    p.add_argument("--workers", type=positive, default=8)
    p.add_argument("--steps", type=positive, default=3, help="GRPO steps a run (the first is "
                                                            "not timed)")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--max-other-cores", type=float, default=0.3)
    p.add_argument("--cache", type=Path, default=benchkit.CACHE,
                   help="where the SFT policy is kept")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise BenchmarkError("--steps must be at least 2 (the first step is not timed)")
    if args.workers < 2:
        raise BenchmarkError("--workers must be at least 2 (it is compared with one)")
    model = benchkit.zoom_policy(args.cache)
    arms = [(tool, w) for tool in (REMOTE_TOOL, "zoom") for w in (1, args.workers)]
    runs: dict[tuple[str, int], list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="tool_workers_") as folder:
        (Path(folder) / "remote_tools.py").write_text(REMOTE.format(latency=args.latency))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)}
        for repeat in range(args.repeats):
            for tool, workers in arms:  # interleaved
                result = measure(model, tool, workers, args.steps, env, Path(folder))
                result["disturbed"] = (result["other_cores"] or 0.0) > args.max_other_cores
                runs[(tool, workers)].append(result)
                step = result["steps"][-1]
                print(f"repeat {repeat + 1} {tool} workers={workers}: tools/seconds "
                      f"{step['tools/seconds']:.3f}, seconds_generate "
                      f"{step['seconds_generate']:.3f}, other cores "
                      f"{result['other_cores'] or 0.0:.2f}", flush=True)
    differ = differences(runs)
    table = summaries(runs)
    print(f"\n{'tool':<20} {'workers':>7} {'runs':>4} {'tools/seconds':>13} "
          f"{'seconds_generate':>16} {'calls/row':>9}")
    for row in table:
        cells = [f"{row[k]:.3f}" if row[k] is not None else "-"
                 for k in ("tools_seconds", "seconds_generate", "calls_per_row")]
        print(f"{row['tool']:<20} {row['workers']:>7} {row['runs']:>4} {cells[0]:>13} "
              f"{cells[1]:>16} {cells[2]:>9}")
    met, speedup, line = verdict(table, differ, args.workers, args.latency)
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "speedup": speedup,
                                               "differ": differ}, indent=2))
    return 0 if met else 1


def differences(runs: dict[tuple[str, int], list[dict]]) -> list[str]:
    """What differs (``SAME``'s figures, step by step) between each run and the first run of
    one worker with the same tool."""
    differ = []
    for (tool, workers), results in runs.items():
        reference = runs[(tool, 1)][0]["steps"]
        for result in results:
            if len(result["steps"]) != len(reference):
                differ.append(f"{tool} x{workers}: {len(result['steps'])} steps, not "
                              f"{len(reference)}")
                continue
            for a, b in zip(reference, result["steps"]):
                differ += [f"{tool} x{workers} step {b['step']} {k}" for k in SAME
                           if a.get(k) != b.get(k)]
    return differ


def summaries(runs: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """Per arm, the medians of its undisturbed runs."""
    table = []
    for (tool, workers), results in runs.items():
        kept = [r for r in results if not r["disturbed"]]
        table.append({"tool": tool, "workers": workers, "runs": len(kept),
                      "tools_seconds": summary(kept, "tools/seconds"),
                      "seconds_generate": summary(kept, "seconds_generate"),
                      "calls_per_row": summary(kept, "tool_calls_mean")})
    return table


def verdict(table: list[dict], differ: list[str], workers: int, latency: float
            ) -> tuple[bool, float | None, str]:
    """(met, the latency tool's speed-up of ``workers`` workers over one, the lines saying so)."""
    one, many = (next((r["tools_seconds"] for r in table
                       if r["tool"] == REMOTE_TOOL and r["workers"] == w), None)
                 for w in (1, workers))
    speedup = one / many if one and many else None
    met = speedup is not None and speedup >= SPEEDUP_TARGET and not differ
    line = (f"\nremote tool ({latency:g} s): tools/seconds {workers} workers "
            f"{'-' if speedup is None else f'{speedup:.1f}x'} faster than 1 (target "
            f"{SPEEDUP_TARGET:g}x); steps equal across worker counts: "
            f"{'yes' if not differ else 'NO: ' + ', '.join(differ[:5])}\n"
            f"{'target met' if met else 'target MISSED'}")
    return met, speedup, line


if __name__ == "__main__":
    sys.exit(benchkit.main(NAME, parse_args, run))
