"""Box rewards for referring-expression comprehension (VLM-R1's REC task).

The completion's ``<answer>`` and the solution each hold a box ``[x1, y1, x2, y2]`` (corners,
any units as long as both sides agree; often inside JSON such as ``{"bbox_2d": [...]}``).
:func:`iou` is the continuous intersection-over-union; :func:`iou_hit` is VLM-R1's binary
variant, 1.0 when IoU >= 0.5 (the usual REC "Acc@0.5"). The ``iou`` accuracy method
(:mod:`r1fit.rewards.methods`) scores the same IoU through :func:`answers_iou`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from r1fit.rewards.answer import extract_answer

__all__ = ["IOU_HIT_THRESHOLD", "answers_iou", "box_iou", "iou", "iou_hit", "parse_box"]

IOU_HIT_THRESHOLD = 0.5

_NUM = r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*"
_BOX = re.compile(r"\[" + r",".join([_NUM] * 4) + r"\]")

Box = tuple[float, float, float, float]


def parse_box(text: str) -> Box | None:
    """Return the first ``[x1, y1, x2, y2]`` in ``text`` as floats, or None.

    None also when the box is degenerate (zero or negative width or height), since its IoU is
    undefined and rewarding it would teach the model to emit empty boxes.
    """
    match = _BOX.search(text)
    if match is None:
        return None
    x1, y1, x2, y2 = (float(group) for group in match.groups())
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)) or x2 <= x1 or y2 <= y1:
        return None
    return x1, y1, x2, y2


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two non-degenerate corner boxes."""
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    intersection = inter_w * inter_h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - intersection
    return intersection / union


def answers_iou(prediction: str, gold: str) -> float:
    """IoU of the first box in each of two extracted answers; 0.0 when either has none (or a
    degenerate one)."""
    predicted, expected = parse_box(prediction), parse_box(gold)
    return 0.0 if predicted is None or expected is None else box_iou(predicted, expected)


def iou(completion: str, solution: str, **info: Any) -> float:
    """IoU in [0, 1] between the first box of the completion's ``<answer>`` and the solution's box.

    0.0 when the completion has no ``<answer>`` tag, or when either box is unparsable or degenerate.
    """
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    return answers_iou(answer, extract_answer(solution, untagged_is_answer=True) or "")


def iou_hit(completion: str, solution: str, **info: Any) -> float:
    """1.0 if :func:`iou` >= ``IOU_HIT_THRESHOLD`` (0.5), else 0.0: VLM-R1's REC reward."""
    return 1.0 if iou(completion, solution, **info) >= IOU_HIT_THRESHOLD else 0.0
