"""The reward r1fit's side of benchmarks/vs_trl.py uses (``rewards.vs_trl_reward:length``): the
same function as TRL's side, a completion's length in characters / 10."""

from __future__ import annotations

from typing import Any


def length(completion: str, solution: str, **info: Any) -> float:
    return len(completion) / 10
