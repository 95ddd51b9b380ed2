"""Accuracy methods: how a row's answer is compared with its solution.

VLM-R1 rows name their method in ``accu_reward_method``; r1fit reads it (or ``data.reward_method``)
into the row and the ``accuracy`` reward scores each completion by it. Every method compares the
completion's LAST ``<answer>...</answer>`` with the solution's answer (tagged or bare):

- ``default``: 1.0 if the normalised answers are equal (:func:`r1fit.rewards.answer.normalize`),
  else 1.0 if math-verify (a dependency; warned about once where missing) shows them equal,
  else 0.0.
- ``mcq``: 1.0 if both name the same option letter (:func:`read_choice`).
- ``yes_no``: 1.0 if both say the same yes/no (:func:`read_yes_no`).
- ``numeric``: 1.0 if both are the same number (:func:`read_number`), else 0.0.
- ``math``: ``default`` that requires math-verify: the run refuses to start without it, where
  ``default`` would quietly compare text only.
- ``fuzzy``: partial credit, the Indel similarity ratio in [0, 1] of the normalised answers.
- ``iou``: partial credit, the IoU in [0, 1] of the first ``[x1, y1, x2, y2]`` box of each answer
  (0 when either has none): the same score as the ``iou`` reward, so for box rows ``accuracy``
  and ``eval/accuracy`` are mean IoUs (VLM-R1 calls this task REC; its Acc@0.5 is the
  ``iou_hit`` reward).

Departures from VLM-R1 (``grpo_jsonl.py``), on purpose:

- A completion without an ``<answer>`` pair, or with an empty one, scores 0; VLM-R1 grades the
  whole text instead (and its ``mcq``/``yes_no`` read the first ``<answer>``, r1fit the last).
- An unknown method is an error when the data is read; VLM-R1 silently scores it as ``default``.
  ``map`` (detection mAP) and ``llm`` (an LLM judge) are not built in: use the ``iou`` reward or
  a reward plugin.
- ``default`` is r1fit's exact-or-math-verify 0/1 score, not VLM-R1's cascade (math-verify, then
  number, then option letter, then a Levenshtein ratio as partial credit for text). Rows that
  relied on that partial credit want ``fuzzy``.
- ``mcq`` reads a letter only where the answer clearly names one (see :func:`read_choice`); VLM-R1
  takes any capital followed by punctuation anywhere and picks among several by keyword points,
  misses lowercase ``(b)``, and compares with the raw solution text when that names no letter.
- ``yes_no`` matches whole words: VLM-R1's substring search reads "I don't know" as "no", and
  scores 1.0 when neither side says yes or no; r1fit scores 0 then.
- ``numeric`` (VLM-R1 uses it inside ``default`` only) scores 0 for non-numbers where VLM-R1
  returns None; ``math`` uses math-verify, VLM-R1 its own ``compute_score``.
- Cleaning is r1fit's :func:`normalize` (case, spacing, quotes and punctuation at the ends, ``$``,
  number spelling), a superset of VLM-R1's ``clean_text`` (case, newlines, a trailing period).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from types import ModuleType
from typing import Any

from r1fit.errors import R1fitError
from r1fit.rewards.answer import extract_answer, normalize
from r1fit.rewards.iou import answers_iou

log = logging.getLogger("r1fit.rewards")

__all__ = [
    "MATH_VERIFY_TIMEOUT_S",
    "METHODS",
    "RewardConfigError",
    "check_method",
    "math_equivalent",
    "read_choice",
    "read_number",
    "read_yes_no",
    "score_by_method",
]


class RewardConfigError(R1fitError, ValueError):
    """A reward name, plugin spec, weight or accuracy method in the configuration is unusable.

    Defined here, the lowest module that raises it; :mod:`r1fit.rewards.registry` raises it too.
    """


# --- math-verify -------------------------------------------------------------------------------

MATH_VERIFY_TIMEOUT_S = 3
"""Seconds allowed for each math-verify parse and each comparison (signal.alarm takes whole
seconds). Sympy can hang on adversarial expressions; a generated answer must not stall training."""

# Something math-verify can actually parse: a digit, a LaTeX command or an operator. Plain words
# are kept away from it on purpose: wrapped in $...$ they would parse as products of symbols, and
# "red" == "der" (r*e*d == d*e*r) would score as correct.
_MATH_LIKE = re.compile(r"[\d\\+\-*/^=<>()\[\]{}|_]")

# Explicit math delimiters; without one of these math-verify's LaTeX extractor finds nothing in
# "\sqrt{2}" and reads "2\pi" as 2, so undelimited answers are wrapped in $...$ before parsing.
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


@functools.cache
def _math_verify() -> ModuleType | None:
    """Import math-verify once (it pulls in sympy, ~0.5 s); ``None`` when it is not installed."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _as_latex(answer: str) -> str:
    """Wrap an undelimited answer in ``$...$`` so math-verify's LaTeX extractor sees all of it."""
    if any(delimiter in answer for delimiter in _MATH_DELIMITERS):
        return answer
    return f"${answer}$"


