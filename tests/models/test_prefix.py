"""Shared-prefix and packed log-probs equal the per-row path's, values and gradients, in float64 on the real
tiny Qwen2.5-VL and Qwen3-VL (3-D M-RoPE positions from each model's own get_rope_index), full and
LoRA, with and without gradient checkpointing.

Gradients agree to ~1e-8 relative, not 1e-15: the models' RMSNorm and rotary embeddings compute in
float32 even in a float64 model, so a gradient summed over G completions before such a cast (one
prompt) rounds differently from G gradients cast one by one (G prompts). Row-by-row against
batched per-row gradients, which cast alike, agree to 1e-15."""

from __future__ import annotations

import pytest
import torch

from r1fit.data.batch import collate
from r1fit.models.logprobs import completion_logprobs
from r1fit.models.packing import packing_is_exact
from r1fit.models.prefix import pack_groups, packed_tokens


def case(model_dirs, setup, name: str, *, lora_r: int = 0, checkpointing: bool = False):
    """``setup`` on model ``name``, flattened to rows, with the per-row path's log-probs:
    ``(model, pad, prompts, groups, rows, completions, per_row)``."""
    model, pad, prompts, groups = setup(model_dirs[name], lora_r=lora_r,
                                        checkpointing=checkpointing,
                                        max_pixels=4096 if "qwen3" in name else 3136)
    rows = [p for p, g in zip(prompts, groups) for _ in g]
    completions = [c for g in groups for c in g]
    per_row = completion_logprobs(model, collate(rows, completions, pad), chunk_size=4)
    return model, pad, prompts, groups, rows, completions, per_row


