"""`r1fit sft` writes the run report: every report.every steps and at its end, with the plots of
what SFT logs (loss, grad norm, speed, memory, evaluations) and the summary."""

from __future__ import annotations

import re

from r1fit.cli import main
from r1fit.report import html
from r1fit.report.metrics import read_metrics


def test_sft_writes_its_report_every_n_steps_and_at_the_end(use_tiny_cache, tmp_path, monkeypatch):
    written = []  # metrics rows on disk each time the page is written
    real = html.write_report

    def counting(run_dir, out=None):
        written.append(len(read_metrics(run_dir / "metrics.jsonl")))
        return real(run_dir, out)

    monkeypatch.setattr(html, "write_report", counting)
    out = tmp_path / "run"
    assert main(["sft", f"train.output_dir={out}", "sft.steps=3", "sft.batch_size=4",
                 "data.eval_size=4", "data.shapes.train_size=50", "data.max_pixels=3136",
                 "data.shapes.image_size=56", "report.every=2"]) == 0
    # rows: the evaluation before training (step 0), then steps 1..3; the page after step 2, and
    # at the end
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert written == [3, 4]
    page = (out / "report.html").read_text()
    assert re.findall(r"<figcaption>(.*?)</figcaption>", page) == [
        "accuracy", "loss", "grad_norm", "tokens_per_second",
        "seconds per step, measured and predicted", "peak memory"]
    assert page.count("<svg") == 6
    assert "3 SFT steps (last step 3)" in page and "no alarm" in page
    assert "eval_accuracy_end" in page  # the summary, written before the page
