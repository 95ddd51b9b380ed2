"""Held-out evaluation: greedy answers to the eval set, scored for accuracy and format (and
mean IoU of the rows scored by boxes)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from r1fit.data.batch import Prompt, decode_completions
from r1fit.memory.telemetry import reset_peak, step_memory
from r1fit.processes import all_sum
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.format import format_reward
from r1fit.rollout.generate import SamplingSettings
from r1fit.rollout.turns import answer_text
from r1fit.train.engines import HFRollouts, RolloutEngine
from r1fit.train.run import Run
from r1fit.train.tool_rollouts import ToolTurns

log = logging.getLogger("r1fit")


@torch.no_grad()
def evaluate(run: Run, engine: RolloutEngine | None = None) -> dict[str, Any]:
    """Greedy decoding on ``run.eval_set``: accuracy and format rate, on the run's rollout
    ``engine`` when given (a vLLM engine is synced with the policy first), else with
    ``generate`` on the policy. When some rows are scored by the ``iou`` accuracy method (box
    answers, e.g. ``builtin:shapes`` box questions), ``eval/iou`` is their mean IoU (their
    accuracy is their IoU: on an eval set of box rows only, it equals ``eval/accuracy``).

    Rows whose image fails to decode, or whose prompt is longer than ``data.max_prompt_tokens``,
    are skipped with a warning, counted in ``eval/bad_rows`` and left out of the averages
    (``eval/size`` is the number actually scored). Over several processes each rank decodes its
    share of the batches with whole parameters (the FSDP root is gathered once) and the counts are
    summed."""
    dataset, cfg = run.eval_set, run.cfg
    assert dataset is not None, "evaluate() needs data.eval"
    reset_peak(run.device)  # eval/peak_memory_bytes is the evaluation's own peak
    if engine is None:
        settings = SamplingSettings(max_new_tokens=cfg.algo.max_new_tokens)
        engine = HFRollouts(run, settings, ToolTurns(run, settings.max_new_tokens)
                            if cfg.tools else None)
    correct = formatted = iou_sum = 0.0
    scored = bad = iou_rows = tool_rows = 0
    starts = list(range(0, len(dataset), cfg.eval.batch))[run.world.rank::run.world.size]
    # every rank enters ready() (it gathers FSDP weights), also one with no batch of its own;
    # a weight sync here is the evaluation's, not a step's
    with engine.ready({}):
        for start in starts:
            samples, errors = dataset.fetch(list(range(start, min(start + cfg.eval.batch,
                                                                   len(dataset)))))
            prompts, refused = run.encode(samples)
            for message in errors + refused:
                log.warning("eval: skipping %s", message)
            bad += len(errors) + len(refused)
            if not prompts:
                continue
            texts, used_tools = _answers(run, engine, prompts)
            tool_rows += used_tools
            for prompt, text in zip(prompts, texts):
                sample = prompt.sample
                score = accuracy(text, sample.solution, problem=sample.problem,
                                 reward_method=sample.reward_method)
                correct += score
                if sample.reward_method == "iou":
                    iou_sum, iou_rows = iou_sum + score, iou_rows + 1
                formatted += format_reward(text, sample.solution, problem=sample.problem)
            scored += len(prompts)
    correct, formatted, scored, bad, iou_sum, iou_rows, tool_rows = all_sum(
        [correct, formatted, scored, bad, iou_sum, iou_rows, tool_rows])
    n = max(1, scored)
    return {"eval/accuracy": correct / n, "eval/format": formatted / n,
            **({"eval/iou": iou_sum / iou_rows} if iou_rows else {}),
            **({"eval/tool_use": tool_rows / n} if engine.tools is not None else {}),
            "eval/size": int(scored),
            "eval/bad_rows": int(bad), **step_memory(run.device, "eval/")}


def _answers(run: Run, engine: RolloutEngine, prompts: list[Prompt]
             ) -> tuple[list[str], int]:
    """The greedy answers to ``prompts`` and how many of them called a tool: with ``tools``, each
    trajectory's last turn (the same multi-turn loop as training, greedy); else the completions."""
    if engine.tools is None:
        return decode_completions(run.processor, engine.greedy(prompts)), 0
    trajectories = engine.greedy_trajectories(prompts)
    return [answer_text(t) for t in trajectories], sum(t.tool_calls > 0 for t in trajectories)
