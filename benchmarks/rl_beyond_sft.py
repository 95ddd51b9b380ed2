"""RL beyond SFT (issue 43): does GRPO lift a policy past what its demonstrations taught? A
partly trained SFT policy, then GRPO from it with a reward that knows the truth, beside a control
arm that keeps training SFT on the same demonstrations for the same training time.

Command (on 2 CPU cores, the arms one after another, each `r1fit` run a process of its own):

    python benchmarks/rl_beyond_sft.py
    # = --tasks colour zoom --seeds 0 1 (the per-task settings: see --help)

Tasks (held-out greedy accuracy on ``builtin:shapes`` eval rows, true answers):

- ``colour``: the demo's colour questions (``r1fit/presets/demo.yaml``: ``builtin:tiny``, one
  large shape, 4 colours). The SFT demonstrations are systematically wrong for one class: 80% of
  the red shapes' rows say "yellow" (``--relabel red=yellow --relabel-share 0.8``), written as a
  JSONL with its images in the work folder. Greedy decoding takes the majority answer, so SFT
  lands at 0.75 by design, while the truth keeps some probability under sampling; the reward,
  which reads the true answers, has something to correct. With every red row relabelled (share
  1) the policy never samples "red" (two tokens it was never taught) and GRPO has nothing to
  reinforce: see benchmarks/RESULTS.md.
- ``zoom``: the zoom questions with the zoom tool (``configs/zoom-tools.yaml``), the colour
  task's mechanism with tools: tool demonstrations (a call on the mark, the zoom's image, the
  answer) written as a JSONL whose calls are all right but whose answer after the zoom says
  "horizontal" in 70% of the checkered marks' rows (``--zoom-relabel checkered=horizontal
  --zoom-relabel-share 0.7``), so a policy that reads the zoom answers 0.667 greedily by design,
  plus 2,000 single-turn rows (``--zoom-read-rows``): the zoom's image alone, its stripes
  asked, answered as the demonstrations answer. SFT 3,500 steps at a constant rate after the
  warm-up. Measured (RESULTS.md): without the single-turn rows no SFT read the zoom within
  1,500-2,000 steps (0.333, every answer "horizontal"), and GRPO cannot start reading from
  nothing; with them it read from ~1,750 steps (seed 1) and ~2,750 (seed 0). At 80% wrong
  the policy sampled "checkered" as often on horizontal marks as on checkered ones and GRPO
  kept 0.667; at 60% the control's greedy answer flipped by chance (its sampled "checkered"
  near half on checkered marks).

``--reuse`` with ``--output-dir`` reads an arm whose folder already holds a run of the same
command (its ``command.json``), so a run stopped partway goes on from the arm it stopped in, or
other GRPO settings can be tried from the same SFT arm.

Arms per task and seed: ``sft`` (the partial or wrong SFT, from the random-weight model), then
from its ``final/`` folder ``grpo`` (``r1fit train``, evaluated every ``--<task>-eval-every``
steps and before the first) and ``control`` (``r1fit sft`` on the same demonstrations, as many
steps as take the GRPO arm's training time at the SFT arm's seconds per step, evaluated about as
often). Time is training time: the steps' own seconds from metrics.jsonl, evaluations and loading
left out, so both arms are compared at equal compute on the same machine.

Target (issue 43; exit 1 when missed): on every task and seed run, GRPO's last held-out accuracy
at least 25 points over the SFT it started from (its evaluation before the first step), and above
the control arm's last (at equal training time). Exit 2 on bad arguments or a failed run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import benchkit
from benchkit import BenchmarkError, positive, run_child

NAME = "rl_beyond_sft"
ROOT = Path(__file__).resolve().parent.parent
ZOOM_CONFIG = ROOT / "configs" / "zoom-tools.yaml"
TASKS = ("colour", "zoom")
TARGET_GAIN = 0.25  # GRPO's last accuracy over the SFT it started from
IMAGE_SIZE = 112  # data.shapes.image_size of the demo's colour questions


# ----------------------------------------------------------------------------------------------
# the colour task's systematically wrong demonstrations (pure, but for writing the images)


def parse_relabel(text: str) -> dict[str, str]:
    """``"red=yellow,green=blue"`` -> ``{"red": "yellow", "green": "blue"}`` (argparse type)."""
    pairs = {}
    for part in filter(None, text.split(",")):
        true, sep, shown = part.partition("=")
        if not sep or not true.strip() or not shown.strip():
            raise argparse.ArgumentTypeError(f"expected TRUE=SHOWN[,TRUE=SHOWN...], got {text!r}")
        pairs[true.strip().lower()] = shown.strip().lower()
    if not pairs:
        raise argparse.ArgumentTypeError("expected at least one TRUE=SHOWN pair")
    return pairs


def shown_answers(answers: Sequence[str], relabel: Mapping[str, str], share: float) -> list[str]:
    """The demonstrations' answers: of each class ``relabel`` names, ``share`` of its rows (spread
    evenly over them, in order: the k-th row of the class is relabelled when ``floor((k + 1) *
    share)`` exceeds ``floor(k * share)``) shown as ``relabel`` says, the rest left true. Over
    half wrong is what makes greedy decoding answer wrong for the class; below 1 the true answer
    keeps some probability under sampling."""
    seen: dict[str, int] = {}
    shown = []
    for answer in answers:
        k = seen[answer] = seen.get(answer, -1) + 1
        wrong = answer in relabel and int((k + 1) * share) > int(k * share)
        shown.append(relabel[answer] if wrong else answer)
    return shown


def greedy_ceiling(answers: Sequence[str], shown: Sequence[str]) -> float:
    """The held-out accuracy of a greedy policy that learnt the demonstrations' majority answer
    per class, on rows whose classes are balanced as in ``answers``: the share of classes whose
    commonest shown answer is the true one, weighted by their rows."""
    by_class: dict[str, list[str]] = {}
    for answer, show in zip(answers, shown, strict=True):
        by_class.setdefault(answer, []).append(show)
    right = sum(len(v) for a, v in by_class.items() if max(set(v), key=v.count) == a)
    return right / len(answers)


def write_rows(folder: Path, spec, rows: int, seed: int, relabel: Mapping[str, str],
               share: float, read_rows: int = 0) -> tuple[Path, float]:
    """``rows`` train items of ``spec`` (``builtin:shapes`` drawn from ``seed``, as ``r1fit
    train`` draws them with ``train.seed=seed``) as a JSONL of demonstrations in ``folder``,
    their PNGs beside it, the answers as :func:`shown_answers` shows them; a zoom item's row
    also holds its mark's box as ``focus``, so ``r1fit sft`` with the zoom tool learns it as a
    call on the mark, the zoom's image, then the answer. Train items only: the held-out rows
    stay out by construction (``builtin:shapes`` splits by scene). Also the accuracy a greedy
    policy that learnt them would have (:func:`greedy_ceiling`).

    ``read_rows`` (zoom items only) adds that many single-turn rows after them, from the next
    train items: the image is what the demonstration's zoom returns on the mark (no tool call
    to learn), the question asks for its stripes, the answer is shown as above; SFT learns to
    read a zoom's image from them as fast as from a lone image, not only through the call."""
    from r1fit.data.shapes import make_item, mark_focus, render_item

    if read_rows:  # the zoom config's pixel budget (its preset's), as the demonstrations have it
        from r1fit.config.load import load_config

        read_max_pixels = load_config(ZOOM_CONFIG).data.max_pixels
    (folder / "images").mkdir(parents=True, exist_ok=True)
    items = [make_item(spec, seed=seed, split="train", index=i) for i in range(rows + read_rows)]
    answers = [t.answer for t in items]
    shown_all = shown_answers(answers, relabel, share)
    lines = []
    for i, (item, shown) in enumerate(zip(items, shown_all)):
        name = f"images/{i:05d}.png"
        image = render_item(item, spec)
        row = {"image": name, "problem": item.problem, "solution": shown}
        if i >= rows:
            image = zoomed_mark(image, mark_focus(item), read_max_pixels)
            row["problem"] = READ_PROBLEM
        elif item.kind == "zoom":
            row["focus"] = list(mark_focus(item))
        image.save(folder / name)
        lines.append(json.dumps(row))
    path = folder / "demonstrations.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, greedy_ceiling(answers, shown_all)


