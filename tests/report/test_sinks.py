"""Each tracker of ``report.to`` gets the metrics rows and samples tables, read back with the
tracker's own reader; a missing package is a one-line error; a failing tracker is dropped."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from r1fit.cli import main
from r1fit.config import load_config
from r1fit.report.metrics import MetricsWriter, read_metrics
from r1fit.report.sinks import (
    SampleRow,
    TrackerMissing,
    Trackers,
    TrackerStartError,
    open_trackers,
    require_trackers,
)

# a warm-up phase on its own axis, an evaluation at step 0, then steps with values that are not
# numbers (left out); every value is a binary fraction, exact in TensorBoard's float32 too
ROWS = [
    {"warmup/step": 1, "warmup/loss": 2.5},
    {"warmup/step": 2, "warmup/loss": 1.25},
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "loss": 0.5, "reward/format": 1, "kl": None, "grad_norm": float("nan"),
     "note": "text"},
    {"step": 2, "loss": 0.375, "reward/format": 0.75, "kl": 0.125},
]
# key -> [(step, value)]
SERIES = {"warmup/step": [(1, 1), (2, 2)], "warmup/loss": [(1, 2.5), (2, 1.25)],
          "step": [(0, 0), (1, 1), (2, 2)], "eval/accuracy": [(0, 0.25)],
          "loss": [(1, 0.5), (2, 0.375)], "reward/format": [(1, 1), (2, 0.75)], "kl": [(2, 0.125)]}
RED, BLUE = Image.new("RGB", (8, 6), "red"), Image.new("RGB", (8, 6), "blue")
SAMPLES = [SampleRow("What colour?", f"<answer>{c}</answer>", r, {"accuracy": r, "format": 1.0}, a,
                     image)
           for c, r, a, image in [("red", 1.0, 0.5, RED), ("blue", 0.0, -0.5, RED),
                                  ("blue", 1.0, 0.0, BLUE)]]


def write_run(out: Path, tracker: str, rows: list[dict] = ROWS, samples_at: int | None = 2) -> None:
    """Rows (and a samples table at step ``samples_at``) through the trackers of a run in
    ``out``, as a run sends them: via its MetricsWriter."""
    cfg = load_config(None, [f"report.to=[{tracker}]", "report.project=r1fit-test",
                             "report.run_name=run-a"])
    trackers = open_trackers(cfg, out)
    assert [s.name for s in trackers.sinks] == [tracker]
    with MetricsWriter(out / "metrics.jsonl", trackers=trackers) as metrics:
        for row in rows:
            metrics.write(row)
        if samples_at is not None:
            trackers.sinks[0].samples(samples_at, SAMPLES)


def resume_rows(out: Path, kept: int) -> None:
    """Cut metrics.jsonl to its first ``kept`` rows, as resuming from a checkpoint does."""
    rows = read_metrics(out / "metrics.jsonl")[:kept]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tensorboard_rows_samples_and_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="needs pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(folder: Path) -> EventAccumulator:
        return EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0,
                                                            "tensors": 0}).Reload()

    write_run(tmp_path, "tensorboard")
    main_run, warmup = read(tmp_path / "tensorboard"), read(tmp_path / "tensorboard" / "warmup")
    found = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
             for acc in (main_run, warmup) for tag in acc.Tags()["scalars"]}
    assert found == SERIES
    assert set(warmup.Tags()["scalars"]) == {"warmup/step", "warmup/loss"}
    # samples: a markdown table (add_text) and one image per prompt
    text = main_run.Tensors("samples/text_summary")
    assert [e.step for e in text] == [2]
    table = text[0].tensor_proto.string_val[0].decode()
    assert "<answer>red</answer>" in table and "reward/accuracy" in table and "-0.500" in table
    assert set(main_run.Tags()["images"]) == {"samples/row_0", "samples/row_2"}
    image = main_run.Images("samples/row_2")[0]
    assert (image.step, image.width, image.height) == (2, 8, 6)

    # resumed from a checkpoint after step 1: step 2 is redone, its first value purged
    resume_rows(tmp_path, 4)
    write_run(tmp_path, "tensorboard", [{"step": 2, "loss": 0.625}], samples_at=None)
    main_run, warmup = read(tmp_path / "tensorboard"), read(tmp_path / "tensorboard" / "warmup")
    assert [(e.step, e.value) for e in main_run.Scalars("loss")] == [(1, 0.5), (2, 0.625)]
    assert [(e.step, e.value) for e in main_run.Scalars("kl")] == []
    assert [(e.step, e.value) for e in warmup.Scalars("warmup/loss")] == SERIES["warmup/loss"]


BLOCK, FULL, LAST = 32768, 1, 4  # the .wandb file: LevelDB's log format of protobuf records


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of a finished offline run's ``.wandb`` file (wandb 0.31 ships no
    Python reader for it, only the records' classes). wandb-core may still be writing the file
    when ``finish()`` returns: wait for the run's exit record."""
    for _ in range(100):
        records = read_wandb_file(next(run_dir.glob("run-*.wandb")))
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        time.sleep(0.1)
    raise AssertionError(f"{run_dir}: no exit record after 10 s")


