"""The end of a run: ``summary.json`` (first and last evaluation) and a table on the terminal."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from r1fit.report.metrics import MetricsWriter, read_metrics

log = logging.getLogger("r1fit")


def eval_history(metrics: MetricsWriter) -> list[dict[str, Any]]:
    """The evaluations of the run so far (from metrics.jsonl, so a resumed run has them all)."""
    metrics.flush()
    return [{"step": row.get("step"), **{k: v for k, v in row.items() if k.startswith("eval/")}}
            for row in read_metrics(metrics.path) if row.get("eval/accuracy") is not None]


def write_summary(out: Path, metrics: MetricsWriter, *, steps: int, seconds: float,
                  extra: dict[str, Any], main: bool) -> dict[str, Any]:
    """Close ``metrics``, write ``summary.json`` (on rank 0, ``main``) and print it; returns it."""
    summary: dict[str, Any] = {"output_dir": str(out), "steps": steps, **extra}
    evals = eval_history(metrics)
    if evals:
        # the start is an evaluation before training (eval.before_train): without one, no start
        # and no gain (the first evaluation came after some training)
        start = evals[0]["eval/accuracy"] if evals[0].get("step") == 0 else None
        if start is not None:
            summary["eval_accuracy_start"] = start
        summary["eval_accuracy_end"] = evals[-1]["eval/accuracy"]
        summary["eval_format_end"] = evals[-1]["eval/format"]
        if start is not None:
            summary["eval_accuracy_gain"] = evals[-1]["eval/accuracy"] - start
    summary["seconds"] = round(seconds, 1)
    metrics.close()
    if not main:
        return summary
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("summary: %s", json.dumps(summary))
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"r1fit: {steps} steps in {summary['seconds']:.0f} s -> {out}")
        table.add_column("evaluation")
        table.add_column("step", justify="right")
        table.add_column("accuracy", justify="right")
        table.add_column("format", justify="right")
        for i, row in enumerate(evals):
            name = ("end" if i == len(evals) - 1 else
                    "start" if i == 0 and row.get("step") == 0 else "")
            table.add_row(name, str(row.get("step", "")), f"{row['eval/accuracy']:.3f}",
                          f"{row['eval/format']:.3f}")
        Console(stderr=True).print(table)
    return summary
