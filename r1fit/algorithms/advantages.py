"""Group-relative advantages: each completion is scored against the other completions of its prompt.

Rewards arrive group-contiguous: rows ``g*G .. g*G+G-1`` are the ``G = num_generations`` completions of
prompt ``g``. Pick an estimator by name from ``ADVANTAGE_ESTIMATORS`` (see ``get_advantage_estimator``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

AdvantageEstimator = Callable[[Tensor, int], Tensor]


def group_advantages(
    rewards: Tensor, num_generations: int, scale_std: bool = True, eps: float = 1e-4
) -> Tensor:
    """Return ``r - mean(group)``, divided by ``std(group) + eps`` when ``scale_std`` (shape ``[N]``).

    ``std`` is the unbiased sample std (``torch.std`` default), as in TRL's GRPO, so a group of two with
    rewards ``[1, 0]`` gets advantages ``[+0.7071, -0.7071]`` (up to ``eps``). A group whose rewards are all
    equal gets zero advantage, and ``eps`` keeps that from being ``0 / 0``.
    Integer or bool rewards are promoted to float32.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        # With one completion per prompt the group mean is the reward itself: every advantage is 0.
        raise ValueError(f"num_generations must be >= 2 for group-relative advantages, got {num_generations}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards length {rewards.numel()} is not a multiple of num_generations={num_generations}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)


# "grpo": DeepSeekMath GRPO. "dr_grpo": Dr. GRPO (Liu et al. 2025) drops the std division, which
# over-weights groups whose rewards barely differ (too easy or too hard prompts).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": partial(group_advantages, scale_std=True),
    "dr_grpo": partial(group_advantages, scale_std=False),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Return the estimator ``fn(rewards, num_generations) -> advantages`` registered under ``name``."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
