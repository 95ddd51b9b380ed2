"""GRPO with ``rollout.engine=vllm`` through the real CLI, each run its own process (as a user
runs it; vLLM keeps process-wide state): full fine-tuning, LoRA with reused rollouts and a KL
reference, torchrun with one engine per process, and the one-line errors of a bad set-up."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from r1fit.cli import main
from r1fit.report.metrics import read_metrics

pytestmark = pytest.mark.vllm
VLLM = ["model.path=builtin:tiny-hd32", "rollout.engine=vllm",
        "rollout.vllm.kv_cache_memory=67108864", "data.max_prompt_tokens=256"]
SMALL = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
         "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=3",
         "memory.generation_batch=5", "data.shapes.train_size=50", "data.shapes.image_size=56",
         "data.max_pixels=3136", "rewards.lenreward:length=1.0", "rewards.format=0.5",
         "train.max_steps=3", "sft.format_warmup_steps=2", "eval.every=0", "checkpoint.every=0"]


def launch(out: Path, plugins: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    r1fit = ["-m", "r1fit", "train", f"train.output_dir={out}", *VLLM, *SMALL, *args]
    cmd = ([sys.executable, *r1fit] if processes == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", *r1fit])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins),
                                                        os.environ.get("PYTHONPATH", "")])}
    if processes > 1:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=300)


def step_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]


def check_steps(out: Path) -> list[dict]:
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the evaluation before GRPO synced the engine; every later step syncs after the updates
    assert "seconds_weight_sync" not in rows[0]
    assert all(r["seconds_weight_sync"] > 0 for r in rows[1:])
    for row in rows:
        assert math.isfinite(row["loss"])
        # float32 engine and trainer: what differs is the image placeholders the engine never
        # samples (their probability is taken out of its log-probs), under 1% here
        assert 0 <= row["engine_logp_diff"] < 0.01
    assert any(r["grad_norm"] > 0 for r in rows)
    # evaluation (before GRPO and after the last step) decodes greedily on the engine
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert [(r["step"], r["eval/size"]) for r in evals] == [(0, 4), (rows[-1]["step"], 4)]
    return rows


def test_grpo_full_finetuning_on_vllm(hd32_dir, use_tiny_cache, vllm_installed, reward_plugin,
                                      tmp_path):
    out = tmp_path / "full"
    done = launch(out, reward_plugin, "algo.beta=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = check_steps(out)
    assert all(r["kl"] is None for r in rows)
    assert (out / "final" / "model.safetensors").is_file()


def test_grpo_lora_reused_rollouts_and_kl_on_vllm(hd32_dir, use_tiny_cache, vllm_installed,
                                                  reward_plugin, tmp_path):
    out = tmp_path / "lora"
    done = launch(out, reward_plugin, "model.lora.r=4", "algo.num_iterations=2",
                  "algo.beta=0.05", "train.learning_rate=5e-2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = check_steps(out)
    assert all(r["kl"] is not None for r in rows)
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_torchrun_two_processes_sample_what_one_does(hd32_dir, use_tiny_cache, vllm_installed,
                                                     reward_plugin, tmp_path):
    """One engine per rank (gloo): each generates its own rows with the rows' own seeds, so the
    step's completions, rewards and engine log-probs are those of one process. Evaluation gives
    rank 1 no batch (4 rows, one batch): it must still take part in the weight sync's gathers."""
    one, two = tmp_path / "one", tmp_path / "two"
    for out, n in ((one, 1), (two, 2)):
        done = launch(out, reward_plugin, "algo.beta=0", "train.max_steps=2", processes=n)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = step_rows(one), step_rows(two)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "reward_std", "completion_len_mean"):
            assert ra[key] == rb[key], key
        # float32 sums in another order on two processes (gradient all-reduce, FSDP gathers)
        assert ra["engine_logp_diff"] == pytest.approx(rb["engine_logp_diff"], rel=1e-4)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-7)


def test_kv_pool_too_small_is_one_line_before_training(hd32_dir, use_tiny_cache, vllm_installed,
                                                       reward_plugin, tmp_path, capsys):
    out = tmp_path / "small-kv"
    # with the format warm-up on: refused before it trains (it ran whole first, before)
    code = main(["train", f"train.output_dir={out}", *VLLM, *SMALL,
                 "rollout.vllm.kv_cache_memory=4096", "sft.format_warmup_steps=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    # 264 tokens: 3 blocks of 128 and the one vLLM keeps back, of 512 bytes a token (the audit
    # found 135,168 bytes, one sequence's own, refused by vLLM itself; 262,144 ran)
    assert err[-1] == ("r1fit: error: rollout.vllm.kv_cache_memory=4096 (4.00 KiB) holds 8 "
                       "tokens, too few for one sequence of data.max_prompt_tokens + "
                       "algo.max_new_tokens = 264 in vLLM's blocks of 128: set "
                       "rollout.vllm.kv_cache_memory >= 262144 or lower data.max_prompt_tokens")
    assert not (out / "metrics.jsonl").exists() or not step_rows(out)
    assert not list(out.glob("checkpoint-*"))  # the warm-up did not run


def test_model_the_engine_cannot_run_is_one_line_before_training(use_tiny_cache, vllm_installed,
                                                                 reward_plugin, tmp_path):
    """builtin:tiny has 16-dim attention heads, which vLLM's CPU attention lacks: the engine's
    start-up token finds it, not the first rollout."""
    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA attention runs 16-dim heads")
    out = tmp_path / "tiny"
    done = launch(out, reward_plugin, "model.path=builtin:tiny", "sft.format_warmup_steps=0")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"r1fit: error: vLLM cannot run \S+tiny-v\d+: RuntimeError: Unsupported CPU attention "
                        r"configuration: head_dim=16 .*", last), last
    assert not (out / "metrics.jsonl").exists() or not step_rows(out)


def test_grpo_with_a_tool_on_vllm(hd32_dir, use_tiny_cache, vllm_installed, reward_plugin,
                                  tool_plugins, monkeypatch, tmp_path):
    """The multi-turn loop on the engine: the first turn's call (``toolpolicy``, installed in the
    child by ``sitecustomize``) runs zoom on the source image and the engine generates the next
    turn from the context holding its result; the trainer scores those trajectories."""
    monkeypatch.setenv("PYTHONPATH", str(reward_plugin))  # launch() puts the tools' folder first
    out = tmp_path / "tools"
    done = launch(out, tool_plugins, "data.shapes.kinds=[zoom]", "tools=[slowtool:zoom]",
                  "data.max_images=2", "rollout.max_turns=3", "algo.max_new_tokens=80",
                  "rewards.toolreward:calls=1.0", "sft.format_warmup_steps=0", "eval.every=3")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0 < row["tool_calls_mean"] < 1 and row["tool_errors_mean"] == 0
        assert row["turns_mean"] == pytest.approx(1 + row["tool_calls_mean"])
        assert row["reward/toolreward:calls"] == pytest.approx(row["tool_calls_mean"])
        assert math.isfinite(row["loss"])
    assert any(r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["eval/tool_use"] == 1.0  # greedy on the engine: every row calls first
