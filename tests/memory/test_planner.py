"""The memory planner: parts worked out by hand on a small config, the per-token formulas against
what autograd really saves, the budget search, a real 7B config, and what the package imports."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from r1fit.config import ConfigError, load_config
from r1fit.memory import planner
from r1fit.memory.planner import (
    CHAT_TEMPLATE_TOKENS,
    CUDA_ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    PARTS,
    QUESTION_TOKENS,
    SAFETY_MARGIN,
    TextDims,
    cublas_workspaces,
    even_size,
    layer_saved_per_token,
    model_facts,
    plan_memory,
    render,
    render_blocks,
    vision_block_saved_per_patch,
    vision_dims,
)
from r1fit.processes import DistributedError, World, check_split
from r1fit.units import format_bytes

# a real model: r1fit ships its config.json (r1fit/models/configs/), so planning it needs no network
QWEN_7B = "Qwen/Qwen2.5-VL-7B-Instruct"

# the hand-built model: text hidden 32, MLP 64, 2 layers, 4 heads of 8 (2 KV heads), vocab 100,
# untied head; a 1-block vision tower of width 16
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "rope_parameters": {"mrope_section": [1, 1, 2], "rope_type": "default",
                            "rope_theta": 1e6}}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
          "out_hidden_size": 32, "fullatt_block_indexes": [0]}
# by hand: per layer q 32*32+32, k and v 32*16+16 each, o 32*32, gate and up 32*64 each,
# down 64*32, two norms of 32 -> 9,344; embedding and head 100*32 each; final norm 32
TEXT_PARAMS = 2 * (1056 + 528 + 528 + 1024 + 2 * 2048 + 2048 + 64) + 2 * 3200 + 32
# patch embedding 3*2*14*14*16 (no bias); the block: norms 2*16, qkv 16*48+48, proj 16*16+16,
# gate and up 16*32+32 each, down 32*16+16; merger: norm 16, 64*64+64, 64*32+32
VISION_PARAMS = 18816 + (32 + 816 + 272 + 2 * 544 + 528) + (16 + 4160 + 2080)
# LoRA r=8 on every language-model Linear: r * (in + out) summed over q, k, v, o, gate, up, down
LORA_8 = 2 * 8 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only the config.json of the hand-built model (no processor, no weights)."""
    from transformers import Qwen2_5_VLConfig

    folder = tmp_path_factory.mktemp("hand_built")
    Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False,
                     dtype="float32").save_pretrained(folder)
    return folder


def cfg_for(folder: Path, *overrides: str):
    # the demo's settings (24-token completions, 112 px images) that the hand counts assume
    return load_config(None, [f"model.path={folder}", "preset=demo", "train.prompts_per_step=2",
                              "algo.num_generations=8", *overrides])


def test_parameter_counts_match_the_hand_count(small_model):
    facts = model_facts(str(small_model))
    assert facts.params == TEXT_PARAMS + VISION_PARAMS == 52_928
    assert facts.vision_params == VISION_PARAMS
    assert facts.lora_in_plus_out * 8 == LORA_8 == 8_192
    assert facts.lora_layers == 14 and not facts.tied_head


def test_full_fine_tuning_parts_in_float32(small_model):
    plan = plan_memory(cfg_for(small_model, "algo.beta=0.04"), device_type="cpu")
    tensors = model_facts(str(small_model)).param_tensors
    p = plan.parts
    assert p["weights"] == 4 * 52_928
    assert p["gradients"] == 4 * 52_928
    assert p["optimizer"] == 2 * 4 * 52_928 + 4 * tensors  # exp_avg, exp_avg_sq, a step count each
    assert p["reference"] == 4 * 52_928
    assert set(p) == set(PARTS) and p["overhead"] == 0


def test_freeze_vision_and_bfloat16(small_model):
    frozen = plan_memory(cfg_for(small_model, "model.freeze_vision=true"), device_type="cpu")
    assert frozen.parts["gradients"] == 4 * TEXT_PARAMS
    bf16 = plan_memory(cfg_for(small_model, "model.dtype=bfloat16"), device_type="cpu")
    assert bf16.parts["weights"] == 2 * 52_928 and bf16.parts["gradients"] == 2 * 52_928


def test_lora_trains_only_adapters_and_has_no_reference(small_model):
    plan = plan_memory(cfg_for(small_model, "model.lora.r=8", "algo.beta=0.04",
                               "model.dtype=bfloat16"), device_type="cpu")
    p = plan.parts
    assert p["weights"] == 2 * 52_928 + 4 * LORA_8  # adapters stay float32 under peft
    assert p["gradients"] == 4 * LORA_8
    assert p["optimizer"] == 2 * 4 * LORA_8 + 4 * 28  # 14 adapted Linears x (A, B)
    assert p["reference"] == 0  # the policy with adapters off
    full = plan_memory(cfg_for(small_model, "algo.beta=0.04"), device_type="cpu")
    assert p["optimizer"] < full.parts["optimizer"] / 6  # 8,192 of 52,928 parameters train


def test_adapters_in_the_model_dtype_hold_copies_and_save_less(small_model, capsys):
    """model.lora.compute_dtype=model: autocast's bfloat16 copies of the adapters (2 bytes x
    8,192) in the update, fewer saved activations, the same states; nothing on float32."""
    lora = ["model.lora.r=8", "model.dtype=bfloat16", "memory.gradient_checkpointing=false"]
    peft_path = plan_memory(cfg_for(small_model, *lora), device_type="cpu")
    autocast = plan_memory(cfg_for(small_model, *lora, "model.lora.compute_dtype=model"),
                           device_type="cpu")
    assert peft_path.parts["adapter_copies"] == 0
    assert autocast.parts["adapter_copies"] == 2 * LORA_8
    assert autocast.parts["activations"] < peft_path.parts["activations"]
    for name in ("weights", "gradients", "optimizer"):
        assert autocast.parts[name] == peft_path.parts[name]
    render(autocast, cfg_for(small_model, *lora, "model.lora.compute_dtype=model"))
    assert "LoRA adapters in the model's dtype (autocast's copies)" in capsys.readouterr().out
    fp32 = plan_memory(cfg_for(small_model, "model.lora.r=8", "model.lora.compute_dtype=model"),
                       device_type="cpu")
    assert fp32.parts["adapter_copies"] == 0
    assert fp32.parts == plan_memory(cfg_for(small_model, "model.lora.r=8"),
                                     device_type="cpu").parts


def test_beta_zero_drops_the_reference(small_model):
    assert plan_memory(cfg_for(small_model, "algo.beta=0"), device_type="cpu").parts[
        "reference"] == 0


def test_checkpointing_lowers_activations_and_both_are_reported(small_model):
    on = plan_memory(cfg_for(small_model, "memory.gradient_checkpointing=true"),
                     device_type="cpu")
    off = plan_memory(cfg_for(small_model, "memory.gradient_checkpointing=false"),
                      device_type="cpu")
    assert on.parts["activations"] < off.parts["activations"]
    assert on.activations_by_checkpointing == off.activations_by_checkpointing
    assert on.activations_by_checkpointing["on"] == on.parts["activations"]
    assert off.activations_by_checkpointing["off"] == off.parts["activations"]


def test_doubling_micro_batch_doubles_activations(small_model):
    four = plan_memory(cfg_for(small_model, "memory.micro_batch=4"), device_type="cpu")
    eight = plan_memory(cfg_for(small_model, "memory.micro_batch=8"), device_type="cpu")
    assert eight.parts["activations"] / four.parts["activations"] == pytest.approx(2, rel=0.02)


