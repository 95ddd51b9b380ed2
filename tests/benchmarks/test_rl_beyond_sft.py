"""The pure parts of benchmarks/rl_beyond_sft.py: the colour task's wrong demonstrations, the
curves read from metrics rows, the control arm's plan, the verdict on made-up curves, and the
arguments."""

from __future__ import annotations

import argparse
import json

import pytest
from benchkit import load_script

rb = load_script("rl_beyond_sft")


def test_relabel_pairs_are_parsed_and_bad_ones_refused():
    assert rb.parse_relabel("red=yellow") == {"red": "yellow"}
    assert rb.parse_relabel(" Red = Yellow ,green=blue") == {"red": "yellow", "green": "blue"}
    for bad in ("red", "red=", "=yellow", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            rb.parse_relabel(bad)


def test_the_share_of_a_class_is_relabelled_evenly_and_the_others_kept():
    answers = ["red", "green", "red", "red", "blue", "red", "red"]  # 5 red rows
    shown = rb.shown_answers(answers, {"red": "yellow"}, 0.8)
    # red rows k = 0..4: floor((k + 1) * 0.8) > floor(k * 0.8) for k = 1, 2, 3, 4 (4 of 5)
    assert shown == ["red", "green", "yellow", "yellow", "blue", "yellow", "yellow"]
    every = rb.shown_answers(answers, {"red": "yellow"}, 1.0)
    assert every == ["yellow", "green", "yellow", "yellow", "blue", "yellow", "yellow"]


def test_the_greedy_ceiling_is_the_share_of_rows_whose_class_majority_is_true():
    answers = ["red", "yellow", "green", "blue"] * 10
    assert rb.greedy_ceiling(answers, rb.shown_answers(answers, {"red": "yellow"}, 0.8)) == 0.75
    assert rb.greedy_ceiling(answers, answers) == 1.0


def test_the_demonstrations_file_holds_the_shown_answers(tmp_path):
    path, ceiling = rb.write_colour_rows(tmp_path, 16, 0, {"red": "yellow"}, 1.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 16 and ceiling == 0.75
    assert not any(r["solution"] == "red" for r in rows)
    assert all((tmp_path / r["image"]).is_file() for r in rows)
    with pytest.raises(rb.BenchmarkError, match="purple"):
        rb.write_colour_rows(tmp_path, 4, 0, {"purple": "red"}, 1.0)


def test_the_zoom_demonstrations_zoom_right_and_name_the_shown_pattern(tmp_path):
    from PIL import Image

    path, ceiling = rb.write_zoom_rows(tmp_path, 6, 0, {"checkered": "horizontal"}, 1.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # answers cycle horizontal, vertical, checkered: both checkered rows are shown "horizontal"
    assert [r["solution"] for r in rows] == ["horizontal", "vertical", "horizontal"] * 2
    assert ceiling == pytest.approx(2 / 3)
    for row in rows:
        x1, y1, x2, y2 = row["focus"]  # the 32 px mark of the 896 px image, in fractions
        assert (x2 - x1, y2 - y1) == (pytest.approx(32 / 896), pytest.approx(32 / 896))
        # the box is centred where the question says the mark is
        assert f"centred at x={(x1 + x2) / 2:.2f}, y={(y1 + y2) / 2:.2f}" in row["problem"]
        assert Image.open(tmp_path / row["image"]).size == (896, 896)
    with pytest.raises(rb.BenchmarkError, match="striped"):
        rb.write_zoom_rows(tmp_path, 3, 0, {"striped": "vertical"}, 1.0)


def test_a_curve_is_read_at_cumulative_training_seconds():
    rows = [{"step": 0, "eval/accuracy": 0.75},  # before the first step: no time
            {"step": 1, "reward_mean": 1.0, "seconds_generate": 1.0, "seconds_update": 2.0},
            {"step": 2, "reward_mean": 1.0, "seconds_generate": 1.0, "seconds_update": 1.0},
            {"step": 2, "eval/accuracy": 0.9},  # the step's evaluation, merged with it
            {"step": 3, "loss": 0.1, "seconds_step": 0.5, "eval/accuracy": 1.0}]
    points, seconds = rb.read_curve(rows)
    assert [(p.seconds, p.step, p.accuracy) for p in points] == [
        (0.0, 0, 0.75), (5.0, 2, 0.9), (5.5, 3, 1.0)]
    assert seconds == [3.0, 2.0, 0.5]


def test_the_control_runs_the_grpo_arms_time_at_the_sft_arms_pace():
    assert rb.control_plan(20.0, 0.1, 4) == (200, 50)
    assert rb.control_plan(0.01, 0.1, 0) == (1, 1)


def pair(task, seed, grpo, control):
    """A made-up (task, seed): accuracy curves at 10 s a point."""
    p = rb.Pair(task, seed)
    p.arms = {name: rb.Arm(name, [rb.Point(10.0 * i, i, a) for i, a in enumerate(curve)])
              for name, curve in (("sft", [0.0, 0.75]), ("grpo", grpo), ("control", control))}
    return p


def test_the_verdict_needs_the_gain_and_the_control_beaten_on_every_pair():
    good = pair("colour", 0, [0.75, 0.98, 1.0], [0.75, 0.75])
    met, lines = rb.verdict([good])
    assert met and "+25.0 points" in lines[0] and lines[0].endswith("met")
    small = pair("colour", 1, [0.75, 0.9], [0.75])  # +15 points
    tied = pair("zoom", 0, [0.4, 0.7], [0.4, 0.7])  # +30 points, not above the control
    met, lines = rb.verdict([good, small, tied])
    assert not met and [line.endswith("MISSED") for line in lines] == [False, True, True]
    assert rb.verdict([]) == (False, [])


def test_the_table_and_the_diagnostics():
    text = rb.table([pair("colour", 0, [0.75, 1.0], [0.75, 0.75])])
    assert "| colour | 0 | grpo | 0.0: 0.750, 0.2: 1.000 | - |" in text
    assert rb.diagnostics(None) == "-"
    row = {"accuracy": 0.5, "entropy": 0.02, "turn_advantage/1": -0.25, "other": 3}
    assert rb.diagnostics(row) == "accuracy 0.5, entropy 0.02, turn_advantage/1 -0.25"


def test_the_zoom_read_rows_show_the_zoom_alone_and_the_shown_pattern(tmp_path):
    import numpy as np
    from PIL import Image

    path, ceiling = rb.write_zoom_rows(tmp_path, 3, 0, {"checkered": "horizontal"}, 1.0,
                                       read_rows=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tool, read = rows[:3], rows[3:]
    assert all("focus" in r for r in tool) and not any("focus" in r for r in read)
    assert all(r["problem"] == rb.READ_PROBLEM for r in read)
    # the read rows continue the train items (patterns cycling), relabelled as the others
    assert [r["solution"] for r in read] == ["horizontal", "vertical", "horizontal"]
    assert ceiling == pytest.approx(2 / 3)
    for row, pattern in zip(read, ["horizontal", "vertical", "checkered"]):
        image = Image.open(tmp_path / row["image"])
        assert image.size == (112, 112)  # factor 8 of 896 px: the source's pixels, unshrunk
        # the 32 px mark lies in the middle: its 16 px core is the striped pattern, 2 px stripes
        core = np.asarray(image.convert("L"), dtype=float)[48:64, 48:64]
        rows_vary, cols_vary = np.ptp(core.mean(axis=1)), np.ptp(core.mean(axis=0))
        if pattern == "horizontal":
            assert rows_vary > 100 and cols_vary < 1
        elif pattern == "vertical":
            assert cols_vary > 100 and rows_vary < 1
        else:  # checkered: each row and column averages to the same grey
            assert rows_vary < 1 and cols_vary < 1 and np.ptp(core) > 100


def test_arguments_defaults_quick_and_refusals(refused):
    args = rb.parse_args([])
    assert args.tasks == ["colour", "zoom"] and args.seeds == [0, 1]
    assert args.colour_sft_steps == 800 and args.relabel == {"red": "yellow"}
    assert rb.task_settings(args, "zoom")["grpo_steps"] == 20
    assert args.zoom_relabel == {"checkered": "horizontal"} and not args.reuse
    assert args.zoom_relabel_share == 0.7 and args.relabel_share == 0.8
    assert args.zoom_read_rows == 2000 and args.jobs == 1
    assert "train.lr_schedule=constant" in rb.task_settings(args, "zoom")["sft_set"]
    assert rb.task_settings(args, "zoom")["sft_steps"] == 3500
    args = rb.parse_args(["--colour-grpo-set", "algo.beta=0.05", "--zoom-sft-steps", "7"])
    assert args.colour_grpo_set == ["algo.beta=0.05"] and args.zoom_sft_steps == 7
    quick = rb.parse_args(["--quick", "--seeds", "3", "4"])
    assert quick.tasks == ["colour"] and quick.seeds == [3] and quick.colour_eval_size == 8
    assert quick.colour_sft_steps < 10
    assert "--relabel-share" in refused(rb.parse_args, ["--relabel-share", "0.5"])
    assert "--relabel" in refused(rb.parse_args, ["--relabel", "red"])
    assert "--tasks" in refused(rb.parse_args, ["--tasks", "box"])
    assert "--zoom-read-rows" in refused(rb.parse_args, ["--zoom-read-rows", "-1"])
    assert "--jobs" in refused(rb.parse_args, ["--jobs", "0"])
