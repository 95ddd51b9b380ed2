"""Rows in the formats people already have, turned into one shape: a conversation and its images.

Two row formats (``data.format``), detected from a source's first row unless configured (the
image column is looked up in each row: ``image``, else ``images``, unless ``data.image_key`` names it):

``columns``: a question, an answer and an image column::

    {"image": "imgs/1.png", "problem": "How many ...?", "solution": "3"}          # r1fit
    {"images": [<PNG bytes>], "problem": "<image>Find x.", "answer": "12"}        # EasyR1

``conversations``: a list of turns, ``from/value`` (VLM-R1, LLaVA, ShareGPT) or ``role/content``
(MiniCPM-V, OpenAI-style messages), with ``<image>`` placeholders::

    {"image": "coco/1.jpg", "conversations": [{"from": "human", "value": "<image>What is it?"},
                                              {"from": "gpt", "value": "a cat"}],
     "accu_reward_method": "default"}

Images are paths (relative to an image folder, by default the file's own), encoded bytes,
``{"bytes", "path"}`` records (a Hugging Face ``Image`` column) or, as MiniCPM-V writes them, a
mapping ``{"<image_00>": path, ...}`` whose keys are the placeholders in the text. Images go where
their ``<image>`` placeholders are; a row without placeholders gets its images before the text of
its first user turn (as VLM-R1 does). The last turn is the answer: GRPO prompts with the turns before
it and scores against it; SFT learns every assistant turn.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from r1fit.data.errors import BadRowError
from r1fit.rewards.answer import extract_answer

IMAGE_TOKEN = "<image>"
#: where a row's images are looked for when ``data.image_key`` is not set, in this order
IMAGE_KEYS = ("image", "images")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "bot": "assistant", "model": "assistant", "system": "system"}
# MiniCPM-V's named placeholders: "<image_00>", "<image_01>", ...
_NAMED_PLACEHOLDER = re.compile(r"<image_\d+>")

#: an image of a row before decoding: a file, encoded bytes, or an image a dataset decoded already
ImageRef = Path | bytes | Image.Image
Turn = tuple[str, str]  # (role: system | user | assistant, text with <image> placeholders)


@dataclass(frozen=True)
class Row:
    """One row in r1fit's shape.

    Attributes:
        turns: the whole conversation, its last turn the assistant's answer; texts keep one
            ``<image>`` placeholder per image, in image order.
        images: one reference per placeholder.
        reward_method: the accuracy method that scores the answer (``data.reward_method``).
        focus: the row's focus box (``data.focus_key``) as written, fractions or pixels of the
            first image (:func:`focus_fractions` turns it into ``Sample.focus``); None: none.
    """

    turns: tuple[Turn, ...]
    images: tuple[ImageRef, ...]
    reward_method: str
    focus: tuple[float, float, float, float] | None = None

    @property
    def problem(self) -> str:
        """The last user turn's text without placeholders (what rewards and logs see)."""
        last = next(text for role, text in reversed(self.turns) if role == "user")
        return last.replace(IMAGE_TOKEN, "").strip()

    @property
    def solution(self) -> str:
        return self.turns[-1][1]


@dataclass(frozen=True)
class RowFormat:
    """How a source's rows are read: the format and the keys that hold each part."""

    kind: Literal["columns", "conversations"]
    problem_key: str | None  # columns
    answer_key: str | None  # columns
    conversations_key: str | None  # conversations
    image_key: str | None  # None: each row's 'image', else its 'images' (image_column)
    reward_method_key: str
    focus_key: str = "focus"

    def describe(self) -> str:
        parts = ([f"question '{self.problem_key}'", f"answer '{self.answer_key}'"]
                 if self.kind == "columns" else [f"turns '{self.conversations_key}'"])
        parts.append(f"images '{self.image_key}'" if self.image_key else
                     " or ".join(f"'{key}'" for key in IMAGE_KEYS) + " for images")
        return f"{self.kind} rows ({', '.join(parts)})"


