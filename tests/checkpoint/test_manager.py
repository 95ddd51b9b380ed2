"""The manager on its own: layout, manifest, latest pointer, retention, best, verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from r1fit.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    ResumePoint,
    list_checkpoints,
    missing_for_resume,
    read_trainer_state,
    verify,
)
from r1fit.config import load_config


class Box:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class PerRankBox(Box):
    storage = "per_rank"


class RestartableBox(Box):
    """Like the optimizer: left out of weights-only checkpoints."""

    restartable = True


def manager(tmp_path: Path, *overrides: str) -> CheckpointManager:
    cfg = load_config(None, [f"train.output_dir={tmp_path}", *overrides])
    m = CheckpointManager(tmp_path, cfg, "sft", resume=None)
    m.add_model("model", torch.nn.Linear(2, 2, bias=False))
    return m


def names(out: Path) -> list[str]:
    return [p.name for p in list_checkpoints(out)]


def test_layout_manifest_and_latest(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 3, {"optimizer": Box(1), "sampler": Box(2), "rng": PerRankBox(3),
                             "scheduler": Box(4)}, metrics={"loss": 0.5})
    assert path == tmp_path / "checkpoint-3"
    manifest = json.loads((path / "manifest.json").read_text())
    # one process: one DCP shard file holding the weights; a per-rank state's file is named by
    # rank
    assert set(manifest["files"]) == {"weights/.metadata", "weights/__0_0.distcp",
                                      "optimizer.json", "sampler.json", "rng-rank0.json",
                                      "scheduler.json", "trainer_state.json", "config.json"}
    state = json.loads((path / "trainer_state.json").read_text())
    assert (state["step"], state["phase"], state["kind"]) == (3, "sft", "sft")
    assert state["metrics"] == {"loss": 0.5} and state["r1fit_version"]
    assert (tmp_path / "latest").read_text() == "checkpoint-3\n"
    assert verify(path) is None and missing_for_resume(path) == []


def test_retention_keeps_the_newest_and_the_best(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.keep=2",
                "checkpoint.keep_best_by=eval/accuracy")
    accuracy = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: 0.6}
    for step, acc in accuracy.items():
        metrics = {} if acc is None else {"eval/accuracy": acc}
        m.save("sft", step, {"sampler": Box(step)}, metrics=metrics)
    assert names(tmp_path) == ["checkpoint-5", "checkpoint-4", "checkpoint-2"]
    assert json.loads((tmp_path / "best").read_text()) == {
        "checkpoint": "checkpoint-2", "metric": "eval/accuracy", "value": 0.9}


def test_a_keep_best_by_metric_no_step_logs_is_said_once_with_close_names(tmp_path, caplog):
    """A typo ('eval/acuracy') kept no best checkpoint and said nothing: the first saved step
    without the metric says so once, with the row's close names; no best file appears."""
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.keep=0",
                "checkpoint.keep_best_by=eval/acuracy")
    with caplog.at_level("WARNING", logger="r1fit"):
        m.save("warmup", 5, {"sampler": Box(0)}, metrics={"loss": 2.0})  # no evaluation there
        for step in (1, 2):
            m.save("sft", step, {"sampler": Box(step)},
                   metrics={"eval/accuracy": 0.5, "loss": 1.0})
    said = [r.getMessage() for r in caplog.records if "keep_best_by" in r.getMessage()]
    assert said == ["checkpoint.keep_best_by=eval/acuracy: checkpoint-1's step logged no such "
                    "metric (close: eval/accuracy); a checkpoint is kept as best only at a step "
                    "that logs it (an evaluation's, for eval/ metrics)"]
    assert not (tmp_path / "best").exists()


def test_min_mode_and_keep_all(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.keep=0",
                "checkpoint.keep_best_by=loss", "checkpoint.keep_best_mode=min")
    for step, loss in {1: 3.0, 2: 1.0, 3: 2.0}.items():
        m.save("sft", step, {"sampler": Box(step)}, metrics={"loss": loss})
    assert names(tmp_path) == ["checkpoint-3", "checkpoint-2", "checkpoint-1"]
    assert json.loads((tmp_path / "best").read_text())["checkpoint"] == "checkpoint-2"


