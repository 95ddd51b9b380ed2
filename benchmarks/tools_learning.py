"""Learning with a tool, measured: the R1 recipe (SFT, then GRPO) on builtin:shapes zoom questions
with the zoom tool against the same recipe without it.

Command (on 2 CPU cores; the arms run one after another, each `r1fit` run a process of its own;
the SFT with tools is the longest, ~17 minutes, and the whole ~33):

    python benchmarks/tools_learning.py
    # = --model builtin:tiny --sft-steps 2500 --sft-eval-every 500 --grpo-steps 10 --eval-size 48
    #   --variant algo.num_iterations=2

The task (``configs/zoom-tools.yaml``, whose values every arm runs with): a 32 px striped mark
(horizontal, vertical or checkered) in an 896 px image, shrunk to 112 x 112 for the prompt,
where the three patterns differ by at most 2 grey levels: without the tool the answer is a
guess (1/3). The question states the mark's place (one of 8 x 8 cell centres); held-out rows
are scenes (place and pattern) that no training row shows. Arms, every one evaluated greedily on
the same held-out rows:

- ``sft-plain``: ``r1fit sft`` on the answers, no tools (tools off, before RL);
- ``sft-tools``: ``r1fit sft`` with the zoom tool, every row a demonstration (call on the mark,
  the tool's image, the answer; docs/training.md) (tools on, before RL);
- ``grpo-plain``: GRPO from ``sft-plain`` without tools (tools off, after RL);
- ``grpo-tools``: GRPO from ``sft-tools`` with the tool (tools on, after RL);
- ``grpo-tools-variant``: the same with ``--variant`` (default: two updates per rollout).

Target (issue 32): ``grpo-tools`` beats ``grpo-plain`` by at least 15 points of held-out
accuracy, the GRPO arm within 20 minutes. Exit status: 0 when met, 1 when missed (the table says
by how much), 2 on bad arguments or a failed run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import benchkit
from benchkit import BenchmarkError, positive, run_child

NAME = "tools_learning"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "zoom-tools.yaml"
TARGET_POINTS = 0.15  # grpo-tools over grpo-plain
TARGET_MINUTES = 20.0  # the GRPO arm with the tool
NO_TOOLS = ["tools=[]", "data.max_images=1"]


@dataclass
class Arm:
    """One run and what its last evaluation measured."""

    name: str
    command: str  # ``sft`` or ``train``
    overrides: list[str]
    start_from: str | None = None  # the arm whose final/ folder is this one's model
    accuracy_before: float | None = None  # GRPO: the evaluation before the first step
    accuracy: float | None = None
    tool_use: float | None = None
    minutes: float | None = None
    curve: list[tuple[int, float]] | None = None  # (step, accuracy) of every evaluation


def arms(args: argparse.Namespace) -> list[Arm]:
    """The arms in the order they run (each GRPO arm after the SFT it starts from)."""
    common = [f"data.eval_size={args.eval_size}", "checkpoint.every=0", *args.set]
    sft = [f"model.path={args.model}", f"sft.steps={args.sft_steps}",
           f"sft.eval_every={args.sft_eval_every}", *common]
    grpo = [f"train.max_steps={args.grpo_steps}", f"eval.every={args.grpo_steps}",
            "eval.before_train=true", *common]
    return [Arm("sft-plain", "sft", [*sft, *NO_TOOLS]),
            Arm("sft-tools", "sft", sft),
            Arm("grpo-plain", "train", [*grpo, *NO_TOOLS], start_from="sft-plain"),
            Arm("grpo-tools", "train", grpo, start_from="sft-tools"),
            Arm("grpo-tools-variant", "train", [*grpo, *args.variant], start_from="sft-tools")]


def evaluations(metrics: Path) -> list[dict]:
    """The rows of ``metrics`` (metrics.jsonl) that hold an evaluation, in step order."""
    from r1fit.report.metrics import read_metrics  # plain json; no torch

    evals = [row for row in read_metrics(metrics) if "eval/accuracy" in row]
    if not evals:
        raise BenchmarkError(f"{metrics}: no evaluation row")
    return evals


def run_arm(arm: Arm, folder: Path, log: Path, timeout: float) -> None:
    """Run ``arm`` into ``folder/<name>`` and record its evaluations and wall time."""
    out = folder / arm.name
    model = [f"model.path={folder / arm.start_from / 'final'}"] if arm.start_from else []
    command = [sys.executable, "-m", "r1fit", arm.command, str(CONFIG), *arm.overrides, *model,
               f"train.output_dir={out}", "train.overwrite=true"]
    began = time.perf_counter()
    run_child(command, f"arm {arm.name}", "r1fit", timeout=timeout, log=log)
    arm.minutes = (time.perf_counter() - began) / 60
    evals = evaluations(out / "metrics.jsonl")
    first, last = evals[0], evals[-1]
    arm.curve = [(int(row["step"]), float(row["eval/accuracy"])) for row in evals]
    arm.accuracy = float(last["eval/accuracy"])
    arm.tool_use = last.get("eval/tool_use")
    if arm.command == "train":
        arm.accuracy_before = float(first["eval/accuracy"])


def verdict(by_name: dict[str, Arm]) -> tuple[bool, str]:
    """Whether the target is met, and the line that says so."""
    tools, plain = by_name["grpo-tools"], by_name["grpo-plain"]
    assert tools.accuracy is not None and plain.accuracy is not None and tools.minutes is not None
    gain = tools.accuracy - plain.accuracy
    met = gain >= TARGET_POINTS and tools.minutes <= TARGET_MINUTES
    return met, (f"grpo-tools - grpo-plain = {100 * gain:+.1f} points in {tools.minutes:.1f} min "
                 f"(target >= {100 * TARGET_POINTS:.0f} points in <= {TARGET_MINUTES:.0f} min): "
                 f"{'met' if met else 'missed'}")


def table(results: Sequence[Arm]) -> str:
    def cell(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if value is None else f"{scale * value:.{digits}f}"

    lines = ["| arm | accuracy before RL | accuracy | tool use | minutes |", "|---|---|---|---|---|"]
    lines += [f"| {a.name} | {cell(a.accuracy_before)} | {cell(a.accuracy)} | "
              f"{cell(a.tool_use)} | {cell(a.minutes, digits=1)} |" for a in results]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.output_dir or tempfile.mkdtemp(prefix="r1fit-tools-learning-"))
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    results = arms(args)
    for arm in results:
        print(f"{NAME}: running {arm.name} ({arm.command}) -> {folder / arm.name}", flush=True)
        run_arm(arm, folder, log, args.timeout)
    met, line = verdict({a.name: a for a in results})
    print(table(results))
    for arm in results:  # the held-out accuracy at each evaluation (sft.eval_every, eval.every)
        print(f"{arm.name} accuracy by step: " + ", ".join(f"{step}: {accuracy:.3f}"
                                                          for step, accuracy in arm.curve or []))
    print(line)
    (folder / "result.json").write_text(json.dumps([asdict(a) for a in results], indent=1))
    return 0 if met else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny", help="the model every arm starts from")
    parser.add_argument("--sft-steps", type=positive, default=2500)
    parser.add_argument("--sft-eval-every", type=int, default=500, metavar="N",
                        help="the SFT arms also evaluate every N steps (0: before and after only)")
    parser.add_argument("--grpo-steps", type=positive, default=10)
    parser.add_argument("--eval-size", type=positive, default=48, help="held-out rows")
    parser.add_argument("--variant", nargs="*", default=["algo.num_iterations=2"],
                        help="overrides of the GRPO variant arm")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of every arm (e.g. data.shapes.zoom_hint=true)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per arm")
    parser.add_argument("--output-dir", help="keep the runs here (default: a temporary folder)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(benchkit.main(NAME, parse_args, run))
