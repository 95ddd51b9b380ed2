"""Accuracy reward: does the completion's ``<answer>`` match the solution?

How answers are compared is the row's accuracy method (VLM-R1's ``accu_reward_method``), passed
as ``info["reward_method"]``; without one it is ``default``: an exact comparison of normalised
answers (see :func:`r1fit.rewards.answer.normalize`), then — when the optional ``math-verify``
package is installed and both answers look like mathematics — a symbolic equivalence check, so
``\\frac{1}{2}`` matches ``0.5``. The methods are in :mod:`r1fit.rewards.methods`.
"""

from __future__ import annotations

from typing import Any

from r1fit.rewards.methods import score_by_method

__all__ = ["accuracy"]


def accuracy(completion: str, solution: str, **info: Any) -> float:
    """Score the completion's last ``<answer>`` against the solution's answer by the method
    ``info["reward_method"]`` (``"default"`` when absent; see :data:`r1fit.rewards.methods.METHODS`).

    The solution may be tagged (its last ``<answer>`` is used) or a bare answer. A completion
    without an ``<answer>...</answer>`` pair, or with an empty one, scores 0.0. An unknown method
    raises :class:`r1fit.rewards.methods.RewardConfigError` (data loading checks the names first).
    """
    return score_by_method(info.get("reward_method", "default"), completion, solution)
