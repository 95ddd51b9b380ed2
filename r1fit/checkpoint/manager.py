"""One manager for everything that must survive a crash.

A checkpoint is a folder ``<output_dir>/checkpoint-<step>/`` (``checkpoint-warmup-<step>/`` during
the SFT warm-up of ``r1fit train``)::

    weights/               torch.distributed.checkpoint (DCP): model weights (the adapter only, for
                           LoRA), the KL reference when it is a copy (full fine-tuning after the
                           warm-up) and the optimizer moments; one shard file per rank
    model/, reference/     the model's config, generation config and processor (adapter_config.json
                           for LoRA), no weights; ``r1fit export`` consolidates a plain HF folder
    optimizer.json         param groups (parameter names, hyper-parameters)
    scheduler.json, sampler.json, loop.json, ...   the rest, written by rank 0
    rng-rank<r>.json/.safetensors   RNG states of rank r
    config.json            the resolved config of the run
    trainer_state.json     step, updates, consumed prompts, epoch, sampler position, config hash...
    manifest.json          every other file with its size and sha256; written last

Every piece is keyed by name, never by process, so a run saved by N processes resumes on M (only
the RNG states are per rank: on another process count they are re-seeded, with a warning). All
ranks write into the same folder, so ``train.output_dir`` must be on a filesystem every node sees.
A save writes ``checkpoint-<step>.partial/``, fsyncs it, renames it into place and then
updates the ``latest`` pointer, so a folder without ``.partial`` and with a matching manifest is
complete; anything else is ignored with a warning saying why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError

import r1fit
from r1fit.checkpoint.files import (
    fsync_dir,
    fsync_tree,
    load_state,
    read_json_object,
    save_state,
    sha256_file,
    write_text_atomic,
)
from r1fit.checkpoint.sharded import load_model_weights, model_tensors, save_tensors
from r1fit.errors import R1fitError, one_line
from r1fit.processes import all_max, barrier, world
from r1fit.units import format_bytes

log = logging.getLogger("r1fit.checkpoint")

FORMAT = 2
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "model"
PARTIAL = ".partial"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(?:(warmup)-)?(\d+)$")
PHASE_ORDER = {"warmup": 0, "grpo": 1, "sft": 1}

# config keys that may change between a run and its resume; the rest would silently change the
# trajectory, so changing them needs checkpoint.allow_config_change=true
RESUME_SAFE = ("train.output_dir", "train.overwrite", "train.device", "train.max_steps",
               "train.deterministic",
               "train.early_stop_patience", "sft.steps", "checkpoint.", "eval.", "memory.",
               "data.eval", "rollout.vllm.kv_cache_memory", "rollout.vllm.gpu_memory_utilization",
               "rollout.vllm.sleep_level", "rollout.share_prefill", "rollout.tool_workers",
               "report.")
# safe to change, but the continued run is no longer bit-identical to an uninterrupted one
# (memory.gradient_checkpointing and checkpoint_every recompute the same numbers: a LoRA-dropout
# run with and without gave the same bits on CPU)
RESUME_NOT_EXACT = ("train.max_steps", "sft.steps", "memory.micro_batch",
                    "memory.generation_batch", "memory.logits_chunk", "memory.fused_loss",
                    "memory.share_prefix", "rollout.share_prefill", "train.deterministic",
                    # the same for tools that end within their timeout at either count
                    "rollout.tool_workers")


#: trainer_state's "resolved" key of the rollout engine the run generated with
RESOLVED_ENGINE = "rollout.engine"


class CheckpointError(R1fitError, RuntimeError):
    """A checkpoint cannot be saved or resumed from; the message says why and what to do."""


class RunStopped(Exception):
    """The run was asked to stop (SIGTERM) and saved a checkpoint first."""


class Stateful(Protocol):
    """What the manager saves. An object may also say:

    - ``storage``: ``"json"`` (the default: rank 0 writes its ``state_dict()`` as JSON +
      safetensors), ``"per_rank"`` (every rank writes its own; a resume on another process count
      calls ``restart``), or ``"sharded"`` (``sharded_state() -> (tensors, json)``: every rank
      writes its shards through DCP; ``load_sharded(folder, name, json)`` reads them back on any
      process count);
    - ``restartable = True``: weights-only checkpoints leave it out; resuming from one calls
      ``restart(point) -> str`` (what that means, for the log) instead of loading it;
    - ``progress() -> dict``: fields for ``trainer_state.json`` (the data position...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def failure_reason(exc: BaseException) -> str:
    """One line for why a checkpoint's save or load failed: DCP's ``CheckpointException`` (a
    ``BaseException`` whose text is every rank's whole traceback) by its first rank's exception,
    an OS error by its reason and file."""
    if isinstance(exc, dcp.api.CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.filename})" if exc.filename else exc.strerror
    return one_line(exc, 300, first_line=True)


