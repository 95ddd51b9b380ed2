import math

import pytest
import torch

from r1fit.algorithms.losses import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    BatchTotals,
    LossSettings,
    aggregate,
    aggregation_weights,
    grpo_loss,
    importance_log_ratio,
    per_token_grpo_terms,
    token_policy_loss,
    truncated_importance_weights,
)

F64 = torch.float64
ALL_AGGREGATIONS = sorted(AGGREGATIONS)


def _logp_with_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A [1, len] logp (leaf, requires grad) and old_logp = 0 such that exp(logp - old_logp) = ratios."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    return logp, torch.zeros_like(logp)


# ---------------------------------------------------------------- per-token clipped loss, by hand


def test_clipped_ratio_is_exactly_1_2_and_has_zero_gradient():
    # A = +1, epsilon = 0.2. Token 0: ratio 1.5 -> clipped to 1.2, loss = -1.2, d loss / d logp = 0.
    # Token 1: ratio 1.1 is inside [0.8, 1.2], loss = -1.1, d(-ratio * A)/d logp = -ratio = -1.1.
    logp, old = _logp_with_ratios([1.5, 1.1])
    loss, clipped = token_policy_loss(logp, old, torch.tensor([1.0], dtype=F64), LossSettings(epsilon=0.2))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.1]], dtype=F64))
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]], dtype=F64))


def test_low_side_clipping_depends_on_advantage_sign():
    # ratio 0.7, epsilon 0.2 -> clip(0.7) = 0.8.
    # A = -1: min(-0.7, -0.8) = -0.8 (clipped branch), loss 0.8, gradient 0.
    # A = +1: min(0.7, 0.8) = 0.7 (unclipped: a worse token keeps its penalty), loss -0.7, grad -0.7.
    logp, old = _logp_with_ratios([0.7])
    logp2, _ = _logp_with_ratios([0.7])
    loss, clipped = token_policy_loss(
        torch.cat([logp, logp2]), torch.cat([old, old]), torch.tensor([-1.0, 1.0], dtype=F64),
        LossSettings(epsilon=0.2)
    )
    torch.testing.assert_close(loss, torch.tensor([[0.8], [-0.7]], dtype=F64))
    assert clipped.tolist() == [[True], [False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0]], dtype=F64))
    torch.testing.assert_close(logp2.grad, torch.tensor([[-0.7]], dtype=F64))


def test_clip_higher_with_epsilon_high_0_28():
    # A = +1, epsilon = 0.2. ratio 1.25: clipped at 1.2 when symmetric (loss -1.2, grad 0), but inside
    # [0.8, 1.28] with epsilon_high 0.28 (loss -1.25, grad -1.25). ratio 1.3 -> clipped at 1.28.
    logp, old = _logp_with_ratios([1.25, 1.3])
    adv = torch.tensor([1.0], dtype=F64)
    symmetric, sym_clipped = token_policy_loss(logp, old, adv, LossSettings(epsilon=0.2))
    torch.testing.assert_close(symmetric, torch.tensor([[-1.2, -1.2]], dtype=F64))
    assert sym_clipped.tolist() == [[True, True]]
    higher, high_clipped = token_policy_loss(logp, old, adv, LossSettings(epsilon=0.2, epsilon_high=0.28))
    torch.testing.assert_close(higher, torch.tensor([[-1.25, -1.28]], dtype=F64))
    assert high_clipped.tolist() == [[False, True]]
    higher.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25, 0.0]], dtype=F64))


