"""Text from data rows and tools never reaches the model as its special tokens.

A tokenizer turns the text of a special token (``<|image_pad|>``, ``<|im_end|>``,
``<start_of_image>``) into that token wherever it meets it, chat template or not. In a row's
question that adds an image placeholder the processor holds no image for ("image features and
image tokens do not match": the run ends in a traceback), or closes a turn the chat template
opened. So:

- **a data row** whose own text (question, answer, any turn) holds one is a bad row: skipped,
  counted and logged with the token named (:func:`row_special_token`). The row is the user's:
  quietly rewriting it would train on something else than the file says;
- **a tool's text result** is escaped (:func:`escaped`): a zero-width space after the token's
  first character, so it reads the same to the policy and is tokenized as plain text. A tool's
  output is data the policy reads at run time; refusing it would turn a working call into an
  error the policy cannot fix;
- **data.system_prompt** holding one is a one-line config error at start.

r1fit's own ``<image>`` placeholder (where a conversation row's image goes) is not a tokenizer's
token here: the chat messages replace it before the template runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r1fit.data.rows import IMAGE_TOKEN
from r1fit.data.sample import Sample

#: inserted after a special token's first character to make its text plain
ZERO_WIDTH_SPACE = "\u200b"


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The texts a tokenizer reads as its special tokens (its named ones and every added token
    marked special), longest first; r1fit's ``<image>`` placeholder and one-character tokens
    (which cannot be split) left out."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(getattr(token, "content", token)))
    return tuple(sorted((t for t in found if len(t) > 1 and t != IMAGE_TOKEN),
                        key=lambda t: (-len(t), t)))


def special_token_in(text: str, specials: Sequence[str]) -> str | None:
    """The first of ``specials`` that ``text`` holds, or None."""
    return next((token for token in specials if token in text), None)


def row_special_token(sample: Sample, specials: Sequence[str]) -> str | None:
    """Why ``sample`` is a bad row (its source, the field and the token), or None when none of its
    own texts holds a special token."""
    fields = [("question", sample.problem), ("answer", sample.solution),
              *((f"{role} turn {i + 1}", text) for i, (role, text) in enumerate(sample.turns))]
    for what, text in fields:
        if (token := special_token_in(text, specials)) is not None:
            return (f"{sample.source}: its {what} holds the model's special token {token!r}, "
                    "which r1fit does not take from data (the processor would read it as a "
                    "control token, e.g. an image placeholder with no image)")
    return None


def escaped(text: str, specials: Sequence[str]) -> str:
    """``text`` with every special token made plain: a zero-width space after its first
    character (until none is left: an insertion cannot form another)."""
    while (token := special_token_in(text, specials)) is not None:
        text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text
