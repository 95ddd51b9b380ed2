"""A tool turn appended to a conversation, in the chat messages r1fit renders prompts from
(:func:`r1fit.data.batch.chat_messages`: ``{"role", "content": [parts]}`` with ``{"type":
"image"}`` where an image goes, the images themselves in a list beside, in order).

The results of one assistant turn's calls become ONE user turn, each result wrapped in
``<tool_response>`` tags and separated by a newline. That is what Qwen's tool-aware chat templates
(Qwen2.5, Qwen3, Qwen3-VL) render ``role: tool`` messages as::

    <|im_start|>user
    <tool_response>
    RESULT 1
    </tool_response>
    <tool_response>
    RESULT 2
    </tool_response><|im_end|>

Writing it as a user turn, not as ``role: tool`` messages, renders the same text through templates
that know no tool role: Qwen2-VL's and Qwen2.5-VL's (which would write ``<|im_start|>tool``, a
role the model never saw), the built-in models' (r1fit/models/tokenizer.py), and Gemma 3's (whose
roles must alternate user/assistant). An image result is an image part there, so the processor
turns it into vision tokens like any prompt image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from PIL import Image

from r1fit.data.conversation import after_assistant_tokens
from r1fit.data.specials import escaped, special_tokens
from r1fit.tools.api import ToolResult

TOOL_RESPONSE_OPEN = "<tool_response>\n"
TOOL_RESPONSE_CLOSE = "\n</tool_response>"


def _add_text(content: list[dict[str, Any]], text: str) -> None:
    """Append text to a content list, merged into its last part when that is text too."""
    if content and content[-1]["type"] == "text":
        content[-1] = {"type": "text", "text": content[-1]["text"] + text}
    else:
        content.append({"type": "text", "text": text})


def tool_turn_content(results: Sequence[ToolResult]) -> tuple[list[dict[str, Any]],
                                                               list[Image.Image]]:
    """The user turn's content parts for ``results`` and the images they show, in order."""
    if not results:
        raise ValueError("a tool turn needs at least one result")
    content: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for index, result in enumerate(results):
        _add_text(content, ("\n" if index else "") + TOOL_RESPONSE_OPEN)
        for part in result.parts:
            if isinstance(part, Image.Image):
                content.append({"type": "image"})
                images.append(part)
            else:
                _add_text(content, part)
        _add_text(content, TOOL_RESPONSE_CLOSE)
    return content, images


def append_tool_turn(messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                     assistant_text: str, results: Sequence[ToolResult]
                     ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """``(messages, images)`` grown by the policy's turn (``assistant_text``, its tool calls
    included, as generated) and the user turn holding the ``results`` of its calls; the inputs are
    left as they are.

    Rendering the grown messages with ``add_generation_prompt=True`` gives the prompt of the
    policy's next turn. The rendered assistant text is for that prompt only: a trainer keeps the
    token ids the policy sampled, as re-tokenizing decoded text need not give them back.
    """
    content, shown = tool_turn_content(results)
    grown = [*messages,
             {"role": "assistant", "content": [{"type": "text", "text": assistant_text}]},
             {"role": "user", "content": content}]
    return grown, [*images, *shown]


def tool_turn_tokens(processor: Any, results: Sequence[ToolResult]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor],
                                list[Image.Image]]:
    """The tool turn of ``results`` as the chat template writes it after an assistant turn's text
    (closing that turn, the user turn of results, the next assistant turn's opening), encoded by
    the processor with its images: ``(ids, per-token extras, image tensors, images)``. SFT on
    tool demonstrations encodes their tool turns by the same function. Text that would read as
    one of the model's special tokens is made plain first (:func:`r1fit.data.specials.escaped`):
    a tool's output never becomes an image placeholder or a turn's end."""
    specials = special_tokens(processor.tokenizer)
    results = [replace(result, parts=tuple(escaped(part, specials) if isinstance(part, str)
                                           else part for part in result.parts))
               for result in results]
    content, images = tool_turn_content(results)
    ids, extras, image_inputs = after_assistant_tokens(
        processor, [{"role": "user", "content": content}], images)
    return ids, extras, image_inputs, images
