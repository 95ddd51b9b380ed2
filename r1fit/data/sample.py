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
            the images followed by ``problem``. A ``"tool"`` turn holds the results of the
            assistant turn's tool calls before it, rendered as the user turn
            :func:`r1fit.tools.append_tool_turn` writes (a tool demonstration's).
        reward_method: the accuracy method that scores answers to it (``data.reward_method``).
        source_images: the same images, RGB, at the resolution their source gave, before the
            pixel budget shrank them, for tools to cut (a crop of the shrunk image shows nothing
            new); an image within the budget is the same object in both. Empty unless the dataset
            keeps them (``load_dataset(keep_source_images=True)``: a run with tools).
        focus: where the answer is to be seen, when the source knows: the box ``(x1, y1, x2,
            y2)`` in fractions of the first image's width and height (top-left origin), as the
            ``crop`` tool takes it (``builtin:shapes`` zoom rows: the mark). ``r1fit sft`` with
            ``crop`` or ``zoom`` tools writes such a row as a demonstration that calls the tool
            there (:mod:`r1fit.tools.demonstrations`); None: unknown.
    """

    images: list[Image.Image]
    problem: str
    solution: str
    source: str
    turns: tuple[tuple[str, str], ...] = ()
    reward_method: str = "default"
    source_images: tuple[Image.Image, ...] = ()
    focus: tuple[float, float, float, float] | None = None
