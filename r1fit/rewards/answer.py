"""Answer extraction and normalisation shared by the built-in rewards.

The R1 answer format wraps the final answer in ``<answer>...</answer>``. Rewards compare the
*extracted* answer of a completion with the extracted answer of the dataset's ``solution`` after
a light, predictable normalisation (case, spacing, punctuation, number spelling), so that "Red."
and "red", or "three" and "3.0", score the same.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["extract_answer", "normalize", "split_thinking"]

_OPEN, _CLOSE = "<answer>", "</answer>"
# a text that opens with its thinking (DeepSeek-R1's layout: <think>..</think> then the answer)
_THINKING = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)

_NUMBER_WORDS: dict[str, str] = {
    word: str(value)
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}

# A plain decimal number, optionally signed, optionally with comma thousands separators.
# Commas are accepted only in strict groups of three ("1,000", not "1,5") so a decimal comma or
# a list "1,2" is never silently read as one number. No exponent form: "1e3" stays text.
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")

# Characters stripped from the ends of an answer. A leading "." is kept (".5" is a number) and a
# leading "-"/"+" is kept (a sign); a trailing "." is dropped ("Red." -> "red").
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_LEADING_STRIP = _QUOTES + ",;:!?"
_TRAILING_STRIP = _QUOTES + ".,;:!?"


def split_thinking(text: str) -> tuple[str | None, str]:
    """The content of the ``<think>..</think>`` block ``text`` opens with (None when it opens
    with none) and the text after it."""
    match = _THINKING.fullmatch(text)
    return (match.group(1), match.group(2)) if match else (None, text)


def extract_answer(text: str, *, untagged_is_answer: bool = False) -> str | None:
    """Return the stripped content of the LAST ``<answer>...</answer>`` in ``text``.

    The last tag wins because models often restate or correct themselves; the final answer is
    the one they commit to. Without any complete tag pair, return ``None`` — or, when
    ``untagged_is_answer`` is set (use it for dataset solutions, which are often a bare answer),
    the whole text stripped, after the thinking it may open with (an R1-distilled solution:
    ``<think>..</think>2`` answers 2).
    """
    # the pairs a non-greedy <answer>(.*?)</answer> finds, left to right, in one pass: the regex
    # rescans to the end from every unclosed <answer> (quadratic: 25 s for a completion of
    # 20,000 of them)
    last, position = None, 0
    while (start := text.find(_OPEN, position)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            break
        last, position = text[start + len(_OPEN):end], end + len(_CLOSE)
    if last is not None:
        return last.strip()
    if untagged_is_answer:
        return split_thinking(text)[1].strip()
    return None


def _canonical_number(token: str) -> str | None:
    """Return ``token`` as a canonical decimal string ("3.0" -> "3", "1,000" -> "1000"), or None."""
    word = _NUMBER_WORDS.get(token)
    if word is not None:
        return word
    if not _NUMBER.fullmatch(token):
        return None
    try:
        value = Decimal(token.replace(",", ""))
    except InvalidOperation:  # defensive: the regex should only admit valid decimals
        return None
    if value == 0:
        return "0"  # "-0", "0.00" and "+0" are all zero
    # normalize() drops trailing zeros; the "f" format avoids exponent notation (1E+3).
    return format(value.normalize(), "f")


def normalize(text: str) -> str:
    """Normalise an answer for exact comparison.

    Lowercases, removes ``$`` (LaTeX math delimiters and currency signs, ``\\$`` too), reads
    the minus sign U+2212 as "-", collapses whitespace,
    strips surrounding quotes and punctuation (including a trailing period), and canonicalises
    every whitespace-separated number: "3.0" -> "3", "1,000" -> "1000", "-0.50" -> "-0.5", and
    the words "zero".."twenty" -> "0".."20".
    """
    # LaTeX's escaped dollar (a currency sign) and Unicode's minus sign read as their plain forms
    text = text.lower().replace("\\$", "").replace("$", "").replace("\u2212", "-")
    text = " ".join(text.split())
    # Alternate whitespace and punctuation stripping until stable: '"Red." ' needs both.
    previous = None
    while previous != text:
        previous = text
        text = text.lstrip(_LEADING_STRIP).rstrip(_TRAILING_STRIP).strip()
    tokens = text.split(" ") if text else []
    return " ".join(_canonical_number(token) or token for token in tokens)
