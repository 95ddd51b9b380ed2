"""The run report: plots, alarms and the rollout browser from a synthetic run folder; a real 2-step
run that saves rollouts and reports them; the page in headless Chromium (not blank, no console
error), multi-turn rows on it."""

from __future__ import annotations

import html
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from r1fit.cli import main
from r1fit.report.html import LiveReport, build_report, write_report
from r1fit.report.rollouts import save_rollout

from .test_trajectories import scored_rollout


def synthetic_run(folder: Path, *, trouble: bool = False, tools: bool = False) -> Path:
    """A run folder: a warm-up, an evaluation at step 0, 12 GRPO steps (with reward errors when
    ``trouble``; with ``tools``, the multi-turn figures of 2 turns, 3 from step 7), one saved step
    of rollouts (2 prompts x 3 completions) with its images."""
    folder.mkdir()
    rows = [{"warmup/step": 1, "warmup/loss": 2.0}, {"warmup/step": 2, "warmup/loss": 1.5},
            {"step": 0, "eval/accuracy": 0.1, "eval/format": 0.5}]
    for s in range(1, 13):
        rows.append({"step": s, "loss": 0.1, "reward_mean": 0.2 + s / 20, "reward_std": 0.3,
                     "reward/accuracy": s / 20, "reward/format": 0.8, "accuracy": s / 20,
                     "kl": None if s == 1 else 0.01 * s, "clip_fraction": 0.02,
                     "grad_norm": 1.0 + s % 3, "completion_len_mean": 60 + s,
                     "completion_clipped_fraction": 0.1, "zero_variance_groups": 0.25,
                     "seconds_generate": 2.0, "seconds_score": 0.1, "seconds_update": 1.5,
                     "predicted_seconds_generate": 1.8, "predicted_seconds_update": 1.2,
                     "tokens_per_second": 300 + s, "learning_rate": 1e-5,
                     "peak_memory_bytes": 2**30 + s * 2**20, "reward_errors": 4 if trouble else 0,
                     **({"eval/accuracy": 0.4} if s % 6 == 0 else {}),
                     **(turn_figures(s) if tools else {})})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "log.txt").write_text("2026-01-01 INFO r1fit.memory: auto-fit for 80.00 GiB on "
                                    "cuda: memory.micro_batch=4 (planned peak 1.50 GiB)\n")
    saved = folder / "rollouts"
    saved.mkdir()
    lines = []
    for group, colour in enumerate(["red", "blue"]):
        image = f"step_000010_g{group:03d}_0.png"
        Image.new("RGB", (48, 32), colour).save(saved / image)
        for k in range(3):
            lines.append({"step": 10, "row": group * 3 + k, "group": group,
                          "prompt": f"What colour is shape {group}?",
                          "completion": f"<answer>{colour if k else 'green'} & more</answer>",
                          "reward": 1.5 if k else 0.5, "advantage": 0.7 if k else -1.4,
                          "components": {"accuracy": float(k > 0), "format": 1.0},
                          "images": [image]})
    (saved / "step_000010.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def turn_figures(step: int) -> dict[str, float]:
    """A multi-turn step's figures (r1fit/report/step.py): turns 1-2, a third from step 7, and
    the reward by 0 or 1 tool calls."""
    turns = range(1, 4 if step >= 7 else 3)
    return {"turns_mean": 2.0, "tool_calls_mean": 1.0, "masked_token_fraction": 0.3,
            **{f"turn_advantage/{k}": 0.1 * (2 - k) for k in turns},
            **{f"turn_ratio/{k}": 1.0 + 0.01 * k * (step % 2) for k in turns},
            **{f"turn_clip_fraction/{k}": 0.02 * k for k in turns},
            **{f"turn_kl/{k}": 0.001 * step * k for k in turns},
            "reward_by_tool_calls/0": 0.2, "reward_by_tool_calls/1": 0.3 + step / 40}


TURN_CAPTIONS = ["advantage per policy token, by turn",
                 "importance ratio to the old policy, by turn (policy tokens)",
                 "clipped policy tokens (fraction), by turn",
                 "KL to the reference (k3) per policy token, by turn",
                 "mean reward by tool calls per row",
                 "trajectory tokens out of the loss: tool turns (fraction)"]


def figures(page: str) -> list[str]:
    return re.findall(r"<figcaption>(.*?)</figcaption>", page)


def test_report_has_plots_rollouts_and_no_alarm_on_a_healthy_run(tmp_path):
    run = synthetic_run(tmp_path / "run")
    page = build_report(run)
    assert figures(page) == [
        "reward", "accuracy", "loss", "kl", "completion length (tokens)",
        "completions clipped at algo.max_new_tokens (fraction)", "zero-variance groups (fraction)",
        "clip_fraction", "grad_norm", "learning_rate", "tokens_per_second",
        "seconds per step, measured and predicted",
        "peak memory", "warm-up (SFT) loss"]
    assert page.count("<svg") == len(figures(page))
    assert "planner&#x27;s prediction: 1.50 GiB" in page
    assert all(f"</i>{key}</span>" in page for key in ("seconds_update", "predicted_seconds_update"))
    assert "no alarm" in page and 'class="alarm"' not in page
    # the rollout browser: each prompt's image once, by a path relative to the page, and its rows
    assert page.count('<img src="rollouts/step_000010_g000_0.png"') == 1
    assert page.count('<img src="rollouts/step_000010_g001_0.png"') == 1
    assert page.count('<tr><td class="n" data-v=') == 6
    assert "&lt;answer&gt;green &amp; more&lt;/answer&gt;" in page  # escaped
    assert '<th>accuracy</th><th>format</th><th>advantage</th>' in page
    assert 'data-v="-1.4"' in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page  # nothing from the network


def test_entropy_gets_a_plot_when_logged_and_old_runs_render_without_it(tmp_path):
    run = synthetic_run(tmp_path / "run")  # logged before the entropy metric existed
    assert "entropy (nats per token)" not in figures(build_report(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{**r, "entropy": 0.9 - r["step"] / 50} if "reward_mean" in r else r for r in rows]
    rows[3]["entropy"] = None  # a step without it (non-finite values are logged as null)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = build_report(run)
    assert figures(page)[3:5] == ["kl", "entropy (nats per token)"]
    assert "no alarm" in page  # 0.88 -> 0.66: no collapse


def test_sft_run_page_shows_what_sft_logs(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.25, "eval/format": 0.0}]
    rows += [{"step": s, "loss": 3.0 / s, "grad_norm": 2.0, "tokens_per_second": 500.0 + s,
              "peak_memory_bytes": 2**30, "peak_reserved_bytes": None, "bad_rows": 0,
              "oom_retries": 0, **({"eval/accuracy": 0.5, "eval/format": 1.0} if s == 4 else {})}
             for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = build_report(run)
    assert figures(page) == ["accuracy", "loss", "grad_norm", "tokens_per_second", "peak memory"]
    assert "4 SFT steps (last step 4), 5 metrics" in page and "no alarm" in page
    assert "or an SFT run" in page  # no rollouts


def test_missing_keys_leave_plots_out_and_an_unrecorded_prediction_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5,
                                                   "peak_memory_bytes": 1000}) + "\n")
    page = build_report(run)
    assert figures(page) == ["reward", "peak memory"]
    assert "prediction: not recorded" in page
    assert "No rollouts saved" in page


