"""A GRPO step's metrics row: the figures of its rollout (rewards, accuracy, lengths, groups
without signal; with tools, turns, tool calls and how the trajectories ended, the tokens the loss
leaves out and the reward by calls) and of its updates, next to its stage times; with tools, an
update's figures per policy turn (:class:`TurnFigures`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from r1fit.algorithms.kl import kl_k3
from r1fit.algorithms.losses import LossSettings, clip_mask
from r1fit.processes import all_gather_rows, all_sum
from r1fit.rollout.record import END_REASONS, Rollout, Trajectory
from r1fit.rollout.score import finished_rows


def step_metrics(rollout: Rollout, updates: list[dict[str, float | None]],
                 times: dict[str, float], eos: Sequence[int]) -> dict[str, Any]:
    """A step's rollout and update figures for its metrics row (the update figures averaged over
    its ``num_iterations`` updates, or over those that measured it). A completion is clipped when
    it does not end with one of the ``eos`` ids: generation stopped at ``algo.max_new_tokens``
    (completions are cut after their first end-of-sequence token, which they keep). With tools,
    the trajectories' figures per row of the step (:func:`trajectory_sums`)."""
    assert rollout.rewards is not None
    seconds = sum(times.values())
    clipped = int((~finished_rows(rollout.completions, eos)).sum())
    sums = trajectory_sums(rollout.trajectories)
    clipped_rows, *summed = all_sum([clipped, *sums.values()])  # one collective for both
    groups = rollout.rewards.view(-1, rollout.num_generations)  # every row of the step
    measured = {k: [u[k] for u in updates if u.get(k) is not None]
                for k in dict.fromkeys(k for u in updates for k in u)}
    return {**{k: sum(v) / len(v) if v else None for k, v in measured.items()},
            "reward_mean": rollout.rewards.mean().item(),
            "reward_std": rollout.rewards.std().item(),
            **{f"reward/{k}": v.mean().item() for k, v in rollout.components.items()},
            "accuracy": sum(rollout.correct) / len(rollout.correct),
            "completion_len_mean": rollout.total_tokens / rollout.total_rows,
            "completion_clipped_fraction": clipped_rows / rollout.total_rows,
            "zero_variance_groups":
                (groups.amax(dim=1) == groups.amin(dim=1)).float().mean().item(),
            **{k: v / rollout.total_rows for k, v in zip(sums, summed)},
            **tool_figures(rollout),
            "engine_logp_diff": rollout.engine_logp_diff,
            **times, "tokens_per_second": rollout.total_tokens / max(seconds, 1e-9)}


def trajectory_sums(trajectories: list[Trajectory] | None) -> dict[str, int]:
    """This process's trajectories' totals, under the key of the per-row figure each becomes:
    policy turns, tool calls answered (run or refused by the call budget), those answered with an
    error, and the trajectories per end reason. Empty for one completion per row."""
    if trajectories is None:
        return {}
    return {"turns_mean": sum(t.num_turns for t in trajectories),
            "tool_calls_mean": sum(t.tool_calls for t in trajectories),
            "tool_errors_mean": sum(t.tool_errors for t in trajectories),
            **{f"trajectory_end/{reason}": sum(t.ended == reason for t in trajectories)
               for reason in END_REASONS}}


def tool_figures(rollout: Rollout) -> dict[str, float]:
    """With tools, over every row of the step: ``masked_token_fraction``, the share of the
    trajectories' tokens the loss leaves out (the tool turns'), and ``reward_by_tool_calls/<n>``,
    the mean reward of the rows with ``n`` tool calls answered, for each ``n`` that occurred.
    Empty for one completion per row."""
    trajectories = rollout.trajectories
    if trajectories is None:
        return {}
    assert rollout.rewards is not None
    tokens, policy = all_sum([sum(t.length for t in trajectories),
                              sum(t.policy_tokens for t in trajectories)])
    # the rewards are every row's, in the order the processes' shares gather in
    calls = all_gather_rows(torch.tensor([t.tool_calls for t in trajectories]))
    return {"masked_token_fraction": (tokens - policy) / max(tokens, 1),
            **{f"reward_by_tool_calls/{n}": rollout.rewards[calls == n].mean().item()
               for n in sorted(set(calls.tolist()))}}