READ_PROBLEM = ("This is a zoom on a small grey square. Are its stripes horizontal, vertical or "
                "checkered? Answer with one word.")


def zoomed_mark(image, focus, max_pixels: int):
    """What a tool demonstration's zoom on ``focus`` returns from ``image`` (r1fit's own
    arguments and tool, at the pixel budget ``max_pixels``)."""
    from r1fit.tools.api import ToolContext
    from r1fit.tools.builtin import zoom
    from r1fit.tools.demonstrations import demonstration_arguments

    arguments = demonstration_arguments("zoom", focus, image.size, max_pixels)
    return zoom(ToolContext(images=(image,)), **arguments)


def write_colour_rows(folder: Path, rows: int, seed: int, relabel: Mapping[str, str],
                      share: float) -> tuple[Path, float]:
    """:func:`write_rows` of the demo's colour questions."""
    from r1fit.data.shapes import ShapesSpec

    spec = ShapesSpec(kinds=("color",), image_size=IMAGE_SIZE, max_distractors=0)
    unknown = sorted(set(relabel) - set(spec.colors))
    if unknown:
        raise BenchmarkError(f"--relabel: {unknown} not among the colours {list(spec.colors)}")
    return write_rows(folder, spec, rows, seed, relabel, share)


def zoom_spec():
    """The zoom questions of ``configs/zoom-tools.yaml``'s ``data.shapes`` (read from the file, so
    the demonstrations are the rows ``r1fit`` would draw from the same config)."""
    import yaml

    from r1fit.data.shapes import ShapesSpec

    shapes = yaml.safe_load(ZOOM_CONFIG.read_text())["data"]["shapes"]
    return ShapesSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in shapes.items()})


