"""Can supervised fine-tuning teach a built-in model the two sub-skills of the ``zoom`` task
(issue 32, "thinking with images")? Each candidate model is fine-tuned with ``r1fit sft`` on
each sub-skill, then answers held-out rows greedily.

Command (20 minutes on 2 CPU cores under other load, measured 1,173 s; latest rows in
benchmarks/RESULTS.md):

    python benchmarks/zoom_skills.py
    # = --models builtin:tiny builtin:small --target builtin:small --train-rows 3000
    #   --eval-rows 200 --steps 400 --batch 16 --learning-rate 1e-3 --max-pixels 12544
    #   --zoom-factor 4 --min-gain 0.2 --max-minutes 10 --threads 1

The rows come from ``builtin:shapes`` zoom items (``data.shapes.image_size`` 112: an 896 px image
with one 32 px striped mark), ``--train-rows`` of its train split and ``--eval-rows`` of its eval
split, written as r1fit JSONL rows with their images (fitted to ``--max-pixels`` here, by the
function r1fit's loader uses, so the loader leaves them as they are):

- ``locate``: the whole image shrunk to the pixel budget (the mark is a 4 px grey square whose
  stripes do not show); the answer is the mark's centre as fractions of the image with one
  decimal, ``"0.3 0.7"``. A held-out row is right when both numbers are within 0.1 of the true
  centre. Baseline: the best constant answer (the one right most often on the train rows),
  scored on the eval rows.
- ``read``: what ``zoom(x, y, --zoom-factor)`` at the mark's true centre returns (r1fit's own
  tool), fitted to the pixel budget; the answer is the pattern (``horizontal``, ``vertical`` or
  ``checkered``). Baseline: the commonest train answer's share of the eval rows (1/3: the
  patterns are balanced).

Each (model, skill) is one ``r1fit sft`` run (full fine-tuning, float32, CPU, ``preset=none``:
the answers are learnt as written, no <think> tags), then a child that loads the run's ``final/``
folder and decodes the eval rows greedily; the parent scores the answers.

Target (exit 1 when missed): the ``--target`` model scores at least ``--min-gain`` above the
baseline on both skills, each run's fine-tuning taking at most ``--max-minutes``. The other
models are for comparison. Exit 2 on bad arguments or a failed run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import benchkit
from benchkit import BenchmarkError, positive, print_result, read_result, run_child

NAME = "zoom_skills"
SKILLS = ("locate", "read")
IMAGE_SIZE = 112  # data.shapes.image_size: the zoom image is 8 x this on a side
TOLERANCE = 0.1  # a located centre is right within this fraction of the image on both axes
GRID = [i / 10 for i in range(11)]  # the one-decimal answers a constant guess can give
LOCATE_PROBLEM = ("Where is the small grey square? Answer with its centre as x y, fractions of "
                  "the image's width and height with one decimal.")
READ_PROBLEM = ("Are the stripes of the square in the middle horizontal, vertical or checkered? "
                "Answer with one word.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# ----------------------------------------------------------------------------------------------
# answers and scores (pure)


def centre_text(x: float, y: float) -> str:
    """The locate answer of a mark centred at fractions (x, y): ``"0.3 0.7"``."""
    return f"{x:.1f} {y:.1f}"


def parse_point(text: str) -> tuple[float, float] | None:
    """The first two numbers of ``text``, or None when it holds fewer."""
    numbers = NUMBER.findall(text)
    return (float(numbers[0]), float(numbers[1])) if len(numbers) >= 2 else None


def located(point: tuple[float, float] | None, truth: Sequence[float]) -> bool:
    """Whether ``point`` is within :data:`TOLERANCE` of ``truth`` on both axes."""
    slack = TOLERANCE + 1e-9  # "0.4" for a centre at 0.3 is right: float rounding aside
    return point is not None and all(abs(p - t) <= slack for p, t in zip(point, truth))


def locate_score(texts: Sequence[str], truths: Sequence[Sequence[float]]) -> float:
    """Share of ``texts`` whose point is within tolerance of its truth."""
    return sum(located(parse_point(t), c) for t, c in zip(texts, truths, strict=True)) / len(texts)


def best_constant(train: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]]
                  ) -> tuple[tuple[float, float], float]:
    """The one-decimal point right most often on ``train``, and its score on ``held_out``."""
    best = max(((x, y) for x in GRID for y in GRID),
               key=lambda p: sum(located(p, c) for c in train))
    return best, sum(located(best, c) for c in held_out) / len(held_out)


def read_score(texts: Sequence[str], answers: Sequence[str]) -> float:
    """Share of ``texts`` that are their answer (case and surrounding blanks ignored)."""
    return sum(t.strip().lower() == a for t, a in zip(texts, answers, strict=True)) / len(texts)


def majority(train: Sequence[str], held_out: Sequence[str]) -> tuple[str, float]:
    """The commonest ``train`` answer and its share of ``held_out``."""
    answer = Counter(train).most_common(1)[0][0]
    return answer, sum(a == answer for a in held_out) / len(held_out)


# ----------------------------------------------------------------------------------------------
# data


@dataclass
class SkillRows:
    """One skill's rows of one split: the JSONL file and what scores them."""

    path: str
    truths: list  # locate: [x, y] fractions; read: the pattern


