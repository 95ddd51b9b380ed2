"""GRPO policy loss: a PPO-style clipped surrogate per token, an optional KL penalty, and an aggregation.

Shapes: ``logp``, ``old_logp``, ``ref_logp`` and ``mask`` are ``[B, T]`` (completion tokens of ``B``
sequences, right-padded); ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``.

The importance ratio is per token (PPO, GRPO) or per sequence (GSPO, Zheng et al. 2025: the geometric
mean of the sequence's token ratios, clipped as a whole), see ``importance_log_ratio``. Optional
per-token extras: truncated importance-sampling weights for a rollout engine whose log-probs differ from
the trainer's (TIS), and an entropy bonus.

Micro-batching: the training step splits a batch into micro-batches and accumulates gradients. Every
aggregation here therefore takes the *whole batch's* normalisers (``total_tokens``, ``total_seqs``,
``max_new_tokens``) and returns this micro-batch's *contribution* to the whole-batch mean, so that
summing the losses (and gradients) of all micro-batches gives exactly the whole-batch value. Dividing
each micro-batch by its own token count instead would weight a short micro-batch's tokens more. A
sequence is never split between micro-batches, so a sequence-level ratio sees all of its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from r1fit.algorithms.covariance import CovRestriction
from r1fit.algorithms.kl import kl_k3

if TYPE_CHECKING:
    from r1fit.config import AlgoConfig

Aggregation = Callable[..., Tensor]


IMPORTANCE_LEVELS = ("token", "sequence", "sequence_token")


@dataclass(frozen=True)
class LossSettings:
    """How the policy loss is configured, built once per run (:meth:`of`) and passed whole to
    ``grpo_loss``, ``token_policy_loss`` and ``per_token_grpo_terms``; what changes per
    micro-batch (the tensors, the batch's totals, Clip-Cov's random stream) is passed beside it.

    ``epsilon`` / ``epsilon_high``: the clip range below / above 1 (``epsilon_high=None`` means
    ``epsilon``; a larger one is DAPO's clip-higher). ``beta``: weight of the k3 KL term in the
    loss. ``aggregation``: a key of ``AGGREGATIONS``. ``importance_level``: one of
    ``IMPORTANCE_LEVELS``. ``entropy_coef``: the entropy bonus's weight. ``tis_cap``: the cap of
    the TIS weights (None: no TIS). ``cov``: Clip-Cov or KL-Cov (None: off). The values are
    checked where they are used, as before (``ValueError`` naming the setting)."""

    epsilon: float
    epsilon_high: float | None = None
    beta: float = 0.0
    aggregation: str = "token_mean"
    importance_level: str = "token"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    cov: CovRestriction | None = None

    @classmethod
    def of(cls, algo: AlgoConfig) -> LossSettings:
        """The settings of ``algo``: its clip range for the importance level in use
        (``algo.clip_range()``), no KL term in the loss with ``algo.kl_in_reward`` (the KL is in
        the reward then), ``algo.tis_cap`` 0 or null as no TIS."""
        epsilon, epsilon_high = algo.clip_range()
        cov = None
        if algo.cov_restriction != "none":
            clip = algo.cov_restriction == "clip_cov"
            cov = CovRestriction(algo.cov_restriction,
                                 algo.clip_cov_ratio if clip else algo.kl_cov_ratio,
                                 lb=algo.clip_cov_lb, ub=algo.clip_cov_ub, coef=algo.kl_cov_coef)
        return cls(epsilon, epsilon_high, beta=0.0 if algo.kl_in_reward else algo.beta,
                   aggregation=algo.loss_aggregation,
                   importance_level=algo.importance_sampling_level,
                   entropy_coef=algo.entropy_coef, tis_cap=algo.tis_cap or None, cov=cov)


@dataclass(frozen=True)
class BatchTotals:
    """The whole batch's normalisers of an aggregation (see the module docstring): valid tokens
    and sequences with valid tokens of every micro-batch, and the generation limit."""

    total_tokens: int
    total_seqs: int
    max_new_tokens: int

    def kwargs(self) -> dict[str, int]:
        """As the keywords of ``aggregate`` and ``aggregation_weights``."""
        return {"total_tokens": self.total_tokens, "total_seqs": self.total_seqs,
                "max_new_tokens": self.max_new_tokens}


def importance_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor | None, level: str) -> Tensor:
    """``[B, T]`` log of the importance ratio that each token's clipped term uses.

    ``token``: ``logp - old_logp`` (PPO, GRPO). ``sequence``: GSPO's ``log s_i``, the mean of
    ``logp - old_logp`` over the valid tokens of sequence ``i`` (``mask``), the same for each of its
    tokens; its gradient reaches every token of the sequence through the mean. ``sequence_token``:
    GSPO-token's ``log s_i,t = sg[log s_i] + logp_t - sg[logp_t]``, valued ``log s_i`` with the gradient
    of ``logp_t`` alone (``sg`` = stop-gradient). A sequence without valid tokens gets ratio 1.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; allowed: {list(IMPORTANCE_LEVELS)}")
    delta = logp - old_logp
    if level == "token":
        return delta
    if mask is None:
        raise ValueError(f"importance sampling level {level!r} needs the mask of valid tokens")
    valid = mask.bool()
    summed = torch.where(valid, delta, torch.zeros((), dtype=delta.dtype, device=delta.device)).sum(-1, keepdim=True)
    seq = summed / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    if level == "sequence":
        return seq.expand_as(delta)
    return seq.detach() + logp - logp.detach()


def token_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    settings: LossSettings,
    *,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    tis_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    restricted: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token loss ``-w*min(r*A, clip(r, 1-eps, 1+eps_high)*A) + beta*k3 - c*H`` and a bool "clipped" mask.

    The numbers are ``settings``' (its ``aggregation`` is not used here).
    ``r = exp(importance_log_ratio(logp, old_logp, mask, importance_level))``: per token by default,
    per sequence for GSPO (``mask`` required). ``epsilon_high`` defaults to ``epsilon``; a larger value
    is DAPO's "clip-higher", which lets low-probability tokens grow further. A token counts as clipped
    when the clipped branch is strictly the one chosen, i.e. its gradient is zero: ``r < 1-eps`` with
    ``A < 0`` or ``r > 1+eps_high`` with ``A > 0`` (at the sequence level a whole sequence is clipped or
    not). ``w = tis_weights`` (detached; TIS) scales the clipped surrogate only, not the KL or entropy
    terms, as in TRL and verl. The KL term is added only when ``beta > 0``; the entropy bonus
    (``H = entropy``, per token) only when ``entropy_coef = c > 0``.

    ``restricted`` (bool ``[B, T]``, r1fit/algorithms/covariance.py) with ``settings.cov``'s method:
    ``clip_cov`` zeroes those tokens' clipped surrogate (value and gradient); ``kl_cov`` drops the
    clip for every token (``-r*A``) and adds ``cov.coef * |logp - old_logp|`` to the restricted
    ones (nothing is then counted as clipped).
    """
    epsilon, beta, entropy_coef = settings.epsilon, settings.beta, settings.entropy_coef
    epsilon_high = _check_clip(epsilon, settings.epsilon_high, beta, ref_logp)
    restriction = "none" if settings.cov is None else settings.cov.method
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef}")
    if entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} > 0 needs the per-token entropy, got None")
    for name, tensor in (("tis_weights", tis_weights), ("entropy", entropy)):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} does not match logp shape {tuple(logp.shape)}")
    adv = advantages.unsqueeze(-1) if advantages.ndim == logp.ndim - 1 else advantages
    ratio = torch.exp(importance_log_ratio(logp, old_logp, mask, settings.importance_level))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv
    # min of the two is PPO's pessimistic bound: clipping removes the incentive, never the penalty.
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = clip_mask(ratio, adv, epsilon, epsilon_high)
    if restricted is not None and restriction == "clip_cov":
        loss = loss.masked_fill(restricted, 0.0)
    elif restricted is not None and restriction == "kl_cov":
        penalty = (1.0 if settings.cov is None else settings.cov.coef) * (logp - old_logp).abs()
        loss = -unclipped + torch.where(restricted, penalty, torch.zeros_like(penalty))
        is_clipped = torch.zeros_like(is_clipped)
    elif restricted is not None:
        raise ValueError(f"unknown restriction {restriction!r}; allowed: 'clip_cov', 'kl_cov'")
    if tis_weights is not None:
        loss = loss * tis_weights.detach()
    if beta > 0:
        loss = loss + beta * kl_k3(logp, ref_logp)
    if entropy_coef > 0:
        loss = loss - entropy_coef * entropy
    return loss, is_clipped


def clip_mask(ratio: Tensor, adv: Tensor, epsilon: float, epsilon_high: float) -> Tensor:
    """Tokens whose clipped branch is strictly chosen (zero gradient): ``r < 1-eps`` with ``A < 0``
    or ``r > 1+eps_high`` with ``A > 0``."""
    return ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))


def truncated_importance_weights(trainer_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """TIS weights ``min(exp(trainer_logp - engine_logp), cap)`` per token, detached.

    The rollout engine (vLLM) sampled the tokens with its own log-probs; the trainer's differ a little
    (kernels, precision), so the update is slightly off-policy. Reweighting by ``pi_trainer /
    pi_engine``, truncated at ``cap`` to bound the variance, corrects for it (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; TRL's
    ``vllm_importance_sampling_correction``, verl's TIS). ``trainer_logp`` is the old policy's (the one
    that generated the rollout), so the weights are constants of the update.
    """
    if trainer_logp.shape != engine_logp.shape:
        raise ValueError(f"engine_logp shape {tuple(engine_logp.shape)} does not match trainer_logp shape "
                         f"{tuple(trainer_logp.shape)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(trainer_logp.detach() - engine_logp.detach()).clamp(max=cap)


def _token_mean(token_loss: Tensor, mask: Tensor, *, total_tokens: int, total_seqs: int, max_new_tokens: int) -> Tensor:
    """DAPO: every valid token of the whole batch weighs the same, ``sum / total_tokens``."""
    return _masked(token_loss, mask).sum() / total_tokens


def _seq_mean_token_mean(
    token_loss: Tensor, mask: Tensor, *, total_tokens: int, total_seqs: int, max_new_tokens: int
) -> Tensor:
    """GRPO: mean over each sequence's valid tokens, then mean over the batch's sequences."""
    # A sequence's own length is local to its micro-batch, so only the sequence count must be global.
    # clamp: a sequence with no valid token contributes 0 instead of 0/0.
    seq_len = mask.sum(dim=-1).clamp(min=1)
    return (_masked(token_loss, mask).sum(dim=-1) / seq_len).sum() / total_seqs


def _seq_mean_token_sum_norm(
    token_loss: Tensor, mask: Tensor, *, total_tokens: int, total_seqs: int, max_new_tokens: int
) -> Tensor:
    """Dr. GRPO: each sequence's token sum divided by the constant ``max_new_tokens``, then mean over sequences.

    A constant divisor removes GRPO's length bias (long wrong answers penalised less per token).
    """
    return _masked(token_loss, mask).sum() / (max_new_tokens * total_seqs)


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(
    token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: int,
    total_seqs: int,
    max_new_tokens: int,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to this micro-batch's contribution to the whole-batch loss.

    ``mode`` is a key of ``AGGREGATIONS``. ``total_tokens`` (valid tokens) and ``total_seqs`` (sequences
    with valid tokens) count the whole batch across all micro-batches; ``max_new_tokens`` is the
    generation limit. Summed over the micro-batches of a batch, the returned values equal the value
    for the whole batch at once.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {sorted(AGGREGATIONS)}")
    if token_loss.ndim != 2:
        raise ValueError(f"token_loss must be 2-D [B, T], got shape {tuple(token_loss.shape)}")
    if mask.shape != token_loss.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match token_loss shape {tuple(token_loss.shape)}")
    for name, value in (("total_tokens", total_tokens), ("total_seqs", total_seqs), ("max_new_tokens", max_new_tokens)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    # rows without valid tokens (padding rows, or completions masked out of the loss) contribute 0
    counted = int(mask.bool().any(dim=-1).sum())
    if counted > total_seqs:
        raise ValueError(f"micro-batch has {counted} sequences but total_seqs={total_seqs}")
    return AGGREGATIONS[mode](
        token_loss, mask.bool(), total_tokens=total_tokens, total_seqs=total_seqs, max_new_tokens=max_new_tokens
    )


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings,
    totals: BatchTotals,
    *,
    tis_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch (its contribution to the whole-batch loss) and detached stats.

    ``old_logp=None`` means one optimisation step per rollout (``num_iterations == 1``): ``logp.detach()``
    stands in, so the ratio is 1 in value while its gradient is the policy gradient ``A * grad(logp)``.
    ``ref_logp`` is required when ``settings.beta > 0``; when given with ``beta == 0`` it is used for
    the stat only. ``totals``: the whole batch's normalisers of ``settings.aggregation``.

    ``tis_weights`` and ``entropy`` as in ``token_policy_loss``. ``settings.cov``: Clip-Cov or KL-Cov
    (r1fit/algorithms/covariance.py), on token-level ratios only; the tokens it restricts are chosen
    over this micro-batch, Clip-Cov's at random from ``generator``.

    Stats (each a contribution to the whole-batch value, summed over micro-batches like the loss, and
    token-weighted like ``token_mean``): ``clip_fraction`` = fraction of valid tokens whose clipped
    branch was chosen; ``kl`` = mean k3 per valid token (present only when ``ref_logp`` is given);
    ``tis_weight`` = mean TIS weight per valid token (only when ``tis_weights`` are given);
    ``cov_restricted`` = fraction of valid tokens ``cov`` restricted (only with ``cov``).
    """
    if logp.ndim != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    if old_logp is None:
        old_logp = logp.detach()
    for name, tensor in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} does not match logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")

    restricted = None
    cov = settings.cov
    if cov is not None:
        if settings.importance_level != "token":
            raise ValueError(f"{cov.method} restricts token-level ratios; importance sampling level "
                             f"is {settings.importance_level!r}")
        adv = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages
        epsilon = settings.epsilon
        high = epsilon if settings.epsilon_high is None else settings.epsilon_high
        with torch.no_grad():
            clipped_now = clip_mask(torch.exp(logp - old_logp), adv, epsilon, high)
            restricted = cov.select(logp, old_logp, advantages, mask, clipped_now, generator)
    token_loss, clipped = token_policy_loss(
        logp, old_logp, advantages, settings, ref_logp=ref_logp, mask=mask, tis_weights=tis_weights,
        entropy=entropy, restricted=restricted)
    norms = totals.kwargs()
    loss = aggregate(token_loss, mask, settings.aggregation, **norms)
    with torch.no_grad():
        stats = {"clip_fraction": aggregate(clipped.to(token_loss.dtype), mask, "token_mean", **norms)}
        if ref_logp is not None:
            stats["kl"] = aggregate(kl_k3(logp, ref_logp), mask, "token_mean", **norms)
        if tis_weights is not None:
            stats["tis_weight"] = aggregate(tis_weights.to(token_loss.dtype), mask, "token_mean", **norms)
        if restricted is not None:
            stats["cov_restricted"] = aggregate(restricted.to(token_loss.dtype), mask, "token_mean", **norms)
    return loss, stats


def aggregation_weights(mask: Tensor, mode: str, *, total_tokens: int, total_seqs: int,
                        max_new_tokens: int) -> Tensor:
    """``[B, T]`` weight of each token's loss in ``aggregate`` (every aggregation is linear in the
    token losses): ``aggregate(x, mask, mode, ...) == (weights * x).sum()`` wherever ``x`` is
    finite, 0 where ``mask`` is not set. Read off ``aggregate`` itself (its gradient), so a new
    aggregation needs no second formula here."""
    ones = torch.ones(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        total = aggregate(ones, mask, mode, total_tokens=total_tokens, total_seqs=total_seqs,
                          max_new_tokens=max_new_tokens)
        (weights,) = torch.autograd.grad(total, ones)
    return weights


def per_token_grpo_terms(
    scored: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    weights: Tensor,
    settings: LossSettings,
    *,
    engine_logp: Tensor | None = None,
) -> Callable[[slice, Tensor, Tensor | None], Tensor]:
    """``grpo_loss`` with token-level ratios and no Clip-Cov/KL-Cov, as a sum of per-token terms
    (r1fit/algorithms/logprobs.py ``fused_head_loss``): ``terms(rows, logp, entropy)`` is the
    loss of tokens ``rows`` given their log-probs and entropies.

    The tokens are the micro-batch's ``scored`` ones (bool ``[B, T]``), row-major: the LM head's
    order. ``old_logp``, ``ref_logp``, ``engine_logp`` and ``weights`` (``aggregation_weights``)
    are ``[B, T]``, ``advantages`` ``[B]`` or ``[B, T]``, as for ``grpo_loss``.
    ``old_logp=None`` (``num_iterations == 1``): the ratio is 1 in value, as in ``grpo_loss``.
    ``engine_logp`` (with ``settings.tis_cap``; None: no TIS): TIS weights from the old log-probs
    (the policy that generated the rollout)."""
    if engine_logp is not None and settings.tis_cap is None:
        raise ValueError("TIS needs both engine_logp and tis_cap")
    if settings.importance_level != "token" or settings.cov is not None:
        raise ValueError("per-token terms need token-level ratios and no Clip-Cov/KL-Cov, got "
                         f"importance level {settings.importance_level!r} and cov {settings.cov}")
    tis_cap = settings.tis_cap

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.expand(scored.shape)[scored]

    old_logp, ref_logp, engine_logp, weights = map(flat, (old_logp, ref_logp, engine_logp, weights))
    advantages = flat(advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages)

    def terms(rows: slice, logp: Tensor, entropy: Tensor | None) -> Tensor:
        old = logp.detach() if old_logp is None else old_logp[rows]
        tis = (truncated_importance_weights(old, engine_logp[rows], tis_cap)
               if engine_logp is not None and tis_cap is not None else None)
        loss, _ = token_policy_loss(
            logp[None], old[None], advantages[rows][None], settings,
            ref_logp=None if ref_logp is None else ref_logp[rows][None],
            tis_weights=None if tis is None else tis[None],
            entropy=None if entropy is None else entropy[None])
        weight = weights[rows].to(loss.dtype)
        return _masked(loss[0] * weight, weight != 0).sum()

    return terms


def _masked(token_loss: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: padded positions may hold inf/NaN (e.g. -inf log-probs), and NaN * 0 is NaN.
    return torch.where(mask, token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device))


def _check_clip(epsilon: float, epsilon_high: float | None, beta: float, ref_logp: Tensor | None) -> float:
    """Validate the clip/KL settings and return ``epsilon_high`` with its default filled in."""
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon_high <= 0:
        raise ValueError(f"epsilon_high must be > 0, got {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (reference-model log-probs), got None")
    return epsilon_high
