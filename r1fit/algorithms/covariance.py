"""Clip-Cov and KL-Cov: restrict the update of the few tokens that drive entropy collapse.

Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv 2505.22617) show that the policy's entropy falls by the covariance between a token's
log-probability and its advantage: confident tokens with high advantage sharpen the policy most.
Both methods score each valid token of a micro-batch by that covariance term,

    cov_t = (A_t - mean A) * (logp_t - mean logp)      (means over the micro-batch's valid tokens)

and restrict the highest-scoring ones (verl ships them as the policy losses ``clip_cov`` and
``kl_cov``; r1fit follows verl's selection, its shipped ratios and bounds, and for ``kl_cov_coef``
the in-function fallback 1.0, where verl's shipped config sets ``ppo_kl_coef: 0.1``):

* **Clip-Cov** (:func:`clip_cov_selection`): among tokens the ordinary clip did not already stop and
  whose ``cov_t`` lies in ``(lb, ub)``, pick ``max(1, int(ratio * valid tokens))`` at random and
  take their clipped surrogate out of the loss, value and gradient both (as verl's ``corr``
  factor, which multiplies those tokens' loss by 0).
* **KL-Cov** (:func:`kl_cov_selection`): the ``max(1, int(ratio * valid tokens))`` tokens of largest
  ``cov_t`` get ``coef * |logp - logp_old|`` added to their policy term; no token is clipped
  (as verl and the paper: KL-Cov replaces clipping). Its penalty is 0 with gradient 0 when the
  policy is the rollout's (``algo.num_iterations=1``), so it acts only on reused rollouts.

The scores are over one micro-batch, as in verl (whose policy loss also runs per micro-batch); the
random choice of Clip-Cov draws from a generator the loop seeds from the run's seed, the step, the
update, the micro-batch and the process, so a resumed run picks the same tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

COV_RESTRICTIONS = ("none", "clip_cov", "kl_cov")


def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` detached ``(A_t - mean A) * (logp_t - mean logp)``, means over the valid tokens
    (``mask``); invalid tokens get ``-inf`` so no selection picks them. ``advantages`` is ``[B]``
    (one per sequence, given to each of its tokens) or ``[B, T]``."""
    valid = mask.bool()
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.ndim == 1 else advantages
    adv, lp = adv.detach().to(logp.dtype), logp.detach()
    count = valid.sum().clamp(min=1)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    mean_adv = torch.where(valid, adv, zero).sum() / count
    mean_lp = torch.where(valid, lp, zero).sum() / count
    cov = (adv - mean_adv) * (lp - mean_lp)
    return cov.masked_fill(~valid, float("-inf"))


def selection_size(mask: Tensor, ratio: float) -> int:
    """How many tokens a method restricts: ``max(1, int(ratio * valid tokens))`` (0 without any)."""
    valid = int(mask.bool().sum())
    return max(1, int(ratio * valid)) if valid else 0


def clip_cov_selection(cov: Tensor, mask: Tensor, clipped: Tensor, *, ratio: float, lb: float,
                       ub: float, generator: torch.Generator | None = None) -> Tensor:
    """Bool ``[B, T]``: the tokens whose policy gradient Clip-Cov removes. Candidates are valid,
    not ``clipped`` by the ordinary clip, with ``lb < cov < ub``; of those a uniformly random
    ``selection_size(mask, ratio)`` (all when fewer), drawn with ``generator`` (on the CPU)."""
    candidates = (mask.bool() & ~clipped & (cov > lb) & (cov < ub)).flatten().nonzero().flatten()
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    take = min(selection_size(mask, ratio), candidates.numel())
    if take:
        order = torch.randperm(candidates.numel(), generator=generator)[:take]
        chosen[candidates[order.to(candidates.device)]] = True
    return chosen.view_as(cov)


def kl_cov_selection(cov: Tensor, mask: Tensor, *, ratio: float) -> Tensor:
    """Bool ``[B, T]``: the ``selection_size(mask, ratio)`` valid tokens of largest ``cov`` (ties
    to the earlier token), which KL-Cov penalises."""
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    take = selection_size(mask, ratio)
    if take:
        # a stable descending sort, so equal scores keep token order on every device
        order = torch.sort(cov.flatten(), descending=True, stable=True).indices[:take]
        chosen[order] = True
    return chosen.view_as(cov)


def selection_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from ``key`` (e.g. seed, step, update, micro-batch, rank) through
    SHA-256, so nearby keys give unrelated streams and a resumed run draws the same."""
    digest = hashlib.sha256(",".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass(frozen=True)
class CovRestriction:
    """``algo.cov_restriction`` and its numbers: ``method`` one of ``clip_cov`` / ``kl_cov``;
    ``ratio`` the share of valid tokens restricted; Clip-Cov's score window ``(lb, ub)``; KL-Cov's
    penalty ``coef``. Clip-Cov's random stream is each micro-batch's own (:meth:`select`)."""

    method: str
    ratio: float
    lb: float = 1.0
    ub: float = 5.0
    coef: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in COV_RESTRICTIONS[1:]:
            raise ValueError(f"unknown covariance restriction {self.method!r}; allowed: "
                             f"{list(COV_RESTRICTIONS[1:])}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"cov restriction ratio must be in (0, 1], got {self.ratio}")

    def select(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
               clipped: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Bool ``[B, T]``: the tokens this method restricts in this micro-batch (``clipped``:
        the tokens the ordinary clip stopped, which Clip-Cov leaves alone; ``generator``:
        Clip-Cov's random stream)."""
        cov = token_covariance(logp, advantages, mask)
        if self.method == "clip_cov":
            return clip_cov_selection(cov, mask, clipped, ratio=self.ratio, lb=self.lb,
                                      ub=self.ub, generator=generator)
        return kl_cov_selection(cov, mask, ratio=self.ratio)
