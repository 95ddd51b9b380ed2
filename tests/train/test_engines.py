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


def test_sft_evaluates_on_the_engine_its_config_resolves(use_tiny_cache, tmp_path, monkeypatch):
    """``r1fit sft``'s evaluations run on the static engine when rollout.engine=static (on CUDA,
    auto's choice) and give the greedy answers Hugging Face generate gives (float32), after 30
    steps that teach the tiny model the format; with auto on CPU they run on generate."""
    from r1fit.cli import main
    from r1fit.report.metrics import read_metrics
    from r1fit.train import engines, evaluate

    answers: list[str] = []
    score = evaluate.answer_scores
    monkeypatch.setattr(evaluate, "answer_scores",
                        lambda text, sample: answers.append(text) or score(text, sample))
    static_calls = []
    greedy = engines.StaticRollouts.greedy
    monkeypatch.setattr(engines.StaticRollouts, "greedy",
                        lambda self, prompts: static_calls.append(len(prompts))
                        or greedy(self, prompts))
    runs = {}
    for engine in ("static", "auto"):
        answers.clear()
        out = tmp_path / engine
        assert main(["sft", f"train.output_dir={out}", "sft.steps=30", "sft.eval_every=15",
                     "data.eval_size=12", "eval.batch=8", "data.shapes.train_size=50",
                     "data.max_pixels=3136", "checkpoint.every=0", "report.to=[]",
                     f"rollout.engine={engine}"]) == 0
        evals = [{k: v for k, v in r.items() if k.startswith("eval/") and "memory" not in k}
                 for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
        runs[engine] = (evals, list(answers))
        if engine == "static":  # before, at 15 and at 30: 12 rows in batches of 8 and 4 each
            assert static_calls == [8, 4] * 3
    assert static_calls == [8, 4] * 3  # auto on CPU: generate, not the static engine
    (static_evals, static_answers), (hf_evals, hf_answers) = runs["static"], runs["auto"]
    assert len(static_evals) == 3 and static_evals == hf_evals
    assert static_evals[-1]["eval/format"] == 1.0  # the answers compared are formatted ones
    assert len(static_answers) == 36 and static_answers == hf_answers
