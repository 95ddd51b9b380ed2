"""The run's tool counts (ToolTotals): summed over steps and a resume, the wall seconds per step."""

from __future__ import annotations

from r1fit.tools import ToolCounts, ToolStats
from r1fit.train.tool_rollouts import ToolTotals


def test_counts_add_up_over_steps_and_seconds_are_each_steps_own():
    stats = ToolStats(tools={"zoom": ToolCounts()})
    totals = ToolTotals(stats)
    stats.tools["zoom"].calls, stats.tools["zoom"].errors, stats.seconds = 3, 1, 0.25
    first = totals.step()
    assert (first["tools/zoom/calls"], first["tools/zoom/errors"]) == (3.0, 1.0)
    assert first["tools/seconds"] == 0.25
    assert (stats.tools["zoom"].calls, stats.seconds) == (0, 0.0)  # zeroed for the next step
    stats.tools["zoom"].calls, stats.seconds = 2, 0.5
    second = totals.step()
    assert (second["tools/zoom/calls"], second["tools/seconds"]) == (5.0, 0.5)
    # a resume restores the totals and zeroes what the runner counted since
    stats.tools["zoom"].calls, stats.seconds = 9, 9.0
    totals.load_state_dict(totals.state_dict())
    assert (stats.tools["zoom"].calls, stats.seconds) == (0, 0.0)
    third = totals.step()
    assert (third["tools/zoom/calls"], third["tools/seconds"]) == (5.0, 0.0)
