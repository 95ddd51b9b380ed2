"""The unit every data source yields: images + a conversation + the reference answer."""

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
        turns: the row's whole conversation ``(role, text)``, its last turn the answer, one
            ``<image>`` placeholder per image (see :mod:`r1fit.data.rows`); empty: the prompt is
            the images followed by ``problem``.
        reward_method: the accuracy method that scores answers to it (``data.reward_method``).
        source_images: the same images, RGB, at the resolution their source gave, before the
            pixel budget shrank them, for tools to cut (a crop of the shrunk image shows nothing
            new); an image within the budget is the same object in both. Empty unless the dataset
            keeps them (``load_dataset(keep_source_images=True)``: a run with tools).
    """

    images: list[Image.Image]
    problem: str
    solution: str
    source: str
    turns: tuple[tuple[str, str], ...] = ()
    reward_method: str = "default"
    source_images: tuple[Image.Image, ...] = ()