@dataclass(frozen=True)
class FormatOptions:
    """What the config says about the format (``None``: detect)."""

    kind: Literal["auto", "columns", "conversations"] = "auto"
    problem_key: str | None = None
    answer_key: str | None = None
    image_key: str | None = None
    conversations_key: str | None = None
    reward_method_key: str = "accu_reward_method"
    focus_key: str = "focus"


def _first_present(row: Mapping[str, Any], given: str | None, candidates: Sequence[str]
                   ) -> str | None:
    if given is not None:
        return given
    return next((key for key in candidates if key in row), None)


def detect_format(row: Mapping[str, Any], options: FormatOptions) -> RowFormat:
    """The format of a source whose first row is ``row``; ``BadRowError`` when the row fits none
    (the next row is tried)."""
    kind = options.kind
    conversations = _first_present(row, options.conversations_key, ("conversations", "messages"))
    if kind == "auto":
        kind = "conversations" if conversations in row else "columns"
    image = options.image_key  # None: looked up in each row (image_column)
    if kind == "conversations":
        if conversations is None:
            raise BadRowError(f"no 'conversations' or 'messages' list in the row (keys: "
                              f"{sorted(row)}); set data.conversations_key")
        return RowFormat("conversations", None, None, conversations, image,
                         options.reward_method_key, options.focus_key)
    problem = _first_present(row, options.problem_key, ("problem", "prompt"))
    answer = _first_present(row, options.answer_key, ("solution", "answer"))
    if problem is None or answer is None:
        raise BadRowError(f"cannot tell the row format (keys: {sorted(row)}): expected "
                          "'problem' or 'prompt' with 'solution' or 'answer', or "
                          "'conversations'; set "
                          "data.format and data.problem_key / data.answer_key")
    return RowFormat("columns", problem, answer, None, image, options.reward_method_key,
                     options.focus_key)


def image_column(raw: Mapping[str, Any], fmt: RowFormat) -> str | None:
    """The key of ``raw``'s images: ``fmt.image_key`` when configured, else the one of
    :data:`IMAGE_KEYS` the row fills (None: it has no images; ``BadRowError`` when it fills both,
    which cannot be told apart). Each row is asked, as a source may leave images out of some rows
    (its first one included) or mix the two names."""
    if fmt.image_key is not None:
        return fmt.image_key
    filled = [key for key in IMAGE_KEYS if raw.get(key) not in (None, [], {})]
    if len(filled) > 1:
        raise BadRowError(f"has both {' and '.join(repr(k) for k in filled)}; set data.image_key "
                          "to the column that holds its images")
    return filled[0] if filled else None


