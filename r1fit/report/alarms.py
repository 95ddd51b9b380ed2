"""Alarms over a run's metrics rows: each a pure function of the rows so far that returns a
one-line message when the run looks unhealthy, else None. The run report shows them at the top;
during training :class:`AlarmWatch` logs each one once, when it first fires. An alarm whose metric
the run did not log (an older run without ``entropy``, an SFT run) stays silent.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from r1fit.report.metrics import read_metrics

log = logging.getLogger("r1fit.report")

Rows = Sequence[dict[str, Any]]

EARLY = 5            # rows that set a run's early level
RECENT = 3           # rows that set its current level (one noisy step raises no alarm)
LENGTH_FRACTION = 0.3  # length collapse: below this fraction of the early length
CLIPPED = 0.99       # "every completion" hits max_new_tokens, allowing for rounding
ZERO_VARIANCE = 0.8  # groups whose rewards are all equal teach nothing
TREND_WINDOW = 20    # format up while accuracy down: over the last rows, first half vs second
TREND = 0.1          # ... each moving by at least this much
ENTROPY_FRACTION = 0.1  # entropy collapse: below this fraction of the early entropy
ENTROPY_FLOOR = 0.01    # ... or below this many nats per token, whatever it started at
SLOW = 2.0  # a phase this many times its predicted seconds (r1fit/memory/prediction.py)
TOOL_SECONDS = "tools/seconds"  # a step's tool calls' wall time, within seconds_generate


def grpo_rows(rows: Rows) -> list[dict[str, Any]]:
    """The GRPO step rows (not the warm-up's, nor the evaluation before training)."""
    return [r for r in rows if "reward_mean" in r and "step" in r]


def series(rows: Rows, key: str) -> list[float]:
    """The values of ``key`` in ``rows`` that are numbers (missing and null are skipped)."""
    return [float(r[key]) for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def length_collapse(rows: Rows) -> str | None:
    lengths = series(grpo_rows(rows), "completion_len_mean")
    if len(lengths) < EARLY + RECENT:
        return None
    early, now = mean(lengths[:EARLY]), mean(lengths[-RECENT:])
    if early > 0 and now < LENGTH_FRACTION * early:
        return (f"length collapse: completions average {now:.1f} tokens over the last {RECENT} "
                f"steps, under {LENGTH_FRACTION:.0%} of the first {EARLY} steps' {early:.1f}")
    return None


def entropy_collapse(rows: Rows) -> str | None:
    """The policy's token-mean entropy over the last ``RECENT`` steps under ``ENTROPY_FRACTION``
    of the first ``EARLY`` steps', or under ``ENTROPY_FLOOR`` nats per token whatever it started
    at (medians of each, so one odd step neither raises the alarm nor hides it)."""
    entropy = series(grpo_rows(rows), "entropy")
    if len(entropy) < EARLY + RECENT:
        return None
    early, now = statistics.median(entropy[:EARLY]), statistics.median(entropy[-RECENT:])
    relative = now < ENTROPY_FRACTION * early
    if not relative and now >= ENTROPY_FLOOR:
        return None
    below = (f"under {ENTROPY_FRACTION:.0%} of the first {EARLY} steps' {early:.3g}" if relative
             else f"under {ENTROPY_FLOOR} (the first {EARLY} steps': {early:.3g})")
    return (f"entropy collapse: {now:.3g} nats per token over the last {RECENT} steps (median), "
            f"{below}: the samples of a prompt barely differ, so its group teaches little (raise "
            "algo.beta or algo.epsilon_high, or lower the learning rate)")


def recent(rows: Rows, key: str) -> list[float] | None:
    """``key`` over the last ``RECENT`` GRPO steps, or None before there are that many."""
    values = series(grpo_rows(rows), key)[-RECENT:]
    return values if len(values) == RECENT else None


def all_clipped(rows: Rows) -> str | None:
    clipped = recent(rows, "completion_clipped_fraction")
    if clipped is not None and min(clipped) >= CLIPPED:
        return (f"every completion of the last {RECENT} steps hit algo.max_new_tokens without "
                "ending: raise it, or the rewards see cut-off answers")
    return None


def zero_variance(rows: Rows) -> str | None:
    fractions = recent(rows, "zero_variance_groups")
    if fractions is not None and mean(fractions) >= ZERO_VARIANCE:
        return (f"{mean(fractions):.0%} of the groups of the last {RECENT} steps have all-equal "
                "rewards (zero advantage, nothing to learn): the task may be too easy or too hard")
    return None


def format_without_accuracy(rows: Rows) -> str | None:
    window = [r for r in grpo_rows(rows) if isinstance(r.get("reward/format"), (int, float))
              and isinstance(r.get("accuracy"), (int, float))][-TREND_WINDOW:]
    if len(window) < TREND_WINDOW:
        return None
    half = len(window) // 2

    def change(key: str) -> float:
        return mean(series(window[half:], key)) - mean(series(window[:half], key))

    fmt, acc = change("reward/format"), change("accuracy")
    if fmt >= TREND and acc <= -TREND:
        return (f"format reward rising (+{fmt:.2f}) while accuracy falls ({acc:.2f}) over the "
                f"last {len(window)} steps: the policy may be gaming the format reward")
    return None


def reward_errors(rows: Rows) -> str | None:
    errors = series(grpo_rows(rows), "reward_errors")
    if errors and errors[-1] > 0:
        return (f"{errors[-1]:.0f} reward calls raised or returned no finite number (scored 0): "
                "see the warnings in log.txt")
    return None


def slow_phase(rows: Rows) -> str | None:
    """A phase of the last ``RECENT`` steps (median) over ``SLOW`` times the time model's
    prediction, where the prediction read rates measured on this machine
    (``predicted_calibrated``); the first steps' one-off work (allocation, graph capture) is
    outvoted by the median. Generation is judged without its tool calls' wall time
    (``tools/seconds``), which the time model leaves out: a slow tool is not a slow machine."""
    timed = [r for r in rows if r.get("predicted_calibrated") == 1][-RECENT:]
    if len(timed) < RECENT:
        return None
    slow = []
    for key in sorted(k for k in timed[-1] if k.startswith("predicted_seconds_")):
        name = key.removeprefix("predicted_")
        measured, predicted = series(timed, name), series(timed, key)
        tools = name == "seconds_generate" and len(series(timed, TOOL_SECONDS)) == len(measured)
        if tools:
            measured = [m - t for m, t in zip(measured, series(timed, TOOL_SECONDS))]
        if len(measured) < RECENT or not predicted:
            continue
        now, expected = statistics.median(measured), statistics.median(predicted)
        if expected > 0 and now > SLOW * expected:
            slow.append(f"{name}{' less tools/seconds' if tools else ''} {now:.3g} s against "
                        f"{expected:.3g} s ({now / expected:.1f}x)")
    if not slow:
        return None
    return (f"slow steps: {'; '.join(slow)} predicted, median of the last {RECENT} steps: "
            "another job on the machine, thermal throttling or a slow disk? (the prediction is "
            "the time model's at start, on the rates of r1fit doctor --calibrate)")


ALARMS: dict[str, Callable[[Rows], str | None]] = {
    "length_collapse": length_collapse,
    "entropy_collapse": entropy_collapse,
    "all_clipped": all_clipped,
    "zero_variance": zero_variance,
    "format_without_accuracy": format_without_accuracy,
    "reward_errors": reward_errors,
    "slow_phase": slow_phase,
}


def check_alarms(rows: Rows) -> dict[str, str]:
    """Name -> message of each alarm that fires on ``rows``."""
    fired = {name: alarm(rows) for name, alarm in ALARMS.items()}
    return {name: message for name, message in fired.items() if message is not None}


class AlarmWatch:
    """Runs the alarms after each step on the rows so far (those of a resumed run's earlier
    steps included) and logs a warning the first time each one fires."""

    def __init__(self, metrics: Path) -> None:
        self.rows = read_metrics(metrics) if metrics.is_file() else []
        self.fired: set[str] = set()

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        for name, message in check_alarms(self.rows).items():
            if name not in self.fired:
                self.fired.add(name)
                log.warning("alarm at step %s: %s", row.get("step"), message)
