"""The unit every data source yields: images + a prompt + the reference answer."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass
class Sample:
    """One prompt for rollout or SFT.

    Attributes:
        images: decoded RGB images, already fitted to the pixel budget; empty for text-only rows.
        problem: the user-facing question (no system prompt; that is added by the prompt builder).
        solution: the reference answer the reward compares against.
        source: where the sample came from, for error messages and logs:
            ``"path/to/file.jsonl:LINE"`` or ``"builtin:shapes/train#123"``.
    """

    images: list[Image.Image]
    problem: str
    solution: str
    source: str
