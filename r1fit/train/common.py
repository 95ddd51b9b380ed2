"""What the GRPO and SFT loops share: run set-up, model/data building, evaluation, saving."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     set_model_state_dict)

from r1fit.checkpoint.manager import CheckpointManager, run_config
from r1fit.checkpoint.sharded import model_tensors
from r1fit.checkpoint.resume import open_output_dir
from r1fit.checkpoint.state import seed_everything
from r1fit.config import Config
from r1fit.data.build import BadRowCounter, build_datasets
from r1fit.data.dataset import PromptDataset
from r1fit.memory.autofit import resolve_auto_sizes
from r1fit.memory.telemetry import (current_rss_bytes, reset_peak, step_memory,
                                    use_tensor_probe)
from r1fit.distributed.context import (World, all_max, all_sum, barrier, broadcast_object, pick_device,
                                       check_split, device_for,
                                       init_distributed, world)
from r1fit.distributed.parallelize import gathered, materialize, parallelize
from r1fit.models.load import load_frozen, load_policy, special_token_ids
from r1fit.report.metrics import MetricsWriter, read_metrics
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.format import format_reward
from r1fit.data.batch import encode_prompts
from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions
from r1fit.train.forward import CompletionLogProbs

log = logging.getLogger("r1fit")


def write_run_config(out: Path, cfg: Config, kind: str) -> None:
    (out / "config.json").write_text(json.dumps(run_config(cfg, kind), indent=2))


def setup_logging(out: Path | None) -> None:
    """Log to the terminal (rich when it is one) and to ``<output_dir>/log.txt``. Ranks other
    than 0 say only warnings and errors, prefixed with their rank."""
    root = logging.getLogger("r1fit")
    w = world()
    root.setLevel(logging.INFO if w.main else logging.WARNING)
    for handler in list(root.handlers):
        if getattr(handler, "_r1fit", False):
            root.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = []
    if out is not None:
        handlers.append(logging.FileHandler(out / "log.txt"))
        handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s"))
    if sys.stderr.isatty() and w.main:
        from rich.logging import RichHandler

        term: logging.Handler = RichHandler(show_path=False)
    else:
        term = logging.StreamHandler()
        rank = f"[rank {w.rank}] " if w.distributed else ""
        term.setFormatter(logging.Formatter(f"{rank}%(levelname)s %(name)s: %(message)s"))
    for handler in (*handlers, term):
        handler._r1fit = True  # type: ignore[attr-defined]
        root.addHandler(handler)


@dataclass
class Run:
    """The pieces every loop starts with."""

    cfg: Config
    out: Path
    device: torch.device
    model: Any
    processor: Any
    ids: TokenIds
    metrics: MetricsWriter
    train_set: PromptDataset
    eval_set: PromptDataset | None
    rss_after_load_bytes: int
    started: float  # perf_counter() when the run started
    checkpoints: CheckpointManager
    rss_before_load_bytes: int  # what memory.budget is measured from on CPU
    policy: Any  # the module to call for log-probs: CompletionLogProbs(model), the FSDP root
    world: World


def start_run(cfg: Config, kind: str) -> Run:
    """Processes, output folder and logging, then the data (cheap to check, so bad data fails
    before a big model loads), then the model. Over several processes rank 0 alone chooses the
    resume point and touches the output folder; the others follow its decision."""
    started = time.perf_counter()
    device_type = pick_device(cfg.train.device).type
    w = init_distributed(device_type)
    check_split(cfg, kind, w)
    device = device_for(device_type, w)
    setup_logging(None)  # the terminal first: choosing the resume point may warn
    decision: tuple[Any, ...] = (None, None, None)
    early = logging.handlers.BufferingHandler(capacity=10_000)
    if w.main:
        logging.getLogger("r1fit").addHandler(early)
        try:
            decision = (*open_output_dir(cfg, kind), None)
            write_run_config(decision[0], cfg, kind)
        except Exception as exc:  # every rank raises rank 0's error, none waits forever
            decision = (None, None, exc)
        finally:
            logging.getLogger("r1fit").removeHandler(early)
    out, resume, error = broadcast_object(decision)
    if error is not None:
        raise error
    setup_logging(out if w.main else None)
    for record in early.buffer:  # what was said before log.txt existed goes into it too
        for handler in logging.getLogger("r1fit").handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
    if w.distributed:
        log.info("%d processes (this is rank %d), %s backend", w.size, w.rank,
                 torch.distributed.get_backend())
    seed_everything(cfg.train.seed)
    use_tensor_probe(cfg.memory.cpu_peak == "tensors" and device.type == "cpu")
    train_set, eval_set = build_datasets(cfg)
    resolve_auto_sizes(cfg, device)  # memory.*_batch=auto: the planner's answer for this device
    if w.distributed:  # every rank must run as many micro-batches: the smallest answer wins
        smallest = all_max([-cfg.memory.micro_batch, -cfg.memory.generation_batch])
        cfg.memory.micro_batch, cfg.memory.generation_batch = (int(-v) for v in smallest)
    rss_before_load = current_rss_bytes()
    checkpoints = CheckpointManager(out, cfg, kind, resume)
    model, processor, policy = load_run_model(cfg, device, checkpoints)
    special = special_token_ids(model, processor)
    # a completion ends at <|im_end|> or, if the model emits it, at <|endoftext|> (Qwen's
    # generation_config stops at both)
    eos = [special["eos"]]
    end_of_text = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(end_of_text, int) and end_of_text != processor.tokenizer.unk_token_id \
            and end_of_text not in eos:
        eos.append(end_of_text)
    ids = TokenIds(pad=special["pad"], eos=eos,
                   blocked=[special["image_pad"], special["video_pad"]])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("%s run: model %s (%.2fM params, %.2fM trainable) on %s -> %s", kind,
             cfg.model.path + (f" resumed from {resume.path}" if resume else ""), total / 1e6, trainable / 1e6, device, out)
    metrics = MetricsWriter(out / "metrics.jsonl", active=w.main)
    checkpoints.models["model"] = (model, processor)
    checkpoints.metrics_lines = lambda: metrics.lines
    return Run(cfg, out, device, model, processor, ids, metrics, train_set, eval_set,
               current_rss_bytes(), started, checkpoints, rss_before_load, policy, w)


def load_run_model(cfg: Config, device: torch.device,
                   checkpoints: CheckpointManager | None = None) -> tuple[Any, Any, Any]:
    """The policy, its processor and the module the loops call for log-probs (the FSDP root over
    several processes), with the resume point's weights when there is one (adapter only, for
    LoRA, over the base from ``model.path``)."""
    m = cfg.model
    kwargs = dict(lora_r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                  lora_target=m.lora.target, freeze_vision=m.freeze_vision, dtype=m.dtype,
                  gradient_checkpointing=False, attn_implementation=m.attn_implementation)
    model, processor, policy = load_on_ranks(
        lambda where: load_policy(m.path, device=where, **kwargs), device,
        activation_checkpointing=cfg.memory.gradient_checkpointing)
    if checkpoints is not None and checkpoints.has_model("model"):
        checkpoints.load_model("model", model)
    return model, processor, policy


def load_frozen_copy(cfg: Config, device: torch.device,
                     policy_model: Any | None) -> tuple[Any, Any]:
    """A frozen model from ``model.path``, holding a copy of ``policy_model``'s current weights when
    given (the KL reference after the warm-up), sharded like the policy: (model, module to call
    for log-probs)."""
    m = cfg.model
    frozen, _, root = load_on_ranks(
        lambda where: (load_frozen(m.path, dtype=m.dtype, device=where,
                                   attn_implementation=m.attn_implementation), None),
        device, activation_checkpointing=False)
    if policy_model is not None:
        # the same names and shards as the policy's: a local copy, no communication
        set_model_state_dict(frozen, get_model_state_dict(policy_model))
    return frozen, root


def load_on_ranks(build: Callable[[Any], tuple[Any, Any]], device: torch.device, *,
                  activation_checkpointing: bool) -> tuple[Any, Any, Any]:
    """``build(device) -> (model, processor or None)`` on every process, then
    :func:`parallelize`; returns (model, processor, root to call for log-probs).

    One process: ``build`` onto the device. Several: rank 0 alone reads the weights (to host
    memory), every rank builds the model on the meta device, shards it, and receives its shards
    from rank 0 (:func:`materialize`)."""
    w = world()
    source = build("cpu")[0] if w.distributed and w.main else None
    model, processor = build("meta" if w.distributed else device)
    root = parallelize(CompletionLogProbs(model), activation_checkpointing=activation_checkpointing,
                       world=w, device_type=device.type)
    if w.distributed:
        materialize(root, model, source, device)
    return model, processor, root


def decode(processor: Any, completions: Sequence[torch.Tensor]) -> list[str]:
    return processor.tokenizer.batch_decode([c.tolist() for c in completions],
                                            skip_special_tokens=True)


@torch.no_grad()
def evaluate(model: Any, processor: Any, dataset: PromptDataset, cfg: Config, ids: TokenIds,
             device: torch.device, policy: Any = None) -> dict[str, float]:
    """Greedy decoding on the held-out set: accuracy and format rate (under inference mode).

    Rows whose image fails to decode are skipped with a warning, counted in ``eval/bad_rows`` and
    left out of the averages (``eval/size`` is the number actually scored). Over several processes
    each rank decodes its share of the batches with whole parameters (``policy``, the FSDP root,
    is gathered once) and the counts are summed."""
    reset_peak(device)  # eval/peak_memory_bytes is the evaluation's own peak
    settings = SamplingSettings(max_new_tokens=cfg.algo.max_new_tokens, greedy=True)
    correct = formatted = 0.0
    scored = bad = 0
    w = world()
    starts = list(range(0, len(dataset), cfg.eval.batch))[w.rank::w.size]
    with gathered(policy if policy is not None else model):
        for start in starts:
            samples, errors = dataset.fetch(list(range(start, min(start + cfg.eval.batch,
                                                                   len(dataset)))))
            for message in errors:
                log.warning("eval: skipping %s", message)
            bad += len(errors)
            if not samples:
                continue
            prompts = encode_prompts(processor, samples, cfg.data.system_prompt)
            with torch.inference_mode():
                completions = generate_completions(policy if policy is not None else model,
                                                   prompts, seeds=None,
                                                   batch_size=cfg.eval.batch, settings=settings,
                                                   ids=ids, device=device)
            for sample, text in zip(samples, decode(processor, completions)):
                correct += accuracy(text, sample.solution, problem=sample.problem)
                formatted += format_reward(text, sample.solution, problem=sample.problem)
            scored += len(samples)
    correct, formatted, scored, bad = all_sum([correct, formatted, scored, bad])
    n = max(1, scored)
    memory = step_memory(device, "eval/")
    return {"eval/accuracy": correct / n, "eval/format": formatted / n, "eval/size": int(scored),
            "eval/bad_rows": int(bad), **reduce_memory(memory)}


def reduce_memory(memory: dict[str, Any]) -> dict[str, Any]:
    """Peak memory figures of the busiest rank."""
    keys = [k for k, v in memory.items() if v is not None]
    peaks = all_max([memory[k] for k in keys])
    return {**memory, **{k: int(v) for k, v in zip(keys, peaks)}}


def save_model(model: Any, processor: Any, folder: Path) -> None:
    """A plain Hugging Face folder (the adapter only, for LoRA) that from_pretrained loads.
    Sharded weights are gathered to rank 0 (to host memory) and written there."""
    w = world()
    state = None
    if w.distributed:
        state = model_tensors(model, full_state_dict=True, cpu_offload=True)
    if w.main:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, state_dict=state)
        processor.save_pretrained(folder)
    barrier()


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into[key] = into.get(key, 0.0) + time.perf_counter() - start


def eval_history(run: Run) -> list[dict[str, Any]]:
    """The evaluations of this run so far (from metrics.jsonl, so a resumed run has them all)."""
    run.metrics.flush()
    return [{"step": row.get("step"), **{k: v for k, v in row.items() if k.startswith("eval/")}}
            for row in read_metrics(run.metrics.path) if "eval/accuracy" in row]


def finish_summary(run: Run, *, steps: int) -> dict[str, Any]:
    """Write ``summary.json`` (first/last evaluation, steps) and print it."""
    summary: dict[str, Any] = {"output_dir": str(run.out), "steps": steps,
                               "rss_after_load_bytes": run.rss_after_load_bytes}
    evals = eval_history(run)
    if evals:
        summary["eval_accuracy_start"] = evals[0]["eval/accuracy"]
        summary["eval_accuracy_end"] = evals[-1]["eval/accuracy"]
        summary["eval_format_end"] = evals[-1]["eval/format"]
        summary["eval_accuracy_gain"] = evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]
    summary["seconds"] = round(time.perf_counter() - run.started, 1)
    run.metrics.close()
    if not run.world.main:
        return summary
    (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("summary: %s", json.dumps(summary))
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"r1fit: {steps} steps in {summary['seconds']:.0f} s -> {run.out}")
        table.add_column("evaluation")
        table.add_column("step", justify="right")
        table.add_column("accuracy", justify="right")
        table.add_column("format", justify="right")
        for i, row in enumerate(evals):
            name = "start" if i == 0 else "end" if i == len(evals) - 1 else ""
            table.add_row(name, str(row.get("step", "")), f"{row['eval/accuracy']:.3f}",
                          f"{row['eval/format']:.3f}")
        Console(stderr=True).print(table)
    return summary
