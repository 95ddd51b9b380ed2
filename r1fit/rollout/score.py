"""Scoring stage of a rollout: rewards of every completion, then group-relative advantages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from r1fit.data.batch import decode_completions
from r1fit.distributed.context import all_gather_rows, all_sum
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.registry import RewardScorer
from r1fit.rollout.record import Rollout

AdvantageFn = Callable[[torch.Tensor, int], torch.Tensor]


def score_rollout(rollout: Rollout, scorer: RewardScorer, processor: Any,
                  advantage: AdvantageFn) -> None:
    """Fill ``rewards``, ``components``, ``correct`` (every row of the step: each process scores
    its own rows, then they are gathered, so advantages see whole groups) and ``advantages`` (this
    process's rows). Reward errors are counted over every process."""
    texts = decode_completions(processor, rollout.completions)
    samples = [p.sample for p in rollout.rows]
    errors_before = scorer.total_errors
    rewards = scorer.score(texts, [s.solution for s in samples],
                           [{"problem": s.problem, "reward_method": s.reward_method}
                            for s in samples])
    # the logged accuracy: the reward component when configured, else scored here
    correct = (rewards.components["accuracy"] if "accuracy" in rewards.components else
               torch.tensor([accuracy(t, s.solution, problem=s.problem,
                                      reward_method=s.reward_method)
                             for t, s in zip(texts, samples)]))
    rollout.rewards = all_gather_rows(rewards.total)
    rollout.components = {k: all_gather_rows(v) for k, v in rewards.components.items()}
    rollout.correct = all_gather_rows(correct.float()).tolist()
    scorer.total_errors = errors_before + int(all_sum([scorer.total_errors - errors_before])[0])
    rollout.advantages = advantage(rollout.rewards, rollout.num_generations)[rollout.share]
