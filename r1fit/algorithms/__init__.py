"""GRPO maths as pure tensor functions: advantages, KL, policy losses, reward shaping and chunked log-probs.

Choices are strings looked up in registries (``ADVANTAGE_ESTIMATORS``, ``AGGREGATIONS``,
``IMPORTANCE_LEVELS``), so the training loop picks a function once instead of branching on a loss
type inside the loop.
"""

from r1fit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from r1fit.algorithms.kl import kl_k1, kl_k3, sequence_kl_k1
from r1fit.algorithms.logprobs import chunked_logprobs_and_entropy, chunked_token_logprobs, full_token_logprobs
from r1fit.algorithms.losses import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    BatchTotals,
    LossSettings,
    aggregate,
    grpo_loss,
    importance_log_ratio,
    token_policy_loss,
    truncated_importance_weights,
)
from r1fit.algorithms.shaping import overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "BatchTotals",
    "IMPORTANCE_LEVELS",
    "LossSettings",
    "aggregate",
    "chunked_logprobs_and_entropy",
    "chunked_token_logprobs",
    "full_token_logprobs",
    "get_advantage_estimator",
    "grpo_loss",
    "group_advantages",
    "importance_log_ratio",
    "kl_k1",
    "kl_k3",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_kl_k1",
    "token_policy_loss",
    "truncated_importance_weights",
]
