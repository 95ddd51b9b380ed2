"""The self-check's reward: it must differ between completions, or a random-weight model (which
earns no accuracy or format reward) has zero advantages, zero gradients, and a resume check
would compare weights that never moved."""

from __future__ import annotations

from typing import Any

#: the reward's name in a config (``rewards.<SPEC>=1.0``)
SPEC = "r1fit.doctor.rewards:completion_length"


def completion_length(completion: str, solution: str, **info: Any) -> float:
    """A tenth of the completion's length in characters."""
    return len(completion) / 10
