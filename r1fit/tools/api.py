"""What a tool receives and returns: the row's context in, text or images out, and the errors that
become an error turn instead of stopping a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from r1fit.errors import R1fitError

#: what a tool may return: text, an image, or a list of them (shown to the policy in order)
ToolPart = str | Image.Image


class ToolConfigError(R1fitError, ValueError):
    """A tool named in the config cannot be used (unknown name, import failure, bad signature)."""


class ToolArgumentError(ValueError):
    """A tool was called with a bad value (the policy's mistake, not the tool's bug).

    The runner turns it into an error result with its message, counted as an error, without
    logging a traceback. A user tool raises it for the same purpose."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool gets of the row it is called on.

    Attributes:
        images: the row's images at the resolution its source gave them, BEFORE the pixel budget
            (``data.max_pixels``) shrank them for the prompt: a crop of the shrunk image would show
            the policy nothing it has not seen already.
        source: where the row came from (``"builtin:shapes/train#12"``), for messages.
    """

    images: tuple[Image.Image, ...]
    source: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One well-formed ``<tool_call>`` of a completion: the tool's name and its keyword
    arguments, and the tag's text as the policy wrote it."""

    name: str
    arguments: dict[str, Any]
    text: str


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` that names no call (bad JSON, no name, arguments not an object, no
    closing tag): ``reason`` is one line saying what is wrong."""

    reason: str
    text: str


@dataclass(frozen=True)
class ToolResult:
    """What the policy is shown for one call: ``parts`` (text and images, in order; images already
    fitted to the pixel budget), and whether it is an error (then ``parts`` is one line of text
    starting ``error:``). ``name`` is the tool called, '' for a malformed call."""

    name: str
    parts: tuple[ToolPart, ...]
    error: bool = False

    @classmethod
    def failure(cls, name: str, message: str) -> ToolResult:
        """An error result whose one line names the culprit: ``error: crop: x2 must be ...``."""
        text = " ".join(message.split())
        return cls(name, (f"error: {name}: {text}" if name else f"error: {text}",), error=True)