def test_kl_term_added_only_with_positive_beta():
    # ratio 1, A = 1, logp = log 0.5, ref = log 0.25: k3 = 0.5 + ln 2 - 1 = 0.193147;
    # loss = -1 + 0.1 * 0.193147 = -0.980685.
    logp = torch.tensor([[math.log(0.5)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    adv = torch.tensor([1.0], dtype=F64)
    with_kl, _ = token_policy_loss(logp, logp, adv, LossSettings(epsilon=0.2, beta=0.1), ref_logp=ref)
    assert with_kl.item() == pytest.approx(-0.980685, abs=1e-6)
    without, _ = token_policy_loss(logp, logp, adv, LossSettings(epsilon=0.2, beta=0.0), ref_logp=ref)
    assert without.item() == pytest.approx(-1.0, abs=1e-12)


# ---------------------------------------------------------------- aggregations, by hand

TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
# Valid tokens: row 0 -> 1, 2 (length 2); row 1 -> 4 (length 1). 3 tokens, 2 sequences, max_new_tokens 3.
HAND = {
    "token_mean": 7 / 3,  # (1 + 2 + 4) / 3
    "seq_mean_token_mean": 2.75,  # ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2
    "seq_mean_token_sum_norm": 7 / 6,  # ((1 + 2) / 3 + 4 / 3) / 2
}
NORMS = {"total_tokens": 3, "total_seqs": 2, "max_new_tokens": 3}


@pytest.mark.parametrize("mode", ALL_AGGREGATIONS)
def test_aggregation_on_hand_example(mode):
    assert aggregate(TOKEN_LOSS, MASK, mode, **NORMS).item() == pytest.approx(HAND[mode], abs=1e-12)


@pytest.mark.parametrize("mode", ALL_AGGREGATIONS)
def test_aggregation_contributions_of_single_rows_sum_to_whole(mode):
    # Row 0 alone contributes 3/3, 1.5/2, 1/2; row 1 contributes 4/3, 4/2, (4/3)/2.
    parts = [aggregate(TOKEN_LOSS[i : i + 1], MASK[i : i + 1], mode, **NORMS).item() for i in range(2)]
    assert sum(parts) == pytest.approx(HAND[mode], abs=1e-12)


def test_padding_values_never_leak_into_the_loss():
    poisoned = TOKEN_LOSS.clone()
    poisoned[MASK == 0] = float("nan")
    assert aggregate(poisoned, MASK, "token_mean", **NORMS).item() == pytest.approx(7 / 3, abs=1e-12)


def test_grpo_loss_stats_on_hand_example():
    # Tokens: ratio 1.5 (clipped), ratio 1.1, and a padded one; A = 1; ref = logp except token 1,
    # where ref - logp = -ln 2, so k3 = 0.5 + ln 2 - 1 = 0.193147 there. Two valid tokens:
    # clip_fraction = 1/2, kl = 0.193147 / 2, token_mean loss = (-1.2 - 1.1) / 2 = -1.15.
    logp, old = _logp_with_ratios([1.5, 1.1, 1.0])
    ref = logp.detach().clone()
    ref[0, 1] -= math.log(2)
    loss, stats = grpo_loss(
        logp, old, ref, torch.tensor([1.0], dtype=F64), torch.tensor([[1, 1, 0]]),
        LossSettings(epsilon=0.2, beta=0.0, aggregation="token_mean"), BatchTotals(2, 1, 3),
    )
    assert loss.item() == pytest.approx(-1.15, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    assert stats["kl"].item() == pytest.approx((0.5 + math.log(2) - 1) / 2, abs=1e-12)
    assert not any(v.requires_grad for v in stats.values())


def test_old_logp_none_gives_ratio_one_and_policy_gradient():
    # ratio = exp(logp - logp.detach()) = 1, so token_mean loss = -A = -2 in value, and
    # d loss / d logp = -A / total_tokens = -2 / 2 = -1 on each valid token, 0 on padding.
    logp = torch.randn(1, 3, dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(
        logp, None, None, torch.tensor([2.0], dtype=F64), torch.tensor([[1, 1, 0]]),
        LossSettings(epsilon=0.2, aggregation="token_mean"), BatchTotals(2, 1, 3),
    )
    assert loss.item() == pytest.approx(-2.0, abs=1e-12)
    assert "kl" not in stats and stats["clip_fraction"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]], dtype=F64))


# ---------------------------------------------------------------- vectorised vs slow reference loop


def reference_grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, epsilon, epsilon_high, beta, aggregation,
                        max_new_tokens, level="token", tis=None, entropy=None, entropy_coef=0.0):
    """Obvious loop over sequences and tokens, scalar by scalar, over the whole batch."""
    seq_sums, seq_lens = [], []
    for b in range(logp.shape[0]):
        valid = [t for t in range(logp.shape[1]) if mask[b, t]]
        # GSPO: s_b = exp(mean over the sequence's valid tokens of (logp - old_logp))
        seq_log_ratio = sum(logp[b, t] - old_logp[b, t] for t in valid) / max(len(valid), 1)
        total, count = 0.0, 0
        for t in valid:
            if level == "token":
                ratio = torch.exp(logp[b, t] - old_logp[b, t])
            elif level == "sequence":
                ratio = torch.exp(seq_log_ratio)
            else:  # GSPO-token: sg[s_b] * exp(logp - sg[logp])
                ratio = torch.exp(seq_log_ratio.detach()) * torch.exp(logp[b, t] - logp[b, t].detach())
            a = advantages[b, t] if advantages.ndim == 2 else advantages[b]
            clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
            token = -torch.minimum(ratio * a, clipped_ratio * a)
            if tis is not None:
                token = token * tis[b, t]
            if beta > 0:
                d = ref_logp[b, t] - logp[b, t]
                token = token + beta * (torch.exp(d) - d - 1)
            if entropy_coef > 0:
                token = token - entropy_coef * entropy[b, t]
            total, count = total + token, count + 1
        seq_sums.append(total)
        seq_lens.append(count)
    if aggregation == "token_mean":
        return sum(seq_sums) / sum(seq_lens)
    if aggregation == "seq_mean_token_mean":
        return sum(s / max(n, 1) for s, n in zip(seq_sums, seq_lens)) / len(seq_sums)
    return sum(s / max_new_tokens for s in seq_sums) / len(seq_sums)


def _random_batch(seed: int, batch: int = 6, length: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(batch, length, generator=g, dtype=F64) * 3).requires_grad_()
    # old/ref within +-0.4 of logp, so some ratios fall outside [0.8, 1.28] and get clipped.
    old = logp.detach() + (torch.rand(batch, length, generator=g, dtype=F64) - 0.5) * 0.8
    ref = logp.detach() + (torch.rand(batch, length, generator=g, dtype=F64) - 0.5) * 0.8
    adv = torch.randn(batch, generator=g, dtype=F64)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)  # right padding
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_vectorised_matches_reference_loop(aggregation, beta):
    logp, old, ref, adv, mask = _random_batch(seed=7)
    settings = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": beta, "aggregation": aggregation}
    loss, stats = grpo_loss(
        logp, old, ref, adv, mask, LossSettings(**settings), BatchTotals(int(mask.sum()), 6, 5)
    )
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_grpo_loss(logp, old, ref, adv, mask, **settings, max_new_tokens=5)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < stats["clip_fraction"].item() < 1  # the random batch really exercises clipping


