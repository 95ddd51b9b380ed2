"""The engine a GRPO run builds from its config: the static engine's torch.compile is on where
``rollout.static.compile`` says so, and by default only on CUDA (off here, on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from r1fit.config import load_config
from r1fit.models.load import load_policy
from r1fit.rollout.generate import SamplingSettings, TokenIds
from r1fit.train.engines import StaticRollouts

CPU = torch.device("cpu")


@pytest.mark.parametrize(("value", "compiled"), [("null", False), ("true", True),
                                                 ("false", False)])
def test_the_static_engine_compiles_as_configured(tiny_dir, value, compiled):
    model, processor = load_policy(str(tiny_dir), lora_r=0, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=True, dtype="float32",
                                   device=CPU, gradient_checkpointing=False)
    cfg = load_config(None, ["rollout.engine=static", f"rollout.static.compile={value}"])
    run = SimpleNamespace(cfg=cfg, model=model, ids=TokenIds.of(model, processor), device=CPU)
    engine = StaticRollouts(run, SamplingSettings(max_new_tokens=4))
    assert engine.decoder.compile is compiled and engine.decoder.graphs is False


@pytest.mark.slow
def test_a_compiled_engine_compiles_once_over_a_runs_steps(use_tiny_cache, tmp_path):
    """rollout.static.compile=true through three GRPO steps (on CPU, without graphs): the decode
    forward is compiled in step 1 and reused by the later steps, not compiled again per step (the
    weights change in place; the model object and its mode at decode time do not)."""
    from torch._dynamo.utils import counters

    from r1fit.cli import main
    from r1fit.report.metrics import read_metrics

    torch._dynamo.reset()  # no cache left by another test's compile in this process
    counters.clear()
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", "train.max_steps=3",
                 "train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
                 "sft.format_warmup_steps=0", "data.eval=null", "eval.before_train=false",
                 "data.shapes.train_size=20", "checkpoint.every=0", "report.to=[]",
                 "rollout.engine=static", "rollout.static.compile=true"]) == 0
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "seconds_generate" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert counters["frames"]["ok"] == 1 and not counters["recompiles"]