def write_zoom_rows(folder: Path, rows: int, seed: int, relabel: Mapping[str, str],
                    share: float, read_rows: int = 0) -> tuple[Path, float]:
    """:func:`write_rows` of the zoom questions of ``configs/zoom-tools.yaml``, each a tool
    demonstration (its 896 px image, the question stating the mark's place, the mark's box):
    the calls and the zoomed images are right, only the word read from them is shown as
    ``relabel`` says in ``share`` of each relabelled pattern's rows."""
    from r1fit.data.shapes import ZOOM_PATTERNS

    unknown = sorted(set(relabel) - set(ZOOM_PATTERNS))
    if unknown:
        raise BenchmarkError(f"--zoom-relabel: {unknown} not among the patterns "
                             f"{list(ZOOM_PATTERNS)}")
    return write_rows(folder, zoom_spec(), rows, seed, relabel, share, read_rows)


# ----------------------------------------------------------------------------------------------
# curves: (training seconds, step, held-out accuracy) read from a run's metrics.jsonl


@dataclass
class Point:
    seconds: float  # training time from the arm's start: the steps' own seconds summed
    step: int
    accuracy: float


@dataclass
class Arm:
    """One run of a (task, seed): what it ran and its evaluations."""

    name: str  # sft, grpo or control
    points: list[Point] = field(default_factory=list)
    minutes: float | None = None  # the process's wall time, loading and evaluations included
    seconds_per_step: float | None = None  # median over its steps
    last_row: dict | None = None  # GRPO: its last step's metrics row (the diagnostics)

    @property
    def final(self) -> float:
        if not self.points:
            raise BenchmarkError(f"arm {self.name}: no evaluation")
        return self.points[-1].accuracy