def assert_same_gradients(model, logp, per_row, rows):
    """The gradients of a random weighting of both log-probs agree (see the module's text)."""
    weights = torch.randn(len(rows), logp.shape[1], generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    for a, b in zip(grads(model, logp, weights), grads(model, per_row, weights)):
        assert (a - b).abs().max() <= 1e-6 * max(b.abs().max().item(), 1.0)


def grads(model, logp, weights):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad((logp * weights[:, :logp.shape[1]]).sum(), params)


@pytest.mark.parametrize("name,lora_r,checkpointing", [
    ("tiny", 0, True), ("tiny", 4, False), ("tiny-qwen3vl", 0, False), ("tiny-qwen3vl", 4, True),
    ("tiny-qwen2vl", 0, True), ("tiny-qwen2vl", 4, False)])
def test_equal_to_the_per_row_path(model_dirs, setup, name, lora_r, checkpointing):
    model, pad, prompts, groups, rows, completions, per_row = case(
        model_dirs, setup, name, lora_r=lora_r, checkpointing=checkpointing)
    packed = pack_groups(model, prompts, groups, pad, torch.float64)
    # one packed row per group: the prompt once, its image once
    assert packed.inputs["input_ids"].shape[0] == 2
    assert packed.inputs["image_grid_thw"].shape[0] == 2
    shared = completion_logprobs(model, packed, chunk_size=4)
    torch.testing.assert_close(shared, per_row, rtol=0, atol=1e-10)
    assert_same_gradients(model, shared, per_row, rows)


def test_positions_matter(model_dirs, setup):
    """The check has teeth: 1-D positions instead of the model's 3-D ones change the log-probs."""
    model, pad, prompts, groups = setup(model_dirs["tiny"], lora_r=0, checkpointing=False,
                                        max_pixels=3136)
    packed = pack_groups(model, prompts, groups, pad, torch.float64)
    rows = [p for p, g in zip(prompts, groups) for _ in g]
    per_row = completion_logprobs(model, collate(rows, [c for g in groups for c in g], pad),
                                  chunk_size=4)
    flat = packed.inputs["position_ids"].clone()
    flat[:] = torch.arange(flat.shape[-1])
    packed.inputs["position_ids"] = flat
    with torch.no_grad():
        wrong = completion_logprobs(model, packed, chunk_size=4)
    # a random-weight model is near uniform, so the change is small, but far above 1e-10
    assert (wrong - per_row).abs().max() > 1e-5


@pytest.mark.parametrize("name,lora_r,checkpointing,shared", [
    ("tiny", 0, True, True), ("tiny", 4, False, False), ("tiny", 0, False, False),
    ("tiny-qwen3vl", 0, True, False), ("tiny-qwen3vl", 4, False, True)])
def test_one_packed_row_equals_the_per_row_path(model_dirs, setup, name, lora_r, checkpointing,
                                                shared):
    """memory.micro_batch_tokens: every sequence of the micro-batch in one row, no padding, seen
    through an additive block mask. With sharing each group is one sequence; without, each
    [prompt | completion] is."""
    model, pad, prompts, groups, rows, completions, per_row = case(
        model_dirs, setup, name, lora_r=lora_r, checkpointing=checkpointing)
    if shared:
        packed = pack_groups(model, prompts, groups, pad, torch.float64, one_row=True)
        assert "attention_mask" in packed.inputs
        expected = packed_tokens(prompts, groups)
    else:
        packed = pack_groups(model, rows, [[c] for c in completions], pad, torch.float64,
                             one_row=True)
        assert packed.inputs["attention_mask"].shape == (1, 1, *packed.inputs["input_ids"].shape[1:] * 2)
        expected = packed_tokens(rows, [[c] for c in completions])
    assert packed.inputs["input_ids"].shape == (1, expected)  # no padding column
    assert expected == sum(p.length for p in (prompts if shared else rows)) + sum(
        int(c.shape[0]) for c in completions)
    logp = completion_logprobs(model, packed, chunk_size=4)
    torch.testing.assert_close(logp, per_row, rtol=0, atol=1e-10)
    assert_same_gradients(model, logp, per_row, rows)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3vl"])
def test_varlen_layout_equals_the_per_row_path(model_dirs, setup, name):
    """The layout for flash-attention kernels (varlen): no mask, text positions restarting at 0
    at each sequence (for M-RoPE the first of 4 position rows). Flash attention cannot run here;
    with SDPA transformers builds the block mask from those same positions, so equal log-probs
    show the positions mark each sequence right, the part r1fit builds."""
    model, pad, prompts, groups, rows, completions, per_row = case(model_dirs, setup, name)
    packed = pack_groups(model, rows, [[c] for c in completions], pad, torch.float64,
                         one_row=True, varlen=True)
    assert "attention_mask" not in packed.inputs
    positions = packed.inputs["position_ids"]
    assert positions.shape == (4, 1, packed_tokens(rows, [[c] for c in completions]))
    starts = (positions[0, 0] == 0).nonzero().flatten().tolist()
    lengths = [p.length + int(c.shape[0]) for p, c in zip(rows, completions)]
    assert starts == [sum(lengths[:i]) for i in range(len(rows))]
    with torch.no_grad():
        logp = completion_logprobs(model, packed, chunk_size=4)
    torch.testing.assert_close(logp, per_row, rtol=0, atol=1e-10)


def test_packed_sequences_do_not_see_each_other(model_dirs, setup):
    """The check has teeth: the varlen row without its text positions (the model then sees one
    long sequence, each part attending to the ones before it) gives other log-probs."""
    model, pad, _, _, rows, completions, per_row = case(model_dirs, setup, "tiny")
    packed = pack_groups(model, rows, [[c] for c in completions], pad, torch.float64,
                         one_row=True, varlen=True)
    positions = packed.inputs["position_ids"]
    packed.inputs["position_ids"] = positions[1:]  # without text positions: no sequence starts
    with torch.no_grad():
        leaked = completion_logprobs(model, packed, chunk_size=4)
    assert (leaked - per_row).abs().max() > 1e-5
    assert packing_is_exact(model, rows, [[c] for c in completions], pad, chunk_size=8,
                            one_row=True)