def item_images(index: int, split: str, args: argparse.Namespace) -> tuple[object, object, dict]:
    """Item ``index`` of the zoom task's ``split``: the whole image and the zoomed crop, both
    fitted to the pixel budget, and the truths (centre fractions, pattern)."""
    from r1fit.data.images import fit_pixel_budget
    from r1fit.data.shapes import ShapesSpec, make_item, render_item
    from r1fit.tools.api import ToolContext
    from r1fit.tools.builtin import zoom

    spec = ShapesSpec(kinds=("zoom",), image_size=IMAGE_SIZE)
    item = make_item(spec, seed=args.seed, split=split, index=index)
    image, mark = render_item(item, spec), item.shapes[0]
    x, y = mark.cx / item.image_size, mark.cy / item.image_size
    crop = zoom(ToolContext(images=(image,)), x, y, float(args.zoom_factor))
    fit = [fit_pixel_budget(img, 784, args.max_pixels) for img in (image, crop)]
    return fit[0], fit[1], {"centre": [x, y], "pattern": item.answer}


def write_split(folder: Path, split: str, rows: int, args: argparse.Namespace
                ) -> dict[str, SkillRows]:
    """Both skills' rows of ``split`` in ``folder``: JSONL files and their PNG images."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[str]] = {s: [] for s in SKILLS}
    truths: dict[str, list] = {s: [] for s in SKILLS}
    for i in range(rows):
        whole, crop, truth = item_images(i, split, args)
        x, y = truth["centre"]
        for skill, image, problem, answer, scored in (
                ("locate", whole, LOCATE_PROBLEM, centre_text(x, y), [x, y]),
                ("read", crop, READ_PROBLEM, truth["pattern"], truth["pattern"])):
            name = f"images/{split}_{i:05d}_{skill}.png"
            image.save(folder / name)
            lines[skill].append(json.dumps({"image": name, "problem": problem,
                                            "solution": answer}))
            truths[skill].append(scored)
    out = {}
    for skill in SKILLS:
        path = folder / f"{split}_{skill}.jsonl"
        path.write_text("\n".join(lines[skill]) + "\n")
        out[skill] = SkillRows(str(path), truths[skill])
    return out


# ----------------------------------------------------------------------------------------------
# children: prepare a built-in model, fine-tune (the r1fit CLI), answer the eval rows


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: build the built-in models in a process of their own; print their sizes."""
    from r1fit.models.builtin import BUILTIN_PREFIX, MARKER_FILE, ensure_builtin

    sizes = {}
    for model in args.models:
        if model.startswith(BUILTIN_PREFIX):
            folder = ensure_builtin(model[len(BUILTIN_PREFIX):])
            sizes[model] = json.loads((folder / MARKER_FILE).read_text())["num_parameters"]
    print_result(NAME, sizes)
    return 0


def sft_command(args: argparse.Namespace, model: str, data: str, output_dir: Path) -> list[str]:
    """``r1fit sft`` of one (model, skill) run."""
    return [sys.executable, "-m", "r1fit", "sft", "preset=none", f"model.path={model}",
            f"data.train={data}", "data.eval=null", f"data.max_pixels={args.max_pixels}",
            f"sft.steps={args.steps}", f"sft.batch_size={args.batch}",
            f"sft.learning_rate={args.learning_rate}", "train.device=cpu", "checkpoint.every=0",
            f"train.output_dir={output_dir}", "train.overwrite=true", f"train.seed={args.seed}",
            f"train.warmup_steps={max(1, args.steps // 20)}"]


