"""The chunk sizes a run uses now, owned by auto-fit (which picks them) and the OOM guard (which
halves them); the config keeps what the user asked for."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("r1fit.memory")


class ChunkSizes:
    """``micro_batch`` and ``generation_batch`` in use, logged in every step's metrics row.

    Saved in checkpoints, so a resumed run continues with the sizes the OOM guard left, as an
    uninterrupted run would. ``asked`` is what the config asked for (numbers or ``auto``): when
    the resumed run asks for other sizes, those win."""

    def __init__(self, micro_batch: int, generation_batch: int, asked: dict[str, Any]) -> None:
        self.micro_batch, self.generation_batch = int(micro_batch), int(generation_batch)
        self.asked = dict(asked)

    def __getitem__(self, key: str) -> int:
        return int(getattr(self, key))

    def halve(self, key: str) -> tuple[int, int]:
        """Halve ``key`` ('micro_batch' or 'generation_batch'); returns (before, after)."""
        before = self[key]
        setattr(self, key, max(1, before // 2))
        return before, self[key]

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "generation_batch": self.generation_batch,
                "asked": self.asked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["asked"] != self.asked:
            log.info("memory sizes changed since the checkpoint (%s, now %s): using the new ones",
                     state["asked"], self.asked)
            return
        if (state["micro_batch"], state["generation_batch"]) != (self.micro_batch,
                                                                  self.generation_batch):
            log.info("continuing with the sizes in use at the checkpoint: memory.micro_batch=%d, "
                     "memory.generation_batch=%d", state["micro_batch"], state["generation_batch"])
        self.micro_batch, self.generation_batch = (int(state["micro_batch"]),
                                                   int(state["generation_batch"]))
