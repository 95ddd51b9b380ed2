"""Format reward: is the completion exactly ``<think>...</think> <answer>...</answer>``?"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FORMAT_PATTERN", "format_reward"]

FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
"""The whole completion: think block, optional whitespace, answer block, optional whitespace."""

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completion: str, solution: str, **info: Any) -> float:
    """1.0 iff the completion is one think block then one answer block and nothing else, else 0.0.

    Nothing may precede ``<think>`` or follow ``</answer>`` except whitespace after it. The tag
    count check is needed because the non-greedy regex alone would still accept a second
    ``<answer>`` or ``<think>`` nested inside a block.
    """
    if any(completion.count(tag) != 1 for tag in _TAGS):
        return 0.0
    return 1.0 if FORMAT_PATTERN.fullmatch(completion) else 0.0
