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