def test_share_prefix_auto_is_planned_as_the_larger_path(small_model):
    """'auto' picks its path on the first micro-batch, after the plan: the plan holds for both.
    Here (no processor: the prompt estimate, 103 tokens, G = 8 in one micro-batch) packing saves
    7 prompts' activations and tower; with 512-token completions its [width x width] mask (4,199
    wide) outweighs that on this 32-wide model."""
    def plans(*overrides: str) -> dict[str, Any]:
        return {v: plan_memory(cfg_for(small_model, "memory.micro_batch=8",
                                       f"memory.share_prefix={v}", *overrides),
                               device_type="cpu") for v in ("false", "true", "auto")}

    chosen = set()
    for overrides in ((), ("algo.max_new_tokens=512",)):
        p = plans(*overrides)
        assert p["auto"].peak_bytes == max(p["true"].peak_bytes, p["false"].peak_bytes)
        larger = "true" if p["true"].phases["update"] >= p["false"].phases["update"] else "false"
        assert p["auto"].details["share_prefix"] == (
            f"auto (planned {'on' if larger == 'true' else 'off'})")
        assert p["true"].details["share_prefix"] == "on"
        chosen.add(larger)
    assert chosen == {"true", "false"}  # each case picks a different path


def test_prompt_estimate_and_kv_cache_without_a_processor(small_model):
    plan = plan_memory(cfg_for(small_model, "memory.generation_batch=4",
                               "algo.max_new_tokens=24"), device_type="cpu")
    d = plan.details
    # builtin:shapes images are 112 px: 4 x 4 tokens of 28 px; + vision start/end tokens
    assert d["image_tokens"] == 16 and d["vision_patches"] == 64
    assert d["prompt_tokens"] == CHAT_TEMPLATE_TOKENS + QUESTION_TOKENS + 2 + 16
    length = d["prompt_tokens"] + 24
    # rows x length x layers x (K and V) x kv heads x head dim x float32
    assert d["kv_cache"] == 4 * length * 2 * 2 * 2 * 8 * 4


def test_cuda_adds_workspaces_context_and_slack_cpu_does_not(small_model, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cfg = cfg_for(small_model, "rollout.engine=hf")  # auto would pick another engine on CUDA
    cpu, cuda = plan_memory(cfg, device_type="cpu"), plan_memory(cfg, device_type="cuda")
    assert cpu.parts["overhead"] == 0 and cpu.parts["workspaces"] == 0
    # two threads (forward, autograd's backward) x cuBLAS's 32 MiB Hopper default, allocated
    assert cuda.parts["workspaces"] == 64 << 20
    allocated = cpu.peak_bytes + (64 << 20)
    assert cuda.peak_bytes == allocated + CUDA_CONTEXT_BYTES + int(CUDA_ALLOCATOR_SLACK * allocated)


@pytest.mark.parametrize(("env", "mib"), [
    (None, 64),  # cuBLAS's Hopper default, and r1fit's train.deterministic (:4096:8): 4 MiB x 8
    (":16:8", 0.25), (":4096:2:16:8", 16.25),  # PyTorch sums SIZE KiB x COUNT
])
def test_cublas_workspaces_follow_the_environment(monkeypatch, env, mib):
    if env is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", env)
    assert cublas_workspaces() == int(mib * (1 << 20))


def test_max_micro_batch_respects_the_budget(small_model):
    def plan(micro: int, budget: int | None = None):
        cfg = cfg_for(small_model, f"memory.micro_batch={micro}", "memory.generation_batch=1",
                      "memory.gradient_checkpointing=false", "data.eval=null")
        return plan_memory(cfg, device_memory_bytes=budget, device_type="cpu")

    low, high = plan(1).peak_bytes, plan(16).peak_bytes
    budget = int((low + (high - low) / 3) / (1 - SAFETY_MARGIN))
    best = plan(16, budget).max_micro_batch
    assert 1 <= best < 16
    assert plan(best, budget).fits
    above = 1 << best.bit_length()  # the next power of two
    assert not plan(above, budget).fits
    assert plan(above, budget).max_micro_batch == best


def test_an_evaluation_is_planned_at_eval_batch_rows_of_its_own_completions(small_model):
    """Generate on the policy (hf): an evaluation generates eval.batch greedy rows, one per
    prompt, so the generation phase is the larger of the step's chunk and that; when it sets a
    peak over the budget, the advice lowers eval.batch. r1fit sft evaluates with
    algo.max_new_tokens (its answers are cut at sft.max_answer_tokens): planned so."""
    def plan(*extra: str, budget: int | None = None, kind: str = "grpo"):
        cfg = cfg_for(small_model, "rollout.engine=hf", "memory.generation_batch=2", *extra)
        return plan_memory(cfg, device_memory_bytes=budget, device_type="cpu", kind=kind)

    none, few, many = (plan("data.eval=null"), plan("eval.batch=4"), plan("eval.batch=64"))
    assert none.phases["update"] == few.phases["update"] == many.phases["update"]
    assert none.phases["generation"] <= few.phases["generation"] < many.phases["generation"]
    assert many.peak_phase == "generation"
    budget = int(max(few.peak_bytes, 1.05 * none.peak_bytes) / (1 - SAFETY_MARGIN))
    tight = plan("eval.batch=64", budget=budget)
    assert not tight.fits and any(
        line.startswith("eval.batch=") and line.endswith(
            "(now 64: the evaluation's generation sets the peak)") for line in tight.advice)
    fitting = int(next(a for a in tight.advice if a.startswith("eval.batch="))
                  .split("=")[1].split()[0])
    assert plan(f"eval.batch={fitting}", budget=budget).fits
    # r1fit sft: the evaluation's completions, not the answers', set its generation
    short, long = (plan("sft.max_answer_tokens=8", f"algo.max_new_tokens={n}", kind="sft")
                   for n in (16, 2048))  # long enough for the KV cache to outgrow the tower
    assert short.phases["update"] == long.phases["update"]
    assert short.phases["generation"] < long.phases["generation"]
    assert any("the evaluation's completions 2048" in note for note in long.notes)


def test_auto_sizes_are_planned_at_what_auto_picks(small_model):
    cfg = cfg_for(small_model, "memory.gradient_checkpointing=false")
    budget = plan_memory(cfg_for(small_model, "memory.micro_batch=4",
                                 "memory.gradient_checkpointing=false"),
                         device_type="cpu").peak_bytes * 2
    cfg = cfg.with_values({"memory.micro_batch": "auto", "memory.generation_batch": "auto"})
    plan = plan_memory(cfg, device_memory_bytes=budget, device_type="cpu")
    assert plan.details["auto"] == ["micro_batch", "generation_batch"]
    rows = plan.details["rows_per_gpu"]
    assert plan.max_micro_batch >= 4 and plan.fits
    # the fewest micro-batches the largest allows, evenly filled: as many, never larger
    picked, group = plan.details["micro_batch"], plan.details["group"]
    assert group == 8  # algo.num_generations
    assert picked == even_size(plan.max_micro_batch, rows, group) <= plan.max_micro_batch
    assert -(-rows // picked) == -(-rows // plan.max_micro_batch)
    assert plan.details["generation_batch"] == even_size(plan.max_generation_batch, rows, group)
    # and the even size's peak is no higher than the largest's
    largest = plan_memory(cfg.with_values({"memory.micro_batch": plan.max_micro_batch}),
                          device_memory_bytes=budget, device_type="cpu")
    assert plan.phases["update"] <= largest.phases["update"]


@pytest.mark.parametrize(("largest", "rows", "picked"), [
    (105, 128, 64),  # 2 chunks: 64 + 64, not 105 + 23
    (93, 128, 64),
    (10, 128, 10),  # 13 chunks either way: 12 x 10 + 8
    (128, 128, 128), (200, 128, 128),
    (4, 7, 4), (3, 7, 3), (6, 7, 4),  # 7 rows: 2 chunks of at most 6 -> 4 + 3
    (1, 5, 1), (0, 128, 0),
])
def test_even_size_is_the_fewest_chunks_evenly_filled(largest, rows, picked):
    assert even_size(largest, rows) == picked


@pytest.mark.parametrize(("largest", "rows", "group", "picked"), [
    (50, 128, 8, 48),  # 3 chunks: 48, 48, 32 in whole groups, not 43, 43, 42
    (105, 128, 8, 64), (93, 128, 8, 64),  # already whole groups
    (10, 128, 8, 10),  # a group does not fit: as without groups
    (44, 128, 8, 43),  # 48 would not fit: 43
    (128, 128, 8, 128), (7, 16, 4, 6),  # 3 chunks of at most 7: 6 (not 8: too large)
])
def test_even_size_takes_whole_groups_where_they_fit(largest, rows, group, picked):
    assert even_size(largest, rows, group) == picked
    assert -(-rows // picked) == -(-rows // largest)  # never more chunks


def test_nothing_fits_gives_switches(small_model):
    plan = plan_memory(cfg_for(small_model, "memory.gradient_checkpointing=false",
                               "algo.beta=0.04"), device_memory_bytes=1 << 20, device_type="cpu")
    assert not plan.fits and plan.max_micro_batch == 0
    switches = " ".join(plan.advice)
    for key in ("memory.gradient_checkpointing=true", "model.lora.r=16", "algo.beta=0"):
        assert key in switches


def test_a_smaller_head_chunk_is_a_switch_when_a_row_fills_it(tmp_path):
    """Long completions and Qwen's vocabulary: one row's 1,024 tokens fill the LM head's chunk,
    and the advice tries memory.logits_chunk=256 at micro_batch = generation_batch = 1."""
    from transformers import Qwen2_5_VLConfig

    vocab = 151_936
    Qwen2_5_VLConfig(text_config={**TEXT, "vocab_size": vocab}, vision_config=VISION,
                     tie_word_embeddings=False, dtype="float32").save_pretrained(tmp_path)
    # the head that recomputes its chunks, whose 'auto' chunk is 1,024 tokens (the fused head's
    # is 256 already: nothing to advise, below)
    long = ("algo.max_new_tokens=1024", "memory.micro_batch=1", "memory.generation_batch=1",
            "memory.fused_loss=false", "data.eval=null")  # no 64-row evaluation to set the peak
    plan = plan_memory(cfg_for(tmp_path, *long), device_memory_bytes=1 << 20, device_type="cpu")
    smaller = plan_memory(cfg_for(tmp_path, *long, "memory.logits_chunk=256"),
                          device_memory_bytes=1 << 20, device_type="cpu")
    (line,) = [a for a in plan.advice if a.startswith("memory.logits_chunk=")]
    assert line == (f"memory.logits_chunk=256: peak {format_bytes(smaller.peak_bytes)} at "
                    "micro_batch = generation_batch = 1 (still does not fit)")
    # 768 tokens fewer of float32 logits in the head's chunk (the head is most of this model)
    assert plan.peak_bytes - smaller.peak_bytes >= 768 * vocab * 4
    # nothing to gain: a chunk already at 256, or rows of 256 tokens or fewer
    for extra in (("memory.logits_chunk=256",), ("algo.max_new_tokens=256",),
                  ("memory.fused_loss=auto",)):
        again = plan_memory(cfg_for(tmp_path, *long, *extra), device_memory_bytes=1 << 20,
                            device_type="cpu")
        assert not any("logits_chunk" in a for a in again.advice)
    # full fine-tuning of the 7B with 512-token completions: the head's chunk is not what sets
    # the peak at micro_batch 1 (a 256-token chunk plans the same peak), so it is not advised
    # (the README's example: the LoRA config's settings, full fine-tuning)
    seven = load_config(Path(__file__).parents[2] / "configs" / "qwen2.5-vl-3b-lora.yaml",
                        [f"model.path={QWEN_7B}", "model.lora.r=0", "algo.num_generations=8",
                         "memory.logits_chunk=1024"])
    assert seven.algo.max_new_tokens == 512 and seven.head_chunk() == 1024
    plan = plan_memory(seven, device_memory_bytes=80 << 30, device_type="cuda")
    assert not plan.fits and plan.advice and not any("logits_chunk" in a for a in plan.advice)
    one = seven.with_values({"memory.micro_batch": 1, "memory.generation_batch": 1})
    assert (plan_memory(one, device_type="cuda").peak_bytes
            == plan_memory(one.with_values({"memory.logits_chunk": 256}),
                           device_type="cuda").peak_bytes)


def test_a_smaller_image_switch_lowers_min_pixels_too(small_model):
    # a quarter of max_pixels (12,544) is below min_pixels: both move, or the config is invalid
    plan = plan_memory(cfg_for(small_model, "data.min_pixels=12544"),
                       device_memory_bytes=1 << 20, device_type="cpu")
    assert any(a.startswith("data.max_pixels=3136 data.min_pixels=3136: peak ")
               for a in plan.advice)


# --- FSDP2 over several GPUs (--gpus N)

# FSDP units of the hand-built model, by hand: a decoder layer (9,344, as above), the vision block
# (norms 32, qkv 816, proj 272, gate and up 544 each, down 528), and the root's own parameters:
# embedding and head 3,200 each, final norm 32, patch embedding 18,816, merger 6,256
LAYER, BLOCK = 9_344, 2_736
ROOT_VISION = 18_816 + 6_256
ROOT = 2 * 3_200 + 32 + ROOT_VISION
LORA_8_LAYER = LORA_8 // 2  # one decoder layer's adapters


def meta_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))


def fsdp2_shard(params: Any, n: int) -> int:
    """Elements of rank 0's FSDP2 shard: each tensor split along dim 0, padded to ceil(rows/n)."""
    return sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) for p in params)