def run_answer(args: argparse.Namespace) -> int:
    """``--answer FOLDER``: greedy answers of the model in FOLDER to the rows of ``--data``."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from r1fit.data.batch import decode_completions, encode_prompts
    from r1fit.data.dataset import load_dataset
    from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions

    model = AutoModelForImageTextToText.from_pretrained(args.answer, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(args.answer)
    dataset = load_dataset(args.data, split="eval", min_pixels=784, max_pixels=args.max_pixels,
                           max_images=1, max_bad_fraction=0.0, seed=args.seed)
    samples, errors = dataset.fetch(list(range(len(dataset))))
    if errors:
        raise BenchmarkError(f"{args.data}: {len(errors)} bad rows, the first: {errors[0]}")
    with torch.no_grad():
        completions = generate_completions(
            model, encode_prompts(processor, samples, ""), seeds=None, batch_size=50,
            settings=SamplingSettings(max_new_tokens=12, greedy=True),
            ids=TokenIds.of(model, processor), device=torch.device("cpu"))
    print_result(NAME, decode_completions(processor, completions))
    return 0


# ----------------------------------------------------------------------------------------------
# parent: runs, table, targets


@dataclass
class Result:
    """One (model, skill) run: its score against its baseline and what the fine-tuning cost."""

    model: str
    skill: str
    score: float
    baseline: float
    sft_seconds: float
    steps: int
    final_loss: float
    examples: list[str]  # the first few greedy answers

    @property
    def gain(self) -> float:
        return self.score - self.baseline


def child_command(args: argparse.Namespace, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every child shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--max-pixels",
            str(args.max_pixels), "--seed", str(args.seed)]


def final_loss(output_dir: Path) -> float:
    """The last step's loss in a run's metrics.jsonl."""
    from r1fit.report.metrics import read_metrics  # plain json; no torch

    steps = [r for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]
    if not steps:
        raise BenchmarkError(f"{output_dir}: no step rows in metrics.jsonl")
    return float(max(steps, key=lambda r: r["step"])["loss"])


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: torch on ``--threads`` threads (on a shared 2-core machine
    2 threads contending with other jobs ran an SFT step 9x slower than 1)."""
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


def measure(args: argparse.Namespace, model: str, skill: str, train: SkillRows,
            held_out: SkillRows, baseline: float) -> Result:
    """Fine-tune ``model`` on ``train``, answer ``held_out``, score."""
    what = f"{model} {skill}"
    with tempfile.TemporaryDirectory(prefix="r1fit-zoom-run-") as tmp:
        out = Path(tmp) / "run"
        started = time.perf_counter()
        run_child(sft_command(args, model, train.path, out), f"{what}: r1fit sft", "r1fit",
                  env=child_env(args), log=args.log)
        seconds = time.perf_counter() - started
        stdout = run_child(child_command(args, "--answer", str(out / "final"), "--data",
                                         held_out.path), f"{what}: answers", NAME,
                           env=child_env(args), log=args.log)
        texts = read_result(stdout, NAME, f"{what}: answers")
        loss = final_loss(out)
    score = (locate_score if skill == "locate" else read_score)(texts, held_out.truths)
    return Result(model, skill, score, baseline, seconds, args.steps, loss, texts[:5])


def baselines(train: dict[str, SkillRows], held_out: dict[str, SkillRows]) -> dict[str, float]:
    """Each skill's baseline score on the eval rows (see the module docstring)."""
    return {"locate": best_constant(train["locate"].truths, held_out["locate"].truths)[1],
            "read": majority(train["read"].truths, held_out["read"].truths)[1]}


def check_targets(results: Sequence[Result], target: str, min_gain: float, max_minutes: float
                  ) -> tuple[bool, list[str]]:
    """The target model's gain on each skill, and its fine-tuning time."""
    verdicts, met = [], True
    for skill in SKILLS:
        runs = [r for r in results if r.model == target and r.skill == skill]
        if not runs:
            verdicts.append(f"{target} {skill}: not measured -> MISSED")
            met = False
            continue
        r = runs[0]
        ok = r.gain >= min_gain and r.sft_seconds <= 60 * max_minutes
        met = met and ok
        verdicts.append(f"{target} {skill}: {r.score:.3f} vs baseline {r.baseline:.3f} (gain "
                        f"{r.gain:+.3f}, target >= {min_gain:g}) in {r.sft_seconds / 60:.1f} min "
                        f"(target <= {max_minutes:g}) -> {'met' if ok else 'MISSED'}")
    return met, verdicts


