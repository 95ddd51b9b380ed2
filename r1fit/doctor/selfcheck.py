"""``r1fit doctor --check``: a self-check of about a minute on the first device.

A few GRPO steps of ``builtin:tiny`` in the device's 16-bit dtype, each item with a verdict that
can fail:

1. the numerics of sharing, in this process, on this device's kernels: the log-probs of a
   group's completions packed after their prompt against the per-row path
   (``memory.share_prefix``, :func:`r1fit.models.packing.packing_distance`), and generation from a
   shared prefill against per-row generation (``rollout.share_prefill``,
   :func:`r1fit.rollout.prefill.prefill_check`), with the distances measured and their bounds;
2. an uninterrupted run (``r1fit train`` in a child process);
3. the planner's peak (:func:`r1fit.memory.planner.plan_memory`, planned with what the run's
   ``auto`` settings and chunk sizes settled on) against the run's measured one: the largest
   per-step ``peak_memory_bytes``, i.e. ``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats`` on CUDA, live tensor bytes (``memory.cpu_peak=tensors``) on a CPU;
4. the same run in another child process, SIGKILLed once its first checkpoint is saved, resumed
   by rerunning the command: its metrics (timings and memory aside) and final weights must equal
   the uninterrupted run's bit for bit, and it must have resumed (a restart from scratch would
   match too and prove nothing), with weights that moved.

The pieces take a run spec (a :class:`Config`, or ``key=value`` overrides) and an output folder,
so a benchmark can run them on other models: :func:`numerics_check`, :func:`run_train`,
:func:`plan_vs_measured`, :func:`kill_and_resume`, :func:`compare_runs`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from r1fit.config import Config, load_config
from r1fit.doctor.env import first_device, half_dtype
from r1fit.doctor.rewards import SPEC as LENGTH_REWARD
from r1fit.errors import R1fitError, one_line
from r1fit.report.metrics import grpo_step_rows, read_metrics
from r1fit.rollout.prefill import PrefillCheck
from r1fit.units import format_bytes

if TYPE_CHECKING:
    from r1fit.models.packing import PackingCheck

#: a run's settings: a config, or ``key.sub=value`` overrides of the defaults
RunSpec = Config | Sequence[str]

#: metric names (parts of) that differ between identical runs: timings and memory
VOLATILE = ("seconds", "tokens_per_second", "peak_memory", "peak_reserved", "mfu")
#: the plan may be this much under the measured peak (the side where a plan means an OOM): the
#: planner's own target (benchmarks/plan_accuracy.py --low-tolerance)
PLAN_LOW = 0.05
#: and this much over it. Wider than plan_accuracy's +15%: a builtin:tiny step holds ~10 MiB,
#: where terms of a MiB the planner rounds up move the ratio by 10-20% (+20% measured in
#: bfloat16 on CPU against +3% in float32); a plan 1.5x too high would still halve auto sizes
PLAN_HIGH = 0.5
#: seconds one child run may take before it is stopped and the check fails
RUN_TIMEOUT = 600.0


class SelfCheckError(R1fitError, RuntimeError):
    """A run of the self-check could not be done; the message says why."""


@dataclass
class Verdict:
    """One item of the self-check: passed or not, a line with the numbers, the numbers."""

    name: str
    ok: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.summary}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def selfcheck_overrides(device: torch.device, dtype: torch.dtype, *, steps: int = 3) -> list[str]:
    """The self-check's run: ``steps`` GRPO steps of builtin:tiny on ``device`` in ``dtype``, 2
    prompts x 4 completions of 8 tokens, a reward that varies between completions, a KL term
    and two updates per rollout (so the loss depends on the weights), a checkpoint every step.
    Every key the check depends on is set here, whatever the defaults are."""
    return [
        "model.path=builtin:tiny", f"model.dtype={str(dtype).removeprefix('torch.')}",
        "model.lora.r=0", "model.freeze_vision=false", "model.attn_implementation=sdpa",
        f"train.device={device.type}", f"train.max_steps={steps}", "train.prompts_per_step=2",
        "train.seed=0", "train.learning_rate=0.01", "train.lr_schedule=constant",
        "train.warmup_steps=0", "train.weight_decay=0.0", "train.max_grad_norm=1.0",
        "train.early_stop_patience=0",
        # bit-exact resume on a GPU needs deterministic kernels (a CPU is deterministic anyway)
        "train.deterministic=true",
        "algo.num_generations=4", "algo.max_new_tokens=8", "algo.beta=0.05",
        "algo.num_iterations=2", "algo.temperature=1.0", "algo.top_p=1.0",
        "algo.dynamic_sampling=false",
        # completions of exactly max_new_tokens, as planned
        "rollout.engine=hf", "rollout.min_new_tokens=8", "rollout.share_prefill=auto",
        "sft.format_warmup_steps=0", "data.train=builtin:shapes", "data.eval=null",
        "eval.every=0", "eval.before_train=false", "data.shapes.train_size=50",
        "data.shapes.image_size=56", "data.min_pixels=784", "data.max_pixels=3136",
        "data.max_prompt_tokens=null", "memory.micro_batch=4", "memory.generation_batch=8",
        "memory.micro_batch_tokens=null", "memory.gradient_checkpointing=true",
        "memory.share_prefix=auto", "memory.cpu_peak=tensors", "memory.budget=",
        "checkpoint.every=1", "checkpoint.keep=0", "checkpoint.resume=auto",
        "checkpoint.weights_only=false", "report.to=[]",
        "rewards.accuracy=0", "rewards.format=0", f"rewards.{LENGTH_REWARD}=1.0"]


def spec_config(spec: RunSpec) -> Config:
    """The config of a run spec."""
    return spec if isinstance(spec, Config) else load_config(None, list(spec))


def run_args(spec: RunSpec, out: Path) -> list[str]:
    """``r1fit train``'s arguments for ``spec`` writing to ``out``: the overrides, or a config
    written as a file next to ``out`` (JSON, which YAML reads)."""
    if isinstance(spec, Config):
        path = out.parent / f"{out.name}.config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec.to_dict(), indent=1))
        return [str(path), f"train.output_dir={out}"]
    return [*spec, f"train.output_dir={out}"]


def _stderr_path(out: Path) -> Path:
    return out.parent / f"{out.name}.stderr.txt"


def start_train(spec: RunSpec, out: Path) -> subprocess.Popen:
    """``r1fit train`` of ``spec`` into ``out`` in a child process; its stderr is appended to
    ``<out>.stderr.txt`` beside ``out`` (a pipe nobody reads could fill and block it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(_stderr_path(out), "a") as err:
        return subprocess.Popen([sys.executable, "-m", "r1fit", "train", *run_args(spec, out)],
                                stdout=subprocess.DEVNULL, stderr=err)


def _tail(out: Path, chars: int = 1500) -> str:
    path = _stderr_path(out)
    return path.read_text()[-chars:].strip() if path.is_file() else ""


def _wait(proc: subprocess.Popen, out: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SelfCheckError(f"r1fit train into {out} ran over {timeout:.0f} s; stopped") \
            from None


def run_train(spec: RunSpec, out: Path, *, timeout: float = RUN_TIMEOUT) -> Path:
    """Run ``r1fit train`` of ``spec`` into ``out`` to the end in a child process (a folder that
    holds a run of the same config resumes it); returns ``out``. Raises
    :class:`SelfCheckError` with the end of its stderr when it fails."""
    code = _wait(start_train(spec, out), out, timeout)
    if code != 0:
        raise SelfCheckError(f"r1fit train into {out} exited with {code}:\n{_tail(out)}")
    return out


def auto_decisions(run_dir: Path) -> dict[str, bool]:
    """What a run's ``memory.share_prefix=auto`` and ``rollout.share_prefill=auto`` settled on,
    read from its log.txt (keys it did not log are left out)."""
    log = (run_dir / "log.txt").read_text()
    found = {}
    for key in ("memory.share_prefix", "rollout.share_prefill"):
        if match := re.search(rf"{re.escape(key)}=auto: (on|off)", log):
            found[key] = match.group(1) == "on"
    return found


def _device_type(cfg: Config) -> str:
    from r1fit.processes import pick_device

    return pick_device(cfg.train.device).type


def planned_as_run(cfg: Config, run_dir: Path, row: dict[str, Any]) -> Config:
    """``cfg`` with what its run settled on, as the planner should see it: the ``auto`` sharing
    decisions (from log.txt), the gradient checkpointing the run chose, and the chunk sizes of
    metrics row ``row`` (auto-fit's or the OOM guard's)."""
    from r1fit.memory.autofit import resolve_checkpointing

    settled: dict[str, Any] = {k: v for k, v in auto_decisions(run_dir).items()
                               if cfg.value(k) == "auto"}
    for key in ("micro_batch", "generation_batch", "micro_batch_tokens"):
        if row.get(key) is not None:
            settled[f"memory.{key}"] = row[key]
    cfg = cfg.with_values(settled)
    return cfg.with_values(resolve_checkpointing(cfg, torch.device(_device_type(cfg)), "grpo"))


def plan_vs_measured(spec: RunSpec, run_dir: Path, *, low: float = PLAN_LOW,
                     high: float = PLAN_HIGH) -> Verdict:
    """The planner's peak of ``spec`` against the largest per-step ``peak_memory_bytes`` of its
    finished run in ``run_dir`` (see :func:`run_train`): on CUDA ``max_memory_allocated``,
    compared with the plan less its CUDA context and allocator slack (which the allocator does
    not count); on a CPU live tensor bytes (``memory.cpu_peak=tensors``; with ``rss`` the
    process's RSS, which the plan does not model, and the verdict says so). Passes when
    ``1 - low <= plan / measured <= 1 + high``."""
    from r1fit.memory.planner import plan_memory

    cfg = spec_config(spec)
    device_type = _device_type(cfg)
    rows = grpo_step_rows(run_dir / "metrics.jsonl")
    if not rows:
        return Verdict("memory plan", False, f"no GRPO step in {run_dir / 'metrics.jsonl'}")
    peak_row = max(rows, key=lambda r: r.get("peak_memory_bytes") or 0)
    measured = int(peak_row.get("peak_memory_bytes") or 0)
    plan = plan_memory(planned_as_run(cfg, run_dir, peak_row), device_type=device_type)
    overhead = plan.parts.get("overhead", 0)
    planned = plan.peak_bytes - overhead
    ratio = planned / measured if measured else float("inf")
    what = {"cuda": "max allocated", "cpu": "live tensors" if cfg.memory.cpu_peak == "tensors"
            else "peak RSS (memory.cpu_peak=rss: the plan counts tensors only)"}[device_type]
    ok = 1 - low <= ratio <= 1 + high and (device_type == "cuda" or cfg.memory.cpu_peak == "tensors")
    extra = f" + {format_bytes(overhead)} CUDA context and slack" if overhead else ""
    summary = (f"plan {format_bytes(planned)}{extra}, measured {format_bytes(measured)} "
               f"({what}, largest of {len(rows)} steps, step {peak_row.get('step')}): "
               f"{ratio:.3f}x (target {1 - low:.2f}x to {1 + high:.2f}x)")
    return Verdict("memory plan", ok, summary, {
        "planned_bytes": planned, "planned_overhead_bytes": overhead, "measured_bytes": measured,
        "ratio": ratio, "low": 1 - low, "high": 1 + high, "measured_as": what,
        "peak_phase": plan.peak_phase, "step": peak_row.get("step")})


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def numerics_check(spec: RunSpec) -> list[Verdict]:
    """Shared prompt and shared prefill, checked on the device and dtype of ``spec``'s run, with
    its model loaded as the run loads it: ``train.prompts_per_step`` prompts of its training set,
    ``algo.num_generations`` sampled completions each. Returns two verdicts with the distances
    measured and their bounds (a failed check means ``auto`` would run that path per row here:
    slower, still correct)."""
    from r1fit.data.batch import consecutive_groups, encode_prompts
    from r1fit.data.build import build_datasets
    from r1fit.distributed.loading import load_policy_on_ranks
    from r1fit.models.packing import check_packing
    from r1fit.processes import device_for, pick_device, world
    from r1fit.rng import seed_everything
    from r1fit.rollout.generate import (
        SamplingSettings,
        TokenIds,
        generate_completions,
        generation_config,
        row_seeds,
    )
    from r1fit.rollout.prefill import prefill_check

    cfg = spec_config(spec)
    device = device_for(pick_device(cfg.train.device), world())
    seed_everything(cfg.train.seed)
    model, processor, _ = load_policy_on_ranks(cfg.model, device, activation_checkpointing=False)
    try:
        ids = TokenIds.of(model, processor)
        train_set, _ = build_datasets(cfg)
        samples = [train_set[i] for i in range(min(cfg.train.prompts_per_step, len(train_set)))]
        prompts = encode_prompts(processor, samples, cfg.data.system_prompt)
        rows = [p for p in prompts for _ in range(cfg.algo.num_generations)]
        settings = SamplingSettings(max_new_tokens=cfg.algo.max_new_tokens,
                                    temperature=cfg.algo.temperature, top_p=cfg.algo.top_p,
                                    min_new_tokens=cfg.rollout.min_new_tokens)
        completions = generate_completions(
            model, rows, seeds=row_seeds(cfg.train.seed, 0, 0, len(rows)),
            batch_size=len(rows), settings=settings, ids=ids, device=device)
        unique, groups = consecutive_groups(rows, completions)
        # the check memory.share_prefix=auto makes, its noise measured whatever the distance
        shared = check_packing(model, unique, groups, ids.pad, chunk_size=cfg.head_chunk(),
                               noise=True)
        prefill = prefill_check(model, rows, generation_config(settings, ids), ids.pad, device)
        _synchronize(device)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    where = f"{device.type}, {dtype}, attention {cfg.model.attn_implementation}"
    return [prefix_verdict(shared, where, {"groups": len(groups),
                                           "completions": len(completions)}),
            prefill_verdict(prefill, where)]


#: what a failed sharing check means for a run
FALLBACK = "; auto would run it per row here (slower, still correct)"


def prefix_verdict(check: PackingCheck, where: str,
                   numbers: dict[str, Any] | None = None) -> Verdict:
    """The shared-prompt verdict: the distance of :func:`r1fit.models.packing.check_packing`
    within its bound (the fixed tolerance, or ``NOISE_FACTOR`` times the per-row path's own
    rounding between batch shapes where that is larger: the rule ``memory.share_prefix=auto``
    follows); NaN fails. ``where``: device, dtype, attention, for the line."""
    return Verdict("shared prompt", check.exact,
                   f"completion log-probs packed after their prompt vs per row ({where}): "
                   f"{check.describe()}" + ("" if check.exact else FALLBACK),
                   {"distance": check.distance, "bound": check.bound,
                    "tolerance": check.tolerance, "per_row_noise": check.noise,
                    **(numbers or {})})


def prefill_verdict(check: PrefillCheck, where: str) -> Verdict:
    """The shared-prefill verdict of a :func:`r1fit.rollout.prefill.prefill_check`."""
    keys = "unreadable" if check.keys is None else f"{check.keys:.3g}"
    line = (f"logits from a shared prefill vs per row differ by {check.logits:.3g} "
            f"(bound {check.logits_tolerance:g}), cached keys by {keys} of their size "
            f"(bound {check.keys_tolerance:g}; {where})")
    if not check.exact:
        line += f": {check.reason()}{FALLBACK}"
    return Verdict("shared prefill", check.exact, line, {
        "logits_distance": check.logits, "logits_bound": check.logits_tolerance,
        "keys_distance": check.keys, "keys_bound": check.keys_tolerance, "error": check.error})


def final_weights(run_dir: Path) -> Path:
    """The file of a finished run's final weights (a LoRA adapter's, or the whole model's)."""
    final = run_dir / "final"
    adapter = (final / "adapter_config.json").is_file()
    return final / ("adapter_model.safetensors" if adapter else "model.safetensors")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def stable_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without the values that differ between identical runs (``VOLATILE``)."""
    return [{k: v for k, v in r.items() if not any(w in k for w in VOLATILE)} for r in rows]


def compare_runs(straight: Path, resumed: Path, *, limit: int = 5) -> list[str]:
    """How two finished runs differ: every metrics row (``VOLATILE`` values aside) and the final
    weights, bit for bit. Returns up to ``limit`` differences, described; empty when the two
    are the same run."""
    from safetensors.torch import load_file

    found: list[str] = []
    a = stable_metrics(read_metrics(straight / "metrics.jsonl"))
    b = stable_metrics(read_metrics(resumed / "metrics.jsonl"))
    if len(a) != len(b):
        found.append(f"metrics: {len(a)} rows against {len(b)}")
    for index, (x, y) in enumerate(zip(a, b)):
        for key in sorted(x.keys() | y.keys()):
            if x.get(key, "(absent)") != y.get(key, "(absent)"):
                found.append(f"metrics row {index + 1} (step {x.get('step')}): {key} "
                             f"{x.get(key, '(absent)')!r} against {y.get(key, '(absent)')!r}")
    files = final_weights(straight), final_weights(resumed)
    if not all(f.is_file() for f in files):
        return [*found, f"final weights missing: {', '.join(str(f) for f in files if not f.is_file())}"
                ][:limit]
    wa, wb = load_file(files[0]), load_file(files[1])
    if wa.keys() != wb.keys():
        found.append(f"final weights: tensors {sorted(wa.keys() ^ wb.keys())[:3]} in one only")
    differ = [k for k in sorted(wa.keys() & wb.keys()) if not _same_bits(wa[k], wb[k])]
    if differ:
        worst = max(float((wa[k].double() - wb[k].double()).abs().max())
                    if wa[k].shape == wb[k].shape else float("inf") for k in differ)
        found.append(f"final weights: {len(differ)} of {len(wa)} tensors differ (first "
                     f"{differ[0]}; largest difference {worst:.3g})")
    return found[:limit]


def weights_moved(cfg: Config, run_dir: Path) -> bool | None:
    """Whether a full fine-tuning run's final weights differ from the model it started from
    (None when that cannot be told: a LoRA adapter, no common tensor)."""
    from safetensors.torch import load_file

    from r1fit.models.load import resolve_model_path

    if cfg.model.lora.r:
        return None
    start = Path(resolve_model_path(cfg.model.path)) / "model.safetensors"
    if not start.is_file():
        return None
    before, after = load_file(start), load_file(final_weights(run_dir))
    common = before.keys() & after.keys()
    if not common:
        return None
    return any(not torch.equal(before[k].to(after[k].dtype), after[k]) for k in common)


def kill_and_resume(spec: RunSpec, out: Path, *, straight: Path | None = None,
                    kill_after: int = 1, timeout: float = RUN_TIMEOUT) -> Verdict:
    """Whether a run killed and resumed is the uninterrupted run, bit for bit. ``straight``: a
    finished run of ``spec`` (else run now into ``out/straight``). A second run of ``spec`` into
    ``out/killed`` gets SIGKILL as soon as ``checkpoint-<kill_after>`` is saved; the same
    command is run again (``checkpoint.resume=auto`` must resume it; ``checkpoint.every`` must
    save that checkpoint); then :func:`compare_runs`. Fails too when the run finished before
    it could be killed, did not say it resumed, or trained nothing (no gradient, weights that
    did not move: a comparison of untouched weights proves nothing)."""
    cfg = spec_config(spec)
    straight = straight or run_train(spec, out / "straight", timeout=timeout)
    killed = out / "killed"
    if killed.exists():
        raise SelfCheckError(f"{killed} exists: the check needs a new folder")
    name = "kill and resume"
    proc = start_train(spec, killed)
    deadline = time.monotonic() + timeout
    checkpoint = killed / f"checkpoint-{kill_after}"
    while proc.poll() is None and not checkpoint.is_dir():
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SelfCheckError(f"no {checkpoint.name} in {timeout:.0f} s:\n{_tail(killed)}")
        time.sleep(0.005)
    if proc.poll() is not None:
        return Verdict(name, False, f"the run ended (exit {proc.returncode}) before "
                       f"{checkpoint.name} was saved, so it could not be killed:\n"
                       f"{_tail(killed)}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_train(spec, killed, timeout=timeout)
    resumed = re.search(r"resumed grpo at step (\d+)", (killed / "log.txt").read_text())
    numbers: dict[str, Any] = {"killed_after_checkpoint": kill_after,
                               "resumed_at": int(resumed.group(1)) if resumed else None}
    if resumed is None:
        return Verdict(name, False, "the rerun of the killed run did not resume from a "
                       "checkpoint (its log.txt says no 'resumed grpo at step')", numbers)
    rows = grpo_step_rows(straight / "metrics.jsonl")
    moved = weights_moved(cfg, straight)
    numbers.update(steps=len(rows), grad_norms=[r.get("grad_norm") for r in rows],
                   weights_moved=moved)
    if not any((r.get("grad_norm") or 0) > 0 for r in rows) or moved is False:
        return Verdict(name, False, "the uninterrupted run trained nothing (no gradient, or "
                       "final weights equal to the initial ones): the comparison would prove "
                       "nothing", numbers)
    differences = compare_runs(straight, killed)
    numbers["differences"] = differences
    if differences:
        return Verdict(name, False, f"killed (SIGKILL) after {checkpoint.name}, resumed at step "
                       f"{resumed.group(1)}, differs from the uninterrupted run: "
                       + "; ".join(differences), numbers)
    return Verdict(name, True, f"killed (SIGKILL) after {checkpoint.name}, resumed at step "
                   f"{resumed.group(1)}: {len(rows)} steps' metrics and the final weights equal "
                   "the uninterrupted run's bit for bit", numbers)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_selfcheck(out: Path, *, device: torch.device | None = None,
                  progress: Callable[[str], None] = _stderr) -> list[Verdict]:
    """The whole self-check on ``device`` (default: the first GPU, else the CPU) in its 16-bit
    dtype, its runs written under ``out`` (a new or empty folder); one ``progress`` line per
    stage. A stage that raises is a failed verdict, not an exception."""
    device = device or first_device()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in its place, or above it; no permission
        raise SelfCheckError(f"--out {out}: cannot create the folder: {one_line(exc)}") from exc
    if any(out.iterdir()):
        raise SelfCheckError(f"{out} is not empty: the self-check needs a new or empty folder")
    dtype = half_dtype(device)
    spec = selfcheck_overrides(device, dtype)
    what = f"builtin:tiny, {str(dtype).removeprefix('torch.')} on {device}"
    verdicts: list[Verdict] = []
    straight: list[Path] = []

    def stage(index: int, title: str, names: Sequence[str],
              body: Callable[[], list[Verdict]]) -> None:
        progress(f"[{index}/4] {title}")
        _synchronize(device)
        began = time.perf_counter()
        try:
            found = body()
        except Exception as exc:  # a crashed stage is a failed check, with its message
            found = [Verdict(n, False, f"{type(exc).__name__}: {exc}") for n in names]
        _synchronize(device)
        seconds = time.perf_counter() - began
        for verdict in found:
            verdict.numbers["seconds"] = round(seconds, 2)
            verdicts.append(verdict)
            progress(f"      {verdict.line()}")
        progress(f"      ({seconds:.1f} s)")

    def uninterrupted() -> list[Verdict]:
        straight.append(run_train(spec, out / "straight"))
        return []

    def need_straight() -> Path:
        if not straight:
            raise SelfCheckError("the uninterrupted run failed (see above)")
        return straight[0]

    stage(1, f"shared prompt and shared prefill on this device's kernels ({what})",
          ["shared prompt", "shared prefill"], lambda: numerics_check(spec))
    stage(2, f"3 GRPO steps, uninterrupted ({what}) -> {out / 'straight'}",
          ["uninterrupted run"], uninterrupted)
    stage(3, "memory: the planner's peak against the measured one",
          ["memory plan"], lambda: [plan_vs_measured(spec, need_straight())])
    stage(4, f"kill and resume: the same run SIGKILLed after step 1, resumed -> "
             f"{out / 'killed'}", ["kill and resume"],
          lambda: [kill_and_resume(spec, out, straight=need_straight())])
    return verdicts
