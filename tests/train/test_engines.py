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


class FakeVllm:
    """A vLLM engine's sleep and sync calls, recorded (CUDA's sleep mode, which a CPU has not)."""

    def __init__(self, calls: list[str], sleeps: bool = True) -> None:
        self.calls, self.sleeps, self.awake = calls, sleeps, True

    def load_weights(self, weights) -> None:
        self.calls.append("sync")
        self.awake = True

    def sleep(self) -> None:
        if self.sleeps and self.awake:
            self.calls.append("sleep")
            self.awake = False

    def wake(self) -> None:
        if self.sleeps and not self.awake:
            self.calls.append("wake")
            self.awake = True


@pytest.mark.parametrize("level,expected", [
    # level 1 keeps the weights in host memory: woken for a second draw of the same policy
    (1, ["sync", "sleep", "sync", "sleep", "wake", "sleep"]),
    # level 2 drops them: synced again instead
    (2, ["sync", "sleep", "sync", "sleep", "sync", "sleep"]),
])
def test_the_vllm_engine_sleeps_from_the_end_of_generation(monkeypatch, level, expected):
    """The engine sleeps once a step's generation is over (idle), not after the update: the
    log-prob passes and updates run without its weights and KV cache, as the memory plan counts
    them. The next generation wakes it, synced when the policy changed or its weights went."""
    from contextlib import ExitStack

    from r1fit.train import engines

    monkeypatch.setattr(engines, "full_named_weights", lambda model: iter(()))
    calls: list[str] = []
    rollouts = object.__new__(engines.VllmRollouts)
    rollouts.run = SimpleNamespace(model=None)
    rollouts.spec = SimpleNamespace(sleep_level=level)
    rollouts._engine, rollouts.stale = FakeVllm(calls), True

    def generation() -> None:
        with ExitStack() as stack:
            stack.enter_context(rollouts.ready({}))

    generation()  # step 1's generation, the engine synced
    rollouts.idle()  # the step's log-prob passes and updates
    rollouts.updated()
    generation()  # step 2: the new policy synced
    rollouts.idle()
    generation()  # a second draw of step 2 (dynamic sampling), the policy unchanged
    rollouts.idle()
    assert calls == expected


def test_a_grpo_step_idles_its_engine_before_the_log_prob_passes(use_tiny_cache, tmp_path,
                                                                 monkeypatch):
    """In a real GRPO step the engine's idle comes after the last generation and before the
    log-prob passes and the update; updated() after the update."""
    from r1fit.cli import main
    from r1fit.train import grpo

    calls: list[str] = []
    real_engine, real_logprobs, real_update = grpo.rollout_engine, grpo.add_logprobs, \
        grpo.policy_update

    def engine(*args, **kwargs):
        inner = real_engine(*args, **kwargs)
        for name in ("idle", "updated"):
            method = getattr(inner, name)
            monkeypatch.setattr(inner, name, lambda m=method, n=name: (calls.append(n), m())[1])
        rollout = inner.rollout
        monkeypatch.setattr(inner, "rollout", lambda *a, **k: (calls.append("generate"),
                                                               rollout(*a, **k))[1])
        return inner

    monkeypatch.setattr(grpo, "rollout_engine", engine)
    monkeypatch.setattr(grpo, "add_logprobs",
                        lambda *a, **k: (calls.append("logprobs"), real_logprobs(*a, **k))[1])
    monkeypatch.setattr(grpo, "policy_update",
                        lambda *a, **k: (calls.append("update"), real_update(*a, **k))[1])
    assert main(["train", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1",
                 "train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=4",
                 "sft.format_warmup_steps=0", "data.eval=null", "eval.before_train=false",
                 "checkpoint.every=0", "report.to=[]", "algo.beta=0",
                 "rollout.min_new_tokens=4"]) == 0
    assert calls[:5] == ["generate", "idle", "logprobs", "update", "updated"]


@pytest.mark.parametrize("top_p,cap,said", [(0.9, 2.0, True), (1.0, 2.0, False),
                                            (0.9, 0.0, False), (0.9, None, False)])
def test_a_vllm_run_with_top_p_and_tis_is_told_what_tis_weighs(top_p, cap, said):
    from r1fit.train.engines import nucleus_warning

    warning = nucleus_warning(top_p, cap)
    assert (warning is not None) is said
    if said:
        assert "nucleus mass" in warning and "algo.tis_cap=0 turns it off" in warning
