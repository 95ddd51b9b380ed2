"""Opening ``train.output_dir``: an output folder the OS refuses is a one-line CheckpointError."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from r1fit.checkpoint.manager import CheckpointError
from r1fit.checkpoint.resume import open_output_dir
from r1fit.config import load_config

from .test_manager import Box


def _open(out: Path, *overrides: str):
    return open_output_dir(load_config(None, [f"train.output_dir={out}", *overrides]), "grpo")


def test_a_fresh_folder_is_created(tmp_path: Path) -> None:
    out, resume = _open(tmp_path / "a" / "run")
    assert out.is_dir() and resume is None


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_folder_below_a_regular_file_is_one_line(tmp_path: Path, resume: str) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    out = blocker / "runs" / "demo"
    with pytest.raises(CheckpointError) as info:
        _open(out, f"checkpoint.resume={resume}")
    assert str(info.value) == (f"train.output_dir={out}: cannot create or use the output folder: "
                               f"{blocker} is a file, not a folder; choose another "
                               "train.output_dir")


def test_a_regular_file_as_the_folder_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.write_text("")
    with pytest.raises(CheckpointError, match=rf"^train\.output_dir={out}: cannot create or use "
                                              rf"the output folder: {out} is a file, not a folder"):
        _open(out)


def test_other_os_errors_name_the_path_and_the_reason(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)  # tests run as root, where chmod stops nothing
    out = tmp_path / "run"
    with pytest.raises(CheckpointError) as info:
        _open(out)
    assert str(info.value) == (f"train.output_dir={out}: cannot create or use the output folder: "
                               f"{out}: Permission denied; choose another train.output_dir")
    assert isinstance(info.value.__cause__, PermissionError)


def test_the_run_config_is_written_and_a_failed_write_is_one_line(tmp_path: Path) -> None:
    out, _ = _open(tmp_path / "run")
    assert json.loads((out / "config.json").read_text())["kind"] == "grpo"
    # a disk that cannot take the file (as root, a read-only folder would still take it)
    other = tmp_path / "other"
    real = Path.write_text

    def full(path: Path, *args: Any, **kwargs: Any) -> int:
        if path.name == "config.json":
            raise OSError(28, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_text", full)
        with pytest.raises(CheckpointError, match=rf"^train\.output_dir={other}: cannot create or "
                                                  r"use the output folder: .*config\.json: No "
                                                  "space left on device"):
            _open(other)


def test_a_newer_checkpoint_skipped_as_damaged_is_set_aside_and_best_and_latest_follow(
        tmp_path: Path) -> None:
    """checkpoint-3's trainer_state.json is cut: the resume takes checkpoint-2, sets checkpoint-3
    aside as checkpoint-3.damaged (its weights may be intact; it was deleted), points ``latest``
    at checkpoint-2, forgets a ``best`` that named checkpoint-3, and keeps metrics.jsonl's first
    2 rows, replaced whole."""
    import torch

    from r1fit.checkpoint.manager import CheckpointManager, list_checkpoints

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.keep=0"])
    manager = CheckpointManager(tmp_path, cfg, "sft", resume=None)
    manager.add_model("model", torch.nn.Linear(2, 2, bias=False))
    rows = [json.dumps({"step": s}) + "\n" for s in (1, 2, 3)]
    for step in (1, 2, 3):
        (tmp_path / "metrics.jsonl").write_text("".join(rows[:step]))
        manager.save("sft", step, {name: Box(step) for name in ("optimizer", "scheduler",
                                                                   "rng")}, metrics_lines=step)
    (tmp_path / "best").write_text(json.dumps({"checkpoint": "checkpoint-3", "metric": "loss",
                                               "value": 0.1}))
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{")
    out, resume = open_output_dir(cfg, "sft")
    assert resume is not None and resume.path.name == "checkpoint-2"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-1"]
    assert (out / "checkpoint-3.damaged" / "weights").is_dir()
    assert (out / "latest").read_text() == "checkpoint-2\n" and not (out / "best").exists()
    assert (out / "metrics.jsonl").read_text() == "".join(rows[:2])


@pytest.mark.parametrize("garbled", ["garbage{", "[]", '{"checkpoint": ""}',
                                     '{"checkpoint": "checkpoint-1", "metric": "loss"}'])
def test_an_unreadable_best_file_is_forgotten_on_resume(tmp_path: Path, garbled: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A garbled ``best`` (before: a JSONDecodeError traceback when the manager read it, and the
    resume's own check took '' for the run folder itself and kept the file) is removed with a
    warning; the resumed run's manager reads no best and keeps one anew."""
    import torch

    from r1fit.checkpoint.manager import CheckpointManager

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.keep=0"])
    manager = CheckpointManager(tmp_path, cfg, "sft", resume=None)
    manager.add_model("model", torch.nn.Linear(2, 2, bias=False))
    (tmp_path / "metrics.jsonl").write_text("")
    manager.save("sft", 1, {name: Box(1) for name in ("optimizer", "scheduler", "rng")})
    (tmp_path / "best").write_text(garbled)
    assert CheckpointManager(tmp_path, cfg, "sft", resume=None).best is None
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        out, resume = open_output_dir(cfg, "sft")
    assert resume is not None and not (out / "best").exists()
    assert "forgetting the best-checkpoint file" in caplog.text and "unreadable" in caplog.text


