"""The time model's prediction a run logs beside its measured seconds: which phases each measured
key covers, the plan it comes from, and a run that goes on without one."""

from __future__ import annotations

import logging

import r1fit.memory.planner as planner
from r1fit.config import load_config
from r1fit.memory.planner import plan_memory
from r1fit.memory.prediction import StepPrediction, predict_steps, seconds_left
from r1fit.memory.sizes import ChunkSizes

BASE = ["model.path=builtin:tiny", "algo.num_generations=4", "train.prompts_per_step=2",
        "data.shapes.image_size=56", "data.max_pixels=3136", "algo.beta=0.04"]


def test_grpo_update_key_covers_the_log_prob_pass_and_the_updates():
    time = {"phases": {"generate": 1.5, "score": 0.01, "logprobs": 0.25, "update": 0.5,
                       "checkpoint": 0.1}, "source": "calibrated 2026-11-28"}
    grpo = StepPrediction.of(time, "grpo")
    assert grpo.seconds == {"seconds_generate": 1.5, "seconds_score": 0.01,
                            "seconds_update": 0.75}
    assert grpo.row() == {"predicted_seconds_generate": 1.5, "predicted_seconds_score": 0.01,
                          "predicted_seconds_update": 0.75, "predicted_calibrated": 1.0}
    sft = StepPrediction.of({**time, "source": "data sheet (x); not calibrated"}, "sft")
    assert sft.row() == {"predicted_seconds_step": 0.5, "predicted_calibrated": 0.0}


def test_prediction_is_the_plan_at_the_sizes_the_run_starts_with(use_tiny_cache, caplog):
    cfg = load_config(None, [*BASE, "memory.micro_batch=auto", "memory.generation_batch=auto",
                             "memory.budget=1GiB"])
    with caplog.at_level(logging.INFO, "r1fit.memory"):
        got = predict_steps(cfg, "cpu", 1, "grpo", ChunkSizes(2, 3, {}))
    plan = plan_memory(load_config(None, [*BASE, "memory.micro_batch=2",
                                          "memory.generation_batch=3"]), device_type="cpu")
    assert got == StepPrediction.of(plan.time, "grpo")
    assert got.seconds["seconds_update"] > 0 and got.seconds["seconds_generate"] > 0
    assert "time model: a step about" in caplog.text and "predicted_seconds_*" in caplog.text


def test_a_run_that_knows_its_budget_names_faster_configurations(use_tiny_cache, caplog):
    """Given the device's budget, the start-up prediction also logs the fastest
    configurations that fit it (as `r1fit plan` lists them); without one, no such line."""
    cfg = load_config(None, [*BASE, "memory.micro_batch=1", "memory.generation_batch=1"])
    plan = plan_memory(cfg, device_memory_bytes=1 << 30, device_type="cpu", faster=True)
    assert plan.faster  # 8 rows one at a time: larger chunks fit 1 GiB and are faster
    with caplog.at_level(logging.INFO, "r1fit.memory"):
        got = predict_steps(cfg, "cpu", 1, "grpo", ChunkSizes(1, 1, {}), budget=1 << 30)
    assert got == StepPrediction.of(plan.time, "grpo")
    line = next(x for x in caplog.messages if "faster configurations fit this device" in x)
    best = plan.faster[0]
    assert " ".join(f"{k}={v}" for k, v in best["values"].items()) in line
    assert f"({best['speedup']:.2f}x)" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, "r1fit.memory"):
        predict_steps(cfg, "cpu", 1, "grpo", ChunkSizes(1, 1, {}))
    assert "time model: a step about" in caplog.text and "faster" not in caplog.text


def test_a_model_the_planner_cannot_read_leaves_the_run_unpredicted(monkeypatch, caplog):
    def unreadable(*args, **kwargs):
        raise KeyError("vision_config")

    monkeypatch.setattr(planner, "plan_memory", unreadable)
    with caplog.at_level(logging.WARNING, "r1fit.memory"):
        assert predict_steps(load_config(None, BASE), "cpu", 1, "sft", ChunkSizes(1, 1, {})
                             ) is None
    assert "time model: no prediction for this run (KeyError: 'vision_config')" in caplog.text



def test_a_resumed_run_is_told_what_is_left(use_tiny_cache, caplog):
    """Steps of 2 s and evaluations of 10 s, eval.every=4 over 10 steps (before, 4, 8, 10):
    done 5, the steps 6-10 and the evaluations at 8 and 10 are left, 5 x 2 + 2 x 10 = 30 s;
    done 8, 2 steps and the last evaluation; done 10, nothing. r1fit sft counts sft.steps."""
    cfg = load_config(None, [*BASE, "train.max_steps=10", "eval.every=4", "sft.steps=6",
                             "sft.eval_every=0"])
    time = {"step_seconds": 2.0, "eval_seconds": 10.0}
    assert seconds_left(time, cfg, "grpo", 0) == 10 * 2 + 3 * 10  # not the one before training
    assert seconds_left(time, cfg, "grpo", 5) == 5 * 2 + 2 * 10
    assert seconds_left(time, cfg, "grpo", 8) == 2 * 2 + 10
    assert seconds_left(time, cfg, "grpo", 10) == 0
    assert seconds_left(time, cfg, "sft", 2) == 4 * 2 + 10  # the last step's evaluation
    assert seconds_left({**time, "eval_seconds": None}, cfg, "grpo", 5) == 10
    with caplog.at_level(logging.INFO, "r1fit.memory"):
        predict_steps(cfg, "cpu", 1, "grpo", ChunkSizes(2, 3, {}), done=5)
    assert "(10 steps, 5 done: about" in caplog.text and " left" in caplog.text
