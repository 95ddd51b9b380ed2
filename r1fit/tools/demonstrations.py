"""Tool demonstrations for SFT ("thinking with images", issue 32): a row whose source knows where
its answer is to be seen (``Sample.focus``: ``builtin:shapes`` zoom rows, the mark) becomes the
conversation of a policy that uses the tool, which a random-weight policy would never write for
GRPO to reward::

    user       <image>A small grey square is hidden in this image. Zoom in: ...
    assistant  <tool_call>
               {"name": "zoom", "arguments": {"x": 0.62, "y": 0.31, "factor": 8}}
               </tool_call>
    tool       <tool_response>
               <image>                      (what the zoom returns on the source image)
               </tool_response>
    assistant  <answer>vertical</answer>

The call is written by :func:`demonstration_call` and run by the run's :class:`ToolRunner` on the
row's source-resolution images (its result fitted to the pixel budget), exactly as a rollout runs
the policy's call, and the tool turn holds that result (``("tool", text)`` in ``Sample.turns``;
:func:`r1fit.data.conversation.conversation_target` lays the row out as a rollout's trajectory).
The answer is the solution in ``<answer>`` tags, which the accuracy reward reads (``sft.think``
adds its think block before, as for any answer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace

from PIL import Image

from r1fit.data.errors import DataError
from r1fit.data.rows import IMAGE_TOKEN
from r1fit.data.sample import Sample
from r1fit.tools.api import ToolContext, ToolResult
from r1fit.tools.builtin import MAX_ZOOM
from r1fit.tools.conversation import tool_turn_content
from r1fit.tools.registry import ToolRunner

#: the built-in tools a demonstration calls, the first configured one
DEMONSTRATION_TOOLS = ("zoom", "crop")

Box = tuple[float, float, float, float]


def _two_decimals(value: float, rounding: str = "nearest") -> float:
    """``value`` at 2 decimals (as the call writes it): nearest, or ``down``/``up``, in [0, 1]."""
    scaled = value * 100
    whole = {"nearest": round, "down": math.floor, "up": math.ceil}[rounding](round(scaled, 6))
    return min(1.0, max(0.0, whole / 100))


def zoom_factor(focus: Box, size: tuple[int, int], max_pixels: int) -> int:
    """The zoom of a demonstration: the smallest whole factor whose region (1/factor of the
    image's sides, at source resolution) fits in ``max_pixels`` unshrunk, so the tool shows the
    source's pixels, unless that region would not hold the whole focus box around a centre
    rounded to 2 decimals: then the largest factor that does (at least 1)."""
    width, height = size
    readable = math.ceil(math.sqrt(width * height / max_pixels) - 1e-9)
    # the region's half side must cover the box's half side and the centre's rounding (0.005)
    widest = max(focus[2] - focus[0], focus[3] - focus[1]) + 0.01 + 1e-9
    holds = max(1, math.floor(1 / widest))
    return int(max(1, min(readable, holds, MAX_ZOOM)))


def demonstration_call(tool: str, focus: Box, size: tuple[int, int], max_pixels: int) -> str:
    """The ``<tool_call>`` of a demonstration on image 0 of ``size`` pixels, with
    :func:`demonstration_arguments`."""
    arguments = demonstration_arguments(tool, focus, size, max_pixels)
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"


def demonstration_arguments(tool: str, focus: Box, size: tuple[int, int], max_pixels: int
                            ) -> dict[str, float]:
    """The arguments of a demonstration's call on image 0 of ``size`` pixels: ``zoom`` on the
    focus box's centre (fractions at 2 decimals) by :func:`zoom_factor`, or ``crop`` of the
    region that zoom shows (its corners rounded outwards to 2 decimals)."""
    factor = zoom_factor(focus, size, max_pixels)
    centre = ((focus[0] + focus[2]) / 2, (focus[1] + focus[3]) / 2)
    if tool == "zoom":
        arguments: dict[str, float] = {"x": _two_decimals(centre[0]),
                                       "y": _two_decimals(centre[1]), "factor": factor}
    elif tool == "crop":
        half = 0.5 / factor
        x, y = (min(max(c, half), 1 - half) for c in centre)
        arguments = {"x1": _two_decimals(x - half, "down"), "y1": _two_decimals(y - half, "down"),
                     "x2": _two_decimals(x + half, "up"), "y2": _two_decimals(y + half, "up")}
    else:
        raise ValueError(f"no demonstration for tool {tool!r}; one of {DEMONSTRATION_TOOLS}")
    return arguments


def tool_turn_text(results: Sequence[ToolResult]) -> tuple[str, list[Image.Image]]:
    """The text of a ``"tool"`` turn of ``Sample.turns`` holding ``results`` (an ``<image>``
    placeholder where an image goes; rendered as the user turn
    :func:`r1fit.tools.append_tool_turn` writes) and the images it shows, in order."""
    content, images = tool_turn_content(results)
    return "".join(IMAGE_TOKEN if part["type"] == "image" else part["text"]
                   for part in content), images


class ToolDemonstrations:
    """Writes rows with a focus as tool demonstrations, running ``tool`` with ``runner`` (the
    run's tools, budgets and pixel bounds, as its rollouts have them)."""

    def __init__(self, tool: str, runner: ToolRunner) -> None:
        self.tool, self.runner = tool, runner

    @classmethod
    def of(cls, tools: Sequence[str], runner: ToolRunner) -> ToolDemonstrations | None:
        """Demonstrations of the first of ``zoom``, ``crop`` among ``tools``; None when neither
        is configured."""
        tool = next((name for name in DEMONSTRATION_TOOLS if name in tools), None)
        return None if tool is None else cls(tool, runner)

    def write(self, sample: Sample) -> Sample:
        """``sample`` as a demonstration conversation (its images followed by the tool's), or
        as it is when it has no focus."""
        if sample.focus is None:
            return sample
        source = tuple(sample.source_images or sample.images)  # what the rollout's tools see
        call = demonstration_call(self.tool, sample.focus, source[0].size, self.runner.max_pixels)
        (result,) = self.runner.run_text(call, ToolContext(source, sample.source))
        if result.error:
            raise DataError(f"{sample.source}: the tool demonstration's call {call!r} failed: "
                            f"{result.parts[0]}")
        tool_text, images = tool_turn_text([result])
        answer = sample.solution if "<answer>" in sample.solution else \
            f"<answer>{sample.solution.strip()}</answer>"
        asked = sample.turns[:-1] or (("user", IMAGE_TOKEN * len(sample.images) + sample.problem),)
        return replace(sample, images=[*sample.images, *images], solution=answer,
                       turns=(*asked, ("assistant", call), ("tool", tool_text),
                              ("assistant", answer)))

