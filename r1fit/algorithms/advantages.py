"""Advantages from rewards: each completion is scored against a baseline from the rewards of the step.

Rewards arrive group-contiguous: rows ``g*G .. g*G+G-1`` are the ``G = num_generations`` completions of
prompt ``g``, and the tensor holds every row of the step (every process's), so an estimator that
normalises over the batch (REINFORCE++) sees the whole batch. Pick an estimator by name from
``ADVANTAGE_ESTIMATORS`` (see ``get_advantage_estimator``).
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
    grouped = _grouped(rewards, num_generations, eps)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)


def rloo_advantages(rewards: Tensor, num_generations: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i`` minus the mean of the *other* ``G - 1`` rewards of its group.

    ``r_i - (sum - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)``: the baseline does not contain the
    sample itself, so it is unbiased; no std division. Group ``[1, 0, 0, 1]`` -> ``[2/3, -2/3, -2/3, 2/3]``.
    """
    grouped = _grouped(rewards, num_generations)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return (grouped - others).reshape(-1)


def reinforce_pp_advantages(
    rewards: Tensor, num_generations: int, group_baseline: bool = False, eps: float = 1e-4
) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): advantages normalised over the whole batch.

    ``x = r`` (REINFORCE++), or ``x = r - mean(group)`` with ``group_baseline`` (REINFORCE++-baseline);
    then ``(x - mean(batch x)) / (std(batch x) + eps)``, ``std`` unbiased as in ``group_advantages``.
    Unlike GRPO's per-group std, one batch std keeps the relative scale of groups: a group whose
    rewards barely differ gets small advantages. verl whitens over tokens instead (a long completion
    weighs more in its mean and std); here every completion weighs the same.
    """
    grouped = _grouped(rewards, num_generations, eps)
    x = grouped - grouped.mean(dim=1, keepdim=True) if group_baseline else grouped
    x = x.reshape(-1)
    return (x - x.mean()) / (x.std() + eps)


def _grouped(rewards: Tensor, num_generations: int, eps: float = 0.0) -> Tensor:
    """Check the inputs and return the rewards as float ``[groups, G]``."""
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
    return rewards.view(-1, num_generations)


# "grpo": DeepSeekMath GRPO. "dr_grpo": Dr. GRPO (Liu et al. 2025) drops the std division, which
# over-weights groups whose rewards barely differ (too easy or too hard prompts). "rloo": leave-one-out
# baseline. "reinforce_pp" / "reinforce_pp_baseline": REINFORCE++ without / with the group mean
# subtracted first, both normalised over the whole batch.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": partial(group_advantages, scale_std=True),
    "dr_grpo": partial(group_advantages, scale_std=False),
    "rloo": rloo_advantages,
    "reinforce_pp": partial(reinforce_pp_advantages, group_baseline=False),
    "reinforce_pp_baseline": partial(reinforce_pp_advantages, group_baseline=True),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Return the estimator ``fn(rewards, num_generations) -> advantages`` registered under ``name``."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
