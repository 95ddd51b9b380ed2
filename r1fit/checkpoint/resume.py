"""Where a run starts: a fresh output folder, or the checkpoint it continues from.

``checkpoint.resume``:
- ``auto`` (default): continue from the newest complete checkpoint in ``train.output_dir``;
  partial or corrupt ones are skipped with a warning saying why. A folder that holds a run but no
  usable checkpoint is refused rather than silently restarted.
- ``never``: always start fresh; a folder that holds another run is refused.
- a path: continue from that checkpoint (which may belong to another output folder).
``train.overwrite=true`` deletes the folder's previous run and starts fresh in every mode: the
entries r1fit writes there (:func:`run_entries`), not the user's own files beside them.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from r1fit.checkpoint.files import read_json_object, write_text_atomic
from r1fit.checkpoint.lock import LOCK, hold_output_dir
from r1fit.checkpoint.manager import (
    PARTIAL,
    RESOLVED_ENGINE,
    RESUME_NOT_EXACT,
    RESUME_SAFE,
    CheckpointError,
    ResumePoint,
    checkpoint_name,
    checkpoint_order,
    command_of,
    list_checkpoints,
    missing_for_resume,
    read_best,
    read_trainer_state,
    run_config,
    verify,
)
from r1fit.config.values import config_changes, flatten
from r1fit.errors import one_line
from r1fit.models.load import loaded_dtype

log = logging.getLogger("r1fit.checkpoint")

#: the suffix a checkpoint skipped as damaged is set aside under (no resume takes it)
DAMAGED = ".damaged"


#: what a run writes into its output folder: its files and folders, a checkpoint's
#: (``checkpoint-N``, ``checkpoint-warmup-N``, ``.partial``, ``.damaged``), a profiled step's, the
#: trackers' folders, and the ``.tmp`` / ``.partial`` names their atomic writes go through
#: where ``r1fit eval`` writes its results in an output folder (kept by train.overwrite)
EVAL_FOLDER = "eval"
RUN_ENTRIES = ("config.json", "metrics.jsonl", "log.txt", "summary.json", "report.html", "latest",
               "best", "final", "rollouts", "tensorboard", "wandb", "mlflow", "trackio", "checkpoint-*",
               "profile-step-*.txt")


def run_entries(out: Path) -> tuple[list[Path], list[Path]]:
    """The entries of ``out`` a run wrote, and the others (the user's), each sorted by name; the
    lock file is in neither (the run that overwrites holds it)."""
    ours, theirs = [], []
    for child in sorted(out.iterdir()):
        if child.name == LOCK:
            continue
        name = child.name.removesuffix(".tmp").removesuffix(PARTIAL)
        mine = any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_ENTRIES)
        (ours if mine else theirs).append(child)
    return ours, theirs


def refuse_foreign(out: Path) -> None:
    """A folder that holds no run of r1fit's but entries a run writes (a model folder's
    config.json, someone's final/) is refused: the run would write over them. A run stopped
    before its first step (its own config.json and log) is no such folder."""
    if not out.is_dir() or holds_run(out):
        return
    ours, _ = run_entries(out)
    if not ours or _run_config(out / "config.json"):
        return
    names = ", ".join(child.name for child in ours[:5])
    raise CheckpointError(f"train.output_dir={out} holds {names}, which no r1fit run wrote (a "
                          "model's folder?) and a run would write over; choose a new or empty "
                          "train.output_dir")


def _run_config(path: Path) -> bool:
    """Whether ``path`` is a run's config.json (:func:`run_config`: which command, then every
    key)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and saved.get("kind") in ("grpo", "sft")


