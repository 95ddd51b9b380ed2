"""Each alarm fires on hand-built rows showing its trouble, none on the shapes of a healthy run; the
step metrics the alarms read (clipped completions, zero-variance groups) on a hand-built rollout."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from r1fit.report.alarms import ALARMS, AlarmWatch, check_alarms
from r1fit.report.html import LiveReport
from r1fit.report.step import step_metrics
from r1fit.rollout.record import Rollout


def healthy(steps: int = 40) -> list[dict]:
    """A healthy run: noisy lengths that shrink a little, then settle; a few clipped completions;
    some zero-variance groups; format and accuracy both rising; entropy halving; no reward
    errors; generation up to 1.5x its predicted seconds (3.75x in the first step: its one-off
    allocations), the update under its prediction."""
    rows: list[dict] = [{"warmup/step": 1, "warmup/loss": 2.0}, {"step": 0, "eval/accuracy": 0.2}]
    for s in range(1, steps + 1):
        wobble = math.sin(s * 1.7)
        rows.append({"step": s, "reward_mean": 0.3 + s / 100, "completion_len_mean":
                     120 - min(s, 20) * 2 + 8 * wobble, "completion_clipped_fraction":
                     0.1 + 0.05 * wobble, "zero_variance_groups": 0.25 + 0.1 * wobble,
                     "reward/format": min(1.0, 0.5 + s / 50), "accuracy": 0.2 + s / 100,
                     "entropy": 0.8 - s / 100 + 0.05 * wobble, "reward_errors": 0,
                     "seconds_generate": 3.0 if s == 1 else 1.0 + 0.2 * wobble,
                     "predicted_seconds_generate": 0.8, "seconds_update": 0.5,
                     "predicted_seconds_update": 0.6, "predicted_calibrated": 1.0})
    return rows


def with_values(rows: list[dict], key: str, value) -> list[dict]:
    """``rows`` with ``key`` of step ``s`` set to ``value(s)`` (GRPO step rows only)."""
    return [{**r, key: value(r["step"])} if "reward_mean" in r else r for r in rows]


def test_no_alarm_on_a_healthy_run():
    rows = healthy()
    for end in range(1, len(rows) + 1):  # nor at any point along it
        assert check_alarms(rows[:end]) == {}, end
    assert check_alarms([]) == {}


@pytest.mark.parametrize("name, rows", [
    ("length_collapse", with_values(healthy(), "completion_len_mean",
                                    lambda s: 150.0 if s < 25 else 12.0)),
    ("all_clipped", with_values(healthy(), "completion_clipped_fraction",
                                lambda s: 1.0 if s > 30 else 0.2)),
    ("zero_variance", with_values(healthy(), "zero_variance_groups",
                                  lambda s: 0.9 if s > 35 else 0.3)),
    ("format_without_accuracy", with_values(with_values(
        healthy(), "reward/format", lambda s: 0.2 + s / 50), "accuracy", lambda s: 0.6 - s / 80)),
    ("reward_errors", with_values(healthy(), "reward_errors", lambda s: 0 if s < 39 else 3)),
    ("entropy_collapse", with_values(healthy(), "entropy", lambda s: 0.8 if s < 30 else 0.05)),
    ("slow_phase", with_values(healthy(), "seconds_update", lambda s: 0.5 if s < 38 else 1.3)),
])
def test_each_alarm_fires_on_its_trouble_and_only_it(name, rows):
    fired = check_alarms(rows)
    assert list(fired) == [name], fired
    assert ALARMS[name](rows) == fired[name]


def test_slow_phase_names_the_phase_and_needs_a_calibrated_prediction():
    rows = with_values(healthy(), "seconds_generate", lambda s: 1.0 if s < 38 else 2.5)
    assert check_alarms(rows)["slow_phase"] == (
        "slow steps: seconds_generate 2.5 s against 0.8 s (3.1x) predicted, median of the last 3 "
        "steps: another job on the machine, thermal throttling or a slow disk? (the prediction "
        "is the time model's at start, on the rates of r1fit doctor --calibrate)")
    # one slow step of the last three is outvoted by the median
    assert "slow_phase" not in check_alarms(
        with_values(healthy(), "seconds_generate", lambda s: 1.0 if s != 39 else 9.0))
    # a prediction from data sheets is no yardstick for this machine
    assert "slow_phase" not in check_alarms(with_values(rows, "predicted_calibrated",
                                                        lambda s: 0.0))
    # nor before three steps have been predicted, nor in a run that logged no prediction
    assert "slow_phase" not in check_alarms(rows[:4])
    assert "slow_phase" not in check_alarms(
        [{k: v for k, v in r.items() if not k.startswith("predicted_")} for r in rows])


def test_slow_phase_leaves_the_tool_calls_time_out_of_generation():
    """The time model leaves tool calls out, so a run with slow tools judges generation less
    its tools/seconds: 2.5 s of which 1.5 s in tools is 1.0 s of model work, as predicted."""
    rows = with_values(with_values(healthy(), "seconds_generate", lambda s: 2.5),
                       "tools/seconds", lambda s: 1.5)
    assert "slow_phase" not in check_alarms(rows)
    slower = with_values(rows, "seconds_generate", lambda s: 4.0)
    assert check_alarms(slower)["slow_phase"].startswith(
        "slow steps: seconds_generate less tools/seconds 2.5 s against 0.8 s (3.1x)")


def test_length_collapse_needs_enough_steps_and_a_real_drop():
    rows = [{"step": s, "reward_mean": 0, "completion_len_mean": v}
            for s, v in enumerate([100, 100, 100, 100, 100, 40, 35, 31], 1)]
    assert "length_collapse" not in check_alarms(rows)  # 35 > 30% of 100
    rows[-3:] = [{**r, "completion_len_mean": 20} for r in rows[-3:]]
    assert "length_collapse" in check_alarms(rows)
    assert "length_collapse" not in check_alarms(rows[:7])  # too few steps


def entropy_rows(values: list[float | None]) -> list[dict]:
    return [{"step": s, "reward_mean": 0.5, "entropy": v} for s, v in enumerate(values, 1)]


def test_entropy_collapse_under_a_tenth_of_the_start_or_an_absolute_floor():
    # medians: first 5 steps 1.0, last 3 steps 0.11 -> 11% of the start, no alarm
    rows = entropy_rows([1.0, 1.2, 0.9, 1.0, 3.0, 0.5, 0.11, 0.11, 0.2])
    assert "entropy_collapse" not in check_alarms(rows)
    rows[-1]["entropy"] = 0.09  # last 3: 0.11, 0.11, 0.09 -> median 0.11 still
    assert "entropy_collapse" not in check_alarms(rows)
    rows[-2]["entropy"] = 0.08  # last 3: 0.11, 0.08, 0.09 -> median 0.09 < 10% of 1.0
    message = check_alarms(rows)["entropy_collapse"]
    assert message.startswith("entropy collapse: 0.09 nats per token over the last 3 steps "
                              "(median), under 10% of the first 5 steps' 1")
    assert "entropy_collapse" not in check_alarms(rows[:7])  # too few steps to tell
    # one odd step moves neither level: the medians ignore it
    assert "entropy_collapse" not in check_alarms(entropy_rows([1.0] * 6 + [0.001, 1.0]))
    assert "entropy_collapse" not in check_alarms(entropy_rows([0.001] + [1.0] * 7))
    # a policy that starts (nearly) deterministic is below the floor, whatever its start
    flat = check_alarms(entropy_rows([0.009] * 8))["entropy_collapse"]
    assert "under 0.01 (the first 5 steps': 0.009)" in flat
    assert "entropy_collapse" not in check_alarms(entropy_rows([0.011] * 8))


def test_entropy_collapse_is_silent_without_entropy():
    # runs logged before the entropy metric existed, and steps where it is null
    assert "entropy_collapse" not in check_alarms(
        [{"step": s, "reward_mean": 0.5} for s in range(1, 30)])
    assert "entropy_collapse" not in check_alarms(entropy_rows([None] * 10 + [0.0] * 3))
    # an SFT run's rows (no reward) are not GRPO steps
    assert check_alarms([{"step": s, "loss": 1.0, "entropy": 0.0} for s in range(1, 30)]) == {}


def test_watch_warns_once_when_an_alarm_first_fires(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward_mean": 0.5, "reward_errors": 0}\n')
    watch = AlarmWatch(metrics)  # a resumed run's earlier rows count
    assert len(watch.rows) == 1
    with caplog.at_level(logging.WARNING, logger="r1fit.report"):
        watch.add({"step": 2, "reward_mean": 0.5, "reward_errors": 0})
        assert caplog.records == []
        for step in (3, 4, 5):
            watch.add({"step": step, "reward_mean": 0.5, "reward_errors": 2})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "alarm at step 3: 2 reward calls raised or returned no finite number")


def test_live_report_warns_of_entropy_collapse_once(tmp_path, caplog):
    live = LiveReport(SimpleNamespace(rollouts_every=0, every=0), tmp_path, main=True)
    with caplog.at_level(logging.WARNING, logger="r1fit.report"):
        for row in entropy_rows([1.0] * 5 + [0.5, 0.05, 0.04, 0.03, 0.02, 0.01]):
            live.after_step(row)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith("alarm at step 8: entropy collapse: 0.05 nats per token")


def test_step_metrics_clipped_completions_and_zero_variance_groups():
    eos = [9, 10]
    rollout = Rollout(
        step=1, prompts=[object(), object(), object()], num_generations=2, share=slice(0, 6),
        # ends with EOS (9 or 10) = finished; else stopped by max_new_tokens = clipped
        completions=[torch.tensor(t) for t in
                     ([1, 2, 9], [1, 2, 3], [4, 10], [5, 5, 5], [9], [7, 7, 10])],
        total_tokens=15,
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.0]),  # groups 0 and 2 all-equal
        correct=[1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    row = step_metrics(rollout, [{"loss": 0.5}], {"seconds_generate": 1.0}, eos)
    assert row["completion_clipped_fraction"] == pytest.approx(2 / 6)
    assert row["zero_variance_groups"] == pytest.approx(2 / 3)
    assert row["completion_len_mean"] == pytest.approx(15 / 6)
