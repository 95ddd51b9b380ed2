"""Accuracy reward: does the completion's ``<answer>`` match the solution?

First an exact comparison of normalised answers (see :func:`r1fit.rewards.answer.normalize`),
then — when the optional ``math-verify`` package is installed and both answers look like
mathematics — a symbolic equivalence check, so ``\\frac{1}{2}`` matches ``0.5``.
"""

from __future__ import annotations

import functools
import re
import threading
from types import ModuleType
from typing import Any

from r1fit.rewards.answer import extract_answer, normalize

__all__ = ["MATH_VERIFY_TIMEOUT_S", "accuracy", "math_equivalent"]

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


def math_equivalent(gold: str, prediction: str) -> bool:
    """Return True when math-verify judges ``prediction`` equivalent to ``gold``.

    False when math-verify is missing, when either answer is plain words, when parsing finds
    nothing, or when math-verify fails or times out.
    """
    math_verify = _math_verify()
    if math_verify is None:
        return False
    if not (_MATH_LIKE.search(gold) and _MATH_LIKE.search(prediction)):
        return False
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


def accuracy(completion: str, solution: str, **info: Any) -> float:
    """1.0 if the completion's last ``<answer>`` matches the solution's answer, else 0.0.

    The solution may be tagged (its last ``<answer>`` is used) or a bare answer. A completion
    without an ``<answer>...</answer>`` pair, or with an empty one, scores 0.0.
    """
    prediction = extract_answer(completion)
    if prediction is None:
        return 0.0
    gold = extract_answer(solution, untagged_is_answer=True)
    normalized_prediction = normalize(prediction)
    if not normalized_prediction or not gold:
        return 0.0
    if normalized_prediction == normalize(gold):
        return 1.0
    return 1.0 if math_equivalent(gold, prediction) else 0.0
