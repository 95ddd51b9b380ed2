"""The run object and its start-up: processes, output folder, logging, data, chunk sizes, model.

Every loop (GRPO, SFT, the warm-up) starts from one :class:`Run` and reads its pieces; what changes
while it runs lives in the objects that change it (the chunk sizes in :class:`ChunkSizes`, owned
by auto-fit and the OOM guard), never in the config, which is read-only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from r1fit.checkpoint.export import save_hf_folder
from r1fit.checkpoint.lock import release_output_dir
from r1fit.checkpoint.manager import CheckpointManager, ResumePoint
from r1fit.checkpoint.resume import open_output_dir
from r1fit.config import Config
from r1fit.data.batch import Prompt, encode_prompts, split_too_long
from r1fit.data.build import BadRowCounter, build_datasets
from r1fit.data.dataset import PromptDataset, PromptSampler
from r1fit.data.sample import Sample
from r1fit.data.specials import row_special_token, special_tokens
from r1fit.distributed.loading import load_policy_on_ranks
from r1fit.memory.autofit import (
    AutoFitError,
    device_budget,
    resolve_checkpointing,
    resolve_sizes,
)
from r1fit.memory.flops import MfuMeter
from r1fit.memory.guard import OOMGuard
from r1fit.memory.prediction import StepPrediction, predict_steps
from r1fit.memory.sizes import ChunkSizes
from r1fit.memory.telemetry import configure_host_allocator, current_rss_bytes, use_tensor_probe
from r1fit.models.load import context_length
from r1fit.processes import (
    World,
    broadcast_object,
    check_same_config,
    check_split,
    device_for,
    init_distributed,
    pick_device,
    world,
)
from r1fit.report.logs import EarlyLog, setup_logging
from r1fit.report.metrics import MetricsWriter
from r1fit.report.sinks import Trackers, TrackerStartError, open_trackers, require_trackers
from r1fit.report.summary import write_summary
from r1fit.rng import seed_everything, use_deterministic_kernels
from r1fit.rollout.generate import TokenIds
from r1fit.train.forward import BatchLayout

log = logging.getLogger("r1fit")


@dataclass
class Session:
    """What generation and evaluation read: the model, its processor, the held-out data and the
    sizes to generate with. ``r1fit eval`` starts one alone (:mod:`r1fit.train.eval_command`);
    a training :class:`Run` is one with its loop's pieces added."""

    cfg: Config
    world: World
    device: torch.device
    model: Any      # the transformers (or peft) model
    processor: Any
    policy: Any     # the module to call for log-probs and generation: the FSDP root when sharded
    ids: TokenIds
    eval_set: PromptDataset | None
    sizes: ChunkSizes  # memory.micro_batch / micro_batch_tokens / generation_batch in use
    max_prompt_tokens: int | None

    @cached_property
    def specials(self) -> tuple[str, ...]:
        """The texts the tokenizer reads as special tokens (r1fit/data/specials.py)."""
        return special_tokens(self.processor.tokenizer)

    def encode(self, samples: list[Sample]) -> tuple[list[Prompt], list[str]]:
        """Prompts of ``samples`` and one message per sample refused: its text holds a special
        token of the model, or its prompt is too long."""
        refused, clean = [], []
        for sample in samples:
            why = row_special_token(sample, self.specials)
            if why is None:
                clean.append(sample)
            else:
                refused.append(why)
        prompts, too_long = split_too_long(
            encode_prompts(self.processor, clean, self.cfg.data.system_prompt),
            self.max_prompt_tokens)
        return prompts, refused + too_long