def print_table(results: Sequence[Result], sizes: dict[str, int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SFT on the zoom task's sub-skills: held-out greedy score vs baseline")
    for name in ("model", "params", "skill", "score", "baseline", "gain", "final loss",
                 "SFT time", "s/step"):
        table.add_column(name, justify="left" if name in ("model", "skill") else "right")
    for r in results:
        params = sizes.get(r.model)
        table.add_row(r.model, "?" if params is None else f"{params / 1e6:.2f}M", r.skill,
                      f"{r.score:.3f}", f"{r.baseline:.3f}", f"{r.gain:+.3f}",
                      f"{r.final_loss:.3f}", f"{r.sft_seconds:.0f} s",
                      f"{r.sft_seconds / r.steps:.2f}")
    Console(width=max(110, Console().width)).print(table)


def run_parent(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    sizes = read_result(run_child(child_command(args, "--prepare", "--models", *args.models),
                                  "prepare", NAME), NAME, "prepare")
    results = []
    with tempfile.TemporaryDirectory(prefix="r1fit-zoom-data-") as tmp:
        train = write_split(Path(tmp) / "train", "train", args.train_rows, args)
        held_out = write_split(Path(tmp) / "eval", "eval", args.eval_rows, args)
        base = baselines(train, held_out)
        print(f"data written in {time.perf_counter() - started:.0f} s; baselines {base}",
              file=sys.stderr, flush=True)
        for model in args.models:
            for skill in args.skills:
                result = measure(args, model, skill, train[skill], held_out[skill], base[skill])
                results.append(result)
                print(f"{model} {skill}: {result.score:.3f} (baseline {result.baseline:.3f}), "
                      f"SFT {result.sft_seconds:.0f} s, loss {result.final_loss:.3f}, answers "
                      f"{result.examples}", file=sys.stderr, flush=True)
    print_table(results, sizes)
    met, verdicts = check_targets(results, args.target, args.min_gain, args.max_minutes)
    print("\n".join(verdicts))
    print(f"{args.train_rows} train / {args.eval_rows} eval rows, {args.steps} SFT steps of "
          f"{args.batch} rows at lr {args.learning_rate:g}, images at most {args.max_pixels} px, "
          f"zoom factor {args.zoom_factor:g}, {time.perf_counter() - started:.0f} s in all. "
          "Times depend on other load on this machine.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "targets_met": met, "verdicts": verdicts, "sizes": sizes,
             "results": [asdict(r) for r in results]}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin:tiny", "builtin:small"],
                   help="model.path of each candidate")
    p.add_argument("--target", default="builtin:small", help="the model the target binds")
    p.add_argument("--skills", nargs="+", choices=SKILLS, default=list(SKILLS))
    p.add_argument("--train-rows", type=positive, default=3000)
    p.add_argument("--eval-rows", type=positive, default=200)
    p.add_argument("--steps", type=positive, default=400, help="sft.steps per run")
    p.add_argument("--batch", type=positive, default=16, help="sft.batch_size")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="sft.learning_rate")
    p.add_argument("--max-pixels", type=positive, default=IMAGE_SIZE * IMAGE_SIZE,
                   help="data.max_pixels: the pixel budget of every image")
    p.add_argument("--zoom-factor", type=float, default=4.0, help="the read rows' zoom factor")
    p.add_argument("--min-gain", type=float, default=0.2)
    p.add_argument("--max-minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive, default=1, help="OMP_NUM_THREADS of the runs")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--log", type=Path, help="append the children's output to this file")
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--answer", metavar="FOLDER", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_pixels < 784:
        p.error(f"--max-pixels: at least 784 (28 x 28), got {args.max_pixels}")
    if not 1 <= args.zoom_factor <= 64:
        p.error(f"--zoom-factor: within [1, 64] (the zoom tool's), got {args.zoom_factor:g}")
    if args.answer is not None and args.data is None:
        p.error("--answer needs --data")
    return args


def dispatch(args: argparse.Namespace) -> int:
    """The mode the arguments name: a child's ``--prepare`` or ``--answer``, else the parent."""
    if args.prepare:
        return run_prepare(args)
    return run_answer(args) if args.answer is not None else run_parent(args)


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
