"""Scoring stage of a rollout: rewards of every completion (with DAPO's overlong shaping when
configured), then advantages; and the two helpers of the update that depend on the scored rows: the
KL-in-reward correction of the advantages and the rows that count in the loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.algorithms.kl import sequence_kl_k1
from r1fit.algorithms.shaping import overlong_penalty
from r1fit.config import AlgoConfig
from r1fit.data.batch import decode_completions, pad_rows
from r1fit.processes import all_gather_rows, all_sum
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.registry import RewardScorer
from r1fit.rollout.record import Rollout
from r1fit.rollout.turns import answer_text

AdvantageFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class AdvantageSettings:
    """How a step's rewards become advantages: the estimator (``algo.advantage_estimator``) and
    DAPO's overlong shaping of the rewards (``algo.overlong_buffer``, 0 = off)."""

    estimator: AdvantageFn
    max_new_tokens: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    @classmethod
    def of(cls, algo: AlgoConfig) -> AdvantageSettings:
        return cls(get_advantage_estimator(algo.estimator()), algo.max_new_tokens,
                   algo.overlong_buffer, algo.overlong_penalty)


def score_rollout(rollout: Rollout, scorer: RewardScorer, processor: Any,
                  advantage: AdvantageSettings | AdvantageFn) -> Rollout:
    """Scoring stage: ``rollout`` with ``rewards``, ``components``, ``correct`` (every row of the
    step: each process scores its own rows, then they are gathered, so advantages see whole
    groups and a batch-normalised estimator the whole batch) and ``advantages`` (this process's
    rows). Reward errors are counted over every process. ``advantage``: the settings, or an
    estimator alone (no shaping). With ``overlong_buffer`` the overlong penalty joins the reward
    as its own component, ``overlong`` (weight 1)."""
    settings = advantage if isinstance(advantage, AdvantageSettings) else AdvantageSettings(advantage)
    texts, seen = scored_texts(rollout, processor)
    samples = [p.sample for p in rollout.rows]
    errors_before = scorer.total_errors
    rewards = scorer.score(texts, [s.solution for s in samples],
                           [{"problem": s.problem, "reward_method": s.reward_method, **extra}
                            for s, extra in zip(samples, seen, strict=True)])
    # the logged accuracy: the reward component when configured, else scored here
    correct = (rewards.components["accuracy"] if "accuracy" in rewards.components else
               torch.tensor([accuracy(t, s.solution, problem=s.problem,
                                      reward_method=s.reward_method)
                             for t, s in zip(texts, samples)]))
    total, components = rewards.total, dict(rewards.components)
    if settings.overlong_buffer:
        lengths = torch.tensor(rollout.policy_tokens())
        components["overlong"] = overlong_penalty(
            lengths, max_new_tokens=settings.max_new_tokens, buffer=settings.overlong_buffer,
            penalty=settings.overlong_penalty)
        total = total + components["overlong"]
    step_rewards = all_gather_rows(total)
    step_components = {k: all_gather_rows(v) for k, v in components.items()}
    step_correct = all_gather_rows(correct.float()).tolist()
    scorer.total_errors = errors_before + int(all_sum([scorer.total_errors - errors_before])[0])
    return replace(rollout, rewards=step_rewards, components=step_components, correct=step_correct,
                   advantages=settings.estimator(step_rewards, rollout.num_generations)[rollout.share])


def scored_texts(rollout: Rollout, processor: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """What the rewards score of each of this process's rows, and what more they see: the
    completion's text; with tools, the trajectory's last turn (its answer), and the trajectory
    itself as the reward's ``trajectory`` keyword (its turns, calls and results, so a reward can
    charge for wasted calls)."""
    if rollout.trajectories is None:
        return decode_completions(processor, rollout.completions), [{}] * len(rollout.completions)
    return ([answer_text(t) for t in rollout.trajectories],
            [{"trajectory": t} for t in rollout.trajectories])


def scored_tokens(rollout: Rollout, width: int) -> torch.Tensor:
    """Bool [this process's rows, width]: the completion tokens the loss and KL count (every
    token of a completion; a trajectory's policy tokens, not its tool turns)."""
    masks = rollout.loss_masks
    if masks is None:
        lengths = torch.tensor([int(c.shape[0]) for c in rollout.completions])
        return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return pad_rows([m[:width] for m in masks], width).bool()


def kl_in_reward(rollout: Rollout, policy_logp: torch.Tensor, beta: float,
                 estimator: AdvantageFn) -> tuple[torch.Tensor, float]:
    """The advantages (this process's rows) recomputed from each row's reward minus ``beta`` x
    its k1 KL to the reference, ``sum_t (log pi - log pi_ref)`` over its completion tokens
    (REINFORCE++'s KL in the reward), and the step's mean completion KL. ``policy_logp``
    [this process's rows, T]: the log-probs of the policy that generated the rollout;
    ``rollout.ref_logp`` the reference's. The KLs are gathered, so the estimator sees the whole
    step again; ``rollout.rewards`` stay the task reward (what reward_mean logs)."""
    assert rollout.rewards is not None and rollout.ref_logp is not None
    width = min(policy_logp.shape[1], rollout.ref_logp.shape[1])
    mask = scored_tokens(rollout, width)
    local = sequence_kl_k1(policy_logp[:, :width].double(), rollout.ref_logp[:, :width].double(), mask)
    kl = all_gather_rows(local)
    penalised = rollout.rewards.double() - beta * kl
    advantages = estimator(penalised, rollout.num_generations).to(
        rollout.rewards.dtype)[rollout.share]
    return advantages, float(kl.mean())


def finished_rows(completions: Sequence[torch.Tensor], eos: Sequence[int]) -> torch.Tensor:
    """Bool [rows]: the completion ends with one of the ``eos`` ids (else generation stopped at
    ``algo.max_new_tokens``: it was truncated). Completions keep their first EOS and are cut after
    it."""
    return torch.tensor([c.numel() > 0 and int(c[-1]) in eos for c in completions],
                        dtype=torch.bool)


def loss_counts(rollout: Rollout, keep: torch.Tensor | None) -> tuple[int, int]:
    """(tokens, rows) of the whole step (every process) that count in the loss: all of them, or
    only this process's ``keep`` rows summed over processes (``algo.mask_truncated``)."""
    if keep is None:
        return rollout.total_tokens, rollout.total_rows
    tokens = sum(n for n, k in zip(rollout.policy_tokens(), keep.tolist()) if k)
    total_tokens, total_rows = all_sum([tokens, int(keep.sum())])
    return int(total_tokens), int(total_rows)
