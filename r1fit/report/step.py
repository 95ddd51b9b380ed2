"""A GRPO step's metrics row: the figures of its rollout (rewards, accuracy, lengths, groups
without signal; with tools, turns, tool calls and how the trajectories ended) and of its updates,
next to its stage times."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r1fit.processes import all_sum
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
