"""A GRPO run's tools (``tools``, the ``rollout.`` budgets): multi-turn rollouts of its rows with
an engine's turn function, and the run's tool counts.

:class:`ToolTurns` runs :func:`r1fit.rollout.turns.run_trajectories` over rows a chunk at a time
(``memory.generation_batch`` while training, ``eval.batch`` in evaluation), each row's tools
seeing its images at source resolution (:func:`~r1fit.rollout.turns.tool_context`). Evaluation has a runner of its
own, so its calls stay out of the training counts. :class:`ToolTotals` keeps those counts over
every process and across a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r1fit.config import Config
from r1fit.data.batch import Prompt
from r1fit.processes import all_max, all_sum
from r1fit.rollout.record import Trajectory
from r1fit.rollout.turns import (
    GenerateTurn,
    TurnBudgets,
    run_trajectories,
    tool_context,
)
from r1fit.tools import ToolRunner
from r1fit.tools.registry import ToolStats


def tool_runner(cfg: Config) -> ToolRunner:
    """The run's tools (``tools``), each call timed out after ``rollout.tool_timeout`` s, the
    images they return fitted to ``data.min_pixels``..``max_pixels``."""
    return ToolRunner(cfg.tools, timeout=cfg.rollout.tool_timeout,
                      min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)


class ToolTotals:
    """The run's ``tools/...`` counts (calls, errors, timeouts per tool, malformed calls) summed
    over every process, saved by rank 0 and restored on resume; ``tools/stuck`` (abandoned
    threads still running) is this moment's, summed over processes; ``tools/seconds`` this
    step's wall seconds of tool calls (within ``seconds_generate``), the slowest process's.

    Each process's :class:`ToolStats` counts from its last :meth:`step`, or restore: loading a
    state also zeroes them, so an OOM-redone step (its state restored) and a resumed run count
    each call once."""

    def __init__(self, stats: ToolStats) -> None:
        self.stats = stats
        self.totals: dict[str, float] = {}

    def step(self) -> dict[str, float]:
        """The counts after this step: every process's calls since the last step added."""
        local = self.stats.metrics()
        stuck, seconds = local.pop("tools/stuck"), local.pop("tools/seconds")
        keys = sorted(local)
        summed = all_sum([local[k] for k in keys] + [stuck])
        for key, value in zip(keys, summed):
            self.totals[key] = self.totals.get(key, 0.0) + value
        self._zero()
        return {**self.totals, "tools/stuck": summed[-1], "tools/seconds": all_max([seconds])[0]}

    def _zero(self) -> None:
        for counts in self.stats.tools.values():
            counts.calls = counts.errors = counts.timeouts = 0
        self.stats.malformed = 0
        self.stats.seconds = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = {k: float(v) for k, v in state["totals"].items()}
        self._zero()


class ToolTurns:
    """The run's tools and turn budgets (``algo.max_new_tokens`` per turn)."""

    @classmethod
    def of(cls, run: Any, max_new_tokens: int) -> ToolTurns | None:
        """The run's tools (``tools``), or None without any: one completion per row."""
        return cls(run, max_new_tokens) if run.cfg.tools else None

    def __init__(self, run: Any, max_new_tokens: int) -> None:
        cfg = run.cfg
        self.run = run
        self.runner, self.eval_runner = tool_runner(cfg), tool_runner(cfg)
        self.totals = ToolTotals(self.runner.stats)
        self.budgets = TurnBudgets.of(cfg, max_new_tokens)
        self.workers = cfg.rollout.tool_workers

    def run_rows(self, generate_turn: GenerateTurn, rows: Sequence[Prompt],
                 seeds: Sequence[int] | None, batch_size: int, *, evaluation: bool = False
                 ) -> list[Trajectory]:
        """One trajectory per row, ``batch_size`` rows at a time (each row's are the same
        whatever the chunking: seeds are per row and turn)."""
        out: list[Trajectory] = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            out += run_trajectories(
                generate_turn, self.run.processor, chunk,
                None if seeds is None else seeds[start:start + batch_size],
                self.eval_runner if evaluation else self.runner, self.budgets,
                eos=self.run.ids.eos, contexts=[tool_context(p) for p in chunk],
                workers=self.workers)
        return out