def test_alarms_are_shown_at_the_top(tmp_path):
    page = build_report(synthetic_run(tmp_path / "run", trouble=True))
    assert page.count('class="alarm"') == 1 and "<b>reward_errors</b>: 4 reward calls" in page
    assert page.index('class="alarm"') < page.index("<figure>")


def test_cli_writes_the_report_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file()
    out = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert '<img src="../run/rollouts/step_000010_g000_0.png"' in out.read_text()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "elsewhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("r1fit: error: ") and "has no metrics.jsonl" in err
    assert len(err.splitlines()) == 1


def test_two_step_run_saves_rollouts_and_reports_them(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", "train.max_steps=2",
                 "train.prompts_per_step=2", "algo.num_generations=3", "algo.max_new_tokens=6",
                 "sft.format_warmup_steps=1", "sft.batch_size=2", "data.eval_size=2",
                 "eval.before_train=false", "memory.micro_batch=6",
                 "memory.generation_batch=6", "data.shapes.train_size=20",
                 "data.shapes.image_size=56", "data.max_pixels=3136",
                 "report.rollouts_every=1", "report.every=1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 <= r["completion_clipped_fraction"] <= 1 and 0 <= r["zero_variance_groups"] <= 1
    for step in (1, 2):
        saved = [json.loads(line) for line in
                 (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert [r["row"] for r in saved] == list(range(6))
        assert [r["group"] for r in saved] == [0, 0, 0, 1, 1, 1]
        assert set(saved[0]["components"]) == {"accuracy", "format"}
        images = sorted(p.name for p in (out / "rollouts").glob(f"step_{step:06d}_*.png"))
        assert images == [f"step_{step:06d}_g000_0.png", f"step_{step:06d}_g001_0.png"]
        assert saved[0]["images"] == [images[0]] and saved[5]["images"] == [images[1]]
    assert (out / "report.html").is_file()  # written by training
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert page.count("<summary>step ") == 2 and page.count('<tr><td class="n" data-v=') == 12
    assert page.count('<img src="rollouts/step_') == 4
    assert {"reward", "completions clipped at algo.max_new_tokens (fraction)",
            "warm-up (SFT) loss"} <= set(figures(page))


def test_multi_turn_diagnostics_have_a_section_only_with_tools(tmp_path):
    assert 'id="multi-turn"' not in build_report(synthetic_run(tmp_path / "plain"))
    page = build_report(synthetic_run(tmp_path / "tools", tools=True))
    section = page.split('<h2 id="multi-turn">Multi-turn diagnostics</h2>')[1].split("<h2>")[0]
    assert figures(section) == TURN_CAPTIONS
    # each turn a line, in turn order (turn 3 from step 7 on); each number of calls a line
    assert re.findall(r"<span><i [^>]*></i>(turn_advantage/\d)</span>", section) == [
        "turn_advantage/1", "turn_advantage/2", "turn_advantage/3"]
    assert "reward_by_tool_calls/0" in section and "reward_by_tool_calls/1" in section
    assert not set(TURN_CAPTIONS) & set(figures(page.split('id="multi-turn"')[0]))


def test_page_renders_in_headless_chromium_without_console_errors(tmp_path, headless_chromium,
                                                                  chromium_dom):
    run = synthetic_run(tmp_path / "run", trouble=True, tools=True)
    save_rollout(scored_rollout(tools=True, step=12), None, run / "rollouts")  # multi-turn rows
    shot, console = headless_chromium(write_report(run))
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # text, plots and images, not a blank page
    assert console == []
    # Chromium shows the multi-turn diagnostics: their section, a plot per figure, a line per turn
    dom = chromium_dom(tmp_path / "run" / "report.html")
    section = dom.split('<h2 id="multi-turn">Multi-turn diagnostics</h2>')[1].split("<h2>")[0]
    assert figures(section) == TURN_CAPTIONS
    assert section.count("<svg") == len(TURN_CAPTIONS)
    assert section.count("<polyline") == 3 * 4 + 2 + 1  # 3 turns x 4 figures, 2 call counts, 1


def test_training_rewrites_the_page_every_n_steps_on_rank_0_only(tmp_path):
    run = synthetic_run(tmp_path / "run")
    other = LiveReport(SimpleNamespace(rollouts_every=1, every=1), run, main=False)
    other.after_step({"step": 13, "reward_mean": 0.9})
    other.finish()
    assert not (run / "report.html").exists()
    live = LiveReport(SimpleNamespace(rollouts_every=0, every=2), run, main=True)
    assert live.watch is not None and len(live.watch.rows) == 15  # the rows so far
    live.after_step({"step": 13, "reward_mean": 0.9})
    assert not (run / "report.html").exists()
    live.after_step({"step": 14, "reward_mean": 0.9})
    assert (run / "report.html").is_file()
    (run / "report.html").unlink()
    live.finish()
    assert (run / "report.html").is_file()


def test_report_of_a_run_killed_while_writing_metrics_reads_the_whole_lines(tmp_path, caplog):
    run = synthetic_run(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    whole = len(metrics.read_text().splitlines())
    with metrics.open("a") as f:
        f.write('{"step": 13, "loss": 0.1, "rew')  # the run was killed mid-row
    with caplog.at_level(logging.WARNING, logger="r1fit"):
        assert main(["report", str(run)]) == 0
    warned = f"{metrics}:{whole + 1}: a half-written last line (the run stopped while writing it)"
    assert any(warned in r.getMessage() for r in caplog.records)
    page = (run / "report.html").read_text()
    assert f"{whole} metrics\nrows (1 unreadable line skipped: {warned})." in page
    assert "12 GRPO steps (last step 12)" in page


def test_rows_the_page_cannot_place_are_skipped_and_named_and_out_may_be_a_folder(tmp_path):
    """Valid JSON that is no usable row: a metrics row whose step is no whole number, a saved
    rollout without its step or group (each once a traceback), NaN and Infinity values (JSON
    literals Python reads), which leave their points out of the plots; --out naming a folder
    writes report.html into it (it raised IsADirectoryError and left a .partial file)."""
    run = synthetic_run(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[5] = lines[5].replace('"step": 3,', '"step": "three",')
    lines[6] = lines[6].replace('"loss": 0.1', '"loss": NaN').replace(
        '"reward_std": 0.3', '"reward_std": Infinity')
    metrics.write_text("\n".join(lines) + "\n")
    saved = run / "rollouts" / "step_000010.jsonl"
    with saved.open("a") as f:
        f.write('{"a": 1}\n{"step": 10, "group": "g"}\n')
    folder = tmp_path / "pages"
    folder.mkdir()
    assert main(["report", str(run), "--out", str(folder)]) == 0
    assert [p.name for p in folder.iterdir()] == ["report.html"]
    assert main(["report", str(run), "--out", f"{tmp_path / 'new'}/"]) == 0  # a new folder
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["report.html"]
    page = (folder / "report.html").read_text()
    assert html.escape(f"{metrics}:6: its 'step' is 'three', not a whole number") in page
    assert "11 GRPO steps (last step 12)" in page
    assert "nan" not in re.sub(r"[a-z]nan|nan[a-z]", "", page.lower())  # no NaN coordinate
    assert "step 10: 2 prompts, 6 completions" in page  # the two bad rollout rows left out