# LaTeX commands (\frac, \sqrt, \pi, \text...): their names are not words of the answer
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[^\W\d_]+")  # a run of letters (any script)
# what marks an answer as LaTeX rather than a plain list of items
_LATEX_MARKS = frozenset("\\${}[]()")


def _words(answer: str) -> set[str]:
    r"""The words of an answer outside LaTeX command names, lowercased: its units ("10 cm": cm),
    variables ("x = 3": x) and text (a ``\text{...}``'s content counts)."""
    return {w.lower() for w in _WORD.findall(_LATEX_COMMAND.sub(" ", answer))}


def _plain_items(answer: str) -> list[str] | None:
    r"""A plain answer's items in order, when it is a list: separated by commas or semicolons
    ("1, 2", "x+1; 3"), or by spaces when every item is a number ("1 2"); None for one item or
    for LaTeX (``$``, backslashes, brackets: "\{1, 2\}" is a set, "(1, 2)" a tuple), which
    math-verify reads. Thousands separators are not list commas ("1,000": normalize reads it)."""
    if _LATEX_MARKS.intersection(answer):
        return None
    text = normalize(answer)
    items = [item for item in re.split(r"\s*[,;]\s*", text)]
    if len(items) > 1:
        return items if all(items) else None
    items = text.split(" ")
    return items if len(items) > 1 and all(_NUMBER.fullmatch(i) for i in items) else None


