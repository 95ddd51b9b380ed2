"""Whole runs through the CLI on the built-in non-Qwen2.5 architectures: GRPO with LoRA and a KL
term, SFT, and a GRPO run resumed after a crash that matches an uninterrupted one bit for bit.

Each architecture is a real transformers model class with its own processor, tokenizer and chat
template (r1fit/models/builtin.py ``FAMILIES``); nothing in r1fit names it. Add a built-in here to
cover its family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText

from r1fit.cli import main
from r1fit.models.builtin import ensure_builtin
from r1fit.report.metrics import read_metrics

from .test_resume import TINY, straight_and_resumed

#: built-in name -> the transformers class its config.json names
ARCHITECTURES = {"tiny-gemma3": "Gemma3ForConditionalGeneration",
                 "tiny-qwen2vl": "Qwen2VLForConditionalGeneration",
                 "tiny-qwen3vl": "Qwen3VLForConditionalGeneration"}
SMALL = [*TINY, "train.max_steps=3", "sft.format_warmup_steps=2", "eval.every=3",
         "checkpoint.every=0"]


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request, tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``model.path=builtin:NAME`` of each architecture, built once into the session cache."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    folder = ensure_builtin(request.param)
    assert AutoConfig.from_pretrained(folder).architectures == [ARCHITECTURES[request.param]]
    return f"model.path=builtin:{request.param}"


def run(*args: str) -> int:
    return main(list(args))


def test_grpo_lora_with_kl(arch, reward_plugin, tmp_path):
    out = tmp_path / "run"
    assert run("train", arch, f"train.output_dir={out}", *SMALL, "model.lora.r=4",
               "algo.beta=0.05", "train.learning_rate=5e-2") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["completion_len_mean"] <= 8 for r in rows)
    # the reference is the policy with adapters off (the warmed-up adapters make KL > 0)
    assert all(r["kl"] is not None and r["kl"] >= 0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # lenreward: rewards differ within groups
    # LoRA adapted the language model's projections only, never the vision tower
    adapters = load_file(out / "final" / "adapter_model.safetensors")
    assert adapters and all(".language_model.layers." in key for key in adapters)
    assert {key.split(".")[-3] for key in adapters} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"}


def test_sft_learns_the_answers_and_ends_turns_as_the_template_does(arch, tmp_path):
    out = tmp_path / "run"
    assert run("sft", arch, f"train.output_dir={out}", *TINY, "sft.steps=3",
               "checkpoint.every=0") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    folder = ensure_builtin(arch.split(":")[-1])
    before = AutoModelForImageTextToText.from_pretrained(folder)
    after = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert type(after) is type(before)
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(),
                                                    after.state_dict().values()))


def test_grpo_resume_is_bit_exact(arch, reward_plugin, same_run, tmp_path, monkeypatch):
    """4 steps straight == 2 steps, a crash right after checkpoint-2, and a resume to 4: the same
    metrics and bit-identical final weights (full fine-tuning, 2 iterations per rollout, KL)."""
    args = [arch, *TINY, "train.max_steps=4", "sft.format_warmup_steps=2", "checkpoint.every=2",
            "eval.every=2", "algo.num_iterations=2", "algo.beta=0.05"]
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, "train", "checkpoint-2", args)
    rows = [r for r in read_metrics(straight / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 0 for r in rows)  # the comparison covers real updates
    same_run(straight, resumed)
    assert "resumed grpo at step 2" in (resumed / "log.txt").read_text()
