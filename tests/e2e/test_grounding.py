"""configs/grounding.yaml end to end on builtin:tiny, shortened to 2 GRPO steps: box questions
are asked, scored by the iou reward, and evaluated by mean IoU (eval/iou)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r1fit.cli import main
from r1fit.report.metrics import read_metrics
from r1fit.rewards.iou import parse_box

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grounding.yaml"


def test_grounding_config_two_steps(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(CONFIG), f"train.output_dir={out}", "train.max_steps=2",
                 "train.prompts_per_step=2", "algo.num_generations=4", "sft.format_warmup_steps=2",
                 "sft.batch_size=4", "data.eval_size=4", "eval.every=1",
                 "data.shapes.train_size=50", "report.rollouts_every=1"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all({"reward/iou", "reward/format"} <= set(r) for r in steps)
    # the logged accuracy of box rows is their IoU, as is the reward's component
    assert all(r["accuracy"] == pytest.approx(r["reward/iou"], abs=1e-6) for r in steps)
    evals = [r for r in rows if "eval/iou" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(0 <= r["eval/iou"] <= 1 and r["eval/iou"] == r["eval/accuracy"] for r in evals)
    saved = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text()
             .splitlines()]
    assert saved[0]["prompt"].startswith("Give the box of the ")
    assert saved[0]["prompt"].endswith(" as [x1,y1,x2,y2] in pixels of this 112x112 image.")
    assert set(saved[0]["components"]) == {"iou", "format"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_end"] == evals[-1]["eval/iou"]
    page = (out / "report.html").read_text()
    assert "eval/iou" in page


def test_box_answers_are_in_the_frame_of_the_image_the_model_gets(use_tiny_cache):
    # the pixel budget of the config leaves the image as drawn, so the solution's box is where
    # the shape is in the image the processor receives
    from r1fit.config import load_config
    from r1fit.data.build import build_datasets

    train, evalset = build_datasets(load_config(CONFIG, ["data.shapes.train_size=20"]))
    for dataset in (train, evalset):
        sample = dataset[0]
        assert sample.images[0].size == (112, 112) and sample.reward_method == "iou"
        x1, y1, x2, y2 = map(int, parse_box(sample.solution))
        background = sample.images[0].getpixel((0, 0))
        inside = {sample.images[0].getpixel((x, y)) for x in range(x1, x2) for y in range(y1, y2)}
        assert len(inside - {background}) == 1  # the shape's colour, and nothing else
