"""What the planner reads off an architecture other than Qwen2.5-VL (builtin:tiny-gemma3): the
vision tower's shape from a SigLIP config, a fixed image size and token count from the config and
processor, the decoder layer's norms, and a Gemma 3 layer's saved activations."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from r1fit.config import load_config
from r1fit.memory.planner import TextDims, layer_saved_per_token, model_facts, plan_memory
from r1fit.memory.planner.facts import prompt_shape
from r1fit.models.builtin import ensure_builtin

GEMMA = "builtin:tiny-gemma3"


@pytest.fixture
def gemma(use_tiny_cache: Path) -> Path:
    return ensure_builtin("tiny-gemma3")


def test_gemma3_facts_come_from_its_config(gemma):
    facts = model_facts(GEMMA)
    v, t = facts.vision, facts.text
    # SigLIP names: num_hidden_layers, num_attention_heads, num_channels; no temporal patches
    assert (v.depth, v.heads, v.hidden, v.intermediate) == (2, 4, 64, 128)
    assert v.pixels_per_patch == 3 * 16 * 16 and v.patch == 16
    assert (v.image_size, v.tokens_per_image, v.patches_per_image) == (64, 4, 16)
    assert not v.rms_norm and not v.gated_mlp  # LayerNorm, fc1 -> GELU -> fc2
    # four norms of the hidden state per layer, per-head q/k norms, and a rotary table for each of
    # the sliding-window and global layers
    assert (t.hidden_norms, t.head_norms, t.rotary_sets) == (4, True, 2)
    # Gemma's norms multiply (1 + weight) in float32, measured on a CPU copy of its norm
    assert t.norm_weight_f32 and not model_facts("builtin:tiny").text.norm_weight_f32
    assert facts.image_token_id == json.loads((gemma / "config.json").read_text())["image_token_index"]
    qwen = model_facts("builtin:tiny")
    assert (qwen.text.hidden_norms, qwen.text.head_norms, qwen.text.rotary_sets) == (2, False, 1)
    assert qwen.vision.image_size is None and qwen.vision.pixels_per_patch == 1176


@pytest.mark.parametrize("side", [56, 112])
def test_gemma3_prompts_have_a_fixed_image_size(gemma, side):
    """Encoded by the processor: 4 image tokens and 16 patches of 16 px per image whatever the
    pixel budget, since the processor resizes every image to 64 px."""
    cfg = load_config(None, [f"model.path={GEMMA}", f"data.shapes.image_size={side}",
                             f"data.max_pixels={side * side}"])
    plan = plan_memory(cfg, device_type="cpu")
    assert plan.details["prompt_estimate"].startswith("encoded by the model's processor")
    assert plan.details["image_tokens"] == 4 and plan.details["vision_patches"] == 16
    # fewer pixels would not shrink a fixed-size tower's input: no such advice
    small = plan_memory(cfg, device_memory_bytes=1 << 20, device_type="cpu")
    assert small.advice and not any("max_pixels" in a for a in small.advice)


def test_gemma3_prompt_estimate_without_a_processor(gemma, tmp_path):
    """A bare config.json: tokens and patches per image from mm_tokens_per_image and the
    tower's image and patch sizes."""
    (tmp_path / "config.json").write_text((gemma / "config.json").read_text())
    cfg = load_config(None, [f"model.path={tmp_path}", "data.max_images=2"])
    facts = model_facts(str(tmp_path))
    assert facts.processor is None
    shape = prompt_shape(cfg, facts)
    assert shape.how.startswith("estimated")
    assert (shape.image_tokens, shape.patches) == (2 * 4, 2 * 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_layer_formula_is_close_to_saved_tensors(dtype):
    """Decoder layer 1 of a hand-sized Gemma 3: the formula with the layer's four norms and q/k
    norms is within 2% of what autograd saves (the rest: the (1 + weight) copies of the norms,
    and the global layers' own rotary table, counted outside the layers). In bfloat16 the norms'
    float32 products are part of it (TextDims.norm_weight_f32)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from r1fit.data.batch import Batch
    from r1fit.models.logprobs import completion_logprobs

    text = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "query_pre_attn_scalar": 8, "sliding_window": 512}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 16}
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=99,
        boi_token_index=97, eoi_token_index=98)).to(dtype).train()
    layer = model.model.language_model.layers[1]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, saved = [False], {}
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    ids = torch.randint(0, 90, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    batch = Batch({"input_ids": ids, "attention_mask": mask}, 10, ids[:, 10:], mask[:, 10:].float())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, batch, chunk_size=8)
    measured = sum(saved.values()) / 40
    dims = TextDims(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8,
                    vocab=100, hidden_norms=4, head_norms=True, rotary_sets=2,
                    norm_weight_f32=True)
    b = dtype.itemsize
    planned = layer_saved_per_token(dims, b)
    assert planned == pytest.approx(measured, rel=0.02)
    if b == 2:  # a model-dtype product would miss it
        assert layer_saved_per_token(replace(dims, norm_weight_f32=False), b) < 0.93 * measured
    # Qwen's two-norm layout would miss a third of it
    assert layer_saved_per_token(TextDims(32, 64, 2, 4, 2, 8, 100), b) < 0.75 * measured
