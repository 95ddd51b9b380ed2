"""Per-token KL estimate between the policy and the frozen reference model."""

from __future__ import annotations

import torch
from torch import Tensor


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token: ``exp(d) - d - 1`` with ``d = ref - logp``.

    Tokens are sampled from the policy, so with ``r = p_ref / p_policy`` the estimate ``r - 1 - log r`` is
    unbiased (``E[r] = 1``) and, unlike ``-log r``, never negative (``e^d >= 1 + d``). This is the form
    DeepSeekMath's GRPO and TRL use. Gradients flow through ``logp`` only in practice (``ref_logp`` comes
    from a frozen model).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}")
    delta = ref_logp - logp
    # expm1 keeps precision when policy and reference agree closely (d ~ 1e-4), where exp(d) - 1 cancels.
    return torch.expm1(delta) - delta


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k1 estimator of KL(policy || reference), per token: ``logp - ref_logp``.

    Unbiased under tokens sampled from the policy but negative for some tokens; summed over a
    completion it is the log-likelihood ratio of the whole sequence, ``log p(y) - log p_ref(y)``, which
    is what REINFORCE++ (and verl's ``kl_penalty=kl``) subtracts from the reward.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}")
    return logp - ref_logp


def sequence_kl_k1(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """``[B]``: each sequence's sum of k1 over its valid tokens (``mask``); padding never counts."""
    if mask.shape != logp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match logp shape {tuple(logp.shape)}")
    k1 = kl_k1(logp, ref_logp)
    return torch.where(mask.bool(), k1, torch.zeros((), dtype=k1.dtype, device=k1.device)).sum(dim=-1)