def step_seconds(row: Mapping) -> float | None:
    """A step row's own seconds: an SFT step's ``seconds_step``, a GRPO step's stages
    (``seconds_generate``, ``seconds_score``, ``seconds_update``, ...) summed; None for a row
    that is not a step (an evaluation before the first)."""
    if "seconds_step" in row:
        return float(row["seconds_step"])
    stages = [float(v) for k, v in row.items() if k.startswith("seconds_") and v is not None]
    return sum(stages) if stages else None


def read_curve(rows: Sequence[Mapping]) -> tuple[list[Point], list[float]]:
    """The evaluations of a run's metrics rows at their cumulative training time, and every
    step's seconds. Rows of a step logged twice (redone after an OOM) count once: the last."""
    by_step: dict[int, Mapping] = {}
    for row in rows:
        if "step" in row:
            by_step[int(row["step"])] = {**by_step.get(int(row["step"]), {}), **row}
    points, seconds, total = [], [], 0.0
    for step in sorted(by_step):
        row = by_step[step]
        spent = step_seconds(row)
        if spent is not None:
            seconds.append(spent)
            total += spent
        if "eval/accuracy" in row:
            points.append(Point(round(total, 2), step, float(row["eval/accuracy"])))
    return points, seconds


def control_plan(grpo_seconds: float, sft_seconds_per_step: float, evaluations: int
                 ) -> tuple[int, int]:
    """The control arm's steps (its training time about the GRPO arm's, at the SFT arm's
    seconds per step) and its evaluation interval (about ``evaluations`` evaluations)."""
    steps = max(1, round(grpo_seconds / sft_seconds_per_step))
    return steps, max(1, round(steps / max(1, evaluations)))


# ----------------------------------------------------------------------------------------------
# verdict and table


@dataclass
class Pair:
    """A (task, seed): its SFT, GRPO and control arms."""

    task: str
    seed: int
    arms: dict[str, Arm] = field(default_factory=dict)

    def start(self) -> float:
        """The SFT policy's accuracy: GRPO's evaluation before its first step."""
        return self.arms["grpo"].points[0].accuracy


def verdict(pairs: Sequence[Pair], target_gain: float = TARGET_GAIN) -> tuple[bool, list[str]]:
    """Whether every (task, seed) met the target, and one line each."""
    met, lines = True, []
    for pair in pairs:
        grpo, control = pair.arms["grpo"], pair.arms["control"]
        start, final = pair.start(), grpo.final
        gain = final - start
        ok = gain >= target_gain and final > control.final
        met = met and ok
        lines.append(f"{pair.task} seed {pair.seed}: SFT {start:.3f} -> GRPO {final:.3f} "
                     f"({100 * gain:+.1f} points, target >= {100 * target_gain:.0f}) in "
                     f"{grpo.points[-1].seconds / 60:.1f} min; control (SFT continued) "
                     f"{control.final:.3f} in {_last_seconds(control) / 60:.1f} min: "
                     f"{'met' if ok else 'MISSED'}")
    return met and bool(pairs), lines


def _last_seconds(arm: Arm) -> float:
    return arm.points[-1].seconds if arm.points else 0.0


def table(pairs: Sequence[Pair]) -> str:
    """One line per arm: its accuracy at each evaluation (training minutes: accuracy)."""
    lines = ["| task | seed | arm | accuracy at training minutes | wall minutes |",
             "|---|---|---|---|---|"]
    for pair in pairs:
        for arm in pair.arms.values():
            curve = ", ".join(f"{p.seconds / 60:.1f}: {p.accuracy:.3f}" for p in arm.points)
            wall = "-" if arm.minutes is None else f"{arm.minutes:.1f}"
            lines.append(f"| {pair.task} | {pair.seed} | {arm.name} | {curve} | {wall} |")
    return "\n".join(lines)