#: how the Rust-backed writers (tokenizers, safetensors) word an OS error: "... (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error \d+\)")


def io_failure(exc: BaseException) -> bool:
    """True for an error that says a file could not be written or read (a full disk, a
    permission, a folder removed): OS errors, DCP's, safetensors' (its own type), and the
    tokenizers library's bare ``Exception`` whose text ends in Rust's '(os error N)'. Anything
    else (a bug) is not worded as a disk's problem."""
    return isinstance(exc, (OSError, dcp.api.CheckpointException, SafetensorError)) or (
        type(exc) is Exception and _RUST_OS_ERROR.search(str(exc)) is not None)


def disk_note(folder: Path, needed: int) -> str:
    """``"; the disk holding FOLDER has N free"`` when that is less than ``needed`` bytes (a
    checkpoint's size): torch's writers report a full disk as other errors."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return (f"; the disk holding {folder} has {format_bytes(free)} free, less than a checkpoint "
            f"({format_bytes(needed)})" if free < needed else "")


def read_best(out: Path) -> dict[str, Any] | None:
    """The ``best`` record of run folder ``out`` (``{checkpoint, metric, value}``); None when
    there is none, or it is unreadable (a resume forgets such a file, ``r1fit inspect`` says
    so)."""
    record = read_json_object(out / "best")
    named, metric = record.get("checkpoint"), record.get("metric")
    if not (isinstance(named, str) and named and isinstance(metric, str)
            and _a_number(record.get("value"))):
        return None
    return record


def _a_number(value: Any) -> bool:
    """A metric's value as JSON gives it: an int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def storage_of(obj: Stateful) -> str:
    storage = getattr(obj, "storage", "json")
    if storage not in ("json", "per_rank", "sharded"):
        raise ValueError(f"{type(obj).__name__}.storage={storage!r}: expected json, per_rank or "
                         "sharded")
    return storage


def restartable(obj: Stateful) -> bool:
    return bool(getattr(obj, "restartable", False))


def run_config(cfg: Any, kind: str) -> dict[str, Any]:
    """The resolved config as a run records it (``config.json``): which command, then every key."""
    return {"kind": kind, **cfg.to_dict()}


def command_of(kind: str | None) -> str:
    """The command that makes runs of ``kind``."""
    return {"grpo": "`r1fit train`", "sft": "`r1fit sft`"}.get(kind, f"unknown ({kind})")


def checkpoint_name(phase: str, step: int) -> str:
    return f"checkpoint-warmup-{step}" if phase == "warmup" else f"checkpoint-{step}"


def checkpoint_order(path: Path) -> tuple[int, int] | None:
    """Sort key of a checkpoint folder (phase, step), or None if the name is not a checkpoint's."""
    match = CHECKPOINT_NAME.match(path.name.removesuffix(PARTIAL))
    if match is None:
        return None
    return (0 if match.group(1) else 1, int(match.group(2)))


