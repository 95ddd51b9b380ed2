"""summary.json: the first and last evaluations of a run; a start (and a gain) only where the run
evaluated before training."""

from __future__ import annotations

import json
import logging

import pytest

from r1fit.report.metrics import MetricsWriter
from r1fit.report.summary import write_summary
from r1fit.train.evaluate import log_evaluation


def _summary(tmp_path, rows):
    tmp_path.mkdir(parents=True, exist_ok=True)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for row in rows:
        metrics.write(row)
    write_summary(tmp_path, metrics, steps=4, seconds=1.0, extra={}, main=True)
    return json.loads((tmp_path / "summary.json").read_text())


def test_a_start_and_a_gain_only_from_an_evaluation_before_training(tmp_path):
    evals = [{"step": 2, "eval/accuracy": 0.25, "eval/format": 1.0},
             {"step": 3, "loss": 0.1},
             {"step": 4, "eval/accuracy": 0.5, "eval/format": 0.75}]
    without = _summary(tmp_path / "a", evals)
    assert "eval_accuracy_start" not in without and "eval_accuracy_gain" not in without
    assert (without["eval_accuracy_end"], without["eval_format_end"]) == (0.5, 0.75)
    before = [{"step": 0, "eval/accuracy": 0.125, "eval/format": 0.5}, *evals]
    with_start = _summary(tmp_path / "b", before)
    assert list(with_start)[2:6] == ["eval_accuracy_start", "eval_accuracy_end",
                                     "eval_format_end", "eval_accuracy_gain"]
    assert with_start["eval_accuracy_start"] == 0.125
    assert with_start["eval_accuracy_gain"] == pytest.approx(0.375)


def test_each_evaluation_is_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="r1fit"):
        log_evaluation(20, {"eval/accuracy": 0.25, "eval/format": 1.0, "eval/size": 40,
                            "eval/bad_rows": 0})
        log_evaluation(40, {"eval/accuracy": None, "eval/format": None, "eval/size": 0,
                            "eval/bad_rows": 3})
    assert caplog.messages == ["eval at step 20: accuracy 0.250, format 1.000 (40 rows)",
                               "eval at step 40: no row could be scored (0 rows, 3 skipped)"]