DIAGNOSTICS = ("accuracy", "reward_mean", "zero_variance_groups", "entropy", "kl",
               "clip_fraction", "completion_len_mean", "tool_calls_mean",
               "masked_token_fraction")


def diagnostics(row: Mapping | None) -> str:
    """The last GRPO step's figures that say why a run did (not) learn: sampled accuracy,
    groups with equal rewards, entropy, KL, and with tools the per-turn figures."""
    if not row:
        return "-"
    keys = [k for k in DIAGNOSTICS if k in row] + sorted(
        k for k in row if k.startswith(("reward_by_tool_calls/", "turn_advantage/")))
    return ", ".join(f"{k} {row[k]:.3g}" for k in keys if isinstance(row[k], (int, float)))


# ----------------------------------------------------------------------------------------------
# running the arms


def task_settings(args: argparse.Namespace, task: str) -> dict:
    """The per-task options (``--<task>-...``) as one record."""
    key = task.replace("-", "_")
    return {name: getattr(args, f"{key}_{name}") for name in
            SETTINGS}


def base_command(task: str, kind: str) -> list[str]:
    """``r1fit sft|train`` with the task's config: the zoom task's file, or the demo preset."""
    config = [str(ZOOM_CONFIG)] if task == "zoom" else ["preset=demo"]
    return [sys.executable, "-m", "r1fit", kind, *config]


def run_arm(arm: Arm, command: list[str], out: Path, args: argparse.Namespace, what: str
            ) -> None:
    """Run ``command`` into ``out`` and read its curve and timings into ``arm``."""
    from r1fit.report.metrics import read_metrics  # plain json; no torch

    command = [*command, f"train.output_dir={out}", "train.overwrite=true", "checkpoint.every=0",
               *args.set]
    done = out / "command.json"  # written after the run ended: what ran, and its minutes
    if args.reuse and done.is_file() and json.loads(done.read_text())["command"] == command[1:]:
        print(f"{NAME}: {what}: read from {out} (--reuse: the same command ran there)",
              flush=True)
        arm.minutes = json.loads(done.read_text())["minutes"]
    else:
        print(f"{NAME}: {what} -> {out}", flush=True)
        began = time.perf_counter()
        run_child(command, what, "r1fit", env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                  timeout=args.timeout, log=args.log or out.parent / "log.txt")
        arm.minutes = (time.perf_counter() - began) / 60
        done.write_text(json.dumps({"command": command[1:], "minutes": arm.minutes}))
    rows = read_metrics(out / "metrics.jsonl")
    arm.points, seconds = read_curve(rows)
    arm.seconds_per_step = statistics.median(seconds) if seconds else None
    steps = [r for r in rows if "reward_mean" in r]
    arm.last_row = steps[-1] if steps else None
    if not arm.points:
        raise BenchmarkError(f"{what}: no evaluation in {out / 'metrics.jsonl'}")


