"""The OOM guard in a real run: on CPU, memory.budget caps peak RSS over the pre-load baseline and
raises torch.OutOfMemoryError like the CUDA allocator; the guard halves the chunk and redoes the step.

builtin:small-realvocab with LoRA, 1 prompt x 8 completions of 64 tokens, one logits chunk per
micro-batch: the [rows x 64 x 151,936] logits make the step's peak grow with memory.micro_batch
(measured here: about 930 / 620 / 425 MiB over the baseline at micro-batch 8 / 4 / 2 in a fresh
process). A redo starts from a higher RSS than a fresh process (glibc keeps part of what the
failed attempt freed, even after malloc_trim), so the guard may shrink one size further than a
fresh run would need: with a 520 MiB budget it went 8 -> 4 -> 2 -> 1 here.
"""

from __future__ import annotations

import json

import pytest

from r1fit.cli import main
from r1fit.report.metrics import read_metrics

ARGS = ["model.path=builtin:small-realvocab", "model.lora.r=8", "train.max_steps=1",
        "sft.format_warmup_steps=0", "train.prompts_per_step=1", "algo.num_generations=8",
        "algo.max_new_tokens=64", "algo.beta=0", "memory.logits_chunk=4096", "eval.every=0",
        "data.eval=null", "data.shapes.image_size=56", "data.max_pixels=3136",
        "checkpoint.every=0", "rewards.format=1.0", "rewards.accuracy=1.0"]
VOLATILE = ("seconds", "tokens_per_second", "peak_", "oom_retries", "mfu")


@pytest.fixture
def use_realvocab(realvocab_cache, monkeypatch):
    monkeypatch.setenv("R1FIT_CACHE", str(realvocab_cache))


def test_budget_halves_micro_batch_and_the_redo_is_deterministic(use_realvocab, tmp_path):
    guarded = tmp_path / "guarded"
    assert main(["train", f"train.output_dir={guarded}", *ARGS, "memory.micro_batch=8",
                 "memory.budget=520MiB"]) == 0
    log = (guarded / "log.txt").read_text()
    assert "out of memory in micro_batch (CPU out of memory" in log
    assert "memory.micro_batch 8 -> 4, redoing the step" in log
    [row] = [r for r in read_metrics(guarded / "metrics.jsonl") if "reward_mean" in r]
    # how far it shrinks depends on what glibc hands back between attempts (see the note below)
    assert row["micro_batch"] in (1, 2, 4) and row["oom_retries"] == {4: 1, 2: 2, 1: 3}[
        row["micro_batch"]]
    assert row["generation_batch"] == 64  # generation fitted: only the failing size shrinks
    # the redo restored the RNG: same completions, rewards, loss and gradient as a run that
    # started at the size the guard settled on
    direct = tmp_path / "direct"
    assert main(["train", f"train.output_dir={direct}", *ARGS,
                 f"memory.micro_batch={row['micro_batch']}"]) == 0
    [expected] = [r for r in read_metrics(direct / "metrics.jsonl") if "reward_mean" in r]
    keep = [k for k in expected if not any(v in k for v in VOLATILE)]
    assert {k: row[k] for k in keep} == {k: expected[k] for k in keep}
    assert expected["oom_retries"] == 0


def test_gives_up_at_size_one_with_one_line(use_realvocab, tmp_path, capsys):
    # the weights alone outgrow the budget, so any generation fails: 2 rows of 4 tokens suffice
    # (the 8 x 64 of ARGS spent minutes generating before each check)
    code = main(["train", f"train.output_dir={tmp_path / 'run'}", *ARGS, "algo.num_generations=2",
                 "algo.max_new_tokens=4", "memory.generation_batch=2", "memory.budget=50MiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("r1fit: error: out of memory in generation work even with "
                              "memory.generation_batch=1 (CPU out of memory")


def test_halved_size_is_logged_saved_and_resumed_while_the_config_keeps_the_ask(
        use_tiny_cache, reward_plugin, tmp_path, monkeypatch):
    """An OOM at step 2 halves memory.micro_batch 8 -> 4: the rows log the size in use, the
    checkpoint saves it (the guard's ChunkSizes), a run resumed from that checkpoint continues at
    4 exactly as the uninterrupted run did, and config.json (run and checkpoint) keeps the 8 the
    user asked for."""
    import torch

    from r1fit.train import grpo

    real = grpo.accumulate_policy_gradients

    def out_of_memory_at_step_2(run, rollout, **options):
        if rollout.step == 2 and run.sizes.micro_batch > 4:
            raise torch.OutOfMemoryError("injected: out of memory at micro_batch 8")
        return real(run, rollout, **options)

    monkeypatch.setattr(grpo, "accumulate_policy_gradients", out_of_memory_at_step_2)
    args = ["model.path=builtin:tiny", "train.max_steps=4", "sft.format_warmup_steps=0",
            "train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
            "data.eval=null", "checkpoint.every=2", "checkpoint.keep=0",
            "rewards.lenreward:length=1.0", "memory.micro_batch=8"]
    straight = tmp_path / "straight"
    assert main(["train", f"train.output_dir={straight}", *args]) == 0
    rows = [r for r in read_metrics(straight / "metrics.jsonl") if "reward_mean" in r]
    assert [(r["micro_batch"], r["oom_retries"]) for r in rows] == [(8, 0), (4, 1), (4, 0),
                                                                     (4, 0)]
    for config in (straight / "config.json", straight / "checkpoint-2" / "config.json"):
        assert json.loads(config.read_text())["memory"]["micro_batch"] == 8
    saved = json.loads((straight / "checkpoint-2" / "sizes.json").read_text())
    assert (saved["micro_batch"], saved["asked"]["micro_batch"]) == (4, 8)

    resumed = tmp_path / "resumed"
    assert main(["train", f"train.output_dir={resumed}", *args,
                 f"checkpoint.resume={straight / 'checkpoint-2'}"]) == 0
    again = [r for r in read_metrics(resumed / "metrics.jsonl") if "reward_mean" in r]
    assert [r["micro_batch"] for r in again] == [8, 4, 4, 4]
    keep = [k for k in rows[0] if not any(v in k for v in VOLATILE)]
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in rows]
    assert json.loads((resumed / "config.json").read_text())["memory"]["micro_batch"] == 8
