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

With tools a row's completion is a :class:`Trajectory`, the conversation after its prompt: the
policy's :class:`Turn` s and the tool turns between them (built turn by turn by
:func:`r1fit.rollout.turns.run_trajectories`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from PIL import Image

from r1fit.data.batch import Prompt
from r1fit.tools import MalformedCall, ToolCall, ToolResult

#: why a trajectory ended
END_REASONS = ("eos", "max_new_tokens", "max_turns", "max_trajectory_tokens")


@dataclass(frozen=True)
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
    # the engine's log-probs of the sampled tokens (vLLM; None with HF generate; 0 on a
    # trajectory's tool-turn tokens), and their mean absolute difference to the trainer's over
    # the policy's tokens, measured by the first update
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


@dataclass(frozen=True)
class Turn:
    """One policy turn: its text (decoded, special tokens left out), its token count, how it ended
    (``"eos"``, ``"tool_call"``, ``"length"``), the calls it wrote when it ended on one, and their
    results (``()`` when they were not run). ``context_tokens``: the tokens of the tool turn
    appended after it (0 when none was)."""

    text: str
    tokens: int
    ended: str
    calls: tuple[ToolCall | MalformedCall, ...] = ()
    results: tuple[ToolResult, ...] = ()
    context_tokens: int = 0


@dataclass
class Trajectory:
    """One row's conversation after its prompt.

    Attributes:
        prompt: the row's prompt.
        token_ids: [T] long, every token after the prompt: the policy's turns and the tool turns.
        policy_mask: [T] float, 1 on the tokens the policy sampled, 0 on tool-turn tokens.
        token_inputs: per-token extras over ``token_ids`` (``mm_token_type_ids``: 1 on the tool
            images' tokens), each [T].
        image_inputs: the tool images' tensors (``pixel_values``, ``image_grid_thw``), in order.
        images: the images the tool turns showed, in order (fitted to the pixel budget).
        turns: the policy's turns.
        ended: why it ended (one of ``END_REASONS``); None while it is open.
        calls_run: tool calls given to the runner (malformed ones included; the budget counts them).
        engine_logp: [T] float, the engine's log-prob of each token the policy sampled, 0 on
            tool-turn tokens; None from an engine that gives none (only vLLM does).
    """

    prompt: Prompt
    token_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    policy_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[Image.Image] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    ended: str | None = None
    calls_run: int = 0
    engine_logp: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def policy_tokens(self) -> int:
        """The tokens the policy sampled (the loss's tokens)."""
        return int(self.policy_mask.sum())

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def tool_calls(self) -> int:
        """Calls answered with a result (run, or refused by a budget)."""
        return sum(len(turn.results) for turn in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(result.error for turn in self.turns for result in turn.results)

    def context(self) -> Prompt:
        """The prompt grown by the trajectory: what the policy's next turn is generated from."""
        keys = dict.fromkeys([*self.prompt.token_inputs, *self.token_inputs])
        extras = {key: torch.cat([_extra(self.prompt.token_inputs, key, self.prompt.length),
                                  _extra(self.token_inputs, key, self.length)]) for key in keys}
        # the sample shows every image the ids hold, in order (the vLLM engine sends them)
        sample = replace(self.prompt.sample, images=[*self.prompt.sample.images, *self.images])
        return Prompt(torch.cat([self.prompt.input_ids, self.token_ids]), extras,
                      self._images(), sample)

    def row(self) -> Prompt:
        """The prompt as the log-prob passes run it before ``token_ids``: the prompt's tokens,
        its images followed by the tool images (the order of their tokens), and the trajectory's
        per-token extras as the completion's (``Prompt.completion_inputs``)."""
        prompt = self.prompt
        return Prompt(prompt.input_ids, prompt.token_inputs, self._images(), prompt.sample,
                      dict(self.token_inputs))

    def _images(self) -> dict[str, torch.Tensor]:
        """The prompt's image tensors followed by the tool images', per key."""
        parts = (self.prompt.image_inputs, self.image_inputs)
        return {key: torch.cat([part[key] for part in parts if key in part])
                for key in dict.fromkeys([*parts[0], *parts[1]])}

    def _append(self, ids: torch.Tensor, policy: bool, extras: dict[str, torch.Tensor],
                logp: torch.Tensor | None = None) -> None:
        """Append a policy turn's ``ids`` (``logp``: the engine's log-probs of them, if any) or,
        not ``policy``, a tool turn's."""
        n = int(ids.shape[0])
        piece = torch.zeros(n) if not policy else None if logp is None else logp.float()
        if self.length == 0:  # the first turn is the policy's
            self.engine_logp = piece
        elif self.engine_logp is not None:
            self.engine_logp = None if piece is None else torch.cat([self.engine_logp, piece])
        for key in dict.fromkeys([*self.token_inputs, *extras]):
            self.token_inputs[key] = torch.cat([_extra(self.token_inputs, key, self.length),
                                                _extra(extras, key, n)])
        self.token_ids = torch.cat([self.token_ids, ids.to(torch.long)])
        self.policy_mask = torch.cat([self.policy_mask, torch.full((n,), float(policy))])


def _extra(extras: dict[str, torch.Tensor], key: str, n: int) -> torch.Tensor:
    """``extras[key]``, or n zeros where a piece has no such extra (text has no image tokens)."""
    return extras[key] if key in extras else torch.zeros(n, dtype=torch.long)