def holds_run(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or bool(list_checkpoints(out))


def find_resume_point(out: Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint in ``out`` and the reasons the newer ones were skipped."""
    skipped = []
    for path in list_checkpoints(out):
        why = verify(path)
        if why is None:
            return path, skipped
        skipped.append(f"{path.name}: {why}")
    return None, skipped


def open_output_dir(cfg: Any, kind: str) -> tuple[Path, ResumePoint | None]:
    """Create or reuse ``train.output_dir``, decide the resume point (see the module doc) and
    write the run's ``config.json``. Raises :class:`CheckpointError` when it cannot, an OS error
    included (a path below a regular file, no permission, a read-only folder)."""
    try:
        refuse_foreign(Path(cfg.train.output_dir))
        hold_output_dir(Path(cfg.train.output_dir))  # one run at a time in a folder
        out, point = _open_output_dir(cfg, kind)
        (out / "config.json").write_text(json.dumps(run_config(cfg, kind), indent=2))
        return out, point
    except OSError as exc:
        raise CheckpointError(f"train.output_dir={cfg.train.output_dir}: cannot create or use the "
                              f"output folder: {os_reason(exc)}; choose another "
                              "train.output_dir") from exc


def os_reason(exc: OSError) -> str:
    """What went wrong and where, e.g. ``/a/b is a file, not a folder`` for a path below a file."""
    if exc.filename is None:
        return one_line(exc)
    path = Path(exc.filename)
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file, not a folder"
    return f"{path}: {exc.strerror or one_line(exc)}"


def _open_output_dir(cfg: Any, kind: str) -> tuple[Path, ResumePoint | None]:
    out = Path(cfg.train.output_dir)
    mode = cfg.checkpoint.resume
    if cfg.train.overwrite and out.exists() and holds_run(out):
        _delete_run(out, "train.overwrite=true")
    if mode not in ("auto", "never") and Path(mode).resolve().parent != out.resolve() \
            and holds_run(out) and find_resume_point(out)[0] is not None \
            and _same_command(out, cfg, kind):
        # this command ran here before (from that checkpoint) and saved checkpoints of its own:
        # rerun after a kill, it continues them, as a run started without a path does
        log.info("checkpoint.resume=%s: %s holds this command's run (its config.json is this "
                 "run's), which saved checkpoints of its own: continuing from its newest", mode,
                 out)
        mode = "auto"
    point: Path | None = None
    damaged: set[str] = set()  # checkpoints skipped as damaged (auto): set aside, not deleted
    if mode == "auto":
        point, skipped = find_resume_point(out)
        damaged = {reason.split(":", 1)[0] for reason in skipped}
        for reason in skipped:
            log.warning("not resuming from %s", reason)
        if point is None and holds_run(out):
            _refuse_or_start_over(out, cfg, kind, skipped)
    elif mode != "never":
        point = Path(mode)
        if not point.is_dir():
            raise CheckpointError(f"checkpoint.resume={mode}: no such folder")
        why = verify(point)
        if why is not None:
            raise CheckpointError(f"checkpoint.resume={mode}: cannot resume: {why}")
    if point is None:
        if holds_run(out):
            raise CheckpointError(f"{out} already holds a run (metrics.jsonl or checkpoints) and "
                                  "checkpoint.resume=never; choose another train.output_dir or "
                                  "pass train.overwrite=true to replace it")
        out.mkdir(parents=True, exist_ok=True)
        return out, None

    resume = _check_resumable(point, cfg, kind)
    same_run = point.resolve().parent == out.resolve()
    own = find_resume_point(out)[0] if not same_run and holds_run(out) else None
    if not same_run and holds_run(out) and _never_saved(out, cfg, kind):
        _delete_run(out, f"starting over from {point}: this command's run stopped before its "
                         "first checkpoint (its metrics rows are redone)")
    if not same_run and holds_run(out):
        its = f" (checkpoint.resume=auto continues it, from {own.name})" if own else ""
        raise CheckpointError(f"{out} already holds a run{its}; to resume from {point}, choose an "
                              "empty train.output_dir, or pass train.overwrite=true (deletes that "
                              "run)")
    out.mkdir(parents=True, exist_ok=True)
    _continue_metrics(point, out, resume.state.get("metrics_lines", 0))
    if same_run:  # checkpoints after the resume point belong to the abandoned trajectory
        # the point's place from its trainer state: a renamed copy (checkpoint.resume=out/keep)
        # has no order in its name
        here = checkpoint_order(Path(checkpoint_name(resume.phase, resume.step)))
        for later in list_checkpoints(out):
            if later.resolve() == point.resolve():
                continue
            if checkpoint_order(later) > here or later.name.endswith(PARTIAL):
                if later.name in damaged and not later.name.endswith(PARTIAL):
                    # skipped as damaged: what is intact in it (often the weights) may be worth
                    # saving, so it is set aside under a name no resume takes, not deleted
                    aside = later.with_name(later.name + DAMAGED)
                    shutil.rmtree(aside, ignore_errors=True)
                    os.rename(later, aside)
                    log.warning("%s was skipped as damaged; kept as %s (no resume takes it): "
                                "delete it when you no longer need it", later.name, aside.name)
                    continue
                log.warning("removing %s: it lies after the resume point %s", later.name,
                            point.name)
                shutil.rmtree(later)
        _forget_abandoned(out, point)
    return out, resume


def _delete_run(out: Path, why: str) -> None:
    """Delete what r1fit wrote in ``out`` (a run's entries; ``r1fit eval``'s results and other
    files stay, said), ``why`` leading each log line."""
    ours, theirs = run_entries(out)
    log.warning("%s: deleting the previous run in %s (%d entries)", why, out, len(ours))
    for child in ours:
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    kept_eval = [child for child in theirs if child.name == EVAL_FOLDER]
    theirs = [child for child in theirs if child.name != EVAL_FOLDER]
    if kept_eval:
        log.warning("%s: kept %s/ (r1fit eval's results of models evaluated before; delete it if "
                    "they are no longer wanted)", why, EVAL_FOLDER)
    if theirs:
        names = ", ".join(child.name for child in theirs[:5])
        more = f" and {len(theirs) - 5} more" if len(theirs) > 5 else ""
        log.warning("%s: kept %d %s r1fit did not write: %s%s", why, len(theirs),
                    "entry" if len(theirs) == 1 else "entries", names, more)


def _same_command(out: Path, cfg: Any, kind: str) -> bool:
    """True when the run in ``out`` was started by this command: its config.json is this run's
    (every key, the command and ``checkpoint.resume`` included)."""
    saved = read_json_object(out / "config.json")
    return bool(saved) and saved == json.loads(json.dumps(run_config(cfg, kind)))


def _never_saved(out: Path, cfg: Any, kind: str) -> bool:
    """True when ``out`` holds this command's run, stopped before or while writing its first
    checkpoint (a half-written one at most) and not finished."""
    saves = [p for p in list_checkpoints(out) if not p.name.endswith(PARTIAL)]
    return not saves and not _finished(out) and _same_command(out, cfg, kind)


def _finished(out: Path) -> bool:
    """The run in ``out`` ended (its ``final/`` or summary written)."""
    return (out / "final").is_dir() or (out / "summary.json").is_file()


def _refuse_or_start_over(out: Path, cfg: Any, kind: str, skipped: list[str]) -> None:
    """``out`` holds a run and no complete checkpoint. Where this very command stopped before or
    during its first save (no checkpoint but a half-written one, not finished), there is nothing
    to lose and nothing to resume: it starts over, said (a requeued job killed early would
    otherwise need a hand). Anything else is refused: damaged checkpoints are worth a look, and
    another config's run is not this one's."""
    if _never_saved(out, cfg, kind):
        _delete_run(out, "starting over: this command's run stopped before its first checkpoint "
                         "(nothing to resume; its metrics rows are redone)")
        return
    if _finished(out) and not skipped:
        raise CheckpointError(f"{out} holds a finished run that saved no checkpoint (checkpoint."
                              "every=0): its final/ is the result; pass train.overwrite=true to run "
                              "it again, or choose another train.output_dir")
    why = "; ".join(skipped) or "it was stopped before its first checkpoint"
    raise CheckpointError(f"{out} holds a run with no complete checkpoint ({why}); pass "
                          "train.overwrite=true to start over, or choose another "
                          "train.output_dir")


def _forget_abandoned(out: Path, point: Path) -> None:
    """``latest`` names the resume point, and a ``best`` that names a checkpoint no longer there
    goes: the new trajectory's checkpoints are compared among themselves, not against a value of
    the abandoned one."""
    write_text_atomic(out / "latest", point.name + "\n")
    best = out / "best"
    if not best.is_file():
        return
    record = read_best(out)
    if record is None:
        log.warning("forgetting the best-checkpoint file %s: it is unreadable (not a "
                    "{checkpoint, metric, value} record); the best is kept anew from here", best)
        best.unlink()
    elif not (out / record["checkpoint"]).is_dir():
        log.warning("forgetting the best checkpoint %s: it was not kept with the resume point "
                    "%s", record["checkpoint"], point.name)
        best.unlink()


def _check_resumable(point: Path, cfg: Any, kind: str) -> ResumePoint:
    missing = missing_for_resume(point)
    if missing and not (cfg.checkpoint.resume_weights_only and (point / "trainer_state.json").is_file()):
        hint = ("pass checkpoint.resume_weights_only=true to continue from its step with a fresh "
                "optimizer" if (point / "trainer_state.json").is_file() else
                f"start a new run from these weights with model.path={point}")
        raise CheckpointError(f"{point} cannot be resumed exactly: it has no "
                              f"{', no '.join(missing)}; {hint}")
    state = read_trainer_state(point)
    if state.get("kind") != kind:
        raise CheckpointError(f"{point} was saved by {command_of(state.get('kind'))}, "
                              f"not {command_of(kind)}: continue it with that command, or give "
                              "this run another train.output_dir (train.overwrite=true replaces "
                              "the folder's run)")
    saved_cfg = json.loads((point / "config.json").read_text())
    changes = config_changes(saved_cfg, run_config(cfg, kind))
    # a key added to r1fit after the checkpoint was saved: the saved run ran as its default does
    # (a new key's default keeps the old behaviour), so that value is no change
    saved, defaults = flatten(saved_cfg), flatten(type(cfg)().to_dict())
    changes = {k: v for k, v in changes.items()
               if k in saved or k not in defaults or v[1] != defaults[k]}
    if "model.dtype" in changes and _same_dtype(cfg.model.path, *changes["model.dtype"]):
        del changes["model.dtype"]  # e.g. a run saved before 'auto' became the default
    engine = changes.get(RESOLVED_ENGINE)
    if engine and "auto" in engine and RESOLVED_ENGINE in (state.get("resolved") or {}):
        # 'auto' and an engine are compared once resolved, when the engine is built
        # (r1fit.train.engines.check_resumed_engine); an older checkpoint: as written
        del changes[RESOLVED_ENGINE]
    fixed = {k: v for k, v in changes.items() if not k.startswith(RESUME_SAFE)}
    if fixed and not cfg.checkpoint.allow_config_change:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(fixed.items())[:5])
        raise CheckpointError(f"{point} was saved with another config ({listed}); resume with the "
                              "same settings, or pass checkpoint.allow_config_change=true")
    for key, (a, b) in changes.items():
        inexact = key.startswith(RESUME_NOT_EXACT) or key in fixed
        log.warning("resuming with %s changed: %r -> %r%s", key, a, b,
                    " (the run will not be identical to an uninterrupted one)" if inexact else "")
    return ResumePoint(point, state, weights_only=bool(missing))


def _same_dtype(model: str, saved: Any, now: Any) -> bool:
    """``model.dtype`` 'auto' and an explicit dtype are one setting when the model's checkpoint
    is stored in that dtype (what 'auto' loads)."""
    if "auto" not in (saved, now) or saved == now:
        return False
    try:
        return loaded_dtype(model, saved) == loaded_dtype(model, now)
    except Exception:  # noqa: BLE001 - unknown: keep treating it as a change
        return False


def _continue_metrics(point: Path, out: Path, lines: int) -> None:
    """Make ``out/metrics.jsonl`` the first ``lines`` rows of the checkpoint's run, so the resumed
    run appends without duplicated or missing steps."""
    source = point.parent / "metrics.jsonl"
    rows = source.read_bytes().splitlines(keepends=True) if source.is_file() else []
    if len(rows) < lines:
        log.warning("%s has %d rows, the checkpoint recorded %d; the earlier rows are missing",
                    source, len(rows), lines)
    dropped = max(0, len(rows) - lines)
    if dropped:
        log.info("metrics.jsonl: dropping %d rows written after %s (they will be redone)",
                 dropped, point.name)
    kept, damaged = [], []
    for number, row in enumerate(rows[:lines], 1):
        try:  # a row cut short (a full disk, a crash mid-write) or garbled on disk
            text = row.decode("utf-8")
            json.loads(text)
        except ValueError:  # UnicodeDecodeError is one
            damaged.append(number)
            continue
        # a row with no end of line: the resumed run's first row would join it
        kept.append(text if text.endswith("\n") else text + "\n")
    if damaged:
        log.warning("%s: %d damaged rows left out (line%s %s: not a JSON row of UTF-8 text)",
                    source, len(damaged), "s" * (len(damaged) > 1),
                    ", ".join(map(str, damaged[:10])) + (", ..." if len(damaged) > 10 else ""))
    # the only copy of the run's history: replaced whole or not at all
    write_text_atomic(out / "metrics.jsonl", "".join(kept))