def test_warmup_checkpoints_sort_before_the_main_phase(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.keep=0")
    m.save("warmup", 10, {"sampler": Box(0)})
    m.save("grpo", 1, {"sampler": Box(0)})
    (tmp_path / "checkpoint-2.partial").mkdir()
    assert names(tmp_path) == ["checkpoint-2.partial", "checkpoint-1", "checkpoint-warmup-10"]
    assert "incomplete save" in verify(tmp_path / "checkpoint-2.partial")


def test_weights_only_lists_what_a_resume_misses(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.weights_only=true")
    path = m.save("sft", 1, {"optimizer": RestartableBox(1), "scheduler": RestartableBox(1),
                             "rng": RestartableBox(1), "sampler": Box(1)})
    assert not (path / "optimizer.json").exists() and (path / "sampler.json").exists()
    assert missing_for_resume(path) == ["optimizer state", "LR scheduler state", "RNG states"]


def test_due():
    m = CheckpointManager(Path("/nonexistent"), load_config(None, ["checkpoint.every=3"]), "sft",
                          None)
    assert [s for s in range(1, 8) if m.due(s, last=s == 7)] == [3, 6, 7]
    off = CheckpointManager(Path("/nonexistent"), load_config(None, ["checkpoint.every=0"]),
                            "sft", None)
    assert not off.due(7, last=True)


def test_verify_reasons(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 1, {"sampler": Box(1)})
    original = (path / "sampler.json").read_text()
    (path / "sampler.json").write_text(original.replace("1", "2"))  # same size, other content
    assert "sampler.json does not match its sha256" in verify(path)
    (path / "sampler.json").write_text("{}")
    assert f"sampler.json has 2 bytes, the manifest says {len(original)}" in verify(path)
    (path / "sampler.json").unlink()
    assert verify(path) == "sampler.json is missing"
    (path / "manifest.json").unlink()
    assert "no manifest.json" in verify(path)


def test_a_manifest_of_valid_json_but_the_wrong_shape_is_a_reason_not_a_crash(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 1, {"sampler": Box(1)})
    manifest = json.loads((path / "manifest.json").read_text())
    for files in ({"sampler.json": {}}, ["sampler.json"], {"sampler.json": {"bytes": "9"}}):
        (path / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
        assert verify(path) == ("manifest.json is unreadable (its files are not each a {bytes, "
                                "sha256} record)")


def test_an_older_format_is_named(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 1, {"sampler": Box(1)})
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    assert verify(path) == ("checkpoint format 1 (an older r1fit, whose layout had no sharded "
                            "weights/); this r1fit reads format 2")


def test_a_weights_only_resume_restarts_what_it_lacks_and_loads_the_rest(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.weights_only=true")
    path = m.save("sft", 5, {"optimizer": RestartableBox(7), "sampler": Box(9)})
    restarted = []

    class Optimizer(RestartableBox):
        def restart(self, point):
            restarted.append(point.step)
            return "fresh optimizer"

    point = ResumePoint(path, read_trainer_state(path), weights_only=True)
    resumed = CheckpointManager(tmp_path, m.cfg, "sft", point)
    sampler, optimizer = Box(0), Optimizer(0)
    assert resumed.restore("sft", {"optimizer": optimizer, "sampler": sampler}) == 5
    assert (sampler.value, optimizer.value, restarted) == (9, 0, [5])
    # an object that cannot be restarted must be in the checkpoint
    with pytest.raises(CheckpointError, match="has no saved 'counters'"):
        resumed.restore("sft", {"counters": Box(0)})


def test_a_per_rank_state_is_written_and_read_by_rank(tmp_path):
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 1, {"rng": PerRankBox(3)})
    assert (path / "rng-rank0.json").is_file() and not (path / "rng.json").exists()
    point = ResumePoint(path, read_trainer_state(path), weights_only=False)
    box = PerRankBox(0)
    CheckpointManager(tmp_path, m.cfg, "sft", point).restore("sft", {"rng": box})
    assert box.value == 3


def test_a_failed_save_or_load_is_one_line_naming_the_cause(tmp_path, monkeypatch) -> None:
    """DCP's CheckpointException (a BaseException) prints every rank's whole traceback: its first
    rank's exception is the reason; an OS error its reason and file; a nearly full disk is said
    (torch's writer reports ENOSPC as 'unexpected pos 704 vs 598')."""
    import errno
    import shutil
    from collections import namedtuple
    from traceback import StackSummary

    import torch.distributed.checkpoint as dcp

    from r1fit.checkpoint.manager import disk_note, failure_reason

    mismatch = ValueError("Size mismatch between saved torch.Size([4, 64]) and current: "
                          "torch.Size([8, 64]) for model.lora_A\nmore lines")
    wrapped = dcp.api.CheckpointException("load failed", {0: (mismatch, StackSummary())})
    assert failure_reason(wrapped) == ("Size mismatch between saved torch.Size([4, 64]) and "
                                       "current: torch.Size([8, 64]) for model.lora_A")
    full = OSError(errno.ENOSPC, "No space left on device", "/x/y.json")
    assert failure_reason(full) == "No space left on device (/x/y.json)"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(100 << 20, 99 << 20, 1 << 20))
    assert disk_note(tmp_path, 2 << 20) == (f"; the disk holding {tmp_path} has 1.00 MiB free, "
                                            "less than a checkpoint (2.00 MiB)")
    assert disk_note(tmp_path, 1 << 19) == ""


class TensorBox(Box):
    """A state with a tensor: saved as .json + .safetensors."""

    def state_dict(self) -> dict:
        return {"value": self.value, "t": torch.full((3,), float(self.value))}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


#: how safetensors and tokenizers (Rust) word a full disk: their own error, and a bare Exception
RUST_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.mark.parametrize("failure", [
    lambda: __import__("safetensors").SafetensorError(RUST_FULL),
    lambda: Exception("No space left on device (os error 28)"),
], ids=["safetensors", "tokenizers"])
def test_a_full_disk_worded_by_a_rust_writer_is_one_line_and_the_last_checkpoint_stays(
        tmp_path, monkeypatch, failure) -> None:
    """safetensors reports a full disk as its SafetensorError, tokenizers' save as a bare
    Exception: both are a failed save (one line, the partial folder removed, the last checkpoint
    named intact), as an OSError is."""
    import r1fit.checkpoint.manager as manager_module

    m = manager(tmp_path, "checkpoint.every=1")
    m.save("sft", 1, {"sampler": TensorBox(1)})

    def full(*args, **kwargs):
        raise failure()

    monkeypatch.setattr(manager_module, "save_state", full)
    with pytest.raises(CheckpointError) as caught:
        m.save("sft", 2, {"sampler": TensorBox(2)})
    message = str(caught.value)
    assert message.startswith(f"could not save checkpoint-2 in {tmp_path}: ")
    assert "(os error 28)" in message and "checkpoint-1 is intact" in message
    assert "\n" not in message
    assert names(tmp_path) == ["checkpoint-1"]
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"


def test_a_bug_while_saving_is_not_worded_as_a_disk_problem(tmp_path, monkeypatch) -> None:
    import r1fit.checkpoint.manager as manager_module

    m = manager(tmp_path, "checkpoint.every=1")

    def bug(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(manager_module, "save_state", bug)
    with pytest.raises(TypeError, match="unsupported operand"):
        m.save("sft", 1, {"sampler": Box(1)})
    # so is an Exception that is not an OS error's wording
    monkeypatch.setattr(manager_module, "save_state",
                        lambda *a, **k: (_ for _ in ()).throw(Exception("no tokenizer.json")))
    with pytest.raises(Exception, match="no tokenizer.json") as caught:
        m.save("sft", 1, {"sampler": Box(1)})
    assert not isinstance(caught.value, CheckpointError)


def test_latest_not_written_after_the_checkpoint_is_in_place_says_so(tmp_path,
                                                                     monkeypatch) -> None:
    """The checkpoint was renamed into place before ``latest`` failed: the message says it was
    saved (not that it was not), no latest.tmp is left, and a resume takes it."""
    import errno
    import os

    import r1fit.checkpoint.files as files_module
    from r1fit.checkpoint.resume import find_resume_point

    m = manager(tmp_path, "checkpoint.every=1")
    m.save("sft", 1, {"sampler": Box(1)})
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("latest.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(files_module.os, "fsync", fsync)
    with pytest.raises(CheckpointError) as caught:
        m.save("sft", 2, {"sampler": Box(2)})
    assert str(caught.value) == (
        f"checkpoint-2 was saved in {tmp_path}, but its 'latest' file could not be written: No "
        "space left on device. Fix it (disk space, permissions) and rerun the same command: it "
        "resumes from checkpoint-2")
    assert not (tmp_path / "latest.tmp").exists()
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"
    assert verify(tmp_path / "checkpoint-2") is None
    monkeypatch.undo()
    assert find_resume_point(tmp_path)[0] == tmp_path / "checkpoint-2"


def test_a_state_file_safetensors_cannot_read_is_one_line_on_restore(tmp_path) -> None:
    """A .safetensors state file damaged past what the manifest checks (rewritten with it)."""
    m = manager(tmp_path, "checkpoint.every=1")
    path = m.save("sft", 1, {"sampler": TensorBox(1)})
    (path / "sampler.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbled")
    point = ResumePoint(path, read_trainer_state(path), weights_only=False)
    with pytest.raises(CheckpointError, match=r"checkpoint-1: cannot restore sampler: "):
        CheckpointManager(tmp_path, m.cfg, "sft", point).restore("sft",
                                                                 {"sampler": TensorBox(0)})


def test_a_resume_chooses_the_best_among_the_kept_checkpoints(tmp_path, caplog) -> None:
    """The ``best`` file can lag its checkpoints (a kill after checkpoint-1's rename, before its
    update: no file at all) or name another metric (keep_best_by changed on resume): the resume
    chooses the best among the kept checkpoints by the setting as it is now, and retention
    (keep=1) then keeps it. Before, checkpoint-2 became the best and checkpoint-1 was deleted."""
    import logging

    m = manager(tmp_path, "checkpoint.every=1", "checkpoint.keep=1",
                "checkpoint.keep_best_by=reward_mean")
    m.save("sft", 1, {"sampler": Box(1)}, metrics={"reward_mean": 0.875, "eval/accuracy": 0.25})
    m.save("sft", 2, {"sampler": Box(2)}, metrics={"reward_mean": 0.5, "eval/accuracy": 0.5})
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-1"]
    (tmp_path / "best").unlink()  # killed before checkpoint-1's best was written
    point = ResumePoint(tmp_path / "checkpoint-2", read_trainer_state(tmp_path / "checkpoint-2"),
                        weights_only=False)
    resumed = CheckpointManager(tmp_path, m.cfg, "sft", point)
    assert resumed.best == {"checkpoint": "checkpoint-1", "metric": "reward_mean", "value": 0.875}
    resumed.add_model("model", torch.nn.Linear(2, 2, bias=False))
    resumed.save("sft", 3, {"sampler": Box(3)}, metrics={"reward_mean": 0.6})
    assert names(tmp_path) == ["checkpoint-3", "checkpoint-1"]
    assert json.loads((tmp_path / "best").read_text())["checkpoint"] == "checkpoint-1"

    # keep_best_by changed on resume: chosen anew by eval/accuracy, said
    changed = load_config(None, [f"train.output_dir={tmp_path}", "checkpoint.every=1",
                                 "checkpoint.keep=1", "checkpoint.keep_best_by=eval/accuracy"])
    (tmp_path / "checkpoint-2").mkdir()  # stands in for a kept one: its state below
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(
        json.dumps({"metrics": {"eval/accuracy": 0.5}}))
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        again = CheckpointManager(tmp_path, changed, "sft", point)
    assert again.best == {"checkpoint": "checkpoint-2", "metric": "eval/accuracy", "value": 0.5}
    assert json.loads((tmp_path / "best").read_text()) == again.best
    assert "checkpoint.keep_best_by=eval/accuracy (the run kept its best by reward_mean" \
        in caplog.text