def list_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders in ``out`` (complete or not), newest first."""
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and checkpoint_order(p) is not None]
    return sorted(found, key=lambda p: (checkpoint_order(p), not p.name.endswith(PARTIAL)),
                  reverse=True)


def verify(path: Path, *, checksums: bool = True) -> str | None:
    """``None`` if ``path`` is a complete, intact checkpoint, else the reason it is not."""
    if path.name.endswith(PARTIAL):
        return "incomplete save (interrupted before it was renamed into place)"
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if (path / "config.json").is_file() and not (path / TRAINER_STATE).is_file():
            return "a plain model folder, not an r1fit checkpoint (no trainer_state.json)"
        return "no manifest.json (not an r1fit checkpoint, or an interrupted save)"
    try:
        manifest = json.loads(manifest_file.read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
                isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                and isinstance(meta.get("sha256"), str) for meta in files.values()):
            raise ValueError("its files are not each a {bytes, sha256} record")
    except (ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is unreadable ({exc})"
    if manifest.get("format") != FORMAT:
        return (f"checkpoint format {manifest.get('format')} (an older r1fit, whose layout had "
                f"no sharded weights/); this r1fit reads format {FORMAT}")
    for rel, meta in files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != meta["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {meta['bytes']}"
        if checksums and sha256_file(file) != meta["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupt)"
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE).read_text())


def missing_for_resume(path: Path) -> list[str]:
    """What a full resume needs that the checkpoint at ``path`` does not hold."""
    if not (path / TRAINER_STATE).is_file():
        return ["trainer_state.json (step and data position)", "optimizer state",
                "LR scheduler state", "RNG states"]
    state = read_trainer_state(path)
    names = {"optimizer": "optimizer state", "scheduler": "LR scheduler state",
             "rng": "RNG states"}
    return [text for key, text in names.items() if key not in state.get("objects", [])]


@dataclass
class ResumePoint:
    """The checkpoint a run continues from."""

    path: Path
    state: dict[str, Any]  # trainer_state.json
    weights_only: bool     # resuming with a fresh optimizer (checkpoint.resume_weights_only)

    @property
    def phase(self) -> str:
        return self.state["phase"]

    @property
    def step(self) -> int:
        return int(self.state["step"])


class CheckpointManager:
    """Saves and restores a run's objects; keeps the newest ``checkpoint.keep`` checkpoints.

    Models (:meth:`add_model`) are saved in every checkpoint of the run; the other objects are
    given to each :meth:`save` and :meth:`restore` by the loop that owns them."""

    def __init__(self, out: Path, cfg: Any, kind: str, resume: ResumePoint | None,
                 started: float | None = None) -> None:
        """``started``: ``time.perf_counter()`` when this process's part of the run began."""
        self.out, self.cfg, self.kind, self.resume = out, cfg, kind, resume
        self.started = time.perf_counter() if started is None else started
        # the run's seconds before this start (a checkpoint from before they were kept: none)
        self.seconds_before = float(resume.state.get("seconds") or 0.0) if resume else 0.0
        self._models: dict[str, tuple[Any, Any]] = {}  # name -> (module, processor or None)
        # what an 'auto' setting resolved to in this run (RESOLVED_ENGINE: the rollout engine),
        # kept in each checkpoint: a resume compares what it resolves to with it
        self.resolved: dict[str, str] = {}
        self.best = read_best(out)
        if resume is not None and cfg.checkpoint.keep_best_by and world().main:
            self._best_anew()
        self._best_missing_said = False  # keep_best_by's metric missing from a saved step, said
        self.last_saved: Path | None = None
        self.stop_requested = False  # SIGTERM/SIGUSR1 (pre-emption): save after this step, stop
        if cfg.checkpoint.every and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", signal.SIGTERM)):
                signal.signal(sig, self._request_stop)

    def _request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        window = ("; under torchrun the step and the save must end within its shutdown timeout "
                  "(30 s by default, torchrun --shutdown_timeout), or torchrun kills them unsaved"
                  if world().distributed else "")
        log.warning("received %s: saving a checkpoint after this step, then stopping%s",
                    signal.Signals(signum).name, window)

    def run_seconds(self) -> float:
        """Wall-clock seconds of the run so far, over every start it resumed through (the time a
        crash lost after its last checkpoint is not in them: that work is redone)."""
        return self.seconds_before + time.perf_counter() - self.started

    # -- resume ------------------------------------------------------------------------------

    def phase_done(self, phase: str) -> bool:
        """True if the resume point lies in a later phase (the warm-up was finished)."""
        return self.resume is not None and PHASE_ORDER[self.resume.phase] > PHASE_ORDER[phase]

    def restore(self, phase: str, objects: dict[str, Stateful]) -> int:
        """Load ``objects`` from the resume point when it is in ``phase``; returns its step (0 when
        the phase starts from scratch). What the checkpoint cannot give (a weights-only
        checkpoint's optimizer, per-rank states saved by another number of processes) is
        restarted by the object itself, and the log says so."""
        point = self.resume
        if point is None or point.phase != phase:
            return 0
        saved = set(point.state.get("objects", []))
        w = world()
        saved_world = int(point.state.get("world_size", 1))
        restarted = []
        for name, obj in objects.items():
            storage = storage_of(obj)
            try:
                if name not in saved:
                    if not (point.weights_only and restartable(obj)):
                        raise CheckpointError(f"{point.path}: has no saved {name!r}")
                    restarted.append(obj.restart(point))  # type: ignore[attr-defined]
                elif storage == "per_rank" and saved_world != w.size:
                    message = obj.restart(point)  # type: ignore[attr-defined]
                    if w.main:
                        log.warning("saved by %d process%s, resumed on %d: %s, so the run "
                                    "continues from the same step and optimizer state but is not "
                                    "bit-identical to an uninterrupted one", saved_world,
                                    "" if saved_world == 1 else "es", w.size, message)
                elif storage == "per_rank":
                    obj.load_state_dict(load_state(point.path, f"{name}-rank{w.rank}"))
                elif storage == "sharded":
                    obj.load_sharded(point.path, name,  # type: ignore[attr-defined]
                                     load_state(point.path, name))
                else:
                    obj.load_state_dict(load_state(point.path, name))
            except (ValueError, KeyError, RuntimeError, SafetensorError,
                    dcp.api.CheckpointException) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{point.path}: cannot restore {name}: "
                                      f"{failure_reason(exc)}") from exc
        log.info("resumed %s at step %d from %s%s", phase, point.step, point.path,
                 f" (weights only: {', '.join(restarted)})" if point.weights_only else "")
        return point.step

    def add_model(self, name: str, module: Any, processor: Any = None) -> None:
        """Save ``module``'s weights (sharded; the adapter only for LoRA) and config, and
        ``processor``, in every checkpoint from now on, as ``weights/`` entries and ``name/``."""
        self._models[name] = (module, processor)

    def has_model(self, name: str) -> bool:
        """True if the resume point holds the weights of model ``name``."""
        return self.resume is not None and name in self.resume.state.get("models", [])

    def load_model(self, name: str, module: Any) -> None:
        """Load model ``name``'s weights from the resume point into ``module`` (plain or
        sharded; every rank calls this)."""
        assert self.resume is not None
        try:
            load_model_weights(self.resume.path, name, module)
        except (ValueError, KeyError, RuntimeError, OSError, SafetensorError,
                dcp.api.CheckpointException) as exc:
            # e.g. DCP's size mismatch of a LoRA rank changed under allow_config_change
            reason = failure_reason(exc)
            hint = "" if "other model settings" in reason else \
                "; was it saved with other model settings (model.lora, model.path)?"
            raise CheckpointError(f"{self.resume.path}: cannot load the {name} weights: "
                                  f"{reason}{hint}") from exc

    # -- save --------------------------------------------------------------------------------

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.checkpoint.every
        if every and world().distributed:
            # a signal reaches the ranks at slightly different moments: they must agree to save
            # after the same step (the save is collective)
            self.stop_requested = bool(all_max([float(self.stop_requested)])[0])
        return bool(every) and (step % every == 0 or last or self.stop_requested)

    def stop_if_requested(self, step: int) -> None:
        """After a signal asked to stop: the checkpoint of ``step`` is written, so stop here."""
        if self.stop_requested:
            raise RunStopped(f"stopped by a signal after step {step}, {self.last_saved} saved; "
                             "rerun the same command to resume")

    def save(self, phase: str, step: int, objects: dict[str, Stateful], *,
             metrics: dict[str, Any] | None = None, metrics_lines: int = 0) -> Path:
        """Write ``checkpoint-<step>`` atomically, update ``latest``, apply retention.
        ``metrics_lines``: the rows of ``metrics.jsonl`` so far (a resume keeps as many)."""
        name = checkpoint_name(phase, step)
        final, partial = self.out / name, self.out / (name + PARTIAL)
        weights_only = self.cfg.checkpoint.weights_only
        started = time.perf_counter()
        w = world()
        files: dict[str, Any] = {}
        try:
            if w.main:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir()  # not parents: a run folder removed under the run is not remade
            barrier()
            # every rank: its shards of the weights and optimizer moments, its per-rank states
            tensors = {model_name: model_tensors(module)
                       for model_name, (module, _) in self._models.items()}
            saved, json_states = [], {}
            for obj_name, obj in objects.items():
                if weights_only and restartable(obj):
                    continue
                saved.append(obj_name)
                storage = storage_of(obj)
                if storage == "per_rank":
                    save_state(partial, f"{obj_name}-rank{w.rank}", obj.state_dict())
                elif storage == "sharded":
                    tensors[obj_name], json_states[obj_name] = obj.sharded_state()  # type: ignore[attr-defined]
                else:
                    json_states[obj_name] = obj.state_dict()
            save_tensors(partial, tensors)
            barrier()
            if w.main:
                progress: dict[str, Any] = {}
                for obj in objects.values():
                    if hasattr(obj, "progress"):
                        progress.update(obj.progress())  # type: ignore[attr-defined]
                files = self._write_metadata(partial, phase, step, progress, saved, json_states,
                                             metrics, metrics_lines)
                if final.exists():  # a checkpoint of an abandoned trajectory (resumed from earlier)
                    shutil.rmtree(final)
                os.rename(partial, final)
        except BaseException as exc:  # noqa: BLE001 -- io_failure picks; the rest is raised
            if not io_failure(exc):
                raise
            complete = [p.name for p in list_checkpoints(self.out) if not p.name.endswith(PARTIAL)
                        and p != final]
            kept = f"{complete[0]} is intact" if complete else "no earlier checkpoint exists"
            newest = self.out / complete[0] if complete else None
            size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) if newest \
                else 64 << 20
            full = disk_note(self.out, size)  # before the partial save's bytes are freed
            if w.main:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(f"could not save {name} in {self.out}: {failure_reason(exc)}"
                                  f"{full}; {kept}. Fix it (disk space, permissions) and rerun "
                                  "the same command to resume") from exc
        if w.main:
            self._point_latest(name)
        barrier()  # the checkpoint is in place for every rank
        self.last_saved = final
        if not w.main:
            return final
        size = sum(m["bytes"] for m in files.values())
        log.info("saved %s (%.1f MB%s) in %.1f s", name, size / 1e6,
                 ", weights only" if weights_only else "", time.perf_counter() - started)
        self._update_best(name, metrics or {})
        self._retain()
        return final

    def _point_latest(self, name: str) -> None:
        """``latest`` names checkpoint ``name``, which is in place: a failure here is said as
        what it is (the checkpoint is complete; a resume takes the newest complete one, whatever
        ``latest`` says)."""
        try:
            fsync_dir(self.out)
            write_text_atomic(self.out / "latest", name + "\n")
        except OSError as exc:
            raise CheckpointError(f"{name} was saved in {self.out}, but its 'latest' file could "
                                  f"not be written: {failure_reason(exc)}. Fix it (disk space, "
                                  f"permissions) and rerun the same command: it resumes from "
                                  f"{name}") from exc

    def _write_metadata(self, partial: Path, phase: str, step: int, progress: dict[str, Any],
                        saved: list[str], json_states: dict[str, Any],
                        metrics: dict[str, Any] | None, metrics_lines: int) -> dict[str, Any]:
        """Rank 0: the non-tensor states, the models' configs and processors, trainer_state.json,
        config.json, then manifest.json over every rank's files, then fsync. Returns the
        manifest's files."""
        for obj_name, state in json_states.items():
            save_state(partial, obj_name, state)
        for model_name, (module, processor) in self._models.items():
            save_model_files(module, processor, partial / model_name)
        trainer_state = {
            "format": FORMAT, "r1fit_version": r1fit.__version__, "kind": self.kind,
            "phase": phase, "step": step, "updates": None, "consumed_prompts": 0, "epoch": None,
            "sampler": {}, **progress,
            "config_fingerprint": self.cfg.fingerprint(),
            "weights_only": self.cfg.checkpoint.weights_only,
            "objects": saved, "models": sorted(self._models), "world_size": world().size,
            "metrics_lines": metrics_lines, "metrics": metrics or {},
            "resolved": dict(self.resolved), "seconds": round(self.run_seconds(), 3),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (partial / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        (partial / "config.json").write_text(json.dumps(run_config(self.cfg, self.kind),
                                                        indent=1))
        files = {str(p.relative_to(partial)): {"bytes": p.stat().st_size,
                                               "sha256": sha256_file(p)}
                 for p in sorted(partial.rglob("*")) if p.is_file()}
        (partial / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files},
                                                   indent=1))
        fsync_tree(partial)
        return files

    def _better(self, value: float, than: dict[str, Any] | None) -> bool:
        return than is None or (value > than["value"] if self.cfg.checkpoint.keep_best_mode == "max"
                                else value < than["value"])

    def _best_anew(self) -> None:
        """On resume: the best among the checkpoints kept (each holds its step's metrics), by
        ``keep_best_by`` as it is now, in the order they were saved. The ``best`` file alone
        can be behind them (a kill between a checkpoint's rename and its update) or name
        another metric or mode (changed on resume, allowed): kept as it was, retention would
        then delete the checkpoint that is the best now."""
        key = self.cfg.checkpoint.keep_best_by
        best: dict[str, Any] | None = None
        for path in reversed(list_checkpoints(self.out)):
            value = read_json_object(path / TRAINER_STATE).get("metrics", {}).get(key) \
                if not path.name.endswith(PARTIAL) else None
            if _a_number(value) and self._better(float(value), best):
                best = {"checkpoint": path.name, "metric": key, "value": float(value)}
        if best == self.best:
            return
        if self.best is not None and self.best.get("metric") != key:
            log.warning("checkpoint.keep_best_by=%s (the run kept its best by %s before): the "
                        "best is %s among the checkpoints kept", key, self.best.get("metric"),
                        best["checkpoint"] if best else "none yet")
        self.best = best
        if best is None:
            (self.out / "best").unlink(missing_ok=True)
        else:
            write_text_atomic(self.out / "best", json.dumps(best) + "\n")

    def _update_best(self, name: str, metrics: dict[str, Any]) -> None:
        key = self.cfg.checkpoint.keep_best_by
        if not key:
            return
        if metrics.get(key) is None:
            # once: a typo would otherwise keep no best unsaid (the format warm-up's steps log no
            # evaluation: not said there)
            if not self._best_missing_said and not name.startswith("checkpoint-warmup"):
                self._best_missing_said = True
                import difflib

                close = difflib.get_close_matches(key, list(metrics), n=3)
                log.warning("checkpoint.keep_best_by=%s: %s's step logged no such metric%s; a "
                            "checkpoint is kept as best only at a step that logs it (an "
                            "evaluation's, for eval/ metrics)", key, name,
                            f" (close: {', '.join(close)})" if close else "")
            return
        value = float(metrics[key])
        if self._better(value, self.best):
            self.best = {"checkpoint": name, "metric": key, "value": value}
            write_text_atomic(self.out / "best", json.dumps(self.best) + "\n")

    def _retain(self) -> None:
        keep = self.cfg.checkpoint.keep
        for stale in self.out.glob(f"checkpoint-*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
        if not keep:
            return
        complete = [p for p in list_checkpoints(self.out) if not p.name.endswith(PARTIAL)]
        protected = {self.best["checkpoint"]} if self.best else set()
        for old in complete[keep:]:
            if old.name not in protected:
                shutil.rmtree(old, ignore_errors=True)


def save_model_files(module: Any, processor: Any, folder: Path) -> None:
    """What a checkpoint keeps of a model besides its weights: its config and generation config,
    the processor, and for LoRA the adapter config, so that ``r1fit export`` can rebuild it."""
    folder.mkdir(parents=True, exist_ok=True)
    base = module.get_base_model() if hasattr(module, "peft_config") else module
    if hasattr(base, "config"):
        base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    if hasattr(module, "peft_config"):
        module.peft_config["default"].save_pretrained(folder)