def read_wandb_file(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data:
        return []
    assert data[:4] == b":W&B"
    records, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's zero-filled tail
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_history(records: list) -> list[dict]:
    """The history rows of the records, without W&B's own keys (``_step``, ``_runtime``..)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def series(rows: list[dict], axis_of: dict[str, str]) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] of history rows, each key against its axis key's value."""
    found: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            if not isinstance(value, dict):
                found.setdefault(key, []).append((row[axis_of.get(key, "step")], value))
    return found


def test_wandb_offline_rows_samples_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for folder in ("DATA", "CACHE", "CONFIG"):  # W&B's staging, cache and settings: not in ~
        monkeypatch.setenv(f"WANDB_{folder}_DIR", str(tmp_path / folder.lower()))
    write_run(tmp_path, "wandb")
    run_id = (tmp_path / "wandb" / "r1fit-run-id").read_text()
    (first,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    records = wandb_records(first)
    *rows, samples = wandb_history(records)
    axes = {"warmup/loss": "warmup/step", "warmup/step": "warmup/step"}
    assert series(rows, axes) == SERIES
    assert (samples["step"], samples["samples/_type"], samples["samples/nrows"]) == (2, "table-file", 3)
    # the table itself, images included, is an artifact staged for `wandb sync`
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    files = {entry.path: entry.local_path for entry in artifact.manifest.contents}
    table = json.loads(Path(files["samples.table.json"]).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "reward/accuracy",
                                "reward/format", "advantage", "image"]
    assert table["data"][1][:6] == ["What colour?", "<answer>blue</answer>", 0, 0, 1, -0.5]
    assert [row[6]["path"] in files for row in table["data"]] == [True] * 3
    # a resumed run continues the same run id (in offline mode: a new folder, synced as one run)
    resume_rows(tmp_path, 4)
    # W&B names the folder by the run's start time in whole seconds: a resume within the same
    # second as the first run's start (a real resume reloads a checkpoint first) would share it
    time.sleep(1.05 - time.time() % 1)
    write_run(tmp_path, "wandb", [{"step": 2, "loss": 0.625}], samples_at=None)
    (second,) = [d for d in (tmp_path / "wandb").glob(f"offline-run-*-{run_id}") if d != first]
    assert wandb_history(wandb_records(second)) == [{"step": 2, "loss": 0.625}]


def test_trackio_local_store_rows_samples_and_resume(tmp_path, monkeypatch):
    if "trackio" not in sys.modules:  # trackio reads TRACKIO_DIR once, when imported
        monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    pytest.importorskip("trackio", reason="needs pip install -e '.[trackio]'")
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import TRACKIO_DIR

    if TRACKIO_DIR != tmp_path / "trackio":
        # trackio was imported earlier in this session: run this test in a fresh interpreter,
        # where it can point TRACKIO_DIR at its own folder first
        assert "R1FIT_TRACKIO_CHILD" not in os.environ, "trackio is imported before the test runs"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"{__file__}::test_trackio_local_store_rows_samples_and_resume"],
            env={**os.environ, "R1FIT_TRACKIO_CHILD": "1"}, capture_output=True, text=True,
            timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        return
    write_run(tmp_path, "trackio")
    name = (tmp_path / "trackio" / "r1fit-run-name").read_text()
    assert re.fullmatch(r"run-a-[0-9a-f]{6}", name)  # one trackio run per output folder
    logs = SQLiteStorage.get_logs("r1fit-test", name)
    assert [log["step"] for log in logs] == [1, 2, 0, 1, 2, 2]
    rows = [{k: v for k, v in log.items() if k not in ("timestamp", "step")} for log in logs]
    found: dict[str, list] = {}
    for row, log in zip(rows[:-1], logs):
        for key, value in row.items():
            found.setdefault(key, []).append((log["step"], value))
    assert found == {k: v for k, v in SERIES.items() if k != "step"}  # "step" is each log's step
    table = rows[-1]["samples"]
    assert table["_type"] == "trackio.table" and len(table["_value"]) == 3
    assert table["_value"][0]["completion"] == "<answer>red</answer>"
    assert table["_value"][0]["image"]["_type"] == "trackio.image"
    resume_rows(tmp_path, 4)
    write_run(tmp_path, "trackio", [{"step": 2, "loss": 0.625}], samples_at=None)
    assert SQLiteStorage.get_runs("r1fit-test") == [name]  # the same run, continued
    assert SQLiteStorage.get_logs("r1fit-test", name)[-1]["loss"] == 0.625
    # another output folder under the same run name is another run, not appended to this one
    write_run(tmp_path / "other", "trackio", [{"step": 1, "loss": 9.0}], samples_at=None)
    other = (tmp_path / "other" / "trackio" / "r1fit-run-name").read_text()
    assert other != name and sorted(SQLiteStorage.get_runs("r1fit-test")) == sorted([name, other])
    assert [log["loss"] for log in SQLiteStorage.get_logs("r1fit-test", other)] == [9.0]
    assert SQLiteStorage.get_logs("r1fit-test", name)[-1]["loss"] == 0.625


def test_mlflow_local_store_rows_samples_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="needs pip install -e '.[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    write_run(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run_id = (tmp_path / "mlflow" / "r1fit-run-id").read_text()
    run = client.get_run(run_id)
    assert (run.info.run_name, run.info.status) == ("run-a", "FINISHED")
    assert {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
            for k in run.data.metrics} == SERIES
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.json", "samples", "images"} <= artifacts
    table = json.loads(Path(client.download_artifacts(run_id, "samples/step_000002.json"))
                       .read_text())
    assert table["columns"][:3] == ["prompt", "completion", "reward"]
    assert [row[5] for row in table["data"]] == [0.5, -0.5, 0.0]  # the advantages
    assert len(client.list_artifacts(run_id, "images")) == 4  # 2 prompts' images (+ thumbnails)
    resume_rows(tmp_path, 4)
    write_run(tmp_path, "mlflow", [{"step": 2, "loss": 0.625}], samples_at=None)
    assert (tmp_path / "mlflow" / "r1fit-run-id").read_text() == run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")][-1] == (2, 0.625)


def test_missing_package_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails: not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(TrackerMissing, match=r"wandb, mlflow .*pip install -e '\.\[wandb,mlflow\]'"):
        require_trackers(("wandb", "mlflow"))
    assert main(["train", f"train.output_dir={tmp_path / 'run'}", "report.to=[wandb]"]) == 2
    err = capsys.readouterr().err
    assert err == ("r1fit: error: report.to names wandb but its package is not installed: "
                   "pip install -e '.[wandb]'\n")
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_tracker_that_cannot_start_stops_the_run_before_the_model_loads(monkeypatch, tmp_path,
                                                                          capsys):
    from r1fit.report import sinks

    opened: list[Recorder] = []

    def tensorboard(*args):
        opened.append(Recorder("tensorboard"))
        return opened[-1]

    def wandb(*args):
        raise ConnectionError("api.wandb.ai unreachable\n(retrying gave up)")

    monkeypatch.setattr(sinks, "TensorBoardSink", tensorboard)
    monkeypatch.setattr(sinks, "WandbSink", wandb)
    cfg = load_config(None, ["report.to=[tensorboard,wandb]"])
    with pytest.raises(TrackerStartError) as info:
        open_trackers(cfg, tmp_path)
    assert str(info.value) == (
        "report.to: wandb could not start: ConnectionError: api.wandb.ai unreachable (retrying "
        "gave up); without a W&B login or network, set WANDB_MODE=offline (the run is kept in "
        "<output_dir>/wandb; `wandb sync` uploads it later), or take wandb out of report.to")
    assert opened[0].closed  # the one opened before it is closed
    loaded = []
    monkeypatch.setattr("r1fit.train.run.load_policy_on_ranks", lambda *a, **k: loaded.append(1))
    assert main(["sft", f"train.output_dir={tmp_path / 'run'}", "report.to=[wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("r1fit: error: report.to: wandb could not start: ConnectionError")
    assert not loaded  # stopped before the model loaded


class Recorder:
    def __init__(self, name: str, fail_at: int | None = None) -> None:
        self.name, self.fail_at, self.rows, self.closed = name, fail_at, [], False

    def log(self, values, axis):
        if len(self.rows) == self.fail_at:
            raise ConnectionError("server went away")
        self.rows.append((values[axis], values))

    def samples(self, step, rows):
        self.rows.append((step, rows))

    def close(self):
        self.closed = True


def test_failing_tracker_warns_once_and_the_others_go_on(caplog):
    broken, kept = Recorder("wandb", fail_at=1), Recorder("tensorboard")
    trackers = Trackers([broken, kept])
    with caplog.at_level(logging.WARNING, logger="r1fit.report"):
        for row in ROWS:
            trackers.write(row)
        trackers.close()
    assert [r.getMessage() for r in caplog.records] == [
        "report.to: wandb failed and gets nothing more from this run: ConnectionError: server "
        "went away"]
    # closed when dropped (quietly: its close may fail too), so it says nothing more at exit
    assert len(broken.rows) == 1 and broken.closed
    assert kept.closed and [step for step, _ in kept.rows] == [1, 2, 0, 1, 2]
    # numbers only: None, NaN and text are left out
    assert kept.rows[3][1] == {"step": 1, "loss": 0.5, "reward/format": 1}


def test_a_dropped_tracker_whose_close_fails_is_not_said_twice(caplog):
    class Dead(Recorder):
        def close(self):
            raise ConnectionResetError("Connection lost")

    dead = Dead("wandb", fail_at=0)
    trackers = Trackers([dead])
    with caplog.at_level(logging.WARNING, logger="r1fit.report"):
        trackers.write(ROWS[0])
        trackers.close()
    assert [r.getMessage() for r in caplog.records] == [
        "report.to: wandb failed and gets nothing more from this run: ConnectionError: server "
        "went away"]


def test_grpo_run_sends_every_step_key_and_samples_to_tensorboard(use_tiny_cache, tmp_path):
    pytest.importorskip("tensorboard", reason="needs pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", "report.to=[tensorboard]",
                 "report.samples_every=1", "train.max_steps=2", "train.prompts_per_step=2",
                 "algo.num_generations=2", "algo.max_new_tokens=4", "sft.format_warmup_steps=1",
                 "sft.batch_size=2", "data.eval_size=2", "data.shapes.train_size=8",
                 "data.shapes.image_size=28", "data.max_pixels=784", "checkpoint.every=0"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    for key in {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}:
        expected = [(r["step"], struct.unpack("f", struct.pack("f", r[key]))[0])  # float32
                    for r in read_metrics(out / "metrics.jsonl")
                    if "step" in r and isinstance(r.get(key), (int, float))]
        assert [(e.step, e.value) for e in events.Scalars(key)] == expected, key
    samples = events.Tensors("samples/text_summary")
    assert [e.step for e in samples] == [1, 2]
    table = samples[0].tensor_proto.string_val[0].decode().splitlines()
    assert len(table) == 2 + 4  # header, rule, then this process's 2 prompts x 2 completions
    assert {e.step for tag in events.Tags()["images"] for e in events.Images(tag)} == {1, 2}
    assert (out / "tensorboard" / "warmup").is_dir()  # the warm-up's rows, on their own axis