def test_damaged_metrics_rows_are_left_out_and_the_last_row_ends_its_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint recorded 4 rows; on disk the 2nd holds a byte that is not UTF-8 and the
    4th, the last, was cut mid-write (no end of line): the resumed run's history keeps rows 1
    and 3, each on its own line, so the next row it appends is a row of its own; the warning
    names the damaged lines. (Before, a bad byte stopped the resume with a traceback and the
    cut row swallowed the next step's.)"""
    import torch

    from r1fit.checkpoint.manager import CheckpointManager

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.keep=0"])
    manager = CheckpointManager(tmp_path, cfg, "sft", resume=None)
    manager.add_model("model", torch.nn.Linear(2, 2, bias=False))
    (tmp_path / "metrics.jsonl").write_text("")
    manager.save("sft", 1, {name: Box(1) for name in ("optimizer", "scheduler", "rng")},
                 metrics_lines=4)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "tag": "\xff"}\n'
                                             b'{"step": 3}\n{"step": 4, "loss": 0.')
    with caplog.at_level("WARNING", logger="r1fit"):
        out, resume = open_output_dir(cfg, "sft")
    assert resume is not None and resume.path.name == "checkpoint-1"
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 3}\n'
    assert "2 damaged rows left out (lines 2, 4: not a JSON row of UTF-8 text)" in caplog.text