def math_equivalent(gold: str, prediction: str) -> bool:
    """Return True when math-verify judges ``prediction`` equivalent to ``gold``, within two
    rules of r1fit's where math-verify is lenient by design: when both answers have words
    (units, variables), they must be the same words ("10 cm" is not "10 m", where math-verify
    drops units; "10" matches either); a plain list ("1, 2", "3 4") matches only a list of as
    many items, each equal in order (wrapped in ``$...$`` math-verify reads "1, 2" as a set).

    False when math-verify is missing, when either answer is plain words, when parsing finds
    nothing, or when math-verify fails or times out.
    """
    math_verify = _math_verify()
    if math_verify is None:
        return False
    if not (_MATH_LIKE.search(gold) and _MATH_LIKE.search(prediction)):
        return False
    gold_words, prediction_words = _words(gold), _words(prediction)
    if gold_words and prediction_words and gold_words != prediction_words:
        return False
    gold_items, prediction_items = _plain_items(gold), _plain_items(prediction)
    if gold_items is not None or prediction_items is not None:
        if gold_items is None or prediction_items is None \
                or len(gold_items) != len(prediction_items):
            return False
        return all(p == g or math_equivalent(g, p) for g, p in zip(gold_items, prediction_items))
    # math-verify times out with signal.alarm, which only works in the main thread; elsewhere
    # (e.g. a reward worker thread) it raises ValueError. Off the main thread we disable its
    # timeout instead, accepting that a pathological expression could be slow.
    timeout: int | None = (
        MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    )
    try:
        gold_parsed: list[Any] = math_verify.parse(_as_latex(gold), parsing_timeout=timeout)
        pred_parsed: list[Any] = math_verify.parse(_as_latex(prediction), parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        # verify() is not symmetric: gold first (it unwraps "x = 3" on the gold side).
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a verifier failure means "not shown equal", not a crash
        return False
    except BaseException as error:
        # math-verify's TimeoutException derives from BaseException; it normally catches its own,
        # but an alarm firing between its try blocks could escape. Treat it as "not equal" and let
        # real interrupts (KeyboardInterrupt, SystemExit) through.
        if type(error).__name__ == "TimeoutException":
            return False
        raise


# --- reading an answer -------------------------------------------------------------------------

# The whole answer is a letter, maybe bracketed or followed by "." or ":": "B", "b", "(B)", "B.".
_CHOICE_ALONE = re.compile(r"[(\[]?([A-Za-z])[)\]]?[.:]?")
# The answer opens with a marked option and its text: "B. Paris", "(b) Paris", "B) Paris".
_CHOICE_LEADS = re.compile(r"[(\[]?([A-Za-z])[)\].:]\s+\S")
# A sentence names the letter: "The answer is C.", "option (b)", "Answer: D". A bare letter must
# be a capital that ends its clause, so "the answer is a dog" and "the answer is I think B" name
# nothing.
_CHOICE_NAMED = re.compile(
    r"\b(?i:answer|option|choice)(?:\s+is)?\s*:?\s*"
    r"(?:[(\[]([A-Za-z])[)\]]|([A-Z])(?=\s*(?:$|[.,;:!?)\]])))"
)
# An option letter in brackets anywhere: "(C)", "[c]"
_CHOICE_MARKED = re.compile(r"[(\[]([A-Za-z])[)\]]")
# LaTeX that only frames a letter: "\boxed{B}", "\text{(B)}" (a letter in math mode)
_LATEX_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\{([^{}]*)\}")
# Characters around an answer that carry no meaning: markdown emphasis, code ticks, quotes,
# math-mode dollars.
_DECORATION = "*`\"'$ \t\n"

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)

# A plain number after normalize() (which has lowercased it and removed thousands commas and $).
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?")


def read_choice(answer: str) -> str | None:
    """The option letter an answer names, uppercased, or None.

    Read, in this order: the whole answer is the letter ("B", "(b)", "B."); the answer opens with
    a marked option ("B. Paris", "(B) Paris", "B) Paris"); the answer names the letter after
    "answer", "option" or "choice" ("The answer is C", "option (b)") — there a bare letter must be
    a capital ending its clause, and two different letters named make it ambiguous (None). Any
    other text ("I think C", "A or B") names no letter, nor does a lead followed by another
    bracketed option ("(B) or (C)").
    """
    text = _LATEX_WRAPPER.sub(r"\1", answer).strip(_DECORATION)
    match = _CHOICE_ALONE.fullmatch(text) or _CHOICE_LEADS.match(text)
    if match:
        letter = match.group(1).upper()
        # "(B) or (C)": a lead followed by another marked option hedges (rewarding it would
        # reward naming every option)
        others = {m.upper() for m in _CHOICE_MARKED.findall(text[match.end():])} - {letter}
        return None if others else letter
    named = {(m.group(1) or m.group(2)).upper() for m in _CHOICE_NAMED.finditer(text)}
    return named.pop() if len(named) == 1 else None


def read_yes_no(answer: str) -> str | None:
    """``"yes"`` or ``"no"``: the first of these whole words in the answer (any case), or None.

    Whole words only: "I don't know" says neither, "Nobody" is not "no".
    """
    match = _YES_NO.search(answer)
    return match.group(1).lower() if match else None


def read_number(answer: str) -> Decimal | None:
    """The answer as an exact decimal after :func:`normalize` ("1,000" -> 1000, "$3.50" -> 3.5,
    "three" -> 3, "1e3" -> 1000), or None when it is anything but one number ("3 apples", "1,5",
    "50%"). Exact, not a float: 20-digit numbers that differ in their last digit differ, and a
    5,000-digit one equals itself. A LaTeX wrapper around it is read through ("\\boxed{5}",
    "\\text{5}"), as ``mcq`` and ``default`` read it."""
    text = normalize(_LATEX_WRAPPER.sub(r"\1", answer))
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # defensive: the pattern admits decimals only
        return None