def run_pair(task: str, seed: int, folder: Path, args: argparse.Namespace) -> Pair:
    """The three arms of (``task``, ``seed``) in ``folder``."""
    opts = task_settings(args, task)
    folder.mkdir(parents=True, exist_ok=True)
    pair = Pair(task, seed)
    seeded = [f"train.seed={seed}", f"data.eval_size={opts['eval_size']}"]
    write, rows, relabel, wrong = (
        (write_colour_rows, args.colour_rows, args.relabel, args.relabel_share)
        if task == "colour" else
        (write_zoom_rows, args.zoom_rows, args.zoom_relabel, args.zoom_relabel_share))
    path = folder / "data" / "demonstrations.jsonl"
    if not (args.reuse and path.is_file()):  # the same rows from the same arguments
        extra = {"read_rows": args.zoom_read_rows} if task == "zoom" else {}
        path, ceiling = write(folder / "data", rows, seed, relabel, wrong, **extra)
        print(f"{NAME}: {task} seed {seed}: {rows} demonstrations, the greedy accuracy they "
              f"teach {ceiling:.3f}", flush=True)
    data = [f"data.train={path}"]
    sft = Arm("sft")
    run_arm(sft, [*base_command(task, "sft"), "model.path=builtin:tiny", *data, *seeded,
                  f"sft.steps={opts['sft_steps']}", *opts["sft_set"]],
            folder / "sft", args, f"{task} seed {seed}: sft")
    start_from = [f"model.path={folder / 'sft' / 'final'}"]
    grpo = Arm("grpo")
    run_arm(grpo, [*base_command(task, "train"), *start_from, *seeded,
                   "sft.format_warmup_steps=0", f"train.max_steps={opts['grpo_steps']}",
                   f"eval.every={opts['eval_every']}", "eval.before_train=true",
                   *opts["grpo_set"]],
            folder / "grpo", args, f"{task} seed {seed}: grpo")
    if sft.seconds_per_step is None:
        raise BenchmarkError(f"{task} seed {seed}: the sft arm logged no step time")
    steps, every = control_plan(grpo.points[-1].seconds, sft.seconds_per_step,
                                len(grpo.points) - 1)
    control = Arm("control")
    run_arm(control, [*base_command(task, "sft"), *start_from, *data, *seeded,
                      *opts["sft_set"], f"sft.steps={steps}", f"sft.eval_every={every}",
                      "eval.before_train=false"],
            folder / "control", args, f"{task} seed {seed}: control ({steps} SFT steps)")
    pair.arms = {"sft": sft, "grpo": grpo, "control": control}
    return pair


def run(args: argparse.Namespace) -> int:
    folder = Path(args.output_dir or tempfile.mkdtemp(prefix="r1fit-rl-beyond-sft-"))
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    jobs = [(task, seed) for task in args.tasks for seed in args.seeds]

    def one(job: tuple[str, int]) -> Pair:
        pair = run_pair(*job, folder / f"{job[0]}-seed{job[1]}", args)
        print(table([pair]), flush=True)
        return pair

    # --jobs 2 on 2 cores with --threads 1: each pair's runs on a core of their own (the arms
    # of one pair still run one after another: each starts from the one before)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pairs = list(pool.map(one, jobs))
    met, lines = verdict(pairs)
    print(table(pairs))
    for pair in pairs:
        print(f"{pair.task} seed {pair.seed} GRPO's last step: "
              f"{diagnostics(pair.arms['grpo'].last_row)}")
    print("\n".join(lines))
    minutes = (time.perf_counter() - started) / 60
    print(f"{minutes:.1f} min in all; work folder {folder}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "targets_met": met, "verdicts": lines, "minutes": minutes,
             "pairs": [{"task": p.task, "seed": p.seed,
                        "arms": {k: asdict(a) for k, a in p.arms.items()}} for p in pairs]},
            indent=1))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------

SETTINGS = ("sft_steps", "grpo_steps", "eval_every", "eval_size", "sft_set", "grpo_set")
DEFAULTS = {  # per task, SETTINGS
    # colour: SFT to convergence (800 steps: by 300 the policy sampled "red" as often on yellow
    # shapes as on red ones, and GRPO then unlearnt it); GRPO at 1e-3 without KL
    "colour": (800, 20, 5, 200, ["sft.learning_rate=2e-3"],
               ["train.learning_rate=1e-3", "algo.beta=0"]),
    # zoom: with --zoom-read-rows the SFT read the zoom from ~1,750 steps on seed 1, ~2,750 on
    # seed 0 (without them none of seven runs had by 1,500-2,000 steps); a constant rate
    # after the warm-up (RESULTS.md)
    "zoom": (3500, 20, 5, 48, ["sft.eval_every=250", "train.lr_schedule=constant"],
             ["train.learning_rate=1e-3", "algo.beta=0"]),
}
QUICK = {"colour": (4, 2, 1, 8, [], []), "zoom": (4, 2, 1, 8, [], ["train.prompts_per_step=2"])}