@dataclass
class Run(Session):
    """The pieces every loop starts with."""

    kind: str  # "grpo" (r1fit train) or "sft"
    out: Path
    train_set: PromptDataset
    metrics: MetricsWriter
    trackers: Trackers  # report.to (also fed by metrics); empty on ranks other than 0
    checkpoints: CheckpointManager
    rss_before_load_bytes: int  # what memory.budget is measured from on CPU
    rss_after_load_bytes: int
    layout: BatchLayout  # memory.share_prefix, packing: how micro-batches reach the model
    #: the time model's seconds per step, logged in each step's row (None: not predicted)
    predicted: StepPrediction | None
    #: the config the time model read (chunk sizes aside): ``cfg`` with the checkpointing resolved
    planned: Config

    @cached_property
    def meter(self) -> MfuMeter:
        """The ``flops`` and ``mfu`` meter of the run's steps (the device's peak read or measured
        once, on first use)."""
        return MfuMeter(self.model, self.device, next(self.model.parameters()).dtype)

    def settle_prediction(self) -> None:
        """``memory.share_prefix=auto``: the prediction made at start planned the path of the
        larger memory peak (the planner cannot know which the run takes); once the run's first
        micro-batch has chosen, predict again, once, for the path it runs."""
        if self.predicted is None or self.planned.memory.share_prefix != "auto" \
                or not self.layout.decided or self.layout.on is None:
            return
        log.info("time model: memory.share_prefix=auto chose %s; predicted again for that path",
                 "on" if self.layout.on else "off")
        self.planned = self.planned.with_values({"memory.share_prefix": self.layout.on})
        self.predicted = predict_steps(self.planned, self.device.type, self.world.size,
                                       self.kind, self.sizes,
                                       done=steps_done(self.checkpoints.resume, self.kind))

    def fetch(self, sampler: PromptSampler, bad_rows: BadRowCounter, k: int) -> list[Prompt]:
        """The next ``k`` good training prompts; bad rows are skipped and counted."""
        return bad_rows.fetch(self.train_set, sampler, k, self.encode)

    def guard(self, optimizer: torch.optim.Optimizer) -> OOMGuard:
        """The OOM guard of a loop that steps ``optimizer``, lowering the run's chunk sizes."""
        return OOMGuard(self.sizes, self.cfg.memory.budget, self.device, optimizer,
                        baseline_rss_bytes=self.rss_before_load_bytes)

    def save(self, phase: str, step: int, state: dict[str, Any], row: dict[str, Any], *,
             last: bool) -> None:
        """Checkpoint ``state`` (and the models) after ``step`` when due (always after the
        ``last``); stop there when a signal asked to."""
        if self.checkpoints.due(step, last=last):
            self.checkpoints.save(phase, step, state, metrics=row,
                                  metrics_lines=self.metrics.lines)
            self.checkpoints.stop_if_requested(step)

    def note_past_the_end(self, start: int, steps: int, key: str) -> None:
        """Say so when the resume point is past the run's last step (``key``, e.g.
        ``train.max_steps``, lowered since, which the config check accepts): no step is left to
        train, and ``final/`` and the summary come from the resume point."""
        point = self.checkpoints.resume
        if point is not None and start > steps:
            log.warning("%s is at step %d, past %s=%d: no step left to train; final/ and the "
                        "summary are written from it", point.path.name, start, key, steps)

    def finish(self, steps: int) -> dict[str, Any]:
        """Write the final model (``final/``) and the summary; returns the summary."""
        save_hf_folder(self.model, self.processor, self.out / "final")
        extra = {"rss_before_load_bytes": self.rss_before_load_bytes,
                 "rss_after_load_bytes": self.rss_after_load_bytes}
        if self.checkpoints.resume is not None:
            extra["seconds_since_resume"] = round(time.perf_counter()
                                                  - self.checkpoints.started, 1)
        summary = write_summary(self.out, self.metrics, steps=steps,
                                seconds=self.checkpoints.run_seconds(), extra=extra,
                                main=self.world.main)
        release_output_dir(self.out)  # the folder is another run's to take now
        return summary


def start_trackers(cfg: Config, out: Path) -> Trackers:
    """``report.to``'s trackers, opened on rank 0 (none elsewhere); one that cannot start stops
    every process with rank 0's error."""
    trackers, error = Trackers([]), None
    if world().main:
        try:
            trackers = open_trackers(cfg, out)
        except TrackerStartError as exc:
            error = exc
    error = broadcast_object(error)
    if error is not None:
        raise error
    return trackers


