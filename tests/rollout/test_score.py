"""The scoring stage on hand-computed numbers: rewards, logged accuracy, group advantages."""

from __future__ import annotations

import pytest
import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.data.batch import Prompt
from r1fit.data.sample import Sample
from r1fit.rewards.registry import RewardScorer
from r1fit.rollout.record import Rollout
from r1fit.rollout.score import score_rollout


class Words:
    """A processor whose tokenizer decodes token ids to words (id 0 = 'red', 1 = 'blue')."""

    class tokenizer:  # noqa: N801 - mimics processor.tokenizer
        @staticmethod
        def batch_decode(rows, skip_special_tokens=True):
            return ["<answer>" + " ".join(("red", "blue")[t] for t in row) + "</answer>"
                    for row in rows]


def test_rewards_accuracy_and_advantages_by_hand():
    prompts = [Prompt(torch.tensor([1]), {}, {}, Sample([], "colour?", "red", "t:1"))]
    generated = Rollout(1, prompts, 4, slice(0, 4), completions=[
        torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([1])])
    scorer = RewardScorer({"accuracy": 1.0})
    rollout = score_rollout(generated, scorer, Words(), get_advantage_estimator("dr_grpo"))
    assert rollout.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert rollout.correct == [1.0, 0.0, 1.0, 0.0]
    # Dr. GRPO: reward minus the group mean 0.5, no std division
    assert rollout.advantages.tolist() == [0.5, -0.5, 0.5, -0.5]
    assert generated.rewards is None and generated.advantages is None  # a new record, not a write
    rollout = score_rollout(generated, scorer, Words(), get_advantage_estimator("grpo"))
    # GRPO divides by the group's sample std: sqrt((4 x 0.25) / 3) = 0.57735, plus eps 1e-4
    a = 0.5 / (0.57735 + 1e-4)
    assert rollout.advantages.tolist() == pytest.approx([a, -a, a, -a], rel=1e-4)
