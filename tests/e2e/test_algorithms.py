"""Three-step GRPO runs on builtin:tiny through the CLI, one per algorithm option, each checking that
the option reached the real loop: GSPO's sequence clipping, the advantage estimators (on the saved
rollouts), KL in the reward, DAPO's overlong shaping and filtering, the entropy metric and bonus, and
TIS (a no-op with the hf engine; weights near 1 with vLLM), Clip-Cov and KL-Cov."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.algorithms.covariance import kl_cov_selection, token_covariance
from r1fit.algorithms.losses import LossSettings, grpo_loss, token_policy_loss
from r1fit.cli import main
from r1fit.report.metrics import read_metrics
from r1fit.report.rollouts import read_rollouts

SMALL = ["train.max_steps=3", "train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
         "sft.format_warmup_steps=0", "data.eval=null", "memory.micro_batch=3",
         "memory.generation_batch=5", "data.shapes.train_size=50", "data.shapes.image_size=56",
         "data.max_pixels=3136", "checkpoint.every=0", "report.rollouts_every=1",
         "rewards.lenreward:length=1.0"]
WEIGHTS = {"accuracy": 1.0, "format": 0.5, "lenreward:length": 1.0}  # rewards of SMALL (defaults + plugin)


@pytest.fixture
def loss_calls(monkeypatch: pytest.MonkeyPatch) -> list[SimpleNamespace]:
    """Every ``grpo_loss`` call of the training loop, with its inputs (detached) and stats."""
    from r1fit.train import grpo

    calls: list[SimpleNamespace] = []
    real = grpo.grpo_loss

    def spy(logp, old, ref, advantages, mask, settings, totals, **kwargs):
        loss, stats = real(logp, old, ref, advantages, mask, settings, totals, **kwargs)
        entropy = kwargs.get("entropy")
        calls.append(SimpleNamespace(
            # old=None is the first update of a rollout: grpo_loss takes logp.detach() as old
            logp=logp.detach(), old=(logp if old is None else old).detach(), advantages=advantages, mask=mask,
            settings=settings, totals=totals, kwargs=kwargs, loss=loss.item(), stats=stats,
            entropy_requires_grad=entropy is not None and entropy.requires_grad,
            # memory.fused_loss: the head made the gradient; this call gives the statistics
            fused=not torch.is_grad_enabled()))
        return loss, stats

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    return calls


def train(out: Path, *overrides: str) -> list[dict]:
    assert main(["train", f"train.output_dir={out}", *SMALL, *overrides]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        # the policy's entropy per completion token, every step (tiny's vocabulary: ~720 tokens)
        assert 0 < row["entropy"] <= math.log(1000)
    return rows


def saved_steps(out: Path) -> dict[int, list[dict]]:
    steps = read_rollouts(out / "rollouts")
    assert sorted(steps) == [1, 2, 3]
    return steps


def tensor(rows: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in rows], dtype=torch.float64)


# ---------------------------------------------------------------- the checks of each run


def check_gspo(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # GSPO's own clip ranges reach the loss; the second update of each rollout is off-policy, and
    # its clipping takes or leaves whole sequences: every valid token of a row shares one flag
    assert all(c.settings.importance_level == "sequence" for c in calls)
    assert {(c.settings.epsilon, c.settings.epsilon_high) for c in calls} == {(3e-4, 4e-4)}
    clipped_rows = 0
    for c in calls:
        _, clipped = token_policy_loss(
            c.logp, c.old, c.advantages,
            LossSettings(epsilon=3e-4, epsilon_high=4e-4, importance_level="sequence"), mask=c.mask)
        for flags, valid in zip(clipped, c.mask.bool()):
            assert len(set(flags[valid].tolist())) == 1
            clipped_rows += int(flags[valid].all())
    assert clipped_rows > 0
    assert any(r["clip_fraction"] > 0 for r in rows)


def check_gspo_token(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    assert all(c.settings.importance_level == "sequence_token" for c in calls)
    assert {(c.settings.epsilon, c.settings.epsilon_high) for c in calls} == {(3e-4, 4e-4)}


def check_rloo(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    for saved in saved_steps(out).values():  # A_i = r_i - mean of the other 3 of its group, on the run's rewards
        rewards, adv = tensor(saved, "reward"), tensor(saved, "advantage")
        for group in range(2):
            r = rewards[group * 4: group * 4 + 4]
            expected = torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
            torch.testing.assert_close(adv[group * 4: group * 4 + 4], expected, rtol=1e-5, atol=1e-6)


def check_reinforce_pp(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # normalised over the whole step (8 rows, both groups): mean 0, unbiased std 1
    for saved in saved_steps(out).values():
        adv = tensor(saved, "advantage")
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)
        if tensor(saved, "reward").std() > 1e-3:
            assert adv.std().item() == pytest.approx(1.0, abs=1e-3)


def check_kl_in_reward(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    assert all(c.settings.beta == 0.0 for c in calls)  # the KL is in the reward, not in the loss
    assert all(r["kl"] is not None for r in rows)  # still logged (k3 against the reference)
    estimator = get_advantage_estimator("reinforce_pp_baseline")
    steps = saved_steps(out)
    # step 1: the policy is the reference (the warmed-up model), so KL = 0 and the advantages are
    # the estimator's on the rewards alone; later the policy has moved and the KL changes them
    assert rows[0]["kl_in_reward"] == pytest.approx(0.0, abs=1e-6)
    for step, row in zip((1, 2, 3), rows):
        rewards, adv = tensor(steps[step], "reward"), tensor(steps[step], "advantage")
        plain = estimator(rewards, 4)
        if step == 1:
            torch.testing.assert_close(adv, plain, rtol=1e-4, atol=1e-4)
        else:
            assert row["kl_in_reward"] != 0 and math.isfinite(row["kl_in_reward"])
            assert not torch.allclose(adv, plain, rtol=1e-4, atol=1e-4)
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)


def check_overlong(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # max_new_tokens 8, buffer 4, penalty 0.5: lengths 5..8 get -0.125 x (length - 4), so the
    # component is one of 0, -0.125, -0.25, -0.375, -0.5, and is part of the reward (weight 1)
    for saved in saved_steps(out).values():
        for r in saved:
            overlong = r["components"]["overlong"]
            assert overlong in (0.0, -0.125, -0.25, -0.375, -0.5)
            expected = sum(w * r["components"][k] for k, w in WEIGHTS.items()) + overlong
            assert r["reward"] == pytest.approx(expected, abs=1e-5)
    for row in rows:
        assert -0.5 <= row["reward/overlong"] <= 0
        if row["completion_clipped_fraction"] == 1:  # every completion ran to 8 tokens: -0.5 each
            assert row["reward/overlong"] == -0.5


def check_mask_truncated(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # a random-weight model never samples EOS, so the run counts a completion as finished when it
    # ends with the token that ended the step's first one (see the test): the steps then have kept
    # and truncated rows, and only the kept ones are in the loss mask and its counts
    masked_rows = 0
    for step in range(3):  # one update per step, 3 micro-batches of its 8 rows
        update = calls[3 * step: 3 * step + 3]
        kept_tokens, kept_rows = 0, 0
        for c in update:
            kept = c.mask.sum(dim=1)
            valid = (c.logp != 0).sum(dim=1)  # completion tokens (padding has log-prob 0)
            assert all(k in (0, v) for k, v in zip(kept.tolist(), valid.tolist()))  # whole rows out
            kept_tokens, kept_rows = kept_tokens + int(kept.sum()), kept_rows + int((kept > 0).sum())
            masked_rows += int((kept == 0).sum())
        assert {c.totals.total_tokens for c in update} == {max(kept_tokens, 1)}
        assert {c.totals.total_seqs for c in update} == {max(kept_rows, 1)}
        assert kept_rows > 0
    assert masked_rows > 0
    assert all(r["loss"] != 0 for r in rows)


def check_entropy_bonus(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # the loss's gradient reaches the entropy: through grpo_loss, or (memory.fused_loss, the
    # default) through the LM head's per-token terms, whose gradients test_grpo.py compares
    assert all(c.settings.entropy_coef == 0.01 and c.kwargs["entropy"] is not None
               and c.entropy_requires_grad != c.fused for c in calls)
    # the logged entropy is the token mean of what the loss used (3 micro-batches per step: 8 rows / 3)
    for step, row in enumerate(rows):
        step_calls = calls[3 * step: 3 * step + 3]
        total = sum(float((c.kwargs["entropy"].detach() * c.mask).sum()) for c in step_calls)
        assert row["entropy"] == pytest.approx(total / step_calls[0].totals.total_tokens, rel=1e-6)


def check_clip_cov(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # every micro-batch restricted some tokens, each from its own random stream; the loss is
    # reproducible from the stream's seed (what a resumed run relies on)
    seeds = [c.kwargs["generator"].initial_seed() for c in calls]
    assert len(set(seeds)) == len(calls)
    for c, seed in zip(calls, seeds):
        assert c.settings.cov.method == "clip_cov" and c.stats["cov_restricted"] > 0
        again = torch.Generator().manual_seed(seed)
        loss, _ = grpo_loss(c.logp, c.old, None, c.advantages, c.mask, c.settings, c.totals,
                            **{**c.kwargs, "generator": again})
        assert loss.item() == c.loss
    assert all(0 < r["cov_restricted"] < 1 for r in rows)


def check_kl_cov(out: Path, rows: list[dict], calls: list[SimpleNamespace]) -> None:
    # no token is clipped; the top 10% of each micro-batch's tokens by covariance carry the
    # |logp - old| penalty, which is nonzero on the second update of each rollout
    assert all(r["clip_fraction"] == 0 and r["cov_restricted"] > 0 for r in rows)
    penalised = 0.0
    for c in calls:
        chosen = kl_cov_selection(token_covariance(c.logp, c.advantages, c.mask), c.mask, ratio=0.1)
        ratio = torch.exp(c.logp - c.old)
        penalty = (c.logp - c.old).abs() * chosen
        expected = ((-ratio * c.advantages[:, None] + penalty) * c.mask).sum() / c.totals.total_tokens
        assert c.loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
        penalised += float(penalty.sum())
    assert penalised > 0


CASES = {
    "gspo": (["algo.importance_sampling_level=sequence", "algo.num_iterations=2",
              "algo.loss_aggregation=seq_mean_token_mean", "algo.beta=0"], check_gspo),
    "gspo_token": (["algo.importance_sampling_level=sequence_token", "algo.num_iterations=2", "algo.beta=0"],
                   check_gspo_token),
    "rloo": (["algo.advantage_estimator=rloo", "algo.beta=0"], check_rloo),
    "reinforce_pp": (["algo.advantage_estimator=reinforce_pp", "algo.beta=0"], check_reinforce_pp),
    "reinforce_pp_baseline_kl_in_reward": (["algo.advantage_estimator=reinforce_pp_baseline",
                                            "algo.kl_in_reward=true", "algo.beta=0.05"], check_kl_in_reward),
    "overlong": (["algo.overlong_buffer=4", "algo.overlong_penalty=0.5", "algo.beta=0"], check_overlong),
    "mask_truncated": (["algo.mask_truncated=true", "algo.beta=0"], check_mask_truncated),
    "entropy_bonus": (["algo.entropy_coef=0.01", "algo.beta=0"], check_entropy_bonus),
    "entropy_bonus_recomputed_head": (["algo.entropy_coef=0.01", "algo.beta=0", "memory.fused_loss=false"],
                                      check_entropy_bonus),
    "clip_cov": (["algo.cov_restriction=clip_cov", "algo.clip_cov_ratio=0.1", "algo.clip_cov_lb=-100",
                  "algo.clip_cov_ub=100", "algo.beta=0"], check_clip_cov),
    "kl_cov": (["algo.cov_restriction=kl_cov", "algo.kl_cov_ratio=0.1", "algo.num_iterations=2",
                "algo.beta=0"], check_kl_cov),
}


@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_runs(case, use_tiny_cache, reward_plugin, loss_calls, tmp_path, monkeypatch):
    overrides, check = CASES[case]
    if case == "mask_truncated":
        from r1fit.train import grpo

        real = grpo.finished_rows

        def finished(completions, eos):  # also "finished": ending with the first completion's last token
            return real(completions, [*eos, int(completions[0][-1])])

        monkeypatch.setattr(grpo, "finished_rows", finished)
    out = tmp_path / case
    rows = train(out, *overrides)
    assert loss_calls
    check(out, rows, loss_calls)


def test_tis_is_a_no_op_on_the_hf_engine(use_tiny_cache, reward_plugin, tmp_path, same_run):
    """The hf engine gives no log-probs of its own (its samples are the trainer's): runs with TIS on
    and off are the same run, bit for bit, and log no TIS weight."""
    on, off = tmp_path / "on", tmp_path / "off"
    rows = train(on, "algo.tis_cap=2", "algo.beta=0")
    train(off, "algo.tis_cap=0", "algo.beta=0")
    same_run(on, off)
    assert all("tis_weight" not in r and r["engine_logp_diff"] is None for r in rows)


def test_the_fused_loss_trains_as_the_recomputing_head(use_tiny_cache, reward_plugin, loss_calls, tmp_path):
    """memory.fused_loss on (the default) and off: 3 steps with a KL term, an entropy bonus and
    two updates per rollout log the same losses, KL, entropies and gradient norms (float32, so
    to rounding: the two sum the head's gradient in other orders)."""
    settings = ["algo.entropy_coef=0.01", "algo.beta=0.05", "algo.num_iterations=2"]
    fused = train(tmp_path / "fused", *settings)
    assert loss_calls and all(c.fused for c in loss_calls)
    loss_calls.clear()
    recomputed = train(tmp_path / "recomputed", *settings, "memory.fused_loss=false")
    assert loss_calls and not any(c.fused for c in loss_calls)
    for a, b in zip(fused, recomputed, strict=True):
        for key in ("loss", "kl", "entropy", "grad_norm", "clip_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert any(r["grad_norm"] > 0 for r in fused)


def test_bad_algorithm_setting_is_one_line(capsys):
    assert main(["train", "algo.importance_sampling_level=sequence", "algo.gspo_epsilon=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("r1fit: error: algo.gspo_epsilon: got 2.0, expected a number < 1 (the ratio is clipped at "
                   "1 - epsilon)")


@pytest.mark.vllm
def test_tis_weights_on_vllm(hd32_dir, use_tiny_cache, vllm_installed, reward_plugin, tmp_path):
    """With vLLM's log-probs the loss is weighted by min(pi_trainer / pi_engine, cap): float32 on both
    sides, the ratios are within 1% of 1 (the engine renormalises without the image placeholders, so
    they are <= 1), and a cap of 1 bounds the mean weight by 1."""
    out = tmp_path / "vllm"
    cmd = [sys.executable, "-m", "r1fit", "train", f"train.output_dir={out}", *SMALL,
           "model.path=builtin:tiny-hd32", "rollout.engine=vllm", "rollout.vllm.kv_cache_memory=67108864",
           "data.max_prompt_tokens=256", "algo.beta=0", "algo.tis_cap=1", "algo.num_iterations=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_plugin), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["loss"]) and 0 < row["entropy"]
        assert 0.99 < row["tis_weight"] <= 1.0
        assert 0 <= row["engine_logp_diff"] < 0.01
