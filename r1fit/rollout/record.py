"""The rollout record: one GRPO step's prompts, completions, rewards, advantages and log-probs.

Built stage by stage, each returning a new record with its fields added (``dataclasses.replace``;
no stage writes into the record it was given): generation
(:func:`r1fit.rollout.generate.generate_rollout`), scoring (:func:`r1fit.rollout.score.score_rollout`),
reference log-probs (:func:`r1fit.train.forward.add_logprobs`); the update reads it and returns,
with its statistics, the record its later updates read (the first one's forwards give the
old-policy log-probs a reused rollout needs, and ``engine_logp_diff``).
Over several processes each holds the whole step's prompts and rewards (groups must be whole for
advantages) but generates and trains on its own share of the rows only. With dynamic sampling a step
draws several batches, each a record of its own (``row_offset`` numbers its rows after the earlier
batches', so every row drawn in a step samples from its own stream), and trains on a record put
together from the kept groups (:class:`r1fit.rollout.dynamic.StepDraws`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from r1fit.data.batch import Prompt

if TYPE_CHECKING:  # turns.py imports generate.py, which imports this module
    from r1fit.rollout.turns import Trajectory


@dataclass
class Rollout:
    """One step's rollout as this process sees it. Rows are group-contiguous: rows
    ``g*G .. g*G+G-1`` are the ``G = num_generations`` completions of prompt ``g``."""

    step: int
    prompts: list[Prompt]  # the step's prompts, every process's, each once
    num_generations: int
    share: slice           # this process's rows of the step's ``len(prompts) x G``
    row_offset: int = 0    # rows drawn in the step before this record's (dynamic sampling)
    # generation: this process's rows
    completions: list[torch.Tensor] = field(default_factory=list)
    total_tokens: int = 0  # the policy's sampled tokens of the whole step (every process)
    # scoring: every row of the step
    rewards: torch.Tensor | None = None  # [rows] weighted sum
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # reward name -> [rows]
    correct: list[float] = field(default_factory=list)  # the logged accuracy, per row
    advantages: torch.Tensor | None = None  # [this process's rows]
    # log-probs of this process's rows [rows, longest completion] (None when not needed)
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    # the engine's log-probs of the sampled tokens (vLLM; None with HF generate), and their mean
    # absolute difference to the trainer's, measured by the first update
    engine_logp: torch.Tensor | None = None
    engine_logp_diff: float | None = None
    # with tools (multi-turn rollouts): this process's rows' trajectories, in the order of
    # ``completions``, whose row i is ``trajectories[i].token_ids`` (the policy's turns and the
    # tool turns); None for one completion per row
    trajectories: list[Trajectory] | None = None

    @property
    def total_rows(self) -> int:
        return len(self.prompts) * self.num_generations

    @cached_property
    def rows(self) -> list[Prompt]:
        """The prompt of each of this process's rows; with trajectories, each row's own prompt
        grown by its tool images (:meth:`Trajectory.row`): what the model runs before the row's
        completion. Built once per record (the stages read it several times; a trajectory row
        concatenates image tensors): stages return new records, they never change one's fields."""
        if self.trajectories is not None:
            return [trajectory.row() for trajectory in self.trajectories]
        return [p for p in self.prompts for _ in range(self.num_generations)][self.share]

    @property
    def loss_masks(self) -> list[torch.Tensor] | None:
        """Per row of this process, 1 on the completion tokens the loss and KL count (the policy's
        tokens of a trajectory, not its tool turns); None: every completion token counts."""
        if self.trajectories is None:
            return None
        return [trajectory.policy_mask for trajectory in self.trajectories]

    def policy_tokens(self) -> list[int]:
        """The tokens the policy sampled in each of this process's rows (a whole completion, or a
        trajectory's policy turns)."""
        if self.trajectories is None:
            return [int(c.shape[0]) for c in self.completions]
        return [t.policy_tokens for t in self.trajectories]

    @property
    def first_row(self) -> int:
        """This process's first row, numbered among every row the step drew (which seeds its
        sampling); with ``row_offset`` 0 (every record but the later batches of a dynamic-sampling
        step) also its index into ``rewards``."""
        return self.row_offset + int(self.share.start or 0)
