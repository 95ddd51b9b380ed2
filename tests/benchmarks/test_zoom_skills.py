"""benchmarks/zoom_skills.py: its answers and scores worked out by hand, its data, its command
lines and its targets on made-up results (no model runs)."""

from __future__ import annotations

import json

import pytest
from benchkit import BenchmarkError, load_script
from PIL import Image

zs = load_script("zoom_skills")


def test_centre_text_and_parse_point() -> None:
    assert zs.centre_text(0.3125, 0.6875) == "0.3 0.7"
    assert zs.parse_point("0.3 0.7") == (0.3, 0.7)
    assert zs.parse_point(" x=0.25, y=1 and 0.5") == (0.25, 1.0)
    assert zs.parse_point("0.3") is None and zs.parse_point("0.0.0.0.") == (0.0, 0.0)


def test_located_within_a_tenth_on_both_axes() -> None:
    truth = (0.3125, 0.6875)
    assert zs.located((0.3, 0.7), truth) and zs.located((0.4, 0.6), truth)
    assert not zs.located((0.5, 0.7), truth)  # x off by 0.1875
    assert not zs.located((0.3, 0.8), truth)  # y off by 0.1125
    assert zs.located((0.4, 0.3), (0.3, 0.4))  # exactly 0.1: float rounding must not refuse it
    assert not zs.located(None, truth)


def test_locate_score_and_best_constant() -> None:
    truths = [(0.5, 0.5), (0.55, 0.45), (0.1, 0.9), (0.9, 0.1)]
    assert zs.locate_score(["0.5 0.5", "0.6 0.4", "nonsense", "0.1 0.9"], truths) == 0.5
    # (0.5, 0.5) covers the first two train centres; only one of the two held-out ones
    point, score = zs.best_constant(truths[:2] + [(0.45, 0.52)], [(0.52, 0.49), (0.05, 0.05)])
    assert zs.located(point, (0.5, 0.5)) and score == 0.5


def test_read_score_and_majority() -> None:
    answers = ["vertical", "horizontal", "checkered"]
    assert zs.read_score([" Vertical", "vertical", "checkered"], answers) == pytest.approx(2 / 3)
    assert zs.majority(["vertical", "vertical", "checkered"], answers) == ("vertical", 1 / 3)


def test_write_split_rows_and_images(tmp_path) -> None:
    args = zs.parse_args(["--zoom-factor", "8"])
    rows = zs.write_split(tmp_path, "eval", 3, args)
    for skill, problem in (("locate", zs.LOCATE_PROBLEM), ("read", zs.READ_PROBLEM)):
        lines = [json.loads(line) for line in open(rows[skill].path)]
        assert [r["problem"] for r in lines] == [problem] * 3
        for row in lines:
            assert Image.open(tmp_path / row["image"]).size == (112, 112)
    locate, read = rows["locate"], rows["read"]
    answers = [json.loads(line)["solution"] for line in open(locate.path)]
    assert answers == [zs.centre_text(*c) for c in locate.truths]
    assert read.truths == ["horizontal", "vertical", "checkered"]  # the zoom items' cycle
    # at factor 8 the crop is 112 px of the source, not resized: the mark's stripes are crisp
    crop = Image.open(tmp_path / json.loads(open(read.path).readline())["image"]).convert("L")
    assert sorted(set(crop.getdata())) == [0, 255]


def test_sft_command_is_the_cli_with_the_runs_settings(tmp_path) -> None:
    args = zs.parse_args(["--steps", "40", "--learning-rate", "0.002", "--max-pixels", "3136"])
    command = zs.sft_command(args, "builtin:small", "train.jsonl", tmp_path)
    assert command[1:4] == ["-m", "r1fit", "sft"]
    for value in ("preset=none", "model.path=builtin:small", "data.train=train.jsonl",
                  "data.eval=null", "data.max_pixels=3136", "sft.steps=40",
                  "sft.learning_rate=0.002", f"train.output_dir={tmp_path}",
                  "train.warmup_steps=2"):
        assert value in command


def test_final_loss_reads_the_last_step(tmp_path) -> None:
    rows = [{"step": 2, "loss": 0.5}, {"step": 1, "loss": 2.0}, {"step": 0, "eval/accuracy": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert zs.final_loss(tmp_path) == 0.5
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(BenchmarkError, match="no step rows"):
        zs.final_loss(tmp_path)


def _result(model: str, skill: str, score: float, baseline: float, seconds: float) -> object:
    return zs.Result(model, skill, score, baseline, seconds, 400, 0.1, [])


def test_targets_bind_the_target_model_only() -> None:
    results = [_result("builtin:tiny", "locate", 0.05, 0.05, 60),
               _result("builtin:tiny", "read", 0.33, 0.33, 60),
               _result("builtin:small", "locate", 0.30, 0.05, 300),
               _result("builtin:small", "read", 0.60, 0.335, 300)]
    met, verdicts = zs.check_targets(results, "builtin:small", 0.2, 10)
    assert met and len(verdicts) == 2 and all(v.endswith("-> met") for v in verdicts)
    assert "gain +0.250" in verdicts[0] and "in 5.0 min" in verdicts[0]
    # a gain of 0.265 missed by a slow run; a gain of 0.19 missed outright
    met, verdicts = zs.check_targets(results, "builtin:small", 0.2, 4)
    assert not met and all(v.endswith("-> MISSED") for v in verdicts)
    results[2] = _result("builtin:small", "locate", 0.24, 0.05, 300)
    met, verdicts = zs.check_targets(results, "builtin:small", 0.2, 10)
    assert not met and verdicts[0].endswith("MISSED") and verdicts[1].endswith("met")


def test_target_not_measured_is_missed() -> None:
    met, verdicts = zs.check_targets([_result("builtin:small", "read", 0.9, 0.3, 10)],
                                     "builtin:small", 0.2, 10)
    assert not met and verdicts[0] == "builtin:small locate: not measured -> MISSED"


def test_bad_arguments_are_refused(refused) -> None:
    assert "--zoom-factor" in refused(zs.parse_args, ["--zoom-factor", "100"])
    assert "--max-pixels" in refused(zs.parse_args, ["--max-pixels", "100"])
    assert "--answer needs --data" in refused(zs.parse_args, ["--answer", "x"])