def share(text: str) -> float:
    """argparse type: a share in (0.5, 1]: more than half wrong, so greedy decoding is."""
    value = float(text)
    if not 0.5 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0.5, 1], got {text}")
    return value


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="train.seed of each pair")
    for task, (sft_steps, grpo_steps, every, size, sft_set, grpo_set) in DEFAULTS.items():
        p.add_argument(f"--{task}-sft-steps", type=positive, default=None,
                       help=f"the SFT arm's sft.steps (default {sft_steps})")
        p.add_argument(f"--{task}-grpo-steps", type=positive, default=None,
                       help=f"the GRPO arm's train.max_steps (default {grpo_steps})")
        p.add_argument(f"--{task}-eval-every", type=positive, default=None,
                       help=f"GRPO's eval.every (default {every})")
        p.add_argument(f"--{task}-eval-size", type=positive, default=None,
                       help=f"held-out rows, data.eval_size (default {size})")
        p.add_argument(f"--{task}-sft-set", nargs="*", default=None, metavar="KEY=VALUE",
                       help=f"overrides of the SFT and control arms (default {sft_set})")
        p.add_argument(f"--{task}-grpo-set", nargs="*", default=None, metavar="KEY=VALUE",
                       help=f"overrides of the GRPO arm (default {grpo_set})")
    p.add_argument("--relabel", type=parse_relabel, default={"red": "yellow"},
                   metavar="TRUE=SHOWN", help="the colour task's wrong labels (default red=yellow)")
    p.add_argument("--relabel-share", type=share, default=0.8, metavar="S",
                   help="the share of each relabelled class's rows shown wrong (default 0.8: "
                   "greedy answers wrong, the truth still sampled)")
    p.add_argument("--zoom-relabel-share", type=share, default=0.7, metavar="S",
                   help="the same for the zoom task (default 0.7: at 0.8 the SFT policy sampled "
                   "the minority answer as often on other marks as on its own; at 0.6 SFT "
                   "continued flipped its greedy answer by chance)")
    p.add_argument("--colour-rows", type=positive, default=2000,
                   help="demonstrations written for the colour task")
    p.add_argument("--zoom-relabel", type=parse_relabel, default={"checkered": "horizontal"},
                   metavar="TRUE=SHOWN", help="the zoom task's wrong answers after a right zoom "
                   "(default checkered=horizontal)")
    p.add_argument("--zoom-rows", type=positive, default=2000,
                   help="tool demonstrations written for the zoom task")
    p.add_argument("--zoom-read-rows", type=count, default=2000,
                   help="single-turn rows added to the zoom demonstrations: the zoom's image "
                   "alone, its stripes asked, answers shown as the demonstrations' (default "
                   "2000; 0: tool demonstrations only)")
    p.add_argument("--reuse", action="store_true",
                   help="with --output-dir: read an arm whose folder holds a run of the same "
                   "command (its command.json) instead of running it again")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of every run")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: colour, one seed, a few steps, 8 held-out rows")
    p.add_argument("--threads", type=positive, default=2, help="OMP_NUM_THREADS of the runs")
    p.add_argument("--jobs", type=positive, default=1,
                   help="(task, seed) pairs run side by side (each pair's arms in turn)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--output-dir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--log", type=Path, help="append the runs' output here (default: each pair's "
                   "folder's log.txt)")
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.seeds, args.colour_rows = ["colour"], args.seeds[:1], 64
    table_ = QUICK if args.quick else DEFAULTS
    for task, values in table_.items():
        key = task.replace("-", "_")
        for name, value in zip(SETTINGS, values):
            if getattr(args, f"{key}_{name}") is None:
                setattr(args, f"{key}_{name}", value)
    return args


if __name__ == "__main__":
    sys.exit(benchkit.main(NAME, parse_args, run))
