"""Reward registry and the scorer the training loop calls once per step.

Rewards are named either by a built-in name (``accuracy``, ``format``, ``iou``, ``iou_hit``) or by
``"package.module:function"`` for a user plugin importable from ``sys.path``. :class:`RewardScorer`
turns a ``{name: weight}`` mapping into one weighted reward per completion, keeps each unweighted
component for logging, and contains every failure of a reward function: a sample whose reward
raised or returned a non-finite/non-number value scores 0 for that component, the error is counted
and its first traceback logged once, and training goes on.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from r1fit.plugins import load_plugin
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.format import format_reward
from r1fit.rewards.iou import iou, iou_hit
from r1fit.rewards.methods import RewardConfigError  # defined below us: methods.py raises it too

logger = logging.getLogger("r1fit.rewards")

RewardFn = Callable[..., float]
"""``fn(completion: str, solution: str, **info) -> float``; see :mod:`r1fit.rewards`."""

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "format": format_reward,
    "iou": iou,
    "iou_hit": iou_hit,
}

# Keys the scorer passes positionally; an info dict carrying them would collide at call time.
_RESERVED_INFO_KEYS = ("completion", "solution")


class RewardInputError(ValueError):
    """``RewardScorer.score`` got inconsistent batches (a caller bug, not a reward's)."""


def _check_signature(spec: str, fn: Callable[..., Any]) -> None:
    """Reject a plugin that cannot be called as ``fn(completion, solution, **info)``.

    Failing here, at startup, beats failing on every sample of every step later on.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature; trust them
        return
    params = list(signature.parameters.values())
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise RewardConfigError(
            f"reward {spec!r}: must accept **info (signature is {fn.__name__}{signature}); "
            "write it as def fn(completion, solution, **info)"
        )
    try:
        signature.bind("completion", "solution", problem="")
    except TypeError as error:
        raise RewardConfigError(
            f"reward {spec!r}: cannot be called as fn(completion, solution, **info): {error}"
        ) from None


def resolve_reward(name: str) -> RewardFn:
    """Return the reward function for a built-in name or a ``"package.module:function"`` spec.

    The part after ``:`` may be a dotted attribute path (``module:Class.method``). Raises
    :class:`RewardConfigError` (one line, naming the spec) when the module cannot be imported, the
    attribute is missing, or the object is not callable with the reward contract.
    """
    if not isinstance(name, str) or not name.strip():
        raise RewardConfigError(f"reward name must be a non-empty string, got {name!r}")
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        builtins = ", ".join(sorted(BUILTIN_REWARDS))
        raise RewardConfigError(
            f"unknown reward {name!r}: use a built-in ({builtins}) or 'package.module:function'"
        )
    target = load_plugin(name, "reward", RewardConfigError)
    _check_signature(name, target)
    return target


@dataclass
class RewardResult:
    """Rewards of one batch of completions."""

    total: torch.Tensor
    """[N] float32: the weighted sum of the components, the reward used for advantages."""
    components: dict[str, torch.Tensor]
    """Reward name -> [N] float32 unweighted scores (0 where that reward failed), for logging."""
    errors: int
    """Number of (sample, reward) calls in this batch that raised or returned a bad value."""
    first_error: str | None
    """Formatted traceback (or message) of the first such failure in this batch, else None."""
    errors_by_reward: dict[str, int] = field(default_factory=dict)
    """Reward name -> number of failed calls in this batch (every name present, 0 if clean)."""


#: the largest score a reward may return: scores are float32 tensors, where 1e39 is inf
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_float(value: Any) -> float | None:
    """Return ``value`` as a finite float, or None if it is not a real number that is finite
    in float32."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    result = float(value)
    return result if math.isfinite(result) and abs(result) <= FLOAT32_MAX else None


class RewardScorer:
    """Weighted sum of reward functions, robust to failures of any of them.

    Args:
        weights: reward name (built-in or ``"package.module:function"``) -> weight. Weights must be
            finite; zero is allowed (the component is computed and logged but not trained on),
            negative weights make penalties. At least one entry is required.
    """

    def __init__(self, weights: Mapping[str, float]) -> None:
        if not isinstance(weights, Mapping) or not weights:
            raise RewardConfigError(
                f"reward weights must be a non-empty mapping of name -> weight, got {weights!r}"
            )
        self.weights: dict[str, float] = {}
        self.functions: dict[str, RewardFn] = {}
        for name, weight in weights.items():
            # bool is a numbers.Real; "format: true" in YAML is almost surely a mistake.
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise RewardConfigError(f"reward {name!r}: weight must be a number, got {weight!r}")
            if not math.isfinite(float(weight)):
                raise RewardConfigError(f"reward {name!r}: weight must be finite, got {weight!r}")
            self.functions[name] = resolve_reward(name)
            self.weights[name] = float(weight)
        self.total_errors = 0
        """Failed (sample, reward) calls since construction, across all ``score`` calls."""
        self.errors_by_reward: dict[str, int] = {name: 0 for name in self.weights}
        """Cumulative failed calls per reward name."""
        self._logged: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        """The error counts (a checkpoint carries them, so ``reward_errors`` keeps counting)."""
        return {"total_errors": self.total_errors, "errors_by_reward": dict(self.errors_by_reward)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_errors = int(state["total_errors"])
        self.errors_by_reward.update(state["errors_by_reward"])

    def _call(
        self, name: str, index: int, completion: str, solution: str, info: dict[str, Any]
    ) -> tuple[float, str | None]:
        """Run one reward on one sample; return (score, error text or None). Never raises."""
        fn = self.functions[name]
        try:
            value = fn(completion, solution, **info)
        except (Exception, SystemExit):  # noqa: BLE001 - a buggy reward must not stop training
            # (nor end the run unsaid with its sys.exit: a reward error, counted and logged)
            return 0.0, f"reward {name!r} raised on sample {index}:\n{traceback.format_exc()}"
        score = _as_float(value)
        if score is None:
            return 0.0, (
                f"reward {name!r} returned {value!r} ({type(value).__name__}) on sample {index}; "
                "expected a finite float (within float32's range)"
            )
        return score, None

    def _weighted_total(self, components: dict[str, torch.Tensor], n: int
                        ) -> tuple[torch.Tensor, list[int]]:
        """The weighted sum of the ``components`` (summed in float64, kept in float32) and the
        samples where it overflows float32 (scores near its limit): those total 0, a reward error
        of the sum (counted once, beside no single reward's)."""
        total = torch.zeros(n, dtype=torch.float64)
        for name, weight in self.weights.items():
            total += weight * components[name].double()
        total = total.float()
        overflows = (~torch.isfinite(total)).nonzero().flatten().tolist()
        total[overflows] = 0.0
        return total, overflows

    def score(
        self,
        completions: Sequence[str],
        solutions: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
    ) -> RewardResult:
        """Score N completions against their solutions; ``infos[i]`` must contain ``"problem"``.

        Every other key of ``infos[i]`` reaches every reward as a keyword, e.g. the row's
        ``reward_method``, which ``accuracy`` reads and rewards that do not know it ignore.

        Raises :class:`RewardInputError` only for inconsistent inputs (length mismatch, missing
        ``problem``, reserved keys in an info). Failures inside reward functions are contained.
        """
        n = len(completions)
        if len(solutions) != n or len(infos) != n:
            raise RewardInputError(
                f"score(): got {n} completions, {len(solutions)} solutions and {len(infos)} infos; "
                "they must have the same length"
            )
        for index, info in enumerate(infos):
            if not isinstance(info, Mapping) or "problem" not in info:
                raise RewardInputError(
                    f"score(): infos[{index}] must be a dict with a 'problem' key"
                )
            reserved = [key for key in _RESERVED_INFO_KEYS if key in info]
            if reserved:
                raise RewardInputError(
                    f"score(): infos[{index}] has reserved key(s) {reserved}; "
                    "completion and solution are passed positionally"
                )

        components: dict[str, torch.Tensor] = {}
        errors_by_reward: dict[str, int] = {}
        first_error: str | None = None
        for name in self.weights:
            scores = [0.0] * n
            errors = 0
            for index in range(n):
                # A fresh dict per call so one reward mutating its info cannot affect the next.
                info = dict(infos[index])
                scores[index], error = self._call(
                    name, index, completions[index], solutions[index], info
                )
                if error is None:
                    continue
                errors += 1
                if first_error is None:
                    first_error = error
                if name not in self._logged:
                    # Once per reward for the scorer's lifetime: a broken reward fails on every
                    # sample, and thousands of identical tracebacks would bury the training log.
                    self._logged.add(name)
                    logger.warning(
                        "%s\n(further errors of reward %r are counted, not logged)", error, name
                    )
            components[name] = torch.tensor(scores, dtype=torch.float32)
            errors_by_reward[name] = errors
            self.errors_by_reward[name] += errors

        total, overflows = self._weighted_total(components, n)
        if overflows:
            errors_by_reward["total"] = len(overflows)
            self.errors_by_reward["total"] = self.errors_by_reward.get("total", 0) + len(overflows)
            first_error = first_error or (f"the weighted sum of the rewards overflows float32 "
                                          f"on sample {overflows[0]}: it scores 0")
        batch_errors = sum(errors_by_reward.values())
        self.total_errors += batch_errors
        return RewardResult(
            total=total,
            components=components,
            errors=batch_errors,
            first_error=first_error,
            errors_by_reward=errors_by_reward,
        )
