"""Held-out evaluation: greedy answers to the eval set, scored for accuracy and format."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from r1fit.data.batch import Prompt, decode_completions
from r1fit.distributed.context import all_sum
from r1fit.distributed.parallelize import gathered
from r1fit.memory.telemetry import reset_peak, step_memory
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.format import format_reward
from r1fit.rollout.generate import SamplingSettings, generate_completions
from r1fit.train.run import Run

log = logging.getLogger("r1fit")


#: ``greedy(prompts) -> completions``: an engine's greedy decoding (rollout.engine=vllm)
Greedy = Callable[[Sequence[Prompt]], list[torch.Tensor]]


@torch.no_grad()
def evaluate(run: Run, greedy: Greedy | None = None) -> dict[str, Any]:
    """Greedy decoding on ``run.eval_set``: accuracy and format rate (under inference mode), by
    ``greedy`` when given (the run's vLLM engine, holding the policy's current weights), else
    with ``generate`` on the policy.

    Rows whose image fails to decode, or whose prompt is longer than ``data.max_prompt_tokens``,
    are skipped with a warning, counted in ``eval/bad_rows`` and left out of the averages
    (``eval/size`` is the number actually scored). Over several processes each rank decodes its
    share of the batches with whole parameters (the FSDP root is gathered once) and the counts are
    summed."""
    dataset, cfg = run.eval_set, run.cfg
    assert dataset is not None, "evaluate() needs data.eval"
    reset_peak(run.device)  # eval/peak_memory_bytes is the evaluation's own peak
    settings = SamplingSettings(max_new_tokens=cfg.algo.max_new_tokens, greedy=True)
    correct = formatted = 0.0
    scored = bad = 0
    starts = list(range(0, len(dataset), cfg.eval.batch))[run.world.rank::run.world.size]
    with gathered(run.policy) if greedy is None else nullcontext():
        for start in starts:
            samples, errors = dataset.fetch(list(range(start, min(start + cfg.eval.batch,
                                                                   len(dataset)))))
            prompts, refused = run.encode(samples)
            for message in errors + refused:
                log.warning("eval: skipping %s", message)
            bad += len(errors) + len(refused)
            if not prompts:
                continue
            if greedy is not None:
                completions = greedy(prompts)
            else:
                with torch.inference_mode():
                    completions = generate_completions(run.policy, prompts, seeds=None,
                                                       batch_size=cfg.eval.batch,
                                                       settings=settings, ids=run.ids,
                                                       device=run.device)
            for prompt, text in zip(prompts, decode_completions(run.processor, completions)):
                sample = prompt.sample
                correct += accuracy(text, sample.solution, problem=sample.problem)
                formatted += format_reward(text, sample.solution, problem=sample.problem)
            scored += len(prompts)
    correct, formatted, scored, bad = all_sum([correct, formatted, scored, bad])
    n = max(1, scored)
    return {"eval/accuracy": correct / n, "eval/format": formatted / n, "eval/size": int(scored),
            "eval/bad_rows": int(bad), **step_memory(run.device, "eval/")}