def test_units_match_the_hand_count(small_model):
    model = meta_model(small_model)
    layers, blocks = model.model.language_model.layers, model.model.visual.blocks
    assert [sum(p.numel() for p in unit.parameters()) for unit in layers] == [LAYER, LAYER]
    assert sum(p.numel() for p in blocks[0].parameters()) == BLOCK
    assert ROOT == TEXT_PARAMS + VISION_PARAMS - 2 * LAYER - BLOCK == 31_504
    facts = model_facts(str(small_model))
    assert (facts.layer_params, facts.vision_block_params, facts.root_params,
            facts.root_vision_params) == (LAYER, BLOCK, ROOT, ROOT_VISION)


def test_fsdp_shards_weights_gradients_optimizer_and_reference(small_model):
    cfg = cfg_for(small_model, "algo.beta=0.04")
    tensors = model_facts(str(small_model)).param_tensors
    # every dim 0 of the hand-built model (16, 32, 48, 64, 100, ...) divides by 4: exact quarters
    p = plan_memory(cfg, device_type="cpu", gpus=4).parts
    assert p["weights"] == p["gradients"] == p["reference"] == 4 * 52_928 // 4
    assert p["optimizer"] == 2 * 4 * 52_928 // 4 + 4 * tensors  # one step count per local tensor
    # by 3 they do not: each rank's piece is padded to ceil(rows / 3) rows (100 -> 34, ...)
    params = list(meta_model(small_model).parameters())
    shard = fsdp2_shard(params, 3)
    assert shard > math.ceil(52_928 / 3)
    p = plan_memory(cfg, device_type="cpu", gpus=3).parts
    assert p["weights"] == p["gradients"] == p["reference"] == 4 * shard
    assert p["optimizer"] == 2 * 4 * shard + 4 * tensors
    frozen = plan_memory(cfg_for(small_model, "model.freeze_vision=true"), device_type="cpu",
                         gpus=3).parts
    visual = list(meta_model(small_model).model.visual.parameters())
    assert frozen["gradients"] == 4 * (shard - fsdp2_shard(visual, 3))


def test_fsdp_shards_lora_adapters(small_model):
    lora = plan_memory(cfg_for(small_model, "model.lora.r=8", "model.dtype=bfloat16"),
                       device_type="cpu", gpus=4).parts
    # lora_A is [8 x in], lora_B [out x 8]: every dim 0 divides by 4
    assert lora["weights"] == 2 * 52_928 // 4 + 4 * LORA_8 // 4
    assert lora["gradients"] == 4 * LORA_8 // 4


