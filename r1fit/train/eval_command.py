"""``r1fit eval [CONFIG.yaml] [key=value ...] [--model PATH] [--out DIR]``: a model scored on
``data.eval``.

The model is ``model.path`` (a folder, hub id or ``builtin:`` model), or ``--model PATH``:

- a Hugging Face model folder or hub id (a full fine-tuning run's ``final/``, ``r1fit export``'s
  output): it becomes ``model.path``;
- a LoRA adapter folder (``adapter_config.json``: a LoRA run's ``final/``, ``r1fit export``'s
  adapter), loaded onto ``model.path``, which must be the base it was trained on;
- a run's checkpoint (``checkpoint-N/`` or ``checkpoint-warmup-N/``, verified against its
  manifest): its weights (full, or the adapter) on the ``model.path``, dtype and LoRA settings its
  ``config.json`` recorded.

Each row gets ``eval.samples`` answers from the run's rollout engine (``rollout.engine``, with the
chunk sizes the run would use, ``memory.*_batch=auto`` planned as for a GRPO step) and, with
``tools``, the run's multi-turn loop: greedy when 1, the run's own evaluation; k > 1 answers
sampled as a GRPO step samples its rollouts (``algo.temperature``, ``algo.top_p``,
``rollout.min_new_tokens``), each with its own seed from ``train.seed`` and the row's index. Each
answer is scored by the ``accuracy`` and ``format`` rewards as the run's evaluations score it
(whatever ``rewards`` weighs) and by every reward of ``rewards``. ``pass_at_k`` is the mean over
rows of the best answer's accuracy (for 0/1 methods, the fraction of rows with a correct answer),
``mean_at_k`` the mean accuracy of every answer, and ``accuracy`` is ``mean_at_k``: with one
greedy answer the three are equal, the run's ``eval/accuracy``. A bad row (an image that fails to
decode, a special token of the model in its text, a prompt too long, a row the reader rejects) is
counted and listed, never fatal.

Into DIR (``--out``, a new or empty folder; default ``<train.output_dir>/eval/<model>-<time>``):
``summary.json``, ``eval.jsonl`` (one row per line), ``eval.html`` and its ``images/``
(:mod:`r1fit.report.eval_page`), ``config.json`` (the config as resolved, the model's keys
included) and ``log.txt``. One process: start it without torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from r1fit.checkpoint.files import read_json_object
from r1fit.checkpoint.manager import (
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    checkpoint_order,
    list_checkpoints,
    run_config,
    verify,
)
from r1fit.checkpoint.resume import EVAL_FOLDER, os_reason
from r1fit.checkpoint.sharded import load_model_weights
from r1fit.config import Config, ConfigError
from r1fit.config.values import flatten
from r1fit.data.build import build_eval_set
from r1fit.data.errors import DataError
from r1fit.distributed.loading import load_on_ranks
from r1fit.memory.autofit import resolve_checkpointing, resolve_sizes
from r1fit.memory.telemetry import reset_peak, step_memory
from r1fit.models.errors import ModelConfigError
from r1fit.models.load import ADAPTER_CONFIG, load_adapter, load_policy, resolve_model_path
from r1fit.processes import DistributedError, pick_device, world
from r1fit.progress import progress_bar
from r1fit.report.eval_page import (
    IMAGES,
    answer_record,
    save_row_images,
    write_page,
    write_rows,
)
from r1fit.report.logs import setup_logging
from r1fit.rewards.registry import RewardScorer
from r1fit.rng import seed_everything, use_deterministic_kernels
from r1fit.rollout.generate import SamplingSettings, TokenIds
from r1fit.rollout.vllm_engine import require_vllm
from r1fit.train.engines import RolloutEngine, rollout_engine
from r1fit.train.evaluate import EvalBatch, answer_scores, answered_batches, mean_at_k, pass_at_k
from r1fit.train.run import Session, prompt_limit
from r1fit.train.tool_rollouts import ToolTurns

log = logging.getLogger("r1fit")

#: what each kind of model source is, in messages and on the page
KINDS = {"model": "model.path", "folder": "a model folder", "adapter": "a LoRA adapter",
         "checkpoint": "a run's checkpoint"}
#: the keys of a checkpoint's recorded ``model`` section that rebuild its model
CHECKPOINT_MODEL_KEYS = ("path", "dtype", "attn_implementation", "lora.r", "lora.alpha",
                         "lora.dropout", "lora.target")


@dataclass(frozen=True)
class ModelSource:
    """The model ``r1fit eval`` scores: its ``kind`` (a key of :data:`KINDS`), the path given,
    and the config values that describe it (``model.path``, ``model.lora.r``...)."""

    kind: str
    path: str
    values: dict[str, Any]

    def describe(self) -> str:
        return f"{self.path} ({KINDS[self.kind]})"


def model_source(cfg: Config, path: str | None) -> ModelSource:
    """What ``--model PATH`` names (None: ``model.path``); see the module doc. A run's output
    folder, a checkpoint that fails its manifest and a folder that holds no model are one-line
    errors."""
    if path is None:
        return ModelSource("model", cfg.model.path, {"model.lora.r": 0})
    folder = Path(path).expanduser()
    if not folder.is_dir():
        # a hub id; a missing local folder, a file, fail here, before the data is read
        resolve_model_path(path)
        return ModelSource("folder", path, {"model.path": path, "model.lora.r": 0})
    if (folder / ADAPTER_CONFIG).is_file():
        rank = read_json_object(folder / ADAPTER_CONFIG).get("r")
        if not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"--model {path}: {ADAPTER_CONFIG} names no LoRA rank r (got "
                              f"{rank!r}); is it a LoRA adapter?")
        return ModelSource("adapter", path, {"model.lora.r": rank})
    if (checkpoint_order(folder) is not None or (folder / MANIFEST).is_file()
            or (folder / TRAINER_STATE).is_file()):
        problem = verify(folder)
        if problem is not None:
            raise CheckpointError(f"--model {path}: cannot read the checkpoint: {problem}")
        saved = flatten(read_json_object(folder / "config.json").get("model", {}))
        return ModelSource("checkpoint", path, {f"model.{key}": saved[key]
                                                for key in CHECKPOINT_MODEL_KEYS if key in saved})
    if inside := list_checkpoints(folder):
        raise CheckpointError(f"--model {path} is a run's output folder; pass its final/ or one of "
                              f"its checkpoints, e.g. {inside[0]}")
    if (folder / "config.json").is_file():
        return ModelSource("folder", path, {"model.path": str(folder), "model.lora.r": 0})
    raise ConfigError(f"--model {path}: not a model folder (config.json), a LoRA adapter folder "
                      f"({ADAPTER_CONFIG}) or an r1fit checkpoint (manifest.json)")


#: what an evaluation writes before its summary: an unfinished one's folder holds no more
UNFINISHED = frozenset({"config.json", "log.txt", IMAGES})


def output_folder(cfg: Config, source: ModelSource, out: Path | None) -> Path:
    """``out`` (it must be new, empty, or an unfinished evaluation's: what a failed or stopped
    ``r1fit eval --out`` left, its images cleared), else a new
    ``<train.output_dir>/eval/<model>-<time>``."""
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: not a new or empty folder")
        names = {p.name for p in out.iterdir()} if out.exists() else set()
        if not names <= UNFINISHED:
            raise ConfigError(f"--out {out}: not a new or empty folder (nor an unfinished "
                              "evaluation's)")
        if (out / IMAGES).is_dir():
            shutil.rmtree(out / IMAGES)
        return out
    given = Path(source.path).expanduser()
    name = given.name if given.is_dir() else source.path
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    base = Path(cfg.train.output_dir) / EVAL_FOLDER / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder, n = base, 1
    while folder.exists():  # two evaluations in the same second
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def other_base(adapter: str, path: str) -> str | None:
    """The base another than ``path`` (model.path) that the LoRA adapter folder ``adapter`` was
    trained on (its adapter_config.json's ``base_model_name_or_path``), logged as a warning: the
    adapter is scored on model.path's weights, which may be another model of the same shapes.
    None where they are one (the same string, or the same folder once resolved) or the adapter
    names none."""
    base = read_json_object(Path(adapter).expanduser() / ADAPTER_CONFIG).get(
        "base_model_name_or_path")
    if not isinstance(base, str) or not base or base == path:
        return None
    try:
        same = Path(resolve_model_path(path)).resolve() == Path(base).expanduser().resolve()
    except (ModelConfigError, OSError):
        same = False
    if same:
        return None
    log.warning("eval: --model %s is a LoRA adapter trained on %s, scored on model.path=%s: "
                "unless that is the same model, pass model.path=%s", adapter, base, path, base)
    return base


def start_session(cfg: Config, source: ModelSource) -> Session:
    """The data (checked before the model loads), the chunk sizes the run would use, the model."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DistributedError("r1fit eval runs in one process: start it without torchrun")
    device = pick_device(cfg.train.device)
    seed_everything(cfg.train.seed)
    use_deterministic_kernels(cfg.train.deterministic)
    eval_set = build_eval_set(cfg)
    checkpointing = resolve_checkpointing(cfg, device, "grpo")
    sizes = resolve_sizes(cfg.with_values(checkpointing), device, "grpo")
    m = cfg.model

    def build(where: Any) -> tuple[Any, Any]:
        # the model as training builds it (LoRA layers only for a LoRA checkpoint), then its
        # weights: the adapter's or the checkpoint's
        model, processor = load_policy(
            m.path, lora_r=m.lora.r if source.kind == "checkpoint" else 0,
            lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout, lora_target=m.lora.target,
            freeze_vision=False, dtype=m.dtype, device=where, gradient_checkpointing=False,
            attn_implementation=m.attn_implementation)
        if source.kind == "adapter":
            model = load_adapter(model, source.path)
        elif source.kind == "checkpoint":
            try:
                load_model_weights(Path(source.path), "model", model)
            except (ValueError, KeyError, RuntimeError, OSError) as exc:
                raise CheckpointError(f"--model {source.path}: cannot load its weights: "
                                      f"{exc}") from exc
        return model.eval().requires_grad_(False), processor

    if source.kind == "adapter":  # once, not per build of the model
        other_base(source.path, m.path)
    model, processor, policy = load_on_ranks(build, device, activation_checkpointing=False)
    log.info("eval: %s on %s, model.path=%s", source.describe(), device, m.path)
    return Session(cfg, world(), device, model, processor, policy, TokenIds.of(model, processor),
                   eval_set, sizes, prompt_limit(cfg, model))


def evaluate_model(cfg: Config, model: str | None = None, out: Path | None = None
                   ) -> tuple[dict[str, Any], Path]:
    """Score the model ``model`` names (see :func:`model_source`) on ``data.eval``; write the
    outputs into ``out`` (see :func:`output_folder`). Returns the summary and the folder."""
    started = time.perf_counter()
    source = model_source(cfg, model)
    cfg = cfg.with_values(source.values)
    scorer = RewardScorer(cfg.rewards)  # a bad reward fails before anything loads
    if cfg.rollout.engine == "vllm":  # and a missing vLLM
        require_vllm()
    folder = output_folder(cfg, source, out)
    unfinished = (folder / "config.json").exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(run_config(cfg, "eval"), indent=2))
    except OSError as exc:
        where = f"--out {out}" if out is not None else f"train.output_dir={cfg.train.output_dir}"
        raise ConfigError(f"{where}: cannot write the evaluation's folder: {os_reason(exc)}"
                          ) from exc
    setup_logging(folder)
    if unfinished:
        log.info("eval: --out %s held an unfinished evaluation (no summary.json): written over",
                 folder)
    session = start_session(cfg, source)
    algo = cfg.algo
    # the rollouts' settings: greedy answers take their max_new_tokens alone
    settings = SamplingSettings(algo.max_new_tokens, algo.temperature, algo.top_p,
                                min_new_tokens=cfg.rollout.min_new_tokens)
    tools = ToolTurns.of(session, algo.max_new_tokens)
    engine = rollout_engine(session, settings, tools)
    reset_peak(session.device)
    try:
        rows, bad = score_rows(session, engine, scorer, folder)
    finally:
        engine.close()
    if not rows:  # no accuracy to report: 0 would read as a model that got everything wrong
        raise DataError(f"data.eval: no row could be answered and scored: all {len(bad)} "
                            f"were bad; first: {bad[0] if bad else 'none'}")
    summary = {"model": source.path, "model_kind": KINDS[source.kind],
               "model_path": cfg.model.path, "data": _sources(cfg.data.eval),
               "samples": cfg.eval.samples,
               **summarise(rows, with_tools=tools is not None), "bad_rows": len(bad),
               "bad": bad, "reward_errors": scorer.total_errors,
               **step_memory(session.device),
               "seconds": round(time.perf_counter() - started, 1), "output_dir": str(folder)}
    write_rows(rows, folder / "eval.jsonl")
    write_page(summary, rows, folder / "eval.html")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("eval summary: %s", json.dumps({k: v for k, v in summary.items() if k != "bad"}))
    return summary, folder


