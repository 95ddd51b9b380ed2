"""Reading metrics.jsonl back: whole lines are rows, a half-written or corrupt line is skipped,
named (file:line) and counted, never a JSONDecodeError."""

from __future__ import annotations

import json
import logging

from r1fit.report.metrics import MetricsWriter, grpo_step_rows, read_json_lines, read_metrics

ROWS = [{"step": s, "loss": 0.5 / s} for s in range(1, 5)]


def _write(path, rows=ROWS) -> bytes:
    with MetricsWriter(path) as writer:
        for row in rows:
            writer.write(row)
    return path.read_bytes()


def test_a_half_written_last_line_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    whole = _write(path)
    path.write_bytes(whole + b'{"step": 5, "lo')  # killed while writing row 5
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        read = read_json_lines(path)
    assert read.rows == ROWS
    assert read.skipped == [f"{path}:5: a half-written last line (the run stopped while writing it)"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: skipped 1 unreadable line, read 4 rows: {path}:5: a half-written last line (the "
        "run stopped while writing it)"]
    assert read_metrics(path) == ROWS


def test_a_corrupt_line_in_the_middle_is_skipped_named_and_counted(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = _write(path).split(b"\n")
    lines[1] = b'{"step": 2, "loss": \xff\xfe}'  # garbage bytes, not even UTF-8
    lines[2] = b"[3]"  # JSON, but not a row
    path.write_bytes(b"\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        read = read_json_lines(path)
    assert read.rows == [ROWS[0], ROWS[3]]
    assert len(read.skipped) == 2
    assert read.skipped[0].startswith(f"{path}:2: not JSON (")
    assert read.skipped[1] == f"{path}:3: not a JSON object but list"
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"{path}: skipped 2 unreadable lines, read 2 rows: {path}:2: ")
    assert "\n" not in message


def test_whole_files_and_blank_lines_read_silently(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_write(path) + b"\n  \n")
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        assert read_json_lines(path) == (ROWS, [])
    assert not caplog.records
    assert json.loads(path.read_text().splitlines()[0]) == ROWS[0]


def test_grpo_step_rows_leave_out_other_rows_and_can_keep_a_steps_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "reward_mean": 0.1}, {"step": 1, "eval/accuracy": 0.5},
            {"step": 2, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.3},  # step 2 redone
            {"step": 3, "loss": 1.0}]  # an SFT row: no reward
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert grpo_step_rows(path) == [rows[0], rows[2], rows[3]]
    assert grpo_step_rows(path, last_per_step=True) == [rows[0], rows[3]]


def test_a_metrics_file_deleted_under_the_run_stops_it(tmp_path) -> None:
    """Its folder removed mid-run: the rows went into a file no folder holds, and the next
    checkpoint remade the folder holding no metrics, log or lock; now the next row stops the run
    with one line naming the file, and a save does not remake the folder."""
    import shutil

    import pytest
    import torch

    from r1fit.checkpoint.manager import CheckpointError, CheckpointManager
    from r1fit.config import load_config
    from r1fit.report.metrics import OutputRemoved

    out = tmp_path / "run"
    out.mkdir()
    writer = MetricsWriter(out / "metrics.jsonl")
    writer.write({"step": 1})
    cfg = load_config(None, [f"train.output_dir={out}", "checkpoint.every=1"])
    manager = CheckpointManager(out, cfg, "sft", resume=None)
    manager.add_model("model", torch.nn.Linear(2, 2, bias=False))
    shutil.rmtree(out)
    with pytest.raises(OutputRemoved, match=f"^{out / 'metrics.jsonl'} was deleted while the run "
                                            "wrote it"):
        writer.write({"step": 2})
    with pytest.raises(CheckpointError, match=f"could not save checkpoint-2 in {out}: "):
        manager.save("sft", 2, {})
    assert not out.exists()
    writer.close()