# --- the methods: (prediction, gold) -> score, both non-empty extracted answers -----------------


def _default(prediction: str, gold: str) -> float:
    """Equal after :func:`normalize` (LaTeX wrappers read through: "\\text{5 cm}" is "5 cm"),
    the same number ("1000" and "1e3"), or equivalent by math-verify."""
    normalized_prediction = normalize(_LATEX_WRAPPER.sub(r"\1", prediction))
    if not normalized_prediction:
        return 0.0
    if normalized_prediction == normalize(_LATEX_WRAPPER.sub(r"\1", gold)):
        return 1.0
    if (number := read_number(gold)) is not None and read_number(prediction) == number:
        return 1.0
    return 1.0 if math_equivalent(gold, prediction) else 0.0


def _same(read: Callable[[str], object]) -> Callable[[str, str], float]:
    """A method scoring 1.0 when ``read`` finds the same value in both answers (and finds one)."""

    def method(prediction: str, gold: str) -> float:
        expected = read(gold)
        return 1.0 if expected is not None and read(prediction) == expected else 0.0

    return method


def _fuzzy(prediction: str, gold: str) -> float:
    from rapidfuzz import fuzz  # here: a run that scores no fuzzy answers runs without rapidfuzz

    normalized_prediction, normalized_gold = normalize(prediction), normalize(gold)
    if not normalized_prediction or not normalized_gold:
        return 0.0  # two empty strings are "identical" to rapidfuzz; an empty answer is not right
    return fuzz.ratio(normalized_prediction, normalized_gold) / 100


METHODS: dict[str, Callable[[str, str], float]] = {
    "default": _default,
    "mcq": _same(read_choice),
    "yes_no": _same(read_yes_no),
    "numeric": _same(read_number),
    "math": _default,  # the same comparison; check_method() makes sure math-verify is there
    "fuzzy": _fuzzy,
    "iou": answers_iou,
}
"""Accuracy method name -> ``fn(prediction, gold) -> float`` over the extracted answers."""

# VLM-R1 methods r1fit does not build in, and what to use instead.
_NOT_BUILT_IN = {
    "map": "accuracy method 'map' (detection mAP) is not built in: use the iou reward "
           "(rewards.iou=1.0) or a reward plugin 'package.module:function'",
    "llm": "accuracy method 'llm' (an LLM judge) is not built in: write the judge as a reward "
           "plugin, rewards.\"pkg.mod:judge\"=1.0",
}


#: whether the missing-math-verify warning was given (once per process)
_WARNED: list[str] = []


def check_method(name: str) -> None:
    """Raise :class:`RewardConfigError` (one line) unless ``name`` is a method r1fit can score.

    Called when the data is read, so a bad name or a missing math-verify stops the run before
    training rather than scoring every row 0.
    """
    if isinstance(name, str) and name in _NOT_BUILT_IN:
        raise RewardConfigError(_NOT_BUILT_IN[name])
    if not isinstance(name, str) or name not in METHODS:
        raise RewardConfigError(
            f"unknown accuracy method {name!r}: use one of {', '.join(METHODS)}"
        )
    if name == "math" and _math_verify() is None:
        raise RewardConfigError(
            "accuracy method 'math' needs math-verify: pip install math-verify (a dependency "
            "of r1fit; missing only in a hand-made environment)"
        )
    if name == "default" and _math_verify() is None and not _WARNED:
        _WARNED.append(name)
        log.warning("math-verify is not installed: accuracy method 'default' scores exact "
                    "matches only ('1/2' against '0.5' is wrong); pip install math-verify (a "
                    "dependency of r1fit, missing only in a hand-made environment)")


def score_by_method(method: str, completion: str, solution: str) -> float:
    """Score the completion's last ``<answer>`` against the solution (tagged or bare) by
    ``method``, one of :data:`METHODS`. A completion without an ``<answer>``, an empty answer or
    an empty solution scores 0.0; an unusable method raises :class:`RewardConfigError`."""
    check_method(method)
    prediction = extract_answer(completion)
    gold = extract_answer(solution, untagged_is_answer=True)
    if not prediction or not gold:
        return 0.0
    return METHODS[method](prediction, gold)