def start_run(cfg: Config, kind: str) -> Run:
    """Processes, output folder and logging, then the data (cheap to check, so bad data fails
    before a big model loads), then the model. Over several processes rank 0 alone chooses the
    resume point and touches the output folder; the others follow its decision."""
    started = time.perf_counter()
    require_trackers(cfg.report.to)  # every process: a missing package stops all before starting
    requested = pick_device(cfg.train.device)
    w = init_distributed(requested.type)
    check_same_config(cfg.to_dict())
    check_split(cfg, kind, w)
    device = device_for(requested, w)
    setup_logging(None)  # the terminal first: choosing the resume point may warn
    decision: tuple[Any, ...] = (None, None, None)
    with EarlyLog() as early:
        if w.main:
            try:
                decision = (*open_output_dir(cfg, kind), None)
            except Exception as exc:  # every rank raises rank 0's error, none waits forever
                decision = (None, None, exc)
    out, resume, error = broadcast_object(decision)
    if error is not None:
        raise error
    setup_logging(out if w.main else None)
    early.replay_to_file()  # what was said before log.txt existed goes into it too
    if w.distributed:
        log.info("%d processes (this is rank %d), %s backend", w.size, w.rank,
                 torch.distributed.get_backend())
    seed_everything(cfg.train.seed)
    use_deterministic_kernels(cfg.train.deterministic)
    use_tensor_probe(cfg.memory.cpu_peak == "tensors" and device.type == "cpu")
    configure_host_allocator(cfg.memory.release_freed, cfg.memory.budget, device)
    train_set, eval_set = build_datasets(cfg)
    if kind == "grpo" and cfg.train.early_stop_patience and (eval_set is None
                                                             or not cfg.eval.every):
        log.warning("train.early_stop_patience=%d has no effect: it counts evaluations during "
                    "training, and %s", cfg.train.early_stop_patience,
                    "there is no eval set (data.eval)" if eval_set is None else
                    "eval.every=0 evaluates only before and after")
    # the trackers before the model: one that cannot start (no login, no server) stops the run
    # in seconds, not after a model load; they are closed if the start fails later
    trackers = start_trackers(cfg, out)
    try:
        # memory.gradient_checkpointing=auto: the planner's choice for the run's steps (r1fit
        # train's warm-up SFT runs at the sizes of its GRPO steps)
        checkpointing = resolve_checkpointing(cfg, device, kind)
        # memory.*_batch=auto: the planner's answer, for the checkpointing the run will use
        sizes = resolve_sizes(cfg.with_values(checkpointing), device, kind)
        budget = known_budget(cfg, device)  # before the model takes its share of the device
        rss_before_load = current_rss_bytes()
        checkpoints = CheckpointManager(out, cfg, kind, resume, started)
        model, processor, policy = load_policy_on_ranks(
            cfg.model, device,
            activation_checkpointing=checkpointing["memory.gradient_checkpointing"],
            checkpoint_every=checkpointing["memory.checkpoint_every"])
        if checkpoints.has_model("model"):
            checkpoints.load_model("model", model)
        checkpoints.add_model("model", model, processor)
        max_prompt_tokens = prompt_limit(cfg, model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info("%s run: model %s (%.2fM params, %.2fM trainable) on %s -> %s", kind,
                 cfg.model.path + (f" resumed from {resume.path}" if resume else ""), total / 1e6,
                 trainable / 1e6, device, out)
        if cfg.model.lora.r and cfg.model.lora.compute_dtype == "model":
            log.info("model.lora.compute_dtype=model: %s", f"the adapters' products in "
                     f"{str(policy.adapter_dtype).removeprefix('torch.')} under torch.autocast "
                     f"(float32 weights, gradients and AdamW states)" if policy.adapter_dtype else
                     "changes nothing on a float32 model (the adapters compute in float32)")
        if preset := cfg.applied_preset():
            log.info("preset %s (config key preset=%s): its values (r1fit/presets/%s.yaml) stand "
                     "under the config file and overrides; `r1fit config` shows each key's "
                     "source", preset, cfg.preset, preset)
        planned = cfg.with_values(checkpointing)
        predicted = predict_steps(planned, device.type, w.size, kind, sizes, budget,
                                  done=steps_done(resume, kind))
        return Run(cfg=cfg, world=w, device=device, model=model, processor=processor,
                   policy=policy, ids=TokenIds.of(model, processor), eval_set=eval_set,
                   sizes=sizes, max_prompt_tokens=max_prompt_tokens, kind=kind, out=out,
                   train_set=train_set,
                   metrics=MetricsWriter(out / "metrics.jsonl", active=w.main, trackers=trackers),
                   trackers=trackers, checkpoints=checkpoints,
                   rss_before_load_bytes=rss_before_load,
                   rss_after_load_bytes=current_rss_bytes(),
                   layout=BatchLayout(cfg.memory.share_prefix), predicted=predicted,
                   planned=planned)
    except BaseException:
        trackers.close()
        raise


def steps_done(resume: ResumePoint | None, kind: str) -> int:
    """The steps of a run of ``kind`` that its resume point has done (0 for a fresh run, and for
    a GRPO run resumed within its format warm-up)."""
    return resume.step if resume is not None and resume.phase == kind else 0


def known_budget(cfg: Config, device: torch.device) -> int | None:
    """The bytes the run may use on ``device`` (``memory.budget``, else CUDA's free memory);
    None on CPU without a budget."""
    try:
        return device_budget(cfg.memory, device)
    except AutoFitError:
        return None


def prompt_limit(cfg: Config, model: Any) -> int | None:
    """The longest prompt a row may have: ``data.max_prompt_tokens``, else the model's context
    less ``algo.max_new_tokens`` (None: the model states no context length)."""
    if cfg.data.max_prompt_tokens is None and (context := context_length(model)) is not None:
        return max(1, context - cfg.algo.max_new_tokens)
    return cfg.data.max_prompt_tokens