@torch.no_grad()
def score_rows(session: Session, engine: RolloutEngine, scorer: RewardScorer, out: Path
               ) -> tuple[list[dict[str, Any]], list[str]]:
    """Every row of the eval set answered and scored (``eval.jsonl``'s rows, their images saved
    under ``out``), and one message per bad row: those the reader skipped, then those found
    while answering."""
    dataset, cfg = session.eval_set, session.cfg
    assert dataset is not None
    rows: list[dict[str, Any]] = []
    bad = list(dataset.skipped)
    with engine.ready({}), progress_bar("eval", len(dataset)) as advance:
        for answered in answered_batches(session, engine, range(len(dataset)),
                                         samples=cfg.eval.samples, seed=cfg.train.seed):
            for message in answered.bad:
                log.warning("eval: skipping %s", message)
            bad += answered.bad
            rows += scored_batch(answered, scorer, out)
            for _ in range(len(answered.prompts) + len(answered.bad)):
                advance()
    return rows, bad


def scored_batch(answered: EvalBatch, scorer: RewardScorer, out: Path) -> list[dict[str, Any]]:
    """The rows of a batch: each answer scored by accuracy and format (as the run's evaluation)
    and by the config's rewards (with tools, each reward sees the answer's trajectory)."""
    rows = []
    for i, (index, prompt, texts) in enumerate(zip(answered.indices, answered.prompts,
                                                   answered.answers)):
        sample = prompt.sample
        found = None if answered.trajectories is None else answered.trajectories[i]
        info: dict[str, Any] = {"problem": sample.problem, "reward_method": sample.reward_method}
        infos = ([dict(info) for _ in texts] if found is None else
                 [{**info, "trajectory": t} for t in found])
        rewards = scorer.score(texts, [sample.solution] * len(texts), infos)
        answers = []
        for j, text in enumerate(texts):
            score, form = answer_scores(text, sample)
            answers.append(answer_record(
                text, score, form, float(rewards.total[j]),
                {name: float(v[j]) for name, v in rewards.components.items()},
                None if found is None else found[j], out, f"row_{index:06d}_a{j}"))
        scores = [a["accuracy"] for a in answers]
        rows.append({"index": index, "id": sample.source, "question": sample.problem,
                     "reference": sample.solution, "reward_method": sample.reward_method,
                     "images": save_row_images(sample.images, out, index),
                     "pass": pass_at_k([scores]), "mean": mean_at_k([scores]),
                     "answers": answers})
    return rows


def _sources(spec: str | tuple[str, ...] | None) -> str:
    return spec if isinstance(spec, str) else ", ".join(spec or ())


def summarise(rows: list[dict[str, Any]], *, with_tools: bool) -> dict[str, Any]:
    """The figures of ``summary.json`` over the scored ``rows``."""
    scores = [[a["accuracy"] for a in row["answers"]] for row in rows]
    answers = [a for row in rows for a in row["answers"]]
    n = max(1, len(answers))
    names = sorted({name for a in answers for name in a["rewards"]})
    box = [a["accuracy"] for row in rows if row["reward_method"] == "iou" for a in row["answers"]]
    mean = mean_at_k(scores)
    return {"accuracy": mean, "format": sum(a["format"] for a in answers) / n,
            "pass_at_k": pass_at_k(scores), "mean_at_k": mean,
            "reward_mean": sum(a["reward"] for a in answers) / n,
            "rewards": {name: sum(a["rewards"][name] for a in answers) / n for name in names},
            **({"iou": sum(box) / len(box)} if box else {}),
            **({"tool_use": sum(a["tool_calls"] > 0 for a in answers) / n} if with_tools else {}),
            "size": len(rows)}
