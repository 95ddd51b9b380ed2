"""r1fit's GRPO loss against TRL's own ``GRPOTrainer._compute_loss`` (called on a stand-in for
the trainer, its forward returning the given log-probs) on the same float64 tensors: the loss and
its gradient with respect to the policy's log-probs agree for every loss aggregation TRL shares
(``grpo``, ``bnpo``/``dapo``, ``dr_grpo``), at token and sequence (GSPO) level, with and without
the KL term and with rollouts reused (old log-probs not the policy's). Needs the bench extra
(TRL); CI installs it."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from r1fit.algorithms.losses import BatchTotals, LossSettings, grpo_loss

pytest.importorskip("trl", reason="the comparison with TRL needs the bench extra: pip install -e "
                    "'.[bench]'")

#: TRL's loss_type -> r1fit's algo.loss_aggregation (docs/algorithms.md)
PAIRS = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dapo": "token_mean",
         "dr_grpo": "seq_mean_token_sum_norm"}


class Trainer(SimpleNamespace):
    """What ``_compute_loss`` reads of its trainer; a field it reads that is not here fails the
    test by name (a TRL release that reads more: extend this stand-in)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"TRL's _compute_loss reads trainer.{name}, which the test's "
                             f"stand-in lacks")


class Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(logp, old, ref, advantages, mask, case):
    """TRL's loss; ``case``: loss_type, epsilon, epsilon_high, beta, level, max_new_tokens."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    loss_type, epsilon, epsilon_high, beta, level, max_new_tokens = case

    rows, length = logp.shape
    trainer = Trainer(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_new_tokens, accelerator=Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
              "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
              "completion_ids": torch.zeros(rows, length, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": advantages,
              "num_items_in_batch": torch.tensor(float(mask.sum()))}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def inputs(level):
    """Six rows of seven columns, lengths 7, 3, 5, 1, 6, 2 (finite padding), one row with a zero
    advantage (a group whose rewards are equal)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(7)[None] < torch.tensor([7, 3, 5, 1, 6, 2])[:, None]).long()
    logp = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3 - 0.05
    spread = 0.3 if level == "token" else 1.5e-3  # GSPO's clip range is ~1e-3 wide
    old = logp + spread * torch.randn(6, 7, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(6, 7, generator=g, dtype=torch.float64)
    advantages = torch.randn(6, generator=g, dtype=torch.float64)
    advantages[1] = 0.0
    return logp, old, ref, advantages, mask


def gradient(loss_of, logp):
    logp = logp.clone().requires_grad_(True)
    loss = loss_of(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


@pytest.mark.parametrize("reused", [False, True], ids=["on-policy", "reused"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(PAIRS))
def test_the_loss_and_its_gradient_equal_trls(loss_type, level, beta, reused):
    logp, old, ref, advantages, mask = inputs(level)
    old = old if reused else None
    epsilon, epsilon_high = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    max_new_tokens = 12  # Dr. GRPO's constant divisor: the generation limit, not the longest row
    case = (loss_type, epsilon, epsilon_high, beta, level, max_new_tokens)
    theirs = gradient(lambda lp: trl_loss(lp, old, ref, advantages, mask, case), logp)
    settings = LossSettings(epsilon, epsilon_high, beta=beta, aggregation=PAIRS[loss_type],
                            importance_level=level)
    totals = BatchTotals(int(mask.sum()), int(mask.any(-1).sum()), max_new_tokens)
    ours = gradient(lambda lp: grpo_loss(lp, old, ref, advantages, mask, settings, totals)[0],
                    logp)
    assert theirs[0] != 0 and theirs[1].abs().sum() > 0
    assert torch.allclose(ours[0], theirs[0], rtol=0, atol=1e-12), (ours[0], theirs[0])
    valid = mask.bool()
    assert torch.allclose(ours[1][valid], theirs[1][valid], rtol=0, atol=1e-12)
    assert not ours[1][~valid].any()  # padding gets no gradient