def test_fsdp_all_gather_is_the_root_and_two_units(small_model):
    model = meta_model(small_model)
    layer = sum(p.numel() for p in model.model.language_model.layers[0].parameters())
    block = sum(p.numel() for p in model.model.visual.blocks[0].parameters())
    root = (sum(p.numel() for p in model.parameters())
            - sum(p.numel() for p in model.model.language_model.layers.parameters())
            - sum(p.numel() for p in model.model.visual.blocks.parameters()))
    full = plan_memory(cfg_for(small_model), device_type="cpu", gpus=2)
    # the root stays gathered through forward and backward; a unit and the next one with it
    assert full.parts["all_gather"] == 4 * (root + 2 * max(layer, block)) == 4 * 50_192
    assert full.details["fsdp_units"] == {"decoder_layer": 4 * LAYER, "vision_block": 4 * BLOCK,
                                          "root": 4 * ROOT}
    # reduce-scatter copies the largest trainable unit's gradients: the root (head, embedding)
    assert full.parts["reduce_scatter"] == 4 * ROOT
    frozen = plan_memory(cfg_for(small_model, "model.freeze_vision=true"), device_type="cpu",
                         gpus=2)
    assert frozen.parts["reduce_scatter"] == 4 * max(LAYER, ROOT - ROOT_VISION) == 4 * LAYER
    lora = plan_memory(cfg_for(small_model, "model.lora.r=8", "model.dtype=bfloat16"),
                       device_type="cpu", gpus=2)
    assert lora.parts["all_gather"] == 2 * ROOT + 2 * (2 * LAYER + 4 * LORA_8_LAYER)
    assert lora.parts["reduce_scatter"] == 4 * LORA_8_LAYER  # only adapters train


def test_fsdp_generation_gathers_the_whole_policy(small_model):
    cfg = cfg_for(small_model, "algo.beta=0.04", "memory.generation_batch=8")
    one = plan_memory(cfg, device_type="cpu")
    four = plan_memory(cfg, device_type="cpu", gpus=4)
    p = four.parts
    # every parameter whole, beside its shard (FSDP2 keeps the shards while unsharded)
    assert p["unsharded_weights"] == one.parts["weights"] == 4 * 52_928
    assert p["generation"] > 4 * ROOT  # so the gathering itself is not the phase's peak
    assert four.phases["generation"] == (four.details["persistent"] + p["unsharded_weights"]
                                         + p["generation"])
    # the shards + the step's inputs on this GPU: both prompts' 64 patches of 1,176 float32 pixel
    # values (every GPU encodes the whole step), old/reference log-probs of 4 rows x 24 tokens
    assert four.details["persistent"] == (p["weights"] + p["optimizer"] + p["reference"]
                                          + 2 * 64 * 1176 * 4 + 2 * 4 * 24 * 4)
    o = one.parts
    assert one.details["persistent"] == (o["weights"] + o["optimizer"] + o["reference"]
                                         + 2 * 64 * 1176 * 4 + 2 * 16 * 24 * 4)
    assert one.phases["generation"] == one.details["persistent"] + o["generation"]


def test_fsdp_splits_a_steps_rows_over_the_gpus(small_model):
    cfg = cfg_for(small_model, "memory.micro_batch=2", "memory.generation_batch=16")
    one, four = plan_memory(cfg, device_type="cpu"), plan_memory(cfg, device_type="cpu", gpus=4)
    assert one.details["rows_per_gpu"] == one.details["rows_per_step"] == 16
    assert four.details["rows_per_gpu"] == 4 and four.details["rows_per_step"] == 16
    assert four.details["micro_batches_per_update"] == 2  # 4 rows, 2 at a time
    assert four.details["generation_batch"] == 4  # a chunk cannot exceed this GPU's rows
    assert four.max_micro_batch <= 4 and four.max_generation_batch <= 4


def test_rows_that_do_not_split_over_the_gpus_are_a_problem_with_the_sizes_that_do(small_model,
                                                                                   capsys):
    # 2 prompts x 8 = 16 rows and the warm-up's sft.batch_size 16 over 3 GPUs: the run refuses
    # to start (r1fit.processes.check_split), so the plan does not fit, whatever its peak
    cfg = cfg_for(small_model, "memory.micro_batch=2", "memory.generation_batch=16")
    three = plan_memory(cfg, device_type="cpu", gpus=3)
    assert three.peak_bytes <= three.budget_bytes and not three.fits
    assert three.problems == [
        "16 rows (train.prompts_per_step x algo.num_generations) do not split evenly over 3 "
        "processes; make it a multiple of 3",
        "16 rows (sft.batch_size (the format warm-up)) do not split evenly over 3 processes; "
        "make it a multiple of 3"]
    assert three.advice == ["train.prompts_per_step=3 (now 2: 24 rows split over 3 GPUs)",
                            "sft.batch_size=18 (now 16)"]
    # the run's own check says the same of the same config
    with pytest.raises(DistributedError, match=re.escape(three.problems[0])):
        check_split(cfg, "grpo", World(size=3))
    assert plan_memory(cfg, device_type="cpu", gpus=4).problems == []  # 16 and 16 split over 4
    sft = plan_memory(cfg_for(small_model, "sft.batch_size=5"), device_type="cpu", gpus=2,
                      kind="sft")
    assert sft.problems == ["5 rows (sft.batch_size) do not split evenly over 2 processes; make "
                            "it a multiple of 2"] and sft.advice[-1] == "sft.batch_size=6 (now 5)"


def test_fsdp_on_cuda_gathers_float32_in_bfloat16_and_reduces_in_float32(small_model):
    # r1fit/distributed/parallelize.py: MixedPrecisionPolicy(param_dtype=bfloat16 for float32
    # weights, reduce_dtype=float32) on CUDA
    f32 = plan_memory(cfg_for(small_model), device_type="cuda", gpus=2).parts
    assert f32["weights"] == 4 * 52_928 // 2  # the shards stay float32
    assert f32["all_gather"] == 2 * (ROOT + 2 * LAYER)
    assert f32["unsharded_weights"] == 2 * 52_928
    assert f32["reduce_scatter"] == 4 * ROOT
    bf16 = plan_memory(cfg_for(small_model, "model.dtype=bfloat16"), device_type="cuda",
                       gpus=2).parts
    assert bf16["all_gather"] == f32["all_gather"] and bf16["reduce_scatter"] == 4 * ROOT


def test_one_gpu_has_no_fsdp_parts_and_more_gpus_say_so(small_model, capsys):
    from r1fit.memory.planner.printing import _LABELS

    cfg = cfg_for(small_model)
    one, two = plan_memory(cfg, device_type="cpu"), plan_memory(cfg, device_type="cpu", gpus=2)
    assert all(one.parts[name] == 0 for name in planner.FSDP_PARTS)
    assert not any("FSDP" in n for n in one.notes)
    assert any("per GPU, FSDP2 over 2 GPUs" in n for n in two.notes)
    assert two.details["gpus"] == 2
    planner.render(two, cfg)
    out = capsys.readouterr().out
    assert "per GPU, FSDP over 2 GPUs" in out and "weights, 1/2 shard" in out
    for name in planner.FSDP_PARTS:
        assert _LABELS[name] in out
    planner.render(one, cfg)
    out = capsys.readouterr().out
    assert "FSDP" not in out and "one cpu device" in out


# --- the per-token formulas against what autograd saves (the slow, obvious reference)


