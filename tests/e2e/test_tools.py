"""GRPO with a tool, end to end on builtin:tiny: multi-turn rollouts whose calls run the zoom tool
on the row's source image, rewards that read the trajectory, and the turns in the metrics."""

from __future__ import annotations

import pytest

from r1fit.cli import main
from r1fit.report.metrics import read_metrics
from r1fit.report.rollouts import read_rollouts

TOOLS = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=80",
         "data.eval_size=4", "memory.micro_batch=3", "memory.generation_batch=5",
         "data.shapes.train_size=40", "data.shapes.image_size=56", "data.shapes.kinds=[zoom]",
         "data.max_pixels=3136", "checkpoint.keep=0", "tools=[zoom]", "data.max_images=2",
         "rollout.max_turns=3", "report.rollouts_every=1", "rewards.toolreward:calls=1.0",
         "rewards.format=0.5", "sft.format_warmup_steps=0"]


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_grpo_runs_the_tool_and_rewards_see_its_calls(use_tiny_cache, tool_calling_policy,
                                                      tmp_path, engine):
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", "train.max_steps=3", "eval.every=3",
                 f"rollout.engine={engine}", *TOOLS]) == 0
    assert f"rollout.engine={engine}" in (out / "log.txt").read_text()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert len(rows) == 3
    calls_before = 0.0
    for row in rows:
        # every call ran (zoom on the 448 px source image), one per calling row, and the reward
        # that counts a trajectory's calls saw them: its mean is the share of calling rows
        calls = row["tools/zoom/calls"] - calls_before
        calls_before = row["tools/zoom/calls"]
        assert row["tools/zoom/errors"] == 0 and row["tools/malformed"] == 0
        # this step's tool calls' wall time, within generation's
        assert 0 < row["tools/seconds"] < row["seconds_generate"]
        assert row["reward/toolreward:calls"] == pytest.approx(calls / 8)
        assert 0 < calls < 8  # the even-seeded rows call (not all, not none, here)
        assert row["tool_calls_mean"] == pytest.approx(calls / 8)
        assert row["tool_errors_mean"] == 0
        # a calling row reads the result in a second turn; the others end in their first
        assert row["turns_mean"] == pytest.approx(1 + calls / 8)
        assert row["grad_norm"] > 0
        # the multi-turn diagnostics: the tool turns out of the loss, the answers after them
        # trained as a second turn (one update per rollout: ratio 1), rewards by calls
        assert 0 < row["masked_token_fraction"] < 1
        assert row["turn_ratio/1"] == row["turn_ratio/2"] == pytest.approx(1.0)
        assert sorted(k for k in row if k.startswith("reward_by_tool_calls/")) == [
            "reward_by_tool_calls/0", "reward_by_tool_calls/1"]
    assert 'id="multi-turn"' in (out / "report.html").read_text()
    # evaluation runs the same loop greedily: every row calls first
    assert rows[-1]["eval/tool_use"] == 1.0
    # the report's rollouts hold the turns, with the image the zoom returned
    saved = read_rollouts(out / "rollouts")
    called = [r for rows_ in saved.values() for r in rows_ if len(r["turns"]) == 2]
    assert called and all(r["turns"][0]["calls"][0]["name"] == "zoom" for r in called)
    assert all((out / "rollouts" / part["image"]).exists() for r in called
               for part in r["turns"][0]["results"][0]["parts"] if "image" in part)