def _focus(raw: Any, key: str) -> tuple[float, float, float, float]:
    """A row's focus box ``[x1, y1, x2, y2]``: four finite numbers, >= 0, x1 < x2, y1 < y2."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise BadRowError(f"'{key}' must be a box [x1, y1, x2, y2], got {raw!r}") from None
    values = list(raw) if isinstance(raw, list | tuple) else None
    if (values is None or len(values) != 4
            or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                       and math.isfinite(v) for v in values)):
        raise BadRowError(f"'{key}' must be a box [x1, y1, x2, y2] of 4 numbers, got {raw!r}")
    x1, y1, x2, y2 = (float(v) for v in values)
    if min(x1, y1) < 0 or x1 >= x2 or y1 >= y2:
        raise BadRowError(f"'{key}' {values} is not a box (need 0 <= x1 < x2 and 0 <= y1 < y2)")
    return x1, y1, x2, y2


def focus_fractions(box: tuple[float, float, float, float], size: tuple[int, int]
                    ) -> tuple[float, float, float, float]:
    """``Row.focus`` as fractions of an image of ``size`` (width, height): a box whose numbers
    are all at most 1 is taken as fractions already, any other as pixels of that image (at the
    resolution the source gives); ``BadRowError`` when it reaches outside the image."""
    if max(box) <= 1.0:
        return box
    width, height = size
    if box[2] > width or box[3] > height:
        raise BadRowError(f"focus box {list(box)} (pixels) reaches outside the {width} x {height} "
                          "image")
    return box[0] / width, box[1] / height, box[2] / width, box[3] / height


def _text(value: Any, what: str) -> str:
    """A turn's or column's text: a non-empty string, or a number (VLM-R1 writes numeric answers)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise BadRowError(f"{what} must be a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN, a parquet null
        raise BadRowError(f"{what} is {value} (not a finite number)")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise BadRowError(f"{what} is empty")
    return _unicode(text, what)


def _unicode(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; JSON's ``\\ud800`` escapes can give a lone surrogate,
    which tokenizers and file systems refuse deep inside a run."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRowError(f"{what} has a lone surrogate {text[exc.start]!r} at character "
                          f"{exc.start} (not valid Unicode)") from None
    return text


def _content_text(content: Any, what: str) -> str:
    """``content`` of a role/content turn: a string, or a list of parts (text and image parts)."""
    if isinstance(content, list):
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind == "image":
                pieces.append(IMAGE_TOKEN)
            else:
                raise BadRowError(f"{what} has a content part that is not a text or image part")
        return _text("".join(pieces), what)
    return _text(content, what)


def _turns(raw: Any, key: str) -> list[Turn]:
    """The turns of a conversation list (from/value or role/content)."""
    if not isinstance(raw, list) or not raw:
        raise BadRowError(f"'{key}' must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(raw):
        what = f"'{key}'[{i}]"
        if not isinstance(turn, Mapping):
            raise BadRowError(f"{what} must be an object")
        speaker = turn.get("from", turn.get("role"))
        role = ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise BadRowError(f"{what} has speaker {speaker!r}; expected one of {sorted(ROLES)}")
        text = (_text(turn["value"], what) if "value" in turn else
                _content_text(turn.get("content"), what))
        turns.append((role, text))
    if turns[-1][0] != "assistant":
        raise BadRowError(f"the last turn of '{key}' is not the assistant's answer")
    if not any(role == "user" for role, _ in turns):
        raise BadRowError(f"'{key}' has no user turn")
    return turns


def _image_ref(value: Any, folder: Path | None, what: str) -> ImageRef:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        data = value.get("bytes")
        if data:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise BadRowError(f"{what}'s 'bytes' must be encoded image bytes, got "
                                  f"{type(data).__name__}")
            return bytes(data)
        value = value.get("path")
    if isinstance(value, str) and value.strip():
        path = Path(_unicode(value, what)).expanduser()
        if path.is_absolute():
            return path
        if folder is None:
            raise BadRowError(f"{what} is a relative path ({value}) but the source has no folder: "
                              "set data.image_folder")
        return folder / path
    raise BadRowError(f"{what} must be a path, image bytes or a {{bytes, path}} record")


def _images(raw: Any, key: str, folder: Path | None) -> tuple[list[ImageRef], dict[str, int]]:
    """The image references of a row, and for MiniCPM-V's named placeholders each name's index."""
    if raw is None:
        return [], {}
    if isinstance(raw, Mapping) and not ("bytes" in raw or "path" in raw):
        names = list(raw)
        if not all(isinstance(n, str) and _NAMED_PLACEHOLDER.fullmatch(n) for n in names):
            raise BadRowError(f"'{key}' as a mapping must map placeholders like '<image_00>' to "
                              "images")
        return ([_image_ref(raw[n], folder, f"'{key}'[{n!r}]") for n in names],
                {n: i for i, n in enumerate(names)})
    items = raw if isinstance(raw, list) else [raw]
    return [_image_ref(v, folder, f"'{key}'[{i}]") for i, v in enumerate(items)], {}


def _place_images(turns: list[Turn], images: list[ImageRef], named: dict[str, int]
                  ) -> tuple[list[Turn], list[ImageRef]]:
    """Turns with one ``<image>`` per image in image order: named placeholders become ``<image>``
    (images reordered as they appear), and a row without placeholders gets its images before the
    text of its first user turn."""
    if named:
        plain = sum(text.count(IMAGE_TOKEN) for _, text in turns)
        if plain:  # which image each would show is unknown (it crashed the processor)
            raise BadRowError(f"mixes named placeholders {sorted(named)} with {plain} plain "
                              f"'{IMAGE_TOKEN}'")
        order: list[int] = []
        placed = []
        for role, text in turns:
            found = _NAMED_PLACEHOLDER.findall(text)
            if unknown := sorted(set(found) - set(named)):
                raise BadRowError(f"the text names {unknown}, which the row's image mapping "
                                  f"{sorted(named)} does not hold")
            order.extend(named[m] for m in found)
            placed.append((role, _NAMED_PLACEHOLDER.sub(IMAGE_TOKEN, text)))
        if sorted(order) != list(range(len(images))):
            raise BadRowError(f"the text's placeholders {sorted(named)} do not name each image "
                              "once")
        return placed, [images[i] for i in order]
    count = sum(text.count(IMAGE_TOKEN) for _, text in turns)
    if count == 0 and images:
        first = next(i for i, (role, _) in enumerate(turns) if role == "user")
        turns = list(turns)
        turns[first] = ("user", IMAGE_TOKEN * len(images) + turns[first][1])
    elif count != len(images):
        raise BadRowError(f"has {count} '{IMAGE_TOKEN}' placeholders for {len(images)} images")
    return turns, images


def _check_answer(answer: str, key: str) -> None:
    """``BadRowError`` for an answer turn with nothing to score a completion against."""
    if extract_answer(answer) == "":
        raise BadRowError(f"'{key}' has an empty <answer></answer>")
    if extract_answer(answer, untagged_is_answer=True) == "":  # <think>..</think> alone
        raise BadRowError(f"'{key}' has no answer after its </think>")


def parse_row(raw: Any, fmt: RowFormat, *, folder: Path | None, reward_method: str,
              max_images: int) -> Row:
    """``raw`` in r1fit's shape; ``BadRowError`` says what is wrong with it (without where)."""
    if not isinstance(raw, Mapping):
        raise BadRowError(f"not a JSON object (got {type(raw).__name__})")
    if fmt.kind == "conversations":
        if fmt.conversations_key not in raw:
            raise BadRowError(f"missing '{fmt.conversations_key}'")
        turns = _turns(raw[fmt.conversations_key], fmt.conversations_key)
    else:
        for key in (fmt.problem_key, fmt.answer_key):
            if key not in raw:
                raise BadRowError(f"missing '{key}'")
        turns = [("user", _text(raw[fmt.problem_key], f"'{fmt.problem_key}'")),
                 ("assistant", _text(raw[fmt.answer_key], f"'{fmt.answer_key}'"))]
    key = image_column(raw, fmt)
    images, named = _images(raw.get(key), key, folder) if key is not None else ([], {})
    if len(images) > max_images:
        raise BadRowError(f"has {len(images)} images, more than data.max_images={max_images}")
    turns, images = _place_images(turns, images, named)
    _check_answer(turns[-1][1], fmt.answer_key or fmt.conversations_key)
    assistant_images = [t for r, t in turns if r == "assistant" and IMAGE_TOKEN in t]
    if assistant_images:
        raise BadRowError("has an image in an assistant turn")
    method = raw.get(fmt.reward_method_key, reward_method)
    if not isinstance(method, str) or not method.strip():
        raise BadRowError(f"'{fmt.reward_method_key}' must be a method name, got {method!r}")
    focus = raw.get(fmt.focus_key)
    if focus is not None:
        focus = _focus(focus, fmt.focus_key)
        if not images:
            raise BadRowError(f"has a '{fmt.focus_key}' box but no image")
    return Row(tuple(turns), tuple(images), method.strip(), focus)
