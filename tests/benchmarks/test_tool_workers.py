"""The bookkeeping of benchmarks/tool_workers.py on hand-made runs: the steps compared across
worker counts, the medians of undisturbed runs, the verdict; the latency tool it writes."""

from __future__ import annotations

import importlib
import sys

import pytest
from benchkit import BenchmarkError, load_script
from PIL import Image

from r1fit.tools import ToolContext

tw = load_script("tool_workers")


def step(n: int, seconds: float, generate: float, **changes) -> dict:
    return {"step": n, "tools/seconds": seconds, "seconds_generate": generate,
            "turns_mean": 1.5, "tool_calls_mean": 0.5, "tool_errors_mean": 0.0,
            "reward_mean": 0.25, "loss": 0.125, **changes}


def runs_of(many_seconds: float, **changes) -> dict:
    def run(seconds: float, disturbed: bool = False, **step_changes) -> dict:
        return {"steps": [step(1, 9.0, 9.0), step(2, seconds, seconds + 2, **step_changes),
                          step(3, seconds, seconds + 2, **step_changes)],
                "disturbed": disturbed}
    return {(tw.REMOTE_TOOL, 1): [run(6.0), run(6.2), run(50.0, disturbed=True)],
            (tw.REMOTE_TOOL, 8): [run(many_seconds), run(many_seconds, **changes)],
            ("zoom", 1): [run(0.02)], ("zoom", 8): [run(0.03)]}


def test_medians_leave_out_the_first_step_and_disturbed_runs():
    table = tw.summaries(runs_of(1.0))
    remote_one = table[0]
    assert (remote_one["runs"], remote_one["tools_seconds"]) == (2, 6.1)
    assert remote_one["seconds_generate"] == pytest.approx(8.1)


@pytest.mark.parametrize("many, changes, met, speedup", [
    (1.0, {}, True, 6.1),
    (2.0, {}, False, 3.05),                     # under 4x
    (1.0, {"reward_mean": 0.5}, False, 6.1),     # a trajectory changed with the workers
])
def test_the_verdict_needs_4x_and_the_same_steps(many, changes, met, speedup):
    runs = runs_of(many, **changes)
    differ = tw.differences(runs)
    assert bool(differ) == bool(changes)
    if changes:
        assert differ == [f"{tw.REMOTE_TOOL} x8 step 2 reward_mean",
                          f"{tw.REMOTE_TOOL} x8 step 3 reward_mean"]
    ok, got, line = tw.verdict(tw.summaries(runs), differ, 8, 0.1)
    assert ok is met and got == pytest.approx(speedup)
    assert line.endswith("target met" if met else "target MISSED")


def test_a_run_with_other_steps_differs():
    runs = runs_of(1.0)
    runs[("zoom", 8)][0]["steps"].pop()
    assert tw.differences(runs) == ["zoom x8: 2 steps, not 3"]


def test_the_latency_tool_waits_then_zooms(tmp_path, monkeypatch):
    (tmp_path / "remote_tools.py").write_text(tw.REMOTE.format(latency=0.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("remote_tools", None)
    remote = importlib.import_module("remote_tools")
    image = remote.zoom(ToolContext((Image.new("RGB", (896, 896)),)), x=0.5, y=0.5, factor=8)
    assert image.size == (112, 112)


def test_bad_arguments_are_refused(refused):
    assert "--workers: expected an integer >= 1, got 0" in refused(tw.parse_args, ["--workers", "0"])
    with pytest.raises(BenchmarkError, match="--workers must be at least 2"):
        tw.run(tw.parse_args(["--workers", "1"]))