class TurnFigures:
    """An update's figures per policy turn of a multi-turn step (with tools), each a mean over
    the policy's tokens of that turn (every process's, those the loss counts): the ``k``-th run of
    a trajectory's policy tokens is its turn ``k``. ``turn_advantage/<k>`` (the advantage those
    tokens are trained with: their trajectory's), ``turn_ratio/<k>`` (the token's importance
    ratio to the old policy, 1 in a rollout's first update), ``turn_clip_fraction/<k>`` (the
    clipped branch chosen: no gradient; before Clip-Cov/KL-Cov) and, with a reference,
    ``turn_kl/<k>`` (k3). Fed each micro-batch's detached tensors (:meth:`add`) like the loss's
    statistics, it keeps this process's shares of the whole-step means (:attr:`sums`), which add
    up over processes."""

    def __init__(self, turns: torch.Tensor | None, counts: list[float], loss: LossSettings, *,
                 reference: bool) -> None:
        self.turns, self.counts, self.loss = turns, counts, loss
        names = ["advantage", "ratio", "clip_fraction", *(["kl"] if reference else [])]
        self.sums: dict[str, float] = {f"turn_{name}/{k}": 0.0 for name in names
                                       for k, n in enumerate(counts, 1) if n}

    @classmethod
    def of(cls, rollout: Rollout, keep: torch.Tensor | None, loss: LossSettings,
           max_turns: int) -> TurnFigures:
        """The figures of ``rollout``'s update: its rows' turn numbers ([rows, longest
        completion], 0 off the policy's tokens and on the rows ``keep`` leaves out) and each
        turn's tokens over every process (one collective); none without trajectories."""
        if rollout.trajectories is None:
            return cls(None, [], loss, reference=False)
        width = max((t.length for t in rollout.trajectories), default=0)
        turns = torch.zeros(len(rollout.trajectories), width, dtype=torch.long)
        for i, trajectory in enumerate(rollout.trajectories):
            mask = trajectory.policy_mask > 0
            starts = mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), mask[:-1]])
            turns[i, :trajectory.length] = torch.cumsum(starts, 0).clamp(max=max_turns) * mask
        if keep is not None:
            turns *= keep.unsqueeze(1)
        counts = torch.bincount(turns.flatten(), minlength=max_turns + 1)[1:max_turns + 1]
        return cls(turns, all_sum(counts.tolist()), loss, reference=rollout.ref_logp is not None)

    def add(self, piece: slice, logp: torch.Tensor, old: torch.Tensor | None,
            ref: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-batch's tokens: rows ``piece``, their log-probs [rows, T] under the policy
        being updated, the old and reference ones (None: none), the rows' advantages [rows] and
        the loss's ``mask``."""
        if self.turns is None:
            return
        width = logp.shape[1]
        turns = self.turns[piece, :width].to(logp.device) * (mask > 0)
        ratio = torch.ones_like(logp) if old is None else torch.exp(logp - old)
        adv = advantages.to(logp.dtype).unsqueeze(1).expand_as(logp)
        high = self.loss.epsilon if self.loss.epsilon_high is None else self.loss.epsilon_high
        values = {"advantage": adv, "ratio": ratio,
                  "clip_fraction": clip_mask(ratio, adv, self.loss.epsilon, high).to(logp.dtype),
                  **({} if ref is None else {"kl": kl_k3(logp, ref)})}
        for name, value in values.items():
            # off the counted tokens (turn 0) values may be anything, inf included: dropped
            value = torch.where(turns > 0, value, torch.zeros((), dtype=value.dtype,
                                                              device=value.device))
            per_turn = torch.zeros(len(self.counts) + 1, dtype=torch.float64, device=logp.device)
            per_turn.scatter_add_(0, turns.flatten(), value.flatten().double())
            for k, (total, n) in enumerate(zip(per_turn.tolist()[1:], self.counts), 1):
                if n:
                    self.sums[f"turn_{name}/{k}"] += total / n