def test_a_folder_that_is_no_runs_is_refused_untouched(tmp_path: Path) -> None:
    """train.output_dir naming a model's folder (its config.json, no run in it) wrote the run's
    config.json over the model's, and the run's final/ over any there: refused, nothing
    written. A run stopped before its first step (its own config.json) is taken again."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2_5_VLForConditionalGeneration"]}')
    (model / "model.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(CheckpointError, match=f"train.output_dir={model} holds config.json, which "
                       "no r1fit run wrote"):
        _open(model)
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    stopped = tmp_path / "stopped"
    _open(stopped)  # writes its config.json, then stops before any step
    (stopped / "log.txt").write_text("started\n")
    out, resume = _open(stopped)
    assert out == stopped and resume is None


def test_resuming_from_a_renamed_copy_inside_the_output_folder(tmp_path: Path) -> None:
    """checkpoint.resume=out/keep-step1 (a copy of checkpoint-1 under a name with no step in it):
    the run resumes at step 1 from it, checkpoint-2 goes (it lies after the point) and
    ``latest`` names the copy."""
    import shutil

    import torch

    from r1fit.checkpoint.manager import CheckpointManager, list_checkpoints

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.keep=0"])
    manager = CheckpointManager(tmp_path, cfg, "sft", resume=None)
    manager.add_model("model", torch.nn.Linear(2, 2, bias=False))
    rows = [json.dumps({"step": s}) + "\n" for s in (1, 2)]
    for step in (1, 2):
        (tmp_path / "metrics.jsonl").write_text("".join(rows[:step]))
        manager.save("sft", step, {name: Box(step) for name in ("optimizer", "scheduler",
                                                                   "rng")}, metrics_lines=step)
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "keep-step1")
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.keep=0",
                             f"checkpoint.resume={tmp_path / 'keep-step1'}"])
    out, resume = open_output_dir(cfg, "sft")
    assert resume is not None and resume.path.name == "keep-step1" and resume.step == 1
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    assert (out / "keep-step1").is_dir() and (out / "latest").read_text() == "keep-step1\n"
    assert (out / "metrics.jsonl").read_text() == rows[0]


def test_overwrite_deletes_what_a_run_wrote_and_keeps_the_users_files(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    ours = ["checkpoint-3", "checkpoint-warmup-2", "checkpoint-4.partial", "checkpoint-5.damaged",
            "final", "final.partial", "rollouts", "tensorboard", "wandb", "mlflow", "trackio"]
    for name in ours:
        (out / name).mkdir(parents=True)
        (out / name / "inside.bin").write_bytes(b"x")
    run_files = ["metrics.jsonl", "log.txt", "summary.json", "report.html", "latest", "best",
                 "latest.tmp", "report.html.partial", "profile-step-7.txt"]
    for name in run_files:
        (out / name).write_text("1\n")
    theirs = ["notes.md", "train.sh", "data", "checkpoints-old", "config.yaml"]
    for name in theirs[:2] + theirs[4:]:
        (out / name).write_text("mine\n")
    for name in theirs[2:4]:
        (out / name).mkdir()
        (out / name / "keep.txt").write_text("mine\n")
    with caplog.at_level("WARNING", logger="r1fit.checkpoint"):
        _, resume = _open(out, "train.overwrite=true")
    assert resume is None
    left = sorted(child.name for child in out.iterdir())
    assert left == sorted([*theirs, "config.json", ".r1fit.lock"])  # the new run's config
    assert (out / "data" / "keep.txt").read_text() == "mine\n"
    assert f"deleting the previous run in {out} (20 entries)" in caplog.text
    assert ("kept 5 entries r1fit did not write: checkpoints-old, config.yaml, data, notes.md, "
            "train.sh") in caplog.text
    assert "eval/" not in caplog.text


def test_overwrite_keeps_r1fit_evals_results_and_says_whose_they_are(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    (out / "eval" / "checkpoint-2-20261129").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.md").write_text("mine\n")
    with caplog.at_level("WARNING", logger="r1fit.checkpoint"):
        _open(out, "train.overwrite=true")
    assert (out / "eval" / "checkpoint-2-20261129").is_dir()
    assert "kept eval/ (r1fit eval's results of models evaluated before" in caplog.text
    assert "kept 1 entry r1fit did not write: notes.md" in caplog.text


def test_overwrite_without_a_previous_run_deletes_nothing(tmp_path: Path) -> None:
    """No run in the folder: train.overwrite deletes nothing; a log of the user's, which the
    run would write into, is refused, and one beside a stopped run's config.json is the run's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.txt").write_text("a log of the user's, not a run")  # no metrics, no checkpoint
    with pytest.raises(CheckpointError, match="holds log.txt, which no r1fit run wrote"):
        _open(out, "train.overwrite=true")
    assert (out / "log.txt").read_text() == "a log of the user's, not a run"
    (out / "notes.md").write_text("the user's")
    (out / "log.txt").unlink()
    _open(out, "train.overwrite=true")
    assert (out / "notes.md").read_text() == "the user's"
