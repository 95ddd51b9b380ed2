"""r1fit against TRL's GRPOTrainer on the same model, data, group size and completion lengths:
completion tokens/s and peak memory, side by side in one run.

Command (needs TRL: ``pip install -e ".[bench]"``; 9 minutes on 2 CPU cores, measured 527 s):

    python benchmarks/vs_trl.py
    # = --model builtin:small-realvocab --generations 8 16 --micro-batch 4 --max-new-tokens 64
    #   --image-size 112 --steps 4 --repeats 3

On a GPU (``--device cuda``, as benchmarks/gpu_check.py runs it): both sides in bfloat16 on the
GPU, peaks in CUDA's allocated bytes (reset at each step's start) over what was allocated after
the load (r1fit: its weights); ``--min-new-tokens`` forces the completion lengths on both sides.

Both train GRPO on one prompt x G completions per step (``builtin:shapes`` questions with one
112 px image, 16 image tokens), full fine-tuning in float32 on CPU, gradient checkpointing on,
no KL term (``beta=0``: no reference model), one update per rollout (``num_iterations=1``), DAPO's
token-mean loss, temperature 1, G rows generated together and ``--micro-batch`` rows per
forward/backward (TRL: ``per_device_train_batch_size=micro-batch``,
``gradient_accumulation_steps=G / micro-batch``), a reward that differs between completions
(a completion's length / 10, so neither side can skip a zero-advantage update), and each side's
defaults otherwise (r1fit's ``memory.share_prefix=auto``, on for Qwen2.5-VL). A model with
random weights almost never emits EOS, so completions run to ``--max-new-tokens`` on both sides;
the table prints both sides' mean lengths, and a comparison whose lengths differ by more than 5%
counts as failed.

How it measures (see /work/shared/PITFALLS.md, "Measuring honestly"):
- every (tool, G, repeat) is a fresh child process, interleaved: r1fit, TRL, r1fit, TRL, ...;
- tokens/s of a step = its completion tokens / its wall time (generation + update); the medians of
  steps 2.. (step 1 allocates the optimizer states), then the median over repeats;
- peak memory = the largest per-step RSS high-water mark (the kernel's ``VmHWM``, reset at each
  step's start through ``/proc/self/clear_refs``: r1fit does this itself, the TRL child from a
  ``TrainerCallback``) minus the RSS right after the model was loaded (r1fit: its summary.json; TRL:
  after ``GRPOTrainer(...)`` returns). Both import the same torch and transformers;
- a run during which other processes used more than ``--max-other-cores`` cores on average is
  counted as disturbed, dropped and rerun (up to ``--retries`` times).

Targets (issue 14): at the largest G, r1fit's tokens/s >= ``--min-speedup`` (3) x TRL's and its
peak <= ``--max-memory-ratio`` (0.6) x TRL's. Exit status: 0 when met, 1 when missed, 2 on bad
arguments, a failed run or TRL missing. It also prints r1fit's floor (weights, gradients and
AdamW states, which both sides' peaks over load include: transformers maps the weights in
lazily) as a multiple of TRL's peak, and says when the memory target lies below it.
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
    cpu_ticks,
    other_cores,
    positive,
    print_result,
    read_result,
    run_child,
)

NAME = "vs_trl"
MIB = 2**20
TOOLS = ("r1fit", "trl")
LENGTH_TOLERANCE = 0.05  # the two sides' mean completion lengths may differ this much


@dataclass
class RunResult:
    """What one child run measured."""

    tokens_per_second: list[float]  # per step, steps 2..
    completion_len_mean: float  # over every step
    peak_over_load: int  # bytes: largest per-step VmHWM minus the RSS after loading the model
    other_cpu: float | None  # cores other processes used meanwhile (None: no /proc)
    seconds: float  # the whole child


@dataclass
class Setting:
    """All kept repeats of one (tool, G)."""

    tool: str
    generations: int
    runs: list[RunResult] = field(default_factory=list)
    disturbed: int = 0  # runs dropped for other load

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(statistics.median(r.tokens_per_second) for r in self.runs)

    @property
    def peak(self) -> float:
        return statistics.median(r.peak_over_load for r in self.runs)

    @property
    def length(self) -> float:
        return statistics.median(r.completion_len_mean for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "generations": self.generations,
                "tokens_per_second": self.tokens_per_second, "peak_over_load_bytes": self.peak,
                "completion_len_mean": self.length, "disturbed": self.disturbed,
                "runs": [asdict(r) for r in self.runs]}


# ----------------------------------------------------------------------------------------------
# children: one tool, one G


def r1fit_overrides(args: argparse.Namespace, generations: int, output_dir: Path) -> list[str]:
    """The r1fit run's config; TRL's child reads its data (and model) from the same config."""
    size = args.image_size
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    return [f"model.path={args.model}", "model.lora.r=0", f"model.dtype={dtype}",
            f"algo.num_generations={generations}", "train.prompts_per_step=1",
            f"memory.micro_batch={args.micro_batch}", f"memory.generation_batch={generations}",
            f"algo.max_new_tokens={args.max_new_tokens}", "algo.beta=0", "algo.num_iterations=1",
            "algo.temperature=1.0", "memory.gradient_checkpointing=true",
            "sft.format_warmup_steps=0", "data.eval=null", "data.shapes.train_size=64",
            f"data.shapes.image_size={size}", f"data.max_pixels={size * size}",
            f"train.max_steps={args.steps}", f"train.device={args.device}", "checkpoint.every=0",
            f"rollout.min_new_tokens={args.min_new_tokens}",
            "report.rollouts_every=0", f"train.output_dir={output_dir}", "train.overwrite=true",
            f"train.seed={args.seed}", "rewards.accuracy=0", "rewards.format=0",
            "rewards.vs_trl_reward:length=1.0"]


def run_r1fit(args: argparse.Namespace, generations: int) -> RunResult:
    from r1fit.config import load_config
    from r1fit.report.metrics import grpo_step_rows
    from r1fit.train.grpo import train_grpo

    started, ticks = time.perf_counter(), cpu_ticks()
    with tempfile.TemporaryDirectory(prefix="vs-trl-r1fit-") as tmp:
        out = Path(tmp) / "run"
        train_grpo(load_config(None, r1fit_overrides(args, generations, out)))
        summary = json.loads((out / "summary.json").read_text())
        steps = grpo_step_rows(out / "metrics.jsonl", last_per_step=True)
    seconds = time.perf_counter() - started
    # after load: the RSS then on CPU; on CUDA the weights, all r1fit has on the GPU by then
    after_load = (int(summary["rss_after_load_bytes"]) if args.device == "cpu" else
                  weight_bytes(args))
    return RunResult(
        tokens_per_second=[float(r["tokens_per_second"]) for r in steps[1:]],
        completion_len_mean=statistics.mean(float(r["completion_len_mean"]) for r in steps),
        peak_over_load=max(int(r["peak_memory_bytes"]) for r in steps) - after_load,
        other_cpu=other_cores(ticks, cpu_ticks(), seconds, os.sysconf("SC_CLK_TCK")),
        seconds=seconds)


def trl_rows(args: argparse.Namespace, generations: int) -> list[dict[str, Any]]:
    """The r1fit run's training samples in TRL's conversational layout: the question as the user
    turn, its image in the ``image`` column (TRL puts it before the text, as r1fit does)."""
    from r1fit.config import load_config
    from r1fit.data.build import build_datasets

    cfg = load_config(None, r1fit_overrides(args, generations, Path(tempfile.gettempdir())))
    train, _ = build_datasets(cfg)
    rows = []
    for sample in train:
        if len(sample.images) != 1 or sample.turns:
            raise BenchmarkError(f"{train.name}: expected one image and a question per row")
        prompt = [{"role": "user", "content": sample.problem}]
        if cfg.data.system_prompt:
            prompt.insert(0, {"role": "system", "content": cfg.data.system_prompt})
        rows.append({"prompt": prompt, "image": sample.images[0]})
    return rows


def read_status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise BenchmarkError(f"/proc/self/status has no {key}")


def run_trl(args: argparse.Namespace, generations: int) -> RunResult:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from r1fit.models.load import resolve_model_path

    started, ticks = time.perf_counter(), cpu_ticks()
    cuda = args.device == "cuda"
    dataset = Dataset.from_list(trl_rows(args, generations))
    folder = resolve_model_path(args.model)
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.bfloat16 if cuda else torch.float32)
    processor = AutoProcessor.from_pretrained(folder)

    from vs_trl_reward import length  # r1fit's reward plugin: the same function

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [length(c[0]["content"] if isinstance(c, list) else c, "") for c in completions]

    steps: list[dict[str, float]] = []

    class StepMeter(TrainerCallback):
        """Each optimizer step's wall time and memory high-water mark (reset at its start): the
        RSS's on CPU, CUDA's allocated bytes on a GPU (what r1fit logs there), the GPU waited
        for at both ends."""

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            steps.append({"start": time.perf_counter()})

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            steps[-1].update(seconds=time.perf_counter() - steps[-1]["start"],
                             peak=torch.cuda.max_memory_allocated() if cuda else
                             read_status("VmHWM"))

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None,
                   **__: Any) -> None:
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["length"] = float(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory(prefix="vs-trl-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=args.steps, num_generations=generations,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=generations // args.micro_batch,
            max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0,
            num_iterations=1, gradient_checkpointing=True, use_cpu=not cuda, bf16=cuda,
            generation_kwargs=({"min_new_tokens": args.min_new_tokens}
                               if args.min_new_tokens else None),
            learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to=[],
            seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=dataset, processing_class=processor,
                              callbacks=[StepMeter()])
        after_load = torch.cuda.memory_allocated() if cuda else read_status("VmRSS")
        trainer.train()
    if len(steps) != args.steps or any("length" not in s for s in steps):
        raise BenchmarkError(f"TRL ran {len(steps)} steps with lengths logged for "
                             f"{sum('length' in s for s in steps)}, expected {args.steps}")
    seconds = time.perf_counter() - started
    return RunResult(
        tokens_per_second=[generations * s["length"] / s["seconds"] for s in steps[1:]],
        completion_len_mean=statistics.mean(s["length"] for s in steps),
        peak_over_load=int(max(s["peak"] for s in steps)) - after_load,
        other_cpu=other_cores(ticks, cpu_ticks(), seconds, os.sysconf("SC_CLK_TCK")),
        seconds=seconds)


def run_one(args: argparse.Namespace) -> int:
    """``--one TOOL G``: train in this process, print the run's measurements."""
    tool, generations = args.one[0], int(args.one[1])
    result = run_r1fit(args, generations) if tool == "r1fit" else run_trl(args, generations)
    print_result(NAME, asdict(result))
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: TRL's version (a one-line error without it), and the built-in model built
    in a process of its own."""
    try:
        import trl
    except ImportError:
        raise BenchmarkError("TRL is not installed: pip install -e \".[bench]\"") from None
    from r1fit.models.builtin import ensure_builtin

    if args.model.startswith("builtin:"):
        ensure_builtin(args.model.split(":", 1)[1])
    print_result(NAME, {"trl": trl.__version__, "floor": state_bytes(args)})
    return 0


def weight_bytes(args: argparse.Namespace) -> int:
    """The model's weights in bytes, as the planner counts them (exact parameter counts)."""
    from r1fit.config import load_config
    from r1fit.memory.planner import plan_memory

    cfg = load_config(None, r1fit_overrides(args, args.micro_batch, Path(tempfile.gettempdir())))
    return int(plan_memory(cfg, device_type="cpu").parts["weights"])


