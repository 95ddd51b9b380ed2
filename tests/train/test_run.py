"""A run's pieces (r1fit/train/run.py): the time model's prediction settled on the path that
``memory.share_prefix=auto`` chose."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

import r1fit.train.run as run_module
from r1fit.checkpoint.manager import ResumePoint
from r1fit.config import load_config
from r1fit.memory.prediction import StepPrediction
from r1fit.memory.sizes import ChunkSizes
from r1fit.train.forward import BatchLayout
from r1fit.train.run import Run


def test_an_auto_shared_prefix_is_predicted_again_once_for_the_path_it_chose(monkeypatch):
    """The prediction made at start planned the larger-peak path; after the first micro-batch
    decided, the run predicts once more for the path taken, and never again; an explicit
    share_prefix, a run not yet decided or one without a prediction are left as they are."""
    asked = []

    def predict(cfg, device_type, gpus, kind, sizes, *, done):
        asked.append((cfg.memory.share_prefix, device_type, gpus, kind, sizes, done))
        return StepPrediction({"seconds_update": 1.0}, calibrated=False, source="data sheet")

    monkeypatch.setattr(run_module, "predict_steps", predict)
    start = StepPrediction({"seconds_update": 2.0}, calibrated=False, source="data sheet")
    sizes = ChunkSizes(2, 3, {})

    def fake(share_prefix, *, decided_on=None, predicted=start):
        layout = BatchLayout(share_prefix)
        if decided_on is not None:
            layout.on, layout.decided = decided_on, True
        return SimpleNamespace(
            predicted=predicted, layout=layout, device=torch.device("cpu"), kind="grpo",
            world=SimpleNamespace(size=1), sizes=sizes, checkpoints=SimpleNamespace(resume=None),
            planned=load_config(None, ["model.path=builtin:tiny",
                                       f"memory.share_prefix={share_prefix}"]))

    run = fake("auto")
    Run.settle_prediction(run)  # not decided yet
    assert asked == [] and run.predicted is start
    run.layout.on, run.layout.decided = True, True
    Run.settle_prediction(run)
    assert asked == [(True, "cpu", 1, "grpo", sizes, 0)]
    assert run.predicted.seconds == {"seconds_update": 1.0}
    assert run.planned.memory.share_prefix is True
    Run.settle_prediction(run)  # once only
    assert len(asked) == 1
    off = fake("auto", decided_on=False)
    Run.settle_prediction(off)
    assert asked[-1][0] is False and len(asked) == 2
    for unchanged in (fake("true", decided_on=True), fake("auto", decided_on=True, predicted=None)):
        Run.settle_prediction(unchanged)
    assert len(asked) == 2
    # a resumed run is predicted again with the steps its resume point has done (GRPO's own:
    # a resume point within the format warm-up has done none of them)
    for phase, done in (("grpo", 5), ("warmup", 0)):
        resumed = fake("auto", decided_on=True)
        resumed.checkpoints.resume = ResumePoint(Path("checkpoint-5"), {"phase": phase, "step": 5},
                                                 weights_only=False)
        Run.settle_prediction(resumed)
        assert asked[-1][-1] == done
