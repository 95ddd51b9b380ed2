"""`r1fit sft` with tools on builtin:shapes zoom, end to end on builtin:tiny: every row is learned as
a zoom demonstration (counted each step), the loss falls, evaluation runs the tool loop, and the
SFT output folder is the model.path of a GRPO run with tools (the R1 recipe: SFT, then RL)."""

from __future__ import annotations

import math

import pytest

from r1fit.cli import main
from r1fit.report.metrics import read_metrics

ZOOM = ["data.shapes.kinds=[zoom]", "data.shapes.image_size=56", "data.max_pixels=3136",
        "data.max_images=2", "tools=[zoom]", "data.shapes.train_size=40", "data.eval_size=4",
        "algo.max_new_tokens=96", "checkpoint.keep=0"]


def test_sft_learns_zoom_demonstrations_and_grpo_starts_from_its_folder(use_tiny_cache, tmp_path):
    sft = tmp_path / "sft"
    assert main(["sft", f"train.output_dir={sft}", "sft.steps=5", "sft.batch_size=4",
                 "eval.before_train=false", *ZOOM]) == 0
    rows = read_metrics(sft / "metrics.jsonl")
    assert [r["demonstrations"] for r in rows] == [4] * 5
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert rows[-1]["truncated_answers"] == 0 and rows[-1]["eval/size"] == 4
    assert "eval/tool_use" in rows[-1]  # reported only by an evaluation run with its tools
    grpo = tmp_path / "grpo"
    assert main(["train", f"model.path={sft / 'final'}", "preset=demo", f"train.output_dir={grpo}",
                 "train.max_steps=1", "train.prompts_per_step=2", "algo.num_generations=2",
                 "sft.format_warmup_steps=0", "data.eval=null", *ZOOM]) == 0
    (step,) = [r for r in read_metrics(grpo / "metrics.jsonl") if "reward_mean" in r]
    assert "tools/zoom/calls" in step
    # the rollouts were trajectories, each closed with a reason; those that ended on their EOS
    # (trajectory.ended) are the rows whose tokens end with one (completion_clipped_fraction)
    ends = {k: v for k, v in step.items() if k.startswith("trajectory_end/")}
    assert len(ends) == 4 and sum(ends.values()) == pytest.approx(1.0)
    assert ends["trajectory_end/eos"] == pytest.approx(1 - step["completion_clipped_fraction"])


def test_sft_learns_demonstrations_from_a_data_files_focus_boxes(use_tiny_cache, tmp_path):
    """data.focus_key on a JSONL file: rows with a box (pixels or fractions) are learned as zoom
    demonstrations, a row without one as a plain answer (the demonstrations column counts)."""
    import json

    from PIL import Image, ImageDraw

    rows = []
    for i in range(4):
        image = Image.new("RGB", (224, 224), "white")
        x = 20 + 40 * i
        ImageDraw.Draw(image).rectangle([x, 100, x + 15, 115], fill="black")
        image.save(tmp_path / f"{i}.png")
        focus = [x, 100, x + 16, 116] if i % 2 == 0 else [x / 224, 100 / 224, (x + 16) / 224,
                                                          116 / 224]
        rows.append({"image": f"{i}.png", "problem": "What is in the box?", "solution": "black",
                     **({"focus": focus} if i < 3 else {})})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "sft"
    assert main(["sft", f"train.output_dir={out}", f"data.train={data}", "data.eval=null",
                 "tools=[zoom]", "data.max_images=2", "data.max_pixels=3136", "sft.steps=2",
                 "sft.batch_size=4", "eval.before_train=false", "checkpoint.keep=0"]) == 0
    assert [r["demonstrations"] for r in read_metrics(out / "metrics.jsonl")] == [3, 3]
