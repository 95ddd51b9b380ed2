"""Metric trackers besides ``metrics.jsonl``: TensorBoard, W&B, trackio and mlflow (``report.to``).

Each tracker is one small class over its own library, imported only when named. Every row that
:class:`~r1fit.report.metrics.MetricsWriter` writes goes to each of them (rank 0 only), numbers only,
against its step: ``step``, or ``<phase>/step`` for a phase's own rows (``warmup/step``). Every
``report.samples_every`` GRPO steps the step's first rows (prompt, completion, rewards, advantage,
image; a multi-turn row's turns and tool results as text) go to each tracker's table and image
types. A tracker never stops training: one that raises is warned about once and dropped. Each
keeps its data in the output folder (trackio in its own store) and continues the same run on
resume where its library allows it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from r1fit.data.batch import decode_completions
from r1fit.errors import R1fitError, one_line
from r1fit.report.metrics import plain, read_metrics
from r1fit.rollout.record import Rollout, Trajectory
from r1fit.tools import ToolResult

log = logging.getLogger("r1fit.report")

SAMPLE_ROWS = 16  # rows of a step's samples table: the cost stays small whatever the step's size


class TrackerMissing(R1fitError):
    """``report.to`` names a tracker whose package is not installed."""


class TrackerStartError(R1fitError):
    """A tracker of ``report.to`` could not start (no login, a server out of reach): the run
    stops before training rather than train for days untracked."""


#: what to try when a tracker cannot start, after its own error
START_HINTS = {
    "wandb": "without a W&B login or network, set WANDB_MODE=offline (the run is kept in "
             "<output_dir>/wandb; `wandb sync` uploads it later)",
    "mlflow": "check MLFLOW_TRACKING_URI (unset: a SQLite store in <output_dir>/mlflow)",
    "trackio": "check TRACKIO_DIR (unset: the Hugging Face cache)",
    "tensorboard": "check that <output_dir>/tensorboard can be written",
}


def require_trackers(names: tuple[str, ...]) -> None:
    """Raise :class:`TrackerMissing`, naming the install line, unless every tracker in ``names``
    can be imported. Cheap (nothing is imported), so every process checks before anything starts.
    Each tracker's package, and its pyproject extra, have the tracker's name."""
    missing = [name for name in names if find_spec(name) is None]
    if missing:
        raise TrackerMissing(f"report.to names {', '.join(missing)} but "
                             f"{'its package is' if len(missing) == 1 else 'their packages are'} "
                             f"not installed: pip install -e '.[{','.join(missing)}]'")


@dataclass
class SampleRow:
    """One completion of a step's samples table."""

    prompt: str
    completion: str
    reward: float
    components: dict[str, float]  # reward name -> score
    advantage: float
    image: Image.Image | None     # the prompt's first image


def sample_rows(rollout: Rollout, processor: Any, limit: int = SAMPLE_ROWS) -> list[SampleRow]:
    """This process's first ``limit`` rows of a scored rollout (whole groups first, as generated)."""
    assert rollout.rewards is not None and rollout.advantages is not None
    texts = decode_completions(processor, rollout.completions[:limit]) \
        if rollout.trajectories is None else \
        [trajectory_text(t) for t in rollout.trajectories[:limit]]
    mine = slice(rollout.first_row, rollout.first_row + len(texts))  # rewards hold every row
    rewards = rollout.rewards[mine].tolist()
    components = {k: v[mine].tolist() for k, v in rollout.components.items()}
    advantages = rollout.advantages[:len(texts)].tolist()
    return [SampleRow(p.sample.problem, text, rewards[i], {k: v[i] for k, v in components.items()},
                      advantages[i], p.sample.images[0] if p.sample.images else None)
            for i, (p, text) in enumerate(zip(rollout.rows, texts))]


def trajectory_text(trajectory: Trajectory) -> str:
    """A multi-turn row as text: each policy turn's text (its calls written in it), each result of
    its calls on a line after it (``-> crop: <image>``), and why the trajectory ended."""
    lines = []
    for turn in trajectory.turns:
        lines.append(turn.text)
        lines.extend(f"-> {result_text(result)}" for result in turn.results)
    return "\n".join([*lines, f"[ended: {trajectory.ended}]"])


