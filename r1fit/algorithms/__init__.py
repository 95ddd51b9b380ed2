"""GRPO maths as pure tensor functions: advantages, KL, policy losses and chunked log-probs.

Choices are strings looked up in registries (``ADVANTAGE_ESTIMATORS``, ``AGGREGATIONS``), so the
training loop picks a function once instead of branching on a loss type inside the loop.
"""

from r1fit.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages
from r1fit.algorithms.kl import kl_k3
from r1fit.algorithms.logprobs import chunked_token_logprobs, full_token_logprobs
from r1fit.algorithms.losses import AGGREGATIONS, aggregate, grpo_loss, token_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "aggregate",
    "chunked_token_logprobs",
    "full_token_logprobs",
    "get_advantage_estimator",
    "grpo_loss",
    "group_advantages",
    "kl_k3",
    "token_policy_loss",
]