# ---------------------------------------------------------------- micro-batching == whole batch


def _policy(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, T] of targets under a tiny linear LM head, so gradients reach a real parameter."""
    return (hidden @ weight).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("level", IMPORTANCE_LEVELS)
def test_micro_batches_sum_to_whole_batch(aggregation, beta, use_old, level):
    g = torch.Generator().manual_seed(3)
    batch, length, hidden_size, vocab = 6, 7, 4, 11
    weight = torch.randn(hidden_size, vocab, generator=g, dtype=F64, requires_grad=True)
    hidden = torch.randn(batch, length, hidden_size, generator=g, dtype=F64)
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    with torch.no_grad():
        old = _policy(weight + 0.3 * torch.randn(weight.shape, generator=g, dtype=F64), hidden, targets)
        ref = _policy(weight + 0.3 * torch.randn(weight.shape, generator=g, dtype=F64), hidden, targets)
    adv = torch.randn(batch, generator=g, dtype=F64)
    mask = torch.arange(length).unsqueeze(0) < torch.tensor([7, 1, 3, 5, 2, 6]).unsqueeze(1)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=beta, aggregation=aggregation,
                            importance_level=level)
    totals = BatchTotals(int(mask.sum()), batch, length)

    def run(rows: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp = _policy(weight, hidden[rows], targets[rows])
        return grpo_loss(logp, old[rows] if use_old else None, ref[rows], adv[rows], mask[rows], settings, totals)

    full_loss, full_stats = run(slice(None))
    (full_grad,) = torch.autograd.grad(full_loss, weight)
    for micro in (1, 2, 4):  # 4 does not divide 6: micro-batches of 4 and 2
        weight.grad = None
        total_loss, total_stats = 0.0, {k: 0.0 for k in full_stats}
        for start in range(0, batch, micro):
            loss, stats = run(slice(start, start + micro))
            loss.backward()  # gradient accumulation, as in the training step
            total_loss = total_loss + loss.detach()
            total_stats = {k: total_stats[k] + stats[k] for k in stats}
        torch.testing.assert_close(total_loss, full_loss.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(weight.grad, full_grad, atol=1e-6, rtol=0)
        for key, value in full_stats.items():
            torch.testing.assert_close(total_stats[key], value, atol=1e-6, rtol=0)
    assert full_grad.abs().max() > 1e-3  # not a vacuous all-zero gradient


# ---------------------------------------------------------------- GSPO (sequence-level ratio), by hand

SEQ = {"epsilon": 0.2, "epsilon_high": 0.28, "aggregation": "seq_mean_token_mean"}
SEQ_TOTALS = BatchTotals(total_tokens=2, total_seqs=1, max_new_tokens=3)


def test_gspo_sequence_ratio_is_the_geometric_mean_of_token_ratios():
    # Token ratios 1.5 and 1.0 (third token padded, ratio 100, must not count):
    # s = exp((ln 1.5 + ln 1) / 2) = sqrt(1.5) = 1.2247449, inside [0.8, 1.28]; A = 1.
    # Every token's loss is -s; seq_mean_token_mean of one sequence: loss = -1.2247449.
    # d loss / d logp_t = d(-s)/d logp_t = -s * (1/2) = -0.6123724 on both valid tokens, 0 on padding.
    logp, old = _logp_with_ratios([1.5, 1.0, 100.0])
    mask = torch.tensor([[1, 1, 0]])
    log_ratio = importance_log_ratio(logp, old, mask, "sequence")
    torch.testing.assert_close(log_ratio.detach(), torch.full((1, 3), math.log(1.5) / 2, dtype=F64))
    loss, stats = grpo_loss(logp, old, None, torch.tensor([1.0], dtype=F64), mask,
                            LossSettings(importance_level="sequence", **SEQ), SEQ_TOTALS)
    s = math.sqrt(1.5)
    assert loss.item() == pytest.approx(-s, abs=1e-12)
    assert stats["clip_fraction"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]], dtype=F64))


def test_gspo_clips_the_whole_sequence():
    # Token ratios 2.0 and 1.125: s = exp((ln 2 + ln 1.125) / 2) = sqrt(2.25) = 1.5 > 1.28 with A = 1:
    # loss = -1.28 on both tokens, zero gradient, and both tokens count as clipped (clip_fraction 1),
    # although token 1 alone (ratio 1.125) would not be clipped at the token level.
    logp, old = _logp_with_ratios([2.0, 1.125])
    adv = torch.tensor([1.0], dtype=F64)
    mask = torch.tensor([[1, 1]])
    loss, stats = grpo_loss(logp, old, None, adv, mask, LossSettings(importance_level="sequence", **SEQ),
                            SEQ_TOTALS)
    assert loss.item() == pytest.approx(-1.28, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2, dtype=F64))
    _, token_clipped = token_policy_loss(logp, old, adv, LossSettings(epsilon=0.2, epsilon_high=0.28))
    assert token_clipped.tolist() == [[True, False]]


def test_gspo_token_has_the_sequence_value_and_per_token_gradients():
    # Token ratios 1.5 and 1.0: s = sqrt(1.5) = 1.2247449 for both levels. Per-token advantages [1, -1]:
    # GSPO-token: loss_t = -A_t * s_t with s_t = sg[s] exp(logp_t - sg[logp_t]) (value s), so
    #   loss = mean(-s, +s) = 0 and d loss / d logp_t = -A_t * s / 2 = [-0.6123724, +0.6123724].
    # GSPO: loss = mean_t(-A_t * s) = -s * mean(A) = 0 and the gradient is -mean(A) * ds/dlogp = 0.
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1]])
    s = math.sqrt(1.5)
    grads = {}
    for level in ("sequence_token", "sequence"):
        logp, old = _logp_with_ratios([1.5, 1.0])
        loss, _ = grpo_loss(logp, old, None, adv, mask, LossSettings(importance_level=level, **SEQ), SEQ_TOTALS)
        assert loss.item() == pytest.approx(0.0, abs=1e-12)
        loss.backward()
        grads[level] = logp.grad
    torch.testing.assert_close(grads["sequence_token"], torch.tensor([[-s / 2, s / 2]], dtype=F64))
    torch.testing.assert_close(grads["sequence"], torch.zeros(1, 2, dtype=F64))


def test_gspo_and_gspo_token_gradients_agree_for_one_advantage_per_sequence():
    # With A_i,t = A_i (GRPO's advantages) the GSPO paper's two objectives have the same gradient.
    logp, old, _, adv, mask = _random_batch(seed=5)
    grads = []
    for level in ("sequence", "sequence_token"):
        loss, _ = grpo_loss(logp, old, None, adv, mask,
                            LossSettings(importance_level=level, epsilon=0.2, epsilon_high=0.28,
                                         aggregation="seq_mean_token_mean"),
                            BatchTotals(int(mask.sum()), 6, 5))
        grads.append(torch.autograd.grad(loss, logp)[0])
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_sequence_levels_match_reference_loop(level, aggregation, per_token_adv):
    logp, old, ref, adv, mask = _random_batch(seed=11)
    # GSPO's own clip ranges, widened so that some sequences are clipped and some are not
    old = logp.detach() + (old - logp.detach()) * 0.1
    if per_token_adv:
        adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    settings = {"epsilon": 0.01, "epsilon_high": 0.012, "beta": 0.04, "aggregation": aggregation}
    loss, stats = grpo_loss(logp, old, ref, adv, mask, LossSettings(**settings, importance_level=level),
                            BatchTotals(int(mask.sum()), 6, 5))
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_grpo_loss(logp, old, ref, adv, mask, **settings, max_new_tokens=5, level=level)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < stats["clip_fraction"].item() < 1  # some sequences clipped, some not


# ---------------------------------------------------------------- TIS and entropy bonus, by hand


def test_truncated_importance_weights_by_hand():
    # trainer p = 0.5, engine p = 0.25 -> ratio 2, truncated at cap 1.5; 0.9 / 0.9 -> 1; 0.2 / 0.4 -> 0.5.
    trainer = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]], dtype=F64, requires_grad=True)
    engine = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.4)]], dtype=F64)
    w = truncated_importance_weights(trainer, engine, 1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, 0.5]], dtype=F64))
    assert not w.requires_grad


def test_tis_weights_scale_the_policy_term_only():
    # Ratio 1 (old_logp None), A = 1, token_mean over 2 tokens, weights [1.5, 0.5]:
    # policy loss = -(1.5 + 0.5) / 2 = -1, gradient -w_t / 2 = [-0.75, -0.25].
    # beta = 0.1 with ref = logp - ln 2 on both tokens: k3 = e^{-ln 2} + ln 2 - 1 = 0.193147 per token,
    # unweighted: loss = -1 + 0.1 * 0.193147 = -0.980685; stats tis_weight = (1.5 + 0.5) / 2 = 1.
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    weights = torch.tensor([[1.5, 0.5]], dtype=F64)
    settings = {"epsilon": 0.2, "aggregation": "token_mean"}
    totals = BatchTotals(total_tokens=2, total_seqs=1, max_new_tokens=2)
    loss, stats = grpo_loss(logp, None, None, torch.tensor([1.0], dtype=F64), torch.ones(1, 2),
                            LossSettings(**settings), totals, tis_weights=weights)
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)
    assert stats["tis_weight"].item() == pytest.approx(1.0, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -0.25]], dtype=F64))
    ref = logp.detach() - math.log(2)
    with_kl, _ = grpo_loss(logp, None, ref, torch.tensor([1.0], dtype=F64), torch.ones(1, 2),
                           LossSettings(beta=0.1, **settings), totals, tis_weights=weights)
    assert with_kl.item() == pytest.approx(-1 + 0.1 * (0.5 + math.log(2) - 1), abs=1e-12)


def test_tis_weights_of_one_change_nothing():
    # What the loop sees with the HF engine's on-policy samples (trainer = engine): weights exactly 1.
    logp, old, ref, adv, mask = _random_batch(seed=2)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.04, aggregation="token_mean")
    totals = BatchTotals(int(mask.sum()), 6, 5)
    ones = truncated_importance_weights(old, old, 2.0)
    assert torch.equal(ones, torch.ones_like(old))
    plain, _ = grpo_loss(logp, old, ref, adv, mask, settings, totals)
    weighted, _ = grpo_loss(logp, old, ref, adv, mask, settings, totals, tis_weights=ones)
    assert torch.equal(plain, weighted)
    assert torch.equal(torch.autograd.grad(plain, logp)[0], torch.autograd.grad(weighted, logp)[0])


def test_entropy_bonus_by_hand():
    # Ratio 1, A = 0 (no policy gradient), entropies [2, 1] on the two valid tokens, coef 0.1,
    # token_mean over 2 tokens: loss = -0.1 * (2 + 1) / 2 = -0.15; d loss / d H_t = -0.1 / 2 = -0.05.
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    entropy = torch.tensor([[2.0, 1.0, 9.0]], dtype=F64, requires_grad=True)
    loss, _ = grpo_loss(logp, None, None, torch.tensor([0.0], dtype=F64), torch.tensor([[1, 1, 0]]),
                        LossSettings(epsilon=0.2, aggregation="token_mean", entropy_coef=0.1),
                        BatchTotals(2, 1, 3), entropy=entropy)
    assert loss.item() == pytest.approx(-0.15, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.05, -0.05, 0.0]], dtype=F64))


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("level", IMPORTANCE_LEVELS)
def test_tis_and_entropy_match_reference_loop(aggregation, level):
    logp, old, ref, adv, mask = _random_batch(seed=9)
    g = torch.Generator().manual_seed(8)
    tis = truncated_importance_weights(old, old + (torch.rand(old.shape, generator=g, dtype=F64) - 0.5), 1.2)
    entropy = (torch.rand(logp.shape, generator=g, dtype=F64) * 3).requires_grad_()
    settings = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04, "aggregation": aggregation}
    loss, _ = grpo_loss(logp, old, ref, adv, mask,
                        LossSettings(**settings, importance_level=level, entropy_coef=0.03),
                        BatchTotals(int(mask.sum()), 6, 5), tis_weights=tis, entropy=entropy)
    grads = torch.autograd.grad(loss, (logp, entropy))
    expected = reference_grpo_loss(logp, old, ref, adv, mask, **settings, max_new_tokens=5, level=level, tis=tis,
                                   entropy=entropy, entropy_coef=0.03)
    expected_grads = torch.autograd.grad(expected, (logp, entropy))
    torch.testing.assert_close(loss, expected)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)



# ---------------------------------------------------------------- per-token terms (fused head)

HAND_WEIGHTS = {
    # MASK = [[1, 1, 0], [1, 0, 0]], 3 tokens, 2 sequences, max_new_tokens 3
    "token_mean": [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]],
    "seq_mean_token_mean": [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]],  # 1 / (length * 2 sequences)
    "seq_mean_token_sum_norm": [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0]],  # 1 / (3 * 2)
}


@pytest.mark.parametrize("mode", ALL_AGGREGATIONS)
def test_aggregation_weights_on_hand_example(mode):
    weights = aggregation_weights(MASK.bool(), mode, **NORMS)
    torch.testing.assert_close(weights, torch.tensor(HAND_WEIGHTS[mode], dtype=F64), atol=1e-15, rtol=0)
    assert (weights * TOKEN_LOSS).sum().item() == pytest.approx(HAND[mode], abs=1e-12)


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("extras", [False, True])
def test_per_token_terms_sum_to_grpo_loss(aggregation, beta, use_old, extras):
    """Summed over chunks of the flattened tokens, the terms give grpo_loss's value and gradients
    (to the log-probs and entropies), with TIS and an entropy bonus (``extras``) or without."""
    logp, old, ref, adv, mask = _random_batch(seed=11)
    g = torch.Generator().manual_seed(4)
    engine = old + (torch.rand(old.shape, generator=g, dtype=F64) - 0.5)
    entropy = (torch.rand(logp.shape, generator=g, dtype=F64) * 3).requires_grad_()
    totals = BatchTotals(int(mask.sum()) + 3, 8, 5)  # + other micro-batches
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=beta, aggregation=aggregation,
                            entropy_coef=0.03 if extras else 0.0, tis_cap=1.2 if extras else None)
    tis = truncated_importance_weights(old if use_old else logp.detach(), engine, 1.2) if extras else None
    loss, _ = grpo_loss(logp, old if use_old else None, ref, adv, mask, settings, totals,
                        tis_weights=tis, entropy=entropy)
    expected = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)

    flat = mask.bool()
    terms = per_token_grpo_terms(
        flat, old if use_old else None, ref, adv, aggregation_weights(flat, aggregation, **totals.kwargs()),
        settings, engine_logp=engine if extras else None)
    token_logp = logp.detach()[flat].requires_grad_()
    token_entropy = entropy.detach()[flat].requires_grad_()
    n = token_logp.shape[0]
    total = sum(terms(slice(i, min(i + 4, n)), token_logp[i:i + 4], token_entropy[i:i + 4])
                for i in range(0, n, 4))
    grads = torch.autograd.grad(total, (token_logp, token_entropy), allow_unused=True)
    torch.testing.assert_close(total, loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grads[0], expected[0][flat], atol=1e-12, rtol=0)
    if extras:
        torch.testing.assert_close(grads[1], expected[1][flat], atol=1e-12, rtol=0)
    else:
        assert expected[1] is None and (grads[1] is None or not grads[1].any())
    assert grads[0].abs().max() > 1e-3  # not vacuous


def test_per_token_terms_ignore_unweighted_tokens():
    # a token out of the loss (weight 0, e.g. a truncated completion under mask_truncated)
    # contributes nothing and gets no gradient
    terms = per_token_grpo_terms(torch.tensor([[True, True]]), None, None,
                                 torch.tensor([[1.0, 3.0]], dtype=F64),
                                 torch.tensor([[0.5, 0.0]], dtype=F64), LossSettings(epsilon=0.2))
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=F64, requires_grad=True)
    total = terms(slice(0, 2), logp, torch.zeros(2, dtype=F64))
    assert total.item() == pytest.approx(-0.5, abs=1e-12)  # ratio 1, A = 1, weight 1/2
    (grad,) = torch.autograd.grad(total, logp)
    assert grad.tolist() == [-0.5, 0.0]

# ---------------------------------------------------------------- validation


def _call(**overrides):
    logp = torch.zeros(2, 3)
    settings = {"epsilon": 0.2, "beta": 0.0, "aggregation": "token_mean"}
    totals = {"total_tokens": 6, "total_seqs": 2, "max_new_tokens": 3}
    args = {"old_logp": None, "ref_logp": None, "advantages": torch.zeros(2), "mask": torch.ones(2, 3)}
    args.update({k: overrides.pop(k) for k in list(overrides) if k in args})
    totals.update({k: overrides.pop(k) for k in list(overrides) if k in totals})
    per_call = {k: overrides.pop(k) for k in list(overrides) if k in ("tis_weights", "entropy")}
    settings.update(overrides)
    return grpo_loss(logp, args["old_logp"], args["ref_logp"], args["advantages"], args["mask"],
                     LossSettings(**settings), BatchTotals(**totals), **per_call)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"aggregation": "sum"}, r"unknown loss aggregation 'sum'; allowed: \['seq_mean_token_mean', "
                                 r"'seq_mean_token_sum_norm', 'token_mean'\]"),
        ({"epsilon": 0.0}, "epsilon must be in"),
        ({"epsilon": 1.5}, "epsilon must be in"),
        ({"epsilon_high": -0.1}, "epsilon_high must be > 0"),
        ({"beta": -1.0}, "beta must be >= 0"),
        ({"beta": 0.1}, "needs ref_logp"),
        ({"total_tokens": 0}, "total_tokens must be a positive integer"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
        ({"total_seqs": 1}, "micro-batch has 2 sequences but total_seqs=1"),
        ({"mask": torch.ones(2, 4)}, "mask shape"),
        ({"old_logp": torch.zeros(3)}, "old_logp shape"),
        ({"advantages": torch.zeros(3)}, "advantages must be"),
        ({"importance_level": "seq"}, "unknown importance sampling level 'seq'"),
        ({"entropy_coef": -0.1}, "entropy_coef must be >= 0"),
        ({"entropy_coef": 0.1}, "needs the per-token entropy"),
        ({"tis_weights": torch.ones(2, 4)}, "tis_weights shape"),
    ],
)
def test_bad_settings_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)