def saved_by_layer_one(dtype: torch.dtype, lora_r: int, padded: bool,
                       target: str = "all-linear", adapters_in_dtype: bool = False
                       ) -> tuple[float, int]:
    """Bytes per token that decoder layer 1 saves for backward in r1fit's log-prob forward
    (``adapters_in_dtype``: with model.lora.compute_dtype=model's autocast)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from r1fit.data.batch import Batch
    from r1fit.models.load import language_model_lora_regex
    from r1fit.models.logprobs import CompletionLogProbs
    from r1fit.train.forward import completion_logprobs

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    model = Qwen2_5_VLForConditionalGeneration(config).to(dtype).train()
    if lora_r:
        model = get_peft_model(model, LoraConfig(
            r=lora_r, target_modules=language_model_lora_regex(target)))
    layers = (model.get_base_model() if lora_r else model).get_decoder().layers
    first_saver, pack = first_savers(model, layers)

    rows, length = 2, 20
    ids = torch.randint(0, 90, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[0, -5:] = 0
    batch = Batch({"input_ids": ids, "attention_mask": mask}, 10, ids[:, 10:],
                  mask[:, 10:].float())
    root = CompletionLogProbs(model, adapter_dtype=dtype if adapters_in_dtype else None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(root, batch, chunk_size=8)
    return sum(n for i, n in first_saver.values() if i == 1) / (rows * length), length


DIMS = TextDims(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=100)
ALL = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("dtype,lora_r,padded,target", [
    (torch.float32, 0, False, ""), (torch.float32, 0, True, ""), (torch.bfloat16, 0, True, ""),
    (torch.float32, 8, True, "all-linear"), (torch.bfloat16, 8, False, "all-linear"),
    (torch.bfloat16, 4, True, "q_proj,v_proj,down_proj")])
def test_layer_formula_matches_saved_tensors(dtype, lora_r, padded, target):
    measured, length = saved_by_layer_one(dtype, lora_r, padded, target or "all-linear")
    b = 4 if dtype == torch.float32 else 2
    targets = (ALL if target == "all-linear" else tuple(target.split(","))) if lora_r else None
    planned = layer_saved_per_token(DIMS, b, lora_targets=targets, lora_r=lora_r,
                                    mask_len=length if padded else 0)
    assert planned == measured


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("padded,target", [(False, "all-linear"), (True, "q_proj,v_proj,down_proj")])
def test_layer_formula_with_adapters_in_bfloat16(padded, target):
    """model.lora.compute_dtype=model: the adapters save the layer's own bfloat16 inputs and
    outputs, and autograd keeps autocast's bfloat16 copies of their weights (the plan's
    adapter_copies, per layer: 2 bytes x r x (in + out) of each adapted Linear)."""
    r = 8
    measured, length = saved_by_layer_one(torch.bfloat16, r, padded, target,
                                          adapters_in_dtype=True)
    targets = ALL if target == "all-linear" else tuple(target.split(","))
    planned = layer_saved_per_token(DIMS, 2, lora_targets=targets, lora_r=r,
                                    mask_len=length if padded else 0, adapter_bytes=2)
    widths = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
              "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}
    copies = sum(2 * r * (widths[name][0] + widths[name][1]) for name in targets)
    tokens = 2 * length
    assert planned * tokens + copies == measured * tokens
    # and less than peft's float32 path saves
    assert planned < layer_saved_per_token(DIMS, 2, lora_targets=targets, lora_r=r,
                                           mask_len=length if padded else 0)


def test_layer_formula_by_hand():
    # float32, full fine-tuning, no padding: 6 x hidden (norm inputs, normalised values, outputs),
    # q, k, v, output (2 x 32 + 2 x 16), 4 log-sum-exps, 4 x MLP width, 2 x 1/rms; in floats
    floats = 6 * 32 + (2 * 32 + 2 * 16) + 4 + 4 * 64 + 2
    assert layer_saved_per_token(DIMS, 4) == 4 * floats


def saved_by_vision_block_one(kind: str, dtype: torch.dtype) -> tuple[float, object]:
    """Bytes per patch that vision block 1 saves for backward when the tower trains."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "qwen2.5-vl":
        config = Qwen2_5_VLConfig(text_config=TEXT, vision_config={**VISION, "depth": 2})
        model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        config = Qwen2VLConfig(text_config=TEXT, vision_config={
            "depth": 2, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 2, "hidden_size": 32})
        model = Qwen2VLForConditionalGeneration(config)
    visual = model.to(dtype).train().model.visual
    first_saver, pack = first_savers(model, visual.blocks)

    grid = torch.tensor([[1, 8, 8], [1, 4, 8]])  # two images: 64 + 32 patches
    pixels = torch.randn(96, 3 * 2 * 14 * 14, dtype=dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        visual(pixels, grid_thw=grid)
    return sum(n for i, n in first_saver.values() if i == 1) / 96, vision_dims(config, visual)


@pytest.mark.parametrize("kind,dtype", [("qwen2.5-vl", torch.float32),
                                        ("qwen2.5-vl", torch.bfloat16),
                                        ("qwen2-vl", torch.float32)])
def test_vision_block_formula_matches_saved_tensors(kind, dtype):
    measured, dims = saved_by_vision_block_one(kind, dtype)
    b = 4 if dtype == torch.float32 else 2
    assert vision_block_saved_per_patch(dims, b) == measured


# --- a real model


def test_qwen25_vl_7b_full_breakdown(capsys):
    from r1fit.cli import main

    assert main(["plan", QWEN_7B, "algo.num_generations=8", "rollout.engine=hf",
                 "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    for label in ("weights", "gradients", "optimizer (AdamW)", "reference model", "activations",
                  "LM head chunk", "vision encoder", "generation (KV cache + logits)", "peak"):
        assert label in out
    assert out.startswith(f"r1fit plan: {QWEN_7B} (8.29B parameters, bfloat16: model.dtype=auto, "
                          "from config.json), full fine-tuning")
    assert "of 80.00 GiB" in out


def test_auto_plans_the_7b_in_its_own_bfloat16():
    auto, bf16, f32 = (plan_memory(load_config(None, [f"model.path={QWEN_7B}", *dtype]))
                       for dtype in ([], ["model.dtype=bfloat16"], ["model.dtype=float32"]))
    params = auto.details["params"]
    assert 8.2e9 < params < 8.4e9
    assert auto.parts["weights"] == bf16.parts["weights"] == 2 * params
    assert auto.parts == bf16.parts and auto.peak_bytes == bf16.peak_bytes
    assert f32.parts["weights"] == 4 * params  # what the float32 default used to plan


def test_plan_a_hub_id_offline(tmp_path):
    """`r1fit plan HUB_ID` with HF_HUB_OFFLINE=1 and an empty Hugging Face cache: a shipped config
    plans; any other id is a one-line error (exit 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))

    def plan(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "r1fit", "plan", model], env=env,
                              capture_output=True, text=True, timeout=600)

    shipped = plan(QWEN_7B)
    assert shipped.returncode == 0, shipped.stderr
    assert shipped.stdout.startswith(f"r1fit plan: {QWEN_7B} (8.29B parameters, bfloat16: "
                                     "model.dtype=auto, from config.json)")
    assert "\npeak " in shipped.stdout and "largest memory.micro_batch that fits" in shipped.stdout
    unknown = plan("nobody-r1fit/not-a-model")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr == (
        "r1fit: error: cannot get the config.json of 'nobody-r1fit/not-a-model': offline "
        "(HF_HUB_OFFLINE) and it is not in the Hugging Face cache; only that file is needed (no "
        "weights): point model.path at a local folder holding it\n")


@pytest.mark.parametrize("lora_r", [0, 16])
def test_qwen25_vl_7b_more_gpus_lower_the_peak(lora_r):
    cfg = load_config(None, [f"model.path={QWEN_7B}", f"model.lora.r={lora_r}",
                             "algo.num_generations=8", "algo.max_new_tokens=512"])
    one = plan_memory(cfg, device_memory_bytes=80 << 30)
    eight = plan_memory(cfg, device_memory_bytes=80 << 30, gpus=8)
    assert eight.peak_bytes < one.peak_bytes
    # a micro-batch cannot exceed a GPU's share of the step's rows (32 prompts x 8 / 8 GPUs)
    assert eight.details["rows_per_gpu"] == 32
    assert eight.max_micro_batch >= min(one.max_micro_batch, 32)
    if lora_r == 0:  # full fine-tuning of 7B does not fit one 80 GiB GPU, and fits on eight
        assert not one.fits and one.max_micro_batch == 0
        assert eight.fits and eight.max_micro_batch >= 1
        assert eight.peak_phase == "generation"  # the whole policy, gathered
        assert eight.parts["unsharded_weights"] == 2 * eight.details["params"]


def test_builtin_prompt_is_encoded_by_its_processor(use_tiny_cache):
    plan = plan_memory(load_config(None, ["data.shapes.image_size=56", "data.max_pixels=3136"]),
                       device_type="cpu")
    assert plan.details["prompt_estimate"].startswith("encoded by the model's processor")
    assert plan.details["image_tokens"] == 4 and plan.details["vision_patches"] == 16


QWEN_3B_CONFIG = "/work/shared/model-configs/Qwen2.5-VL-3B-Instruct"  # config.json only


@pytest.mark.skipif(not Path(QWEN_3B_CONFIG).is_dir(), reason="the shared model configs are absent")
def test_tools_plan_a_whole_trajectory_of_images(capsys):
    """Qwen2.5-VL-3B (36 layers, 2 KV heads of 128, bfloat16): with tools a row is the prompt plus
    a trajectory of rollout.max_turns x algo.max_new_tokens tokens (or
    rollout.max_trajectory_tokens), and each row of a micro-batch runs data.max_images images at
    data.max_pixels through the tower; without tools the rollout's budgets change nothing."""
    import dataclasses

    base = load_config(None, [f"model.path={QWEN_3B_CONFIG}", "train.prompts_per_step=2",
                              "algo.num_generations=4", "algo.max_new_tokens=64",
                              "memory.share_prefix=false", "memory.micro_batch=2",
                              "memory.generation_batch=4", "data.max_images=3",
                              "data.max_pixels=50176", "rollout.max_turns=3"])

    def plan(cfg):  # a budget everything fits: no advice, which would re-check the config
        return plan_memory(cfg, device_memory_bytes=1 << 50, device_type="cpu")

    # set past the config's checks, which may still refuse tools
    with_tools = dataclasses.replace(base, tools=("crop", "zoom"))
    plain, tools = plan(base), plan(with_tools)
    capped = plan(dataclasses.replace(with_tools, rollout=dataclasses.replace(
        base.rollout, max_trajectory_tokens=100)))
    # the prompt (estimated: no processor beside config.json) is the same: 3 shapes images of
    # 112 px, 4 x 4 tokens of 28 px each, 4 patches a token
    prompt = CHAT_TEMPLATE_TOKENS + QUESTION_TOKENS + 2 * 3 + 3 * 16
    for p in (plain, tools, capped):
        assert p.details["prompt_tokens"] == prompt and p.details["vision_patches"] == 3 * 64
    assert [p.details["completion_tokens"] for p in (plain, tools, capped)] == [64, 3 * 64, 100]
    # each row's images: its prompt's; with tools 3 images of 224 x 224 px: 8 x 8 tokens
    assert plain.details["row_vision_patches"] == 192
    assert tools.details["row_vision_patches"] == 3 * 64 * 4 == 768
    # KV cache of a generation chunk of 4 rows: 36 layers x K and V x 2 x 128 x 2 bytes a token
    per_token = 36 * 2 * 2 * 128 * 2
    assert plain.details["kv_cache"] == 4 * (prompt + 64) * per_token
    assert tools.details["kv_cache"] == 4 * (prompt + 192) * per_token
    assert capped.details["kv_cache"] == 4 * (prompt + 100) * per_token
    # the vision tower's saved activations grow with a micro-batch's patches: 2 x 768, not 2 x 192
    assert tools.parts["vision"] * 192 == plain.parts["vision"] * 768
    # the step keeps its 8 rows' trajectory pixel values (float32, 1,176 a patch) and the
    # old/reference log-probs of 192 tokens instead of 64
    assert tools.parts["inputs"] - plain.parts["inputs"] == 8 * 768 * 1176 * 4 + 2 * 8 * 128 * 4
    assert tools.peak_bytes > capped.peak_bytes > plain.peak_bytes
    # without tools, the trajectory budgets are not read: the plan is the plain one
    longer = plan(base.with_values({"rollout.max_turns": 6, "rollout.max_trajectory_tokens": 300}))
    assert (longer.parts, longer.phases) == (plain.parts, plain.phases)
    render(tools, with_tools)
    assert "trajectory up to 192 tokens (tools: crop, zoom; 3 image(s) per row, 768 vision " \
           "patches)" in capsys.readouterr().out
    # rollout.share_prefill=true does not act on trajectories (docs/tools.md): the plan with
    # tools is the one without it, memory and time; without tools it shares the prefill
    shared = dataclasses.replace(base.rollout, engine="hf", share_prefill=True)
    hf = dataclasses.replace(base.rollout, engine="hf", share_prefill=False)
    on, off = (plan(dataclasses.replace(with_tools, rollout=r)) for r in (shared, hf))
    assert (on.parts, on.phases) == (off.parts, off.phases)
    assert on.time["phases"] == off.time["phases"]
    # (without evaluations, whose 64 rows of one prompt each would set the generation peak)
    quiet = base.with_values({"data.eval": None})
    plain_on, plain_off = (plan(dataclasses.replace(quiet, rollout=r)) for r in (shared, hf))
    assert plain_on.phases["generation"] < plain_off.phases["generation"]


# --- the package


def test_the_planner_imports_nothing_above_its_layer():
    # function-level imports included: the planner reads models and data (a tool turn encoded as
    # r1fit.tools encodes it), prints with
    # report.blocks, measures a CPU kernel's workspace with the tensor probe (planner/kernels.py),
    # times a step with the FLOP count and the device's rates (planner/timing.py), and never
    # reaches up into train or checkpoint
    allowed = ("r1fit.config", "r1fit.units", "r1fit.errors", "r1fit.algorithms", "r1fit.data",
               "r1fit.tools", "r1fit.models",
               "r1fit.report.blocks", "r1fit.memory.planner", "r1fit.memory.probe",
               "r1fit.memory.flops", "r1fit.memory.rates")
    imported = []
    for path in sorted(Path(planner.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported += [(path.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.append((path.name, node.module))
    ours = [(file, name) for file, name in imported if name.split(".")[0] == "r1fit"]
    assert ("estimate.py", "r1fit.memory.planner.facts") in ours
    assert [(file, name) for file, name in ours
            if not any(name == a or name.startswith(a + ".") for a in allowed)] == []


def test_importing_the_planner_loads_neither_torch_nor_transformers():
    root = Path(planner.__file__).parents[3]  # so the child imports this r1fit
    code = ("import sys, r1fit.memory.planner; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}).stdout
    assert out.strip() == "[]"


def first_savers(model: torch.nn.Module, blocks: Any) -> tuple[dict[int, tuple[int, int]], Any]:
    """A saved-tensors ``pack`` hook recording, for each non-parameter storage autograd saves
    inside ``blocks[i]``, the first block that saved it and its bytes (shared tensors such as the
    rotary cos/sin count once, for the first block)."""
    current: list[int | None] = [None]
    first_saver: dict[int, tuple[int, int]] = {}
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        block.register_forward_hook(lambda *_: current.__setitem__(0, None))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in params:
            first_saver.setdefault(storage.data_ptr(), (current[0], storage.nbytes()))
        return t

    return first_saver, pack


def test_static_engine_parts_stay_through_the_update(small_model, monkeypatch, capsys):
    """rollout.engine=auto on CUDA without vLLM plans the static engine: its cache and decode
    workspace are held in every phase, the LoRA backup and the prefill in generation only; the
    plan prints them and says why auto chose it."""
    lora = ["model.lora.r=8", "rollout.engine=auto"]  # vLLM absent (tests/conftest.py)
    static = plan_memory(cfg_for(small_model, *lora), device_type="cuda")
    hf = plan_memory(cfg_for(small_model, "model.lora.r=8", "rollout.engine=hf"),
                     device_type="cuda")
    assert static.details["engine"] == "static" and hf.details["engine"] == "hf"
    held = static.parts["engine_kv_cache"] + static.parts["engine_graphs"]
    assert static.parts["engine_kv_cache"] > 0 and static.parts["engine_graphs"] > 0
    assert static.parts["engine_weights"] > 0  # the adapted weights' copy
    # the update phase is the HF run's plus what the engine holds (on CPU, where no allocator
    # overhead is added to the phases, exactly)
    on_cpu = [plan_memory(cfg_for(small_model, "model.lora.r=8", f"rollout.engine={name}"),
                          device_type="cpu") for name in ("static", "hf")]
    cpu_held = on_cpu[0].parts["engine_kv_cache"] + on_cpu[0].parts["engine_graphs"]
    assert on_cpu[0].phases["update"] == on_cpu[1].phases["update"] + cpu_held
    s = on_cpu[0]
    assert s.phases["generation"] == (s.details["persistent"] + cpu_held
                                      + s.parts["engine_weights"] + s.parts["generation"])
    # the same model, dtype and sizes on either device; CUDA adds the graphs' cuBLAS workspaces
    from r1fit.memory.planner.estimate import CUBLAS_THREADS, STATIC_GRAPH_STREAMS

    assert held == cpu_held + STATIC_GRAPH_STREAMS * cublas_workspaces() // CUBLAS_THREADS
    render(static, cfg_for(small_model, *lora))
    out = capsys.readouterr().out
    assert "rollout.engine static (auto: CUDA, vLLM not installed" in out
    assert "static engine: static KV cache" in out and "CUDA graph pool" in out
    # CPU: auto is hf, nothing of the engine is planned
    cpu = plan_memory(cfg_for(small_model, *lora), device_type="cpu")
    assert cpu.details["engine"] == "hf" and cpu.parts["engine_kv_cache"] == 0


def test_vllm_engine_parts_and_when_the_engine_sleeps(small_model, capsys):
    hf = plan_memory(cfg_for(small_model), device_type="cpu")
    kv = 3 << 20
    vllm = cfg_for(small_model, "rollout.engine=vllm", f"rollout.vllm.kv_cache_memory={kv}")
    cpu = plan_memory(vllm, device_type="cpu")
    weights = cpu.parts["weights"]  # float32, full fine-tuning: the engine's copy is as big
    assert (cpu.parts["engine_weights"], cpu.parts["engine_kv_cache"]) == (weights, kv)
    assert cpu.parts["generation"] == 0 and hf.parts["engine_weights"] == 0
    # CPU: no sleep mode, the engine's memory stays through the update
    assert cpu.phases["update"] == hf.phases["update"] + weights + kv
    persistent = cpu.details["persistent"]
    assert cpu.phases["generation"] == persistent + weights + kv
    # CUDA with sleep_level 1: asleep while training, so the update phase is the HF run's
    cuda, cuda_hf = (plan_memory(c, device_type="cuda", device_memory_bytes=80 << 30)
                     for c in (vllm, cfg_for(small_model, "rollout.engine=hf")))
    assert cuda.phases["update"] == cuda_hf.phases["update"]
    render(cuda, vllm)
    out = capsys.readouterr().out
    assert "vLLM engine: KV cache pool" in out and "asleep while training" in out
    render(cuda_hf, cfg_for(small_model))
    assert "vLLM engine" not in capsys.readouterr().out


def test_a_vllm_share_that_cannot_hold_its_weights_is_a_problem_the_plan_names(small_model,
                                                                              capsys):
    """vLLM sized by rollout.vllm.gpu_memory_utilization on CUDA needs its share to hold its copy
    of the weights and one sequence's KV cache: short of that the plan does not fit whatever the
    peak says, names the least utilisation that holds them, and its advice tries that and
    rollout.engine=hf."""
    budget = 8 << 30
    asked = cfg_for(small_model, "rollout.engine=vllm")
    fine = plan_memory(asked, device_type="cuda", device_memory_bytes=budget)
    d = fine.details
    weights = fine.parts["engine_weights"]
    one_sequence = d["kv_cache"] // d["generation_batch"]  # the step's rows of one length each
    assert d["engine_needs"] == weights + one_sequence
    assert d["engine_share"] == int(0.3 * budget) > d["engine_needs"]
    assert fine.problems == [] and fine.fits
    # a share of half the weights: the peak fits, the engine would not start
    utilization = weights / budget / 2
    short = plan_memory(cfg_for(small_model, "rollout.engine=vllm",
                                f"rollout.vllm.gpu_memory_utilization={utilization}"),
                        device_type="cuda", device_memory_bytes=budget)
    assert short.peak_bytes <= short.usable_bytes and not short.fits
    least = -(-d["engine_needs"] * 100 // budget) / 100  # whole hundredths, no float drift
    assert short.problems == [
        f"rollout.vllm.gpu_memory_utilization={utilization} gives vLLM "
        f"{format_bytes(int(utilization * budget))} of the GPU's 8.00 GiB, less than its copy of the "
        f"weights and one sequence's KV cache ({format_bytes(d['engine_needs'])}): raise it to "
        f"{least:.2f}, or use rollout.engine=static or hf"]
    assert [a.split(":")[0] for a in short.advice[:2]] == [
        f"rollout.vllm.gpu_memory_utilization={least}", "rollout.engine=hf"]
    assert all(a.endswith("(fits)") for a in short.advice[:2])
    render(short, asked)
    out = capsys.readouterr().out
    assert "does NOT fit (the peak would, but see the problem below)" in out
    assert f"problem: {short.problems[0]}" in out
    # kv_cache_memory set, or CPU: vLLM is not sized by a share, nothing to check
    for cfg, device in ((cfg_for(small_model, "rollout.engine=vllm",
                                 "rollout.vllm.gpu_memory_utilization=0.01",
                                 "rollout.vllm.kv_cache_memory=1000000"), "cuda"),
                        (asked, "cpu")):
        assert plan_memory(cfg, device_type=device, device_memory_bytes=budget).problems == []


def test_an_sft_plan_is_its_rows_update_with_no_kl_no_sharing(small_model):
    """kind="sft" plans sft.batch_size rows with answers of sft.max_answer_tokens, each its own
    prompt: a GRPO step of as many rows, completions that long, no reference and no sharing,
    except that each of the rows has a prompt (pixel values) of its own."""
    sft_cfg = cfg_for(small_model, "sft.batch_size=8", "sft.max_answer_tokens=48",
                      "memory.micro_batch=4", "algo.beta=0.04", "memory.share_prefix=auto",
                      "algo.max_new_tokens=16", "algo.num_iterations=2")
    sft = plan_memory(sft_cfg, device_type="cpu", kind="sft")
    grpo = plan_memory(cfg_for(small_model, "train.prompts_per_step=4", "algo.num_generations=2",
                               "memory.micro_batch=4", "algo.max_new_tokens=48", "algo.beta=0",
                               "memory.share_prefix=false"), device_type="cpu")
    assert sft.details["rows_per_step"] == grpo.details["rows_per_step"] == 8
    assert sft.details["kind"] == "sft" and sft.details["share_prefix"] == "off"
    assert "log-probs" not in sft.phases and sft.parts["reference"] == 0
    differ = {k for k in sft.parts if sft.parts[k] != grpo.parts[k]}
    assert differ == {"inputs"}  # 8 prompts' pixel values held for the step, not 4
    extra = sft.parts["inputs"] - grpo.parts["inputs"]
    assert extra > 0 and sft.phases["update"] - grpo.phases["update"] == extra
    # the answers' length is sft.max_answer_tokens, not algo.max_new_tokens
    assert plan_memory(sft_cfg.with_values({"algo.max_new_tokens": 200}), device_type="cpu",
                       kind="sft").peak_bytes == sft.peak_bytes
    longer = plan_memory(sft_cfg.with_values({"sft.max_answer_tokens": 96}), device_type="cpu",
                         kind="sft")
    assert longer.parts["activations"] > sft.parts["activations"]


def test_an_sft_plan_holds_the_engine_its_evaluations_run_on(small_model, monkeypatch):
    """r1fit sft evaluates on the static engine on one CUDA device (auto and vllm alike: never
    vLLM, installed or not), which keeps its cache through the updates from the first
    evaluation on: the plan holds it then, and nothing without data.eval, on CPU or on two
    GPUs (generate on the policy)."""
    from r1fit.config import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    cfg = cfg_for(small_model, "sft.batch_size=8", "sft.max_answer_tokens=48",
                  "memory.micro_batch=4", "data.eval=builtin:shapes", "eval.batch=16")
    for setting in ("auto", "vllm", "static"):
        plan = plan_memory(cfg.with_values({"rollout.engine": setting}), kind="sft")
        assert plan.details["engine"] == "static"
        kv = plan.parts["engine_kv_cache"]
        assert kv > 0 and plan.phases["update"] >= kv  # held while training too
    no_eval = plan_memory(cfg.with_values({"data.eval": None}), kind="sft")
    cpu = plan_memory(cfg, device_type="cpu", kind="sft")
    two = plan_memory(cfg, gpus=2, kind="sft")
    hf = plan_memory(cfg.with_values({"rollout.engine": "hf"}), kind="sft")
    for other in (no_eval, cpu, two, hf):
        assert other.details["engine"] == "hf" and not other.parts.get("engine_kv_cache")


def test_an_unknown_plan_kind_is_refused(small_model):
    with pytest.raises(ConfigError, match="plan kind: got 'dpo'"):
        plan_memory(cfg_for(small_model), kind="dpo")


def test_an_sft_plan_that_does_not_fit_advises_switches_of_the_config_asked(small_model):
    """The advice tries its switches on the config asked and plans them as SFT steps: no
    algo.beta switch (an SFT step has no reference), and each switch's peak is an SFT plan's."""
    cfg = cfg_for(small_model, "sft.batch_size=8", "sft.max_answer_tokens=256", "algo.beta=0.04",
                  "memory.micro_batch=8")
    plan = plan_memory(cfg, device_type="cpu", device_memory_bytes=1 << 20, kind="sft")
    assert not plan.fits and plan.advice
    assert not any("algo.beta" in line for line in plan.advice)
    lora = next(line for line in plan.advice if line.startswith("model.lora.r=16"))
    expected = plan_memory(cfg.with_values({"model.lora.r": 16, "memory.micro_batch": 1,
                                            "memory.generation_batch": 1}),
                           device_type="cpu", device_memory_bytes=1 << 20, kind="sft")
    assert f"peak {format_bytes(expected.peak_bytes)} at micro_batch" in lora


QWEN_3B = "Qwen/Qwen2.5-VL-3B-Instruct"  # the config shipped with r1fit (no download)
RECIPE = Path(__file__).parents[2] / "configs" / "qwen2.5-vl-3b-lora.yaml"


def test_faster_fits_lists_predicted_faster_configurations_that_fit():
    """`r1fit plan` (faster=True) on the 3B recipe pinned to small chunks and Hugging Face
    generate on an 80 GiB GPU: each configuration it lists fits the same device, is predicted at
    least 5% faster by the same time model (its numbers are a plan of that configuration), and
    they come fastest first; the sizes are those 'auto' would pick."""
    cfg = load_config(RECIPE, [f"model.path={QWEN_3B}", "memory.micro_batch=4",
                               "memory.generation_batch=32", "rollout.engine=hf",
                               # listed apart (the next test); left out of the 4 shown here
                               "model.lora.compute_dtype=model"])
    budget = 80 << 30
    plan = plan_memory(cfg, device_memory_bytes=budget, device_type="cuda", faster=True)
    assert plan.fits and plan_memory(cfg, device_memory_bytes=budget,
                                     device_type="cuda").faster == []  # only when asked
    rows = plan.details["rows_per_gpu"]
    listed = [x["values"] for x in plan.faster]
    assert {"rollout.engine": "static"} in listed
    assert {"memory.generation_batch": even_size(plan.max_generation_batch, rows)} in listed
    seconds = [x["step_seconds"] for x in plan.faster]
    assert seconds == sorted(seconds) and len(seconds) <= 4
    for x in plan.faster:
        other = plan_memory(cfg.with_values(x["values"]), device_memory_bytes=budget,
                            device_type="cuda")
        assert other.fits and other.peak_bytes == x["peak_bytes"]
        assert other.time["step_seconds"] == pytest.approx(x["step_seconds"])
        assert x["speedup"] == pytest.approx(plan.time["step_seconds"] / x["step_seconds"])
        assert x["speedup"] >= 1.05
    # printed as a table under the time lines
    text = "\n".join(str(b) for b in render_blocks(plan, cfg))
    assert "faster configurations that fit (predicted):" in text


def test_faster_fits_lists_adapters_in_the_model_dtype():
    """On the 3B recipe (bfloat16, LoRA) with peft's float32 adapters the plan lists
    model.lora.compute_dtype=model, predicted faster; not once it is set, nor in float32."""
    cfg = load_config(RECIPE, [f"model.path={QWEN_3B}"])
    plan = plan_memory(cfg, device_memory_bytes=80 << 30, device_type="cuda", faster=True)
    listed = [x["values"] for x in plan.faster]
    assert {"model.lora.compute_dtype": "model"} in listed
    done = plan_memory(cfg.with_values({"model.lora.compute_dtype": "model"}),
                       device_memory_bytes=80 << 30, device_type="cuda", faster=True)
    assert not any("model.lora.compute_dtype" in x["values"] for x in done.faster)
    assert done.time["phases"]["update"] < plan.time["phases"]["update"]
    fp32 = plan_memory(cfg.with_values({"model.dtype": "float32"}), device_memory_bytes=80 << 30,
                       device_type="cuda", faster=True)
    assert not any("model.lora.compute_dtype" in x["values"] for x in fp32.faster)


def test_faster_fits_leaves_out_what_does_not_apply():
    """Sizes already at what 'auto' picks, the engine already static, several GPUs (the static
    engine runs in one process): nothing of those is listed."""
    cfg = load_config(RECIPE, [f"model.path={QWEN_3B}", "rollout.engine=static"])
    assert (cfg.memory.micro_batch, cfg.memory.generation_batch) == ("auto", "auto")
    plan = plan_memory(cfg, device_memory_bytes=80 << 30, device_type="cuda", faster=True)
    assert not any(k.startswith(("memory.micro_batch", "memory.generation_batch",
                                 "rollout.engine")) for x in plan.faster for k in x["values"])
    eight = plan_memory(cfg.with_values({"rollout.engine": "hf", "memory.micro_batch": 1}),
                        device_memory_bytes=80 << 30, device_type="cuda", gpus=8, faster=True)
    assert eight.faster and not any("rollout.engine" in x["values"] for x in eight.faster)
    # a budget only micro_batch 1 fits: no larger size is listed
    tight = plan_memory(cfg.with_values({"memory.micro_batch": 1, "rollout.engine": "hf"}),
                        device_memory_bytes=budget_for_one(cfg), device_type="cuda",
                        faster=True)
    assert tight.max_micro_batch == 1
    assert not any("memory.micro_batch" in x["values"] for x in tight.faster)


def budget_for_one(cfg) -> int:
    """A device budget whose usable part holds micro_batch 1 of ``cfg`` and not 2."""
    one, two = (plan_memory(cfg.with_values({"memory.micro_batch": m, "memory.generation_batch": 1,
                                             "rollout.engine": "hf"}),
                            device_memory_bytes=1 << 40, device_type="cuda").phases["update"]
                for m in (1, 2))
    return int((one + two) / 2 / (1 - SAFETY_MARGIN))


def test_the_header_counts_small_models_in_millions(use_tiny_cache, capsys):
    cfg = load_config(None, [])
    render(plan_memory(cfg, device_type="cpu"), cfg)
    assert capsys.readouterr().out.startswith("r1fit plan: builtin:tiny (0.36M parameters, ")


def test_a_model_that_is_no_vision_language_model_is_said_so_in_one_short_line(tmp_path):
    from transformers import LlamaConfig

    from r1fit.models.errors import ModelConfigError

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000).save_pretrained(tmp_path)
    with pytest.raises(ModelConfigError) as info:
        plan_memory(load_config(None, [f"model.path={tmp_path}"]), device_type="cpu")
    # transformers' own error lists every model class it knows: 2,000 characters
    assert str(info.value) == (
        f"cannot plan for '{tmp_path}': its config (LlamaConfig) is no image-text-to-text model, "
        "which r1fit trains through transformers' AutoModelForImageTextToText (Qwen2-VL, "
        "Qwen2.5-VL, Qwen3-VL, Gemma 3, ...)")
