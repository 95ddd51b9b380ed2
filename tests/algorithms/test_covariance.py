"""Clip-Cov and KL-Cov (r1fit/algorithms/covariance.py) on hand-computed numbers, and their
gradients through grpo_loss against a slow per-token reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from r1fit.algorithms.covariance import (
    CovRestriction,
    clip_cov_selection,
    kl_cov_selection,
    selection_generator,
    selection_size,
    token_covariance,
)
from r1fit.algorithms.losses import BatchTotals, LossSettings, grpo_loss

F64 = torch.float64
# two sequences of two tokens; advantages +1 and -1 (given to each token of the sequence)
LOGP = torch.tensor([[-1.0, -2.0], [-3.0, -5.0]], dtype=F64)
ADV = torch.tensor([1.0, -1.0], dtype=F64)
MASK = torch.ones(2, 2)
# by hand: mean A = 0, mean logp = -11/4 = -2.75; cov = A * (logp + 2.75)
#   (0,0): 1 * 1.75 = 1.75   (0,1): 1 * 0.75 = 0.75   (1,0): -1 * -0.25 = 0.25   (1,1): -1 * -2.25 = 2.25
COV = torch.tensor([[1.75, 0.75], [0.25, 2.25]], dtype=F64)


def test_token_covariance_by_hand():
    torch.testing.assert_close(token_covariance(LOGP, ADV, MASK), COV)


def test_token_covariance_leaves_out_padding():
    # a third, padded token of the first sequence: it must not move the means and gets -inf
    logp = torch.tensor([[-1.0, -2.0, -100.0], [-3.0, -5.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    cov = token_covariance(logp, ADV, mask)
    torch.testing.assert_close(cov[:, :2], COV)
    assert cov[:, 2].tolist() == [float("-inf")] * 2


def test_selection_size_is_a_share_of_the_valid_tokens_at_least_one():
    assert selection_size(MASK, 2e-4) == 1
    assert selection_size(torch.ones(10, 100), 2e-2) == 20
    assert selection_size(torch.zeros(2, 2), 0.5) == 0


def test_kl_cov_selects_the_largest_covariances():
    # ratio 0.5 of 4 tokens: the two largest, 2.25 at (1,1) and 1.75 at (0,0)
    chosen = kl_cov_selection(COV, MASK, ratio=0.5)
    assert chosen.tolist() == [[True, False], [False, True]]
    assert kl_cov_selection(COV, MASK, ratio=0.25).tolist() == [[False, False], [False, True]]


def test_clip_cov_picks_within_the_window_and_skips_clipped_tokens():
    none_clipped = torch.zeros(2, 2, dtype=torch.bool)
    # window (0.5, 2.0): candidates 1.75 at (0,0) and 0.75 at (0,1); ratio 0.5 -> 2 tokens: both
    both = clip_cov_selection(COV, MASK, none_clipped, ratio=0.5, lb=0.5, ub=2.0)
    assert both.tolist() == [[True, True], [False, False]]
    # the ordinary clip already stopped (0,0): only (0,1) is left
    clipped = torch.tensor([[True, False], [False, False]])
    assert clip_cov_selection(COV, MASK, clipped, ratio=0.5, lb=0.5, ub=2.0).tolist() == \
        [[False, True], [False, False]]
    # ratio 0.25 -> 1 of the 2 candidates, at random: always one of them, both over seeds
    picks = set()
    for seed in range(20):
        one = clip_cov_selection(COV, MASK, none_clipped, ratio=0.25, lb=0.5, ub=2.0,
                                 generator=torch.Generator().manual_seed(seed))
        assert int(one.sum()) == 1 and not one[1].any()
        picks.add(tuple(one.flatten().tolist()))
    assert len(picks) == 2


def test_the_random_choice_is_reproducible_from_its_key():
    cov = torch.arange(100, dtype=F64).view(10, 10) / 50  # 0 .. 1.98
    mask, none = torch.ones(10, 10), torch.zeros(10, 10, dtype=torch.bool)

    def pick(*key):
        return clip_cov_selection(cov, mask, none, ratio=0.05, lb=0.0, ub=3.0,
                                  generator=selection_generator(*key))

    assert torch.equal(pick(1, 2, 0, 0, 0), pick(1, 2, 0, 0, 0))
    assert int(pick(1, 2, 0, 0, 0).sum()) == 5
    assert not torch.equal(pick(1, 2, 0, 0, 0), pick(1, 3, 0, 0, 0))  # another step


def _reference_loss(logp, old, adv, mask, restricted, method, *, eps=0.2, eps_high=0.28,
                    coef=1.0, total_tokens):
    """Slow per-token loop: token_mean of the restricted clipped surrogate."""
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            r = torch.exp(logp[b, t] - old[b, t])
            a = adv[b]
            if method == "kl_cov":
                term = -r * a + (coef * (logp[b, t] - old[b, t]).abs() if restricted[b, t] else 0)
            else:
                term = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps_high) * a)
                if restricted[b, t]:
                    term = term * 0
            total = total + term
    return total / total_tokens


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_restricted_loss_and_gradient_equal_a_slow_reference(method):
    torch.manual_seed(0)
    logp = (torch.randn(4, 6, dtype=F64) - 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 6, dtype=F64)  # off-policy: some tokens clip
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    restriction = CovRestriction(method, 0.25, lb=-10.0, ub=10.0, coef=0.7)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, aggregation="token_mean")
    totals = BatchTotals(total_tokens=22, total_seqs=4, max_new_tokens=6)
    loss, stats = grpo_loss(logp, old, None, adv, mask, replace(settings, cov=restriction), totals,
                            generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad(loss, logp)
    # the same choice again, from a generator with the same seed
    again = CovRestriction(method, 0.25, lb=-10.0, ub=10.0, coef=0.7)
    clipped = ((torch.exp(logp - old) < 0.8) & (adv[:, None] < 0)) | \
        ((torch.exp(logp - old) > 1.28) & (adv[:, None] > 0))
    restricted = again.select(logp.detach(), old, adv, mask, clipped,
                              torch.Generator().manual_seed(3))
    assert int(restricted.sum()) == 5  # max(1, int(0.25 x 22))
    assert stats["cov_restricted"].item() == pytest.approx(5 / 22)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = _reference_loss(ref_logp, old, adv, mask, restricted, method, coef=0.7, total_tokens=22)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    # and the restriction changed something: the plain loss's gradient differs on those tokens
    plain, _ = grpo_loss(logp, old, None, adv, mask, settings, totals)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    assert not torch.allclose(plain_grad[restricted], grad[restricted])
    if method == "clip_cov":  # elsewhere untouched
        torch.testing.assert_close(plain_grad[~restricted], grad[~restricted])
        assert torch.all(grad[restricted] == 0)
    else:  # no clipping at all under KL-Cov
        assert stats["clip_fraction"].item() == 0


def test_kl_cov_does_nothing_on_policy():
    # num_iterations=1: old = logp, |logp - old| = 0 with gradient 0, so KL-Cov is the plain
    # unclipped policy gradient (which equals the clipped one at ratio 1)
    logp = (torch.randn(3, 4, dtype=F64) - 1).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    mask = torch.ones(3, 4)
    settings = LossSettings(epsilon=0.2, aggregation="token_mean")
    totals = BatchTotals(total_tokens=12, total_seqs=3, max_new_tokens=4)
    kl, _ = grpo_loss(logp, None, None, adv, mask,
                      replace(settings, cov=CovRestriction("kl_cov", 0.5)), totals)
    plain, _ = grpo_loss(logp, None, None, adv, mask, settings, totals)
    g_kl, g_plain = (torch.autograd.grad(x, logp)[0] for x in (kl, plain))
    torch.testing.assert_close(g_kl, g_plain)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown covariance restriction 'clip'"):
        CovRestriction("clip", 0.1)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        CovRestriction("kl_cov", 0.0)
    logp = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="restricts token-level ratios"):
        grpo_loss(logp, None, None, torch.ones(1, dtype=F64), torch.ones(1, 2),
                  LossSettings(epsilon=0.2, aggregation="token_mean", importance_level="sequence",
                               cov=CovRestriction("kl_cov", 0.5)),
                  BatchTotals(total_tokens=2, total_seqs=1, max_new_tokens=2))