def state_bytes(args: argparse.Namespace) -> int:
    """What any full fine-tuning step with AdamW holds at least, as the planner counts it (exact
    parameter counts of the model built on the meta device): weights, gradients and AdamW's two
    states. transformers maps a checkpoint's weights in lazily, so they enter the RSS after the
    load, on both sides: each side's peak over load includes all of this."""
    from r1fit.config import load_config
    from r1fit.memory.planner import plan_memory

    cfg = load_config(None, r1fit_overrides(args, args.micro_batch, Path(tempfile.gettempdir())))
    parts = plan_memory(cfg, device_type="cpu").parts
    return int(sum(parts[k] for k in ("weights", "gradients", "optimizer")))


# ----------------------------------------------------------------------------------------------
# parent: interleaved runs, table, targets


def child_command(args: argparse.Namespace, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every run shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--model", args.model,
            "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
            "--image-size", str(args.image_size), "--micro-batch", str(args.micro_batch),
            "--seed", str(args.seed), "--device", args.device,
            "--min-new-tokens", str(args.min_new_tokens)]


def child_env() -> dict[str, str]:
    """The children's environment: this folder on the path (r1fit's reward plugin,
    ``vs_trl_reward:length``, which TRL's side calls too), no hub access."""
    path = os.pathsep.join(p for p in (str(benchkit.FOLDER), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "KINETO_LOG_LEVEL": "5",
            "TOKENIZERS_PARALLELISM": "false"}


def measure(args: argparse.Namespace, tool: str, generations: int) -> RunResult:
    what = f"{tool} G={generations}"
    stdout = run_child(child_command(args, "--one", tool, str(generations)), what, NAME,
                       env=child_env(), timeout=args.timeout)
    return RunResult(**read_result(stdout, NAME, what))


def measure_settled(args: argparse.Namespace, setting: Setting) -> RunResult:
    """One run of ``setting`` undisturbed by other load: disturbed ones are dropped and rerun."""
    for _ in range(args.retries + 1):
        result = measure(args, setting.tool, setting.generations)
        if result.other_cpu is None or result.other_cpu <= args.max_other_cores:
            return result
        setting.disturbed += 1
        print(f"  dropped: other processes used {result.other_cpu:.2f} cores", file=sys.stderr)
    raise BenchmarkError(f"{setting.tool} G={setting.generations}: {args.retries + 1} runs in a "
                         f"row were disturbed by other load (> {args.max_other_cores} cores)")


def compare(r1fit: Setting, trl: Setting) -> dict[str, float]:
    """r1fit over TRL: tokens/s and peak ratios, and how far apart the completion lengths are."""
    return {"speedup": r1fit.tokens_per_second / trl.tokens_per_second,
            "memory_ratio": r1fit.peak / trl.peak,
            "length_gap": abs(r1fit.length / trl.length - 1)}


def check_targets(settings: dict[tuple[str, int], Setting], largest: int, min_speedup: float,
                  max_memory_ratio: float) -> tuple[bool, list[str]]:
    """The targets at the largest G; equal completion lengths at every G."""
    verdicts, met = [], True
    for g in sorted({g for _, g in settings}):
        c = compare(settings[("r1fit", g)], settings[("trl", g)])
        if c["length_gap"] > LENGTH_TOLERANCE:
            met = False
            verdicts.append(f"G={g}: mean completion lengths differ by {c['length_gap']:.0%} "
                            f"(> {LENGTH_TOLERANCE:.0%}): not a like-for-like comparison")
        if g != largest:
            continue
        fast, small = c["speedup"] >= min_speedup, c["memory_ratio"] <= max_memory_ratio
        met &= fast and small
        verdicts.append(f"G={g}: r1fit {c['speedup']:.2f}x TRL's tokens/s (target >= "
                        f"{min_speedup:g}) -> {'met' if fast else 'MISSED'}; peak "
                        f"{c['memory_ratio']:.2f}x TRL's (target <= {max_memory_ratio:g}) -> "
                        f"{'met' if small else 'MISSED'}")
    return met, verdicts


def floor_note(floor: int, trl_peak: float, max_memory_ratio: float) -> str:
    """r1fit's floor (weights + gradients + AdamW states) against TRL's largest-G peak, and
    whether the memory target lies below it (then no change to r1fit's step can meet it)."""
    note = (f"r1fit's floor (weights + gradients + AdamW states, in both sides' peaks over load): "
            f"{floor / MIB:,.0f} MiB = {floor / trl_peak:.2f}x TRL's peak")
    if floor > max_memory_ratio * trl_peak:
        note += (f"; the memory target ({max_memory_ratio:g}x) is below it: unreachable with "
                 "full fine-tuning and AdamW on this model")
    return note


def print_table(settings: dict[tuple[str, int], Setting], trl_version: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO steps: r1fit vs TRL {trl_version} GRPOTrainer (medians)")
    for name in ("G", "tool", "tokens/s", "x TRL", "peak over load (MiB)", "x TRL ",
                 "completion len", "runs (dropped)"):
        table.add_column(name, justify="left" if name == "tool" else "right")
    for (tool, g), s in settings.items():
        c = compare(settings[("r1fit", g)], settings[("trl", g)])
        table.add_row(str(g), tool, f"{s.tokens_per_second:.1f}",
                      f"{c['speedup']:.2f}" if tool == "r1fit" else "1.00", f"{s.peak / MIB:,.0f}",
                      f"{c['memory_ratio']:.2f}" if tool == "r1fit" else "1.00", f"{s.length:.1f}",
                      f"{len(s.runs)} ({s.disturbed})")
    Console(width=max(120, Console().width)).print(table)


def run_parent(args: argparse.Namespace) -> int:
    prepared = read_result(run_child(child_command(args, "--prepare"), "prepare", NAME,
                                     env=child_env()), NAME, "prepare")
    keys = [(tool, g) for g in args.generations for tool in TOOLS]
    settings = {key: Setting(*key) for key in keys}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for key in keys:  # interleaved: r1fit, TRL, r1fit, TRL, ...
            result = measure_settled(args, settings[key])
            settings[key].runs.append(result)
            print(f"{key[0]} G={key[1]} repeat {repeat + 1}/{args.repeats}: "
                  f"{statistics.median(result.tokens_per_second):.1f} tokens/s, peak "
                  f"{result.peak_over_load / MIB:,.0f} MiB, {result.seconds:.0f} s",
                  file=sys.stderr, flush=True)
    print_table(settings, prepared["trl"])
    met, verdicts = check_targets(settings, max(args.generations), args.min_speedup,
                                  args.max_memory_ratio)
    verdicts.append(floor_note(prepared["floor"], settings[("trl", max(args.generations))].peak,
                               args.max_memory_ratio))
    print("\n".join(verdicts))
    print(f"model {args.model}, {args.image_size} px image, {args.max_new_tokens} new tokens, "
          f"micro-batch {args.micro_batch}, {args.steps} steps, {args.repeats} repeat(s), "
          f"TRL {prepared['trl']}, {time.perf_counter() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "trl": prepared["trl"], "floor_bytes": prepared["floor"],
             "targets_met": met,
             "verdicts": verdicts, "settings": [s.to_dict() for s in settings.values()]},
            indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:small-realvocab", help="model.path")
    p.add_argument("--generations", type=positive, nargs="+", default=[8, 16],
                   help="group sizes G; the targets apply at the largest")
    p.add_argument("--micro-batch", type=positive, default=4,
                   help="rows per forward/backward on both sides (must divide every G)")
    p.add_argument("--max-new-tokens", type=positive, default=64)
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="no EOS before this many tokens, on both sides (r1fit's "
                   "rollout.min_new_tokens, TRL's generation_kwargs): forced lengths")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: both sides on the GPU in bfloat16, peaks in allocated bytes")
    p.add_argument("--image-size", type=positive, default=112,
                   help="builtin:shapes image side in px (a multiple of 28)")
    p.add_argument("--steps", type=positive, default=4, help="GRPO steps per run (>= 2)")
    p.add_argument("--repeats", type=positive, default=3, help="runs per (tool, G)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-speedup", type=float, default=3.0)
    p.add_argument("--max-memory-ratio", type=float, default=0.6)
    p.add_argument("--max-other-cores", type=float, default=0.1,
                   help="drop and rerun a run while other processes used more cores than this")
    p.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child run")
    p.add_argument("--json", metavar="PATH", help="also write the table and raw numbers here")
    p.add_argument("--one", nargs=2, metavar=("TOOL", "G"), help=argparse.SUPPRESS)
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps: need >= 2 (step 1 is left out of the medians)")
    bad = [g for g in args.generations if g < 2 or g % args.micro_batch]
    if bad:
        p.error(f"--generations: every G must be >= 2 and a multiple of --micro-batch "
                f"{args.micro_batch}, got {bad}")
    if args.image_size % 28:
        p.error(f"--image-size: must be a multiple of 28 px (Qwen2.5-VL), got {args.image_size}")
    if args.one is not None and args.one[0] not in TOOLS:
        p.error(f"--one: TOOL must be one of {', '.join(TOOLS)}, got {args.one[0]}")
    return args


def run(args: argparse.Namespace) -> int:
    return benchkit.dispatch(args, run_prepare, run_one, run_parent)


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
