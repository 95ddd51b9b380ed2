"""The chunk sizes a run uses now, owned by auto-fit (which picks them) and the OOM guard (which
halves them); the config keeps what the user asked for."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("r1fit.memory")


class ChunkSizes:
    """``micro_batch``, ``micro_batch_tokens`` (None: micro-batches by rows) and
    ``generation_batch`` in use, logged in every step's metrics row.

    Saved in checkpoints, so a resumed run continues with the sizes the OOM guard left, as an
    uninterrupted run would. ``asked`` is what the config asked for (numbers or ``auto``): when
    the resumed run asks for other sizes, those win."""

    def __init__(self, micro_batch: int, generation_batch: int, asked: dict[str, Any], *,
                 micro_batch_tokens: int | None = None) -> None:
        self.micro_batch, self.generation_batch = int(micro_batch), int(generation_batch)
        self.micro_batch_tokens = None if micro_batch_tokens is None else int(micro_batch_tokens)
        self.asked = dict(asked)
        #: the most tokens one sequence of a packed micro-batch took so far: a micro_batch_tokens
        #: at or below it already runs every sequence alone, so halving it further gains nothing
        self.longest_sequence = 0

    def note_sequence(self, tokens: int) -> None:
        self.longest_sequence = max(self.longest_sequence, int(tokens))

    @property
    def smallest(self) -> dict[str, int]:
        """Below these sizes halving cannot help any more."""
        return {"micro_batch": 1, "generation_batch": 1,
                "micro_batch_tokens": max(1, self.longest_sequence)}

    @property
    def training_key(self) -> str:
        """The size that sets a training micro-batch: 'micro_batch_tokens' when set."""
        return "micro_batch" if self.micro_batch_tokens is None else "micro_batch_tokens"

    def __getitem__(self, key: str) -> int:
        return int(getattr(self, key))

    def halve(self, key: str) -> tuple[int, int]:
        """Halve ``key`` ('micro_batch', 'micro_batch_tokens' or 'generation_batch'); returns
        (before, after)."""
        before = self[key]
        setattr(self, key, max(1, before // 2))
        return before, self[key]

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "generation_batch": self.generation_batch,
                "micro_batch_tokens": self.micro_batch_tokens, "asked": self.asked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["asked"] != self.asked:
            log.info("memory sizes changed since the checkpoint (%s, now %s): using the new ones",
                     state["asked"], self.asked)
            return
        tokens = state.get("micro_batch_tokens")  # absent in checkpoints before it existed
        if (state["micro_batch"], state["generation_batch"], tokens) != (
                self.micro_batch, self.generation_batch, self.micro_batch_tokens):
            log.info("continuing with the sizes in use at the checkpoint: memory.micro_batch=%d, "
                     "memory.micro_batch_tokens=%s, memory.generation_batch=%d",
                     state["micro_batch"], tokens, state["generation_batch"])
        self.micro_batch, self.generation_batch = (int(state["micro_batch"]),
                                                   int(state["generation_batch"]))
        self.micro_batch_tokens = None if tokens is None else int(tokens)