def result_text(result: ToolResult) -> str:
    """A tool result on one line: the tool's name (an error's text names it), its text parts,
    ``<image>`` for each image."""
    parts = " ".join(p if isinstance(p, str) else "<image>" for p in result.parts)
    return parts if result.error else f"{result.name}: {parts}"


def sample_table(rows: list[SampleRow]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a samples table; the image (or None) is the last column."""
    names = list(rows[0].components) if rows else []
    columns = ["prompt", "completion", "reward", *(f"reward/{k}" for k in names), "advantage",
               "image"]
    return columns, [[r.prompt, r.completion, r.reward, *(r.components[k] for k in names),
                      r.advantage, r.image] for r in rows]


def markdown_table(rows: list[SampleRow]) -> str:
    """The samples table in markdown, numbered by row, without the images."""
    columns, data = sample_table(rows)

    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else \
            str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| row | " + " | ".join(columns[:-1]) + " |", "|---" * len(columns) + "|"]
    return "\n".join(lines + [f"| {i} | " + " | ".join(cell(v) for v in row[:-1]) + " |"
                              for i, row in enumerate(data)])


def distinct_images(rows: list[SampleRow]) -> list[tuple[int, Image.Image]]:
    """(row, image) of the first row of each prompt: a group's rows share their prompt's image."""
    first: dict[int, tuple[int, Image.Image]] = {}
    for i, row in enumerate(rows):
        if row.image is not None:
            first.setdefault(id(row.image), (i, row.image))
    return list(first.values())


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (None, NaN, infinities and text are left out)."""
    values = {k: plain(v) for k, v in row.items()}  # NaN and infinities become None
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def axis_of(row: dict[str, Any]) -> str | None:
    """The row's step key: ``step``, else a phase's own (``warmup/step``); None if it has none."""
    if "step" in row:
        return "step"
    return next((k for k in row if k.endswith("/step")), None)


class Sink(Protocol):
    name: str

    def log(self, values: dict[str, float], axis: str) -> None:
        """Send one row's numbers; ``values[axis]`` is its step."""

    def samples(self, step: int, rows: list[SampleRow]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under ``<out>/tensorboard``; a phase's own rows (``warmup/step``) in a
    subfolder (``tensorboard/warmup``), a run of their own in TensorBoard, so that a resumed run's
    ``purge_step`` (which hides the abandoned events from that step on, whatever their tag) hides
    only its own axis's."""

    name = "tensorboard"

    def __init__(self, folder: Path, last_steps: dict[str, int]) -> None:
        """``last_steps``: the last step of each axis in the rows a resumed run kept."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer_class = SummaryWriter
        self.folder, self.last_steps = folder, last_steps
        self.writers: dict[str, Any] = {}

    def _writer(self, axis: str) -> Any:
        if axis not in self.writers:
            folder = self.folder / axis.rpartition("/")[0]
            resumed = any(folder.glob("events.out.tfevents.*"))
            purge = self.last_steps.get(axis, -1) + 1 if resumed else None
            self.writers[axis] = self._writer_class(str(folder), purge_step=purge)
        return self.writers[axis]

    def log(self, values: dict[str, float], axis: str) -> None:
        writer, step = self._writer(axis), int(values[axis])
        for key, value in values.items():
            writer.add_scalar(key, value, step)
        writer.flush()  # a crash loses no row (SummaryWriter would hold them up to 2 minutes)

    def samples(self, step: int, rows: list[SampleRow]) -> None:
        import numpy as np

        writer = self._writer("step")
        writer.add_text("samples", markdown_table(rows), step)
        for i, image in distinct_images(rows):
            writer.add_image(f"samples/row_{i}", np.asarray(image.convert("RGB")), step,
                             dataformats="HWC")
        writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def kept_run_id(out: Path, tracker: str, file: str = "r1fit-run-id") -> tuple[Path, str]:
    """``<out>/<tracker>/<file>`` (its folder made) and the run id an earlier start of this run
    kept there ("" for a fresh run): how a resumed run continues its tracker's run."""
    id_file = out / tracker / file
    id_file.parent.mkdir(parents=True, exist_ok=True)
    return id_file, id_file.read_text().strip() if id_file.is_file() else ""


class WandbSink:
    """A W&B run in ``<out>/wandb`` (``WANDB_MODE=offline`` keeps it there; ``wandb sync`` uploads
    it later). Its id is kept in ``<out>/wandb/r1fit-run-id`` so a resumed run continues it. Each
    key is plotted against its row's step key (``define_metric``), not W&B's own counter, which
    a phase's rows (warm-up, then GRPO from 0) and a resume would send backwards."""

    name = "wandb"

    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        id_file, run_id = kept_run_id(out, "wandb")
        run_id = run_id or uuid.uuid4().hex[:12]
        # a resumed run may change what resuming allows (report.*, ...): update the config
        self.run = wandb.init(project=project, name=run_name, dir=str(out), id=run_id,
                              resume="allow", config=config, allow_val_change=True,
                              reinit="create_new")
        id_file.write_text(run_id)
        self.defined: set[str] = set()

    def _define(self, keys: Iterable[str], axis: str) -> None:
        for key in set(keys) - self.defined - {axis}:
            self.run.define_metric(key, step_metric=axis)
            self.defined.add(key)

    def log(self, values: dict[str, float], axis: str) -> None:
        self._define(values, axis)
        self.run.log(values)

    def samples(self, step: int, rows: list[SampleRow]) -> None:
        wandb = self._wandb
        columns, data = sample_table(rows)
        table = wandb.Table(columns=columns, data=[
            [*r[:-1], wandb.Image(r[-1]) if r[-1] is not None else None] for r in data])
        self._define(["samples"], "step")
        self.run.log({"samples": table, "step": step})

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception:
            # its service is gone (killed, crashed): wandb's own exit hook would try the same at
            # exit and print a whole traceback; tearing down unregisters that hook
            import wandb

            with contextlib.suppress(Exception):
                wandb.teardown()
            raise


class TrackioSink:
    """A trackio run in trackio's own local store (``TRACKIO_DIR``, else the Hugging Face cache;
    ``trackio show`` opens its dashboard). trackio knows a run by its name, so a new run is
    named ``<run_name>-<6 hex digits>`` (two output folders of one name, ``runs/a/sft`` and
    ``runs/b/sft``, are two runs), kept in ``<out>/trackio/r1fit-run-name`` so a resumed run
    continues it. Rows are logged at their step key's value."""

    name = "trackio"

    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        name_file, name = kept_run_id(out, "trackio", "r1fit-run-name")
        resume = "allow" if name else "never"  # this folder's run, continued; else a new one
        name = name or f"{run_name}-{uuid.uuid4().hex[:6]}"
        trackio.init(project=project, name=name, config=config, resume=resume, embed=False)
        name_file.write_text(name)

    def log(self, values: dict[str, float], axis: str) -> None:
        # "step" is a key trackio reserves (renaming it, with a warning): it is the row's step
        self._trackio.log({k: v for k, v in values.items() if k != "step"},
                          step=int(values[axis]))

    def samples(self, step: int, rows: list[SampleRow]) -> None:
        trackio = self._trackio
        columns, data = sample_table(rows)
        table = trackio.Table(columns=columns, data=[
            [*r[:-1], trackio.Image(r[-1]) if r[-1] is not None else None] for r in data])
        trackio.log({"samples": table}, step=step)

    def close(self) -> None:
        self._trackio.finish()


class MlflowSink:
    """An mlflow run: at ``MLFLOW_TRACKING_URI`` when set, else in a SQLite store under
    ``<out>/mlflow`` (mlflow's file store is refused by default since mlflow 3.7), its artifacts
    beside it. The run id is kept in ``<out>/mlflow/r1fit-run-id`` so a resumed run continues
    it. The config goes in as the ``config.json`` artifact."""

    name = "mlflow"

    def __init__(self, out: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        id_file, self.run_id = kept_run_id(out, "mlflow")
        folder = id_file.parent
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{folder.resolve() / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=None if uri else (folder / "artifacts").resolve().as_uri())
        if self.run_id and self._exists(self.run_id):
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)
        self.client.log_dict(self.run_id, config, "config.json")

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return True
        except Exception:  # another store (MLFLOW_TRACKING_URI changed) or a deleted run
            return False

    def log(self, values: dict[str, float], axis: str) -> None:
        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(values[axis])
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, stamp, step)
                                                    for k, v in values.items()])

    def samples(self, step: int, rows: list[SampleRow]) -> None:
        columns, data = sample_table(rows)
        self.client.log_table(self.run_id, {c: [r[j] for r in data] for j, c in
                                            enumerate(columns[:-1])},
                              artifact_file=f"samples/step_{step:06d}.json")
        for i, image in distinct_images(rows):
            self.client.log_image(self.run_id, image, key=f"samples/row_{i}", step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """``key`` with the characters mlflow refuses in metric names replaced by ``_``."""
    return re.sub(r"[^\w\-. /:]", "_", key)


class Trackers:
    """The trackers of ``report.to`` (none on ranks other than 0): each metrics row and, every
    ``samples_every`` GRPO steps, a samples table go to all of them; one that raises is warned
    about once and dropped, and training goes on."""

    def __init__(self, sinks: list[Sink], samples_every: int = 0) -> None:
        self.sinks, self.samples_every = list(sinks), samples_every

    def write(self, row: dict[str, Any]) -> None:
        values = numbers(row) if self.sinks else {}
        axis = axis_of(values)
        if axis is not None:
            self._each(lambda sink: sink.log(values, axis))

    def log_samples(self, rollout: Rollout, processor: Any) -> None:
        """Send this process's first rows of a scored rollout, when its step is due."""
        if self.sinks and self.samples_every and rollout.step % self.samples_every == 0:
            rows = sample_rows(rollout, processor)
            self._each(lambda sink: sink.samples(rollout.step, rows))

    def close(self) -> None:
        self._each(_close)
        self.sinks = []

    def _each(self, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:  # a tracker's trouble never stops training
                log.warning("report.to: %s failed and gets nothing more from this run: %s: %s",
                            sink.name, type(exc).__name__, one_line(exc, 300))
                self.sinks.remove(sink)
                if call is not _close:
                    # closed now, quietly: a tracker left open reports its broken connection
                    # again at exit (wandb's atexit hook printed a whole traceback)
                    with contextlib.suppress(Exception):
                        sink.close()


def _close(sink: Sink) -> None:
    sink.close()


def open_trackers(cfg: Any, out: Path) -> Trackers:
    """The trackers of ``cfg.report.to`` for the run in ``out`` (call on rank 0 only). One that
    cannot start raises :class:`TrackerStartError`, naming it and what to try, after closing
    those already open."""
    report = cfg.report
    run_name = report.run_name or out.resolve().name
    config = cfg.to_dict()
    metrics = out / "metrics.jsonl"
    kept = read_metrics(metrics) if metrics.is_file() else []  # rows a resumed run continues
    last_steps = {axis: int(row[axis]) for row in kept if (axis := axis_of(row)) is not None}
    openers: dict[str, Callable[[], Sink]] = {
        "tensorboard": lambda: TensorBoardSink(out / "tensorboard", last_steps),
        "wandb": lambda: WandbSink(out, report.project, run_name, config),
        "trackio": lambda: TrackioSink(out, report.project, run_name, config),
        "mlflow": lambda: MlflowSink(out, report.project, run_name, config),
    }
    trackers = Trackers([], report.samples_every)
    for name in report.to:
        try:
            trackers.sinks.append(openers[name]())
        except Exception as exc:
            trackers.close()
            raise TrackerStartError(
                f"report.to: {name} could not start: {type(exc).__name__}: "
                f"{one_line(exc, 300)}; {START_HINTS[name]}, or take {name} out of report.to"
            ) from exc
    return trackers
