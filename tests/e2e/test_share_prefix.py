"""GRPO with memory.share_prefix on and off, and with micro-batches packed by tokens
(memory.micro_batch_tokens), trains the same model (up to float32 summation order): the same
completions, rewards and losses each step, and final weights within rounding. 'auto' turns
sharing on for Qwen2.5-VL after checking the first micro-batch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r1fit.cli import main
from r1fit.report.metrics import read_metrics

# groups of 4 over micro-batches of 3 rows: groups split across micro-batches too; a reference
# (beta) and reused rollouts (num_iterations) so every log-prob pass runs
RUN = ["train.max_steps=3", "train.prompts_per_step=2", "algo.num_generations=4",
       "algo.max_new_tokens=8", "sft.format_warmup_steps=0", "data.eval=null",
       "memory.micro_batch=3", "memory.generation_batch=5", "data.shapes.train_size=50",
       "data.shapes.image_size=56", "data.max_pixels=3136", "checkpoint.every=0",
       "algo.beta=0.05", "algo.num_iterations=2", "train.learning_rate=1e-2",
       "rewards.lenreward:length=1.0"]


def run(out: Path, setting: str, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    assert main(["train", f"train.output_dir={out}", *RUN, f"memory.share_prefix={setting}",
                 *extra]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    return rows, load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("setting,extra", [
    ("auto", ()),
    # packed by tokens: a prompt is ~40 tokens here, so 100 tokens cut a group of 4 in pieces
    ("false", ("memory.micro_batch_tokens=100",)),
    ("auto", ("memory.micro_batch_tokens=100",))])
def test_same_training_with_and_without_a_shared_prefix(use_tiny_cache, reward_plugin, tmp_path,
                                                       caplog, setting, extra):
    per_row, w_row = run(tmp_path / "rows", "false")
    with caplog.at_level(logging.INFO, logger="r1fit.forward"):
        shared, w_shared = run(tmp_path / "other", setting, *extra)
    if setting == "auto":
        assert "memory.share_prefix=auto: on" in caplog.text
    if extra:
        assert "packed micro-batches checked equal" in caplog.text
        assert all(r["micro_batch_tokens"] == 100 for r in shared)
    assert len(per_row) == len(shared) == 3
    for a, b in zip(per_row, shared):
        # sampling saw the same weights at each step: same completions, hence rewards
        assert a["reward_mean"] == b["reward_mean"] and a["completion_len_mean"] == \
            b["completion_len_mean"]
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        # the model FLOPs done: a group's prompt (and image) runs once per micro-batch, not per
        # completion, in the old, reference and update passes; packing alone changes none
        if setting == "auto":
            assert 0 < b["flops"] < a["flops"]
        else:
            assert b["flops"] == a["flops"]
        assert 0 < a["mfu"] < 1 and 0 < b["mfu"] < 1
        assert 0 < a["mfu_update"] < 1 and 0 < b["mfu_update"] < 1
    assert any(r["grad_norm"] > 0 for r in per_row)
    assert w_row.keys() == w_shared.keys()
    moved = 0
    for key in w_row:
        # AdamW divides by the gradient's running RMS, so float noise in a near-zero gradient
        # moves a weight by up to a fraction of the learning rate (1e-2 here): atol 1e-3
        torch.testing.assert_close(w_shared[key], w_row[key], rtol=1e-4, atol=1e-3)
        moved += int(not torch.equal(w_row[key], w_shared[key]))
    assert moved  # two different computations, not one path twice
