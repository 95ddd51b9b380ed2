"""The time model's prediction of a run's steps, made once at start and logged in every step's
row beside what the step measured (``predicted_seconds_generate`` beside ``seconds_generate``
...), so the report plots both and an alarm (:mod:`r1fit.report.alarms`) says when a phase runs
more than twice its prediction: another job on the machine, thermal throttling, a slow disk.

The prediction is :func:`r1fit.memory.planner.plan_memory`'s ``time`` for the run's own config at
the chunk sizes it starts with (``auto`` resolved) on this machine's rates: measured by ``r1fit
doctor --calibrate`` (``predicted_calibrated`` 1) or data sheets (0, and no alarm: a data sheet
is no yardstick for one machine). Like the plan, it takes every completion at
``algo.max_new_tokens`` (with tools, the trajectory budget), so a run whose completions end
earlier generates faster than predicted; and one drawn batch a step (dynamic sampling may draw
more).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from r1fit.memory.sizes import ChunkSizes
from r1fit.units import format_seconds

log = logging.getLogger("r1fit.memory")

#: a step's measured keys (the loops' ``seconds_*``) and the time model's phases each covers:
#: GRPO's update stage runs the reference's log-prob pass and the updates; an SFT step is one
#: update. Checkpoint saves are not in the rows (they run after the row is written).
MEASURED = {"grpo": {"seconds_generate": ("generate",), "seconds_score": ("score",),
                     "seconds_update": ("logprobs", "update")},
            "sft": {"seconds_step": ("update",)}}
PREFIX = "predicted_"
#: the faster configurations a run's log names (the fastest first)
FASTER_LOGGED = 2


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one step under each measured key, and where the rates came from."""

    seconds: dict[str, float]
    calibrated: bool  # the rates were measured on this machine (r1fit doctor --calibrate)
    source: str

    def row(self) -> dict[str, float]:
        """The metrics row's keys: ``predicted_<measured key>`` and ``predicted_calibrated``."""
        return {**{PREFIX + key: value for key, value in self.seconds.items()},
                f"{PREFIX}calibrated": float(self.calibrated)}

    @classmethod
    def of(cls, time: dict[str, Any], kind: str) -> StepPrediction:
        """From a plan's ``time`` (:class:`r1fit.memory.planner.timing.TimePlan` as a dict)."""
        phases = time["phases"]
        return cls(seconds={key: sum(phases[p] for p in parts)
                            for key, parts in MEASURED[kind].items()},
                   calibrated=time["source"].startswith("calibrated"), source=time["source"])


def seconds_left(time: dict[str, Any], cfg: Any, kind: str, done: int) -> float:
    """A plan's ``time`` for a run of ``kind`` whose first ``done`` steps are done (resumed):
    the seconds of its other steps and of the evaluations still ahead (those at every
    ``eval.every``-th step after ``done``, and the last step's)."""
    from r1fit.memory.planner.timing import evaluation_count, run_steps

    steps, every = run_steps(cfg, kind == "sft")
    left = max(steps - done, 0)
    if not left:
        return 0.0
    evaluations = evaluation_count(steps, every, False) - (done // every if every else 0)
    return left * time["step_seconds"] + evaluations * (time["eval_seconds"] or 0.0)


def predict_steps(cfg: Any, device_type: str, gpus: int, kind: str, sizes: ChunkSizes,
                  budget: int | None = None, done: int = 0) -> StepPrediction | None:
    """The time model's prediction for a run of ``kind`` ("grpo" or "sft") starting at ``sizes``
    on ``gpus`` processes, logged; None (with a warning) where the planner cannot read the
    model. Training goes on either way: the prediction is a diagnostic. ``budget``: the bytes
    the run may use on its device (CUDA's free memory before the model loaded, or
    ``memory.budget``); given, the log also names the configurations that fit it and are
    predicted faster (:func:`r1fit.memory.planner.estimate.faster_fits`), as ``r1fit plan``
    lists them. ``done``: the steps a resumed run has done (the log says what is left)."""
    from r1fit.memory.planner import plan_memory
    from r1fit.memory.planner.estimate import shown_values

    values: dict[str, Any] = {"memory.micro_batch": sizes.micro_batch,
                              "memory.generation_batch": sizes.generation_batch}
    if sizes.micro_batch_tokens is not None:
        values["memory.micro_batch_tokens"] = sizes.micro_batch_tokens
    # the planner's own reading of the data (its prompt estimate) would log "data: N rows" a
    # second time in the run's log: only its warnings are kept
    root = logging.getLogger("r1fit")
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        plan = plan_memory(cfg.with_values(values), device_type=device_type, gpus=gpus,
                           kind=kind, device_memory_bytes=budget, faster=budget is not None)
    except Exception as exc:  # noqa: BLE001 - any model the planner cannot read: no prediction
        log.warning("time model: no prediction for this run (%s: %s); the steps log their "
                    "measured seconds alone", type(exc).__name__, exc)
        return None
    finally:
        root.setLevel(level)
    prediction = StepPrediction.of(plan.time, kind)
    shown = ", ".join(f"{key.removeprefix('seconds_')} {format_seconds(value)}"
                      for key, value in prediction.seconds.items())
    warmup = plan.time.get("warmup_steps")
    log.info("time model: a step about %s (%s; every completion at its token budget), the "
             "run about %s (%d steps%s); rates: %s. Each step's row logs predicted_seconds_* "
             "beside its seconds_*%s", format_seconds(sum(prediction.seconds.values())), shown,
             format_seconds(plan.time["run_seconds"]), plan.time["steps"],
             (f", {done} done: about {format_seconds(seconds_left(plan.time, cfg, kind, done))} "
              "left" if done else "")
             + (f", the {warmup}-step format warm-up not counted" if warmup else ""),
             prediction.source,
             "" if prediction.calibrated else " (no slow-phase alarm without a calibration)")
    if plan.faster:
        log.info("time model: faster configurations fit this device (r1fit plan lists them): %s",
                 "; ".join(shown_values(x["values"]) + f": a step about {format_seconds(x['step_seconds'])} "
                             f"({x['speedup']:.2f}x)" for x in plan.faster[:FASTER_LOGGED]))
    return prediction

