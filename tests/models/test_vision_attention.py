"""Vision attention over a step's images in one call a layer (r1fit/models/vision_attention.py):
the same outputs and gradients as transformers' own per-segment sdpa loop on the real vision
towers (Qwen2.5-VL's windows, Qwen2-VL's and Qwen3-VL's whole images, of mixed sizes), one call
a layer, and models it does not apply to left as they are."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AttentionInterface

import r1fit.models.vision_attention as vision_attention
from r1fit.models.load import load_policy, vision_tower
from r1fit.models.vision_attention import (
    SEGMENT_ATTENTION,
    SegmentAttentionError,
    batch_vision_segments,
    segment_attention,
)

#: (temporal, height, width) patch grids: a square image (every window full) and one whose
#: windows at the edges are cut short, so segments of several lengths share a layer
GRIDS = [[1, 16, 16], [1, 10, 14]]


def policy(name: str, **kwargs):
    model, _ = load_policy(f"builtin:{name}", lora_r=0, lora_alpha=16, lora_dropout=0.0,
                           lora_target="all-linear", freeze_vision=False, dtype="float32",
                           device="cpu", gradient_checkpointing=False, **kwargs)
    return model.double()  # float64: the two paths' rounding far below the tolerances


def tower_inputs(tower: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel patches for ``GRIDS`` (the processor's flattened layout) and the grid."""
    config = tower.config
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    grid = torch.tensor(GRIDS)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, dtype=torch.float64,
                         generator=generator)
    return pixels, grid


@pytest.mark.parametrize("name,windows", [("tiny", True), ("tiny-qwen2vl", False),
                                          ("tiny-qwen3vl", False)])
def test_one_call_a_layer_gives_the_per_segment_loops_outputs_and_gradients(
        use_tiny_cache, name, windows, monkeypatch):
    model = policy(name)
    tower = vision_tower(model)
    assert tower.config._attn_implementation == SEGMENT_ATTENTION  # set on load
    pixels, grid = tower_inputs(tower)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["cu_seq_lens_q"].numel() - 1)
        return segment_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, SEGMENT_ATTENTION, counted)
    results = {}
    for impl in ("sdpa", SEGMENT_ATTENTION):
        tower.config._attn_implementation = impl
        tower.zero_grad()
        out = tower(pixels, grid_thw=grid)
        embeds = out.pooler_output
        embeds.pow(2).sum().backward()
        # (Qwen3-VL's deepstack mergers feed the text model, not pooler_output: no gradient)
        results[impl] = (embeds.detach(), [p.grad.clone() for p in tower.parameters()
                                           if p.grad is not None])
    (ref, ref_grads), (got, got_grads) = results["sdpa"], results[SEGMENT_ATTENTION]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert len(ref_grads) > len(tower.blocks)
    for a, b in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert len(calls) == len(tower.blocks)  # one call a layer, not one a segment
    # Qwen2.5-VL's windows: several segments an image (of several lengths); else one an image
    assert (max(calls) > len(GRIDS)) if windows else set(calls) == {len(GRIDS)}


def test_other_vision_towers_and_eager_attention_are_left_as_they_are(use_tiny_cache, tmp_path):
    gemma = policy("tiny-gemma3")
    assert batch_vision_segments(gemma) == 0
    assert vision_tower(gemma).config._attn_implementation == "sdpa"
    eager = policy("tiny", attn_implementation="eager")
    assert vision_tower(eager).config._attn_implementation == "eager"
    # the text model keeps its own attention, and a saved model says nothing of the change
    model = policy("tiny")
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    assert batch_vision_segments(model) == len(vision_tower(model).blocks)  # again: same
    model.save_pretrained(tmp_path)
    assert SEGMENT_ATTENTION not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_a_call_without_the_segments_bounds_is_refused():
    """Attending across the packed sequence would mix the images: an error, not a result."""
    q = torch.zeros(1, 2, 8, 4)
    module = torch.nn.Linear(1, 1)
    with pytest.raises(SegmentAttentionError, match="without the segments' bounds"):
        segment_attention(module, q, q, q)
    with pytest.raises(SegmentAttentionError, match="query and key segments differ"):
        segment_attention(module, q, q, q, cu_seq_lens_q=torch.tensor([0, 4, 8]),
                          cu_seq_lens_k=torch.tensor([0, 2, 8]))


@pytest.mark.parametrize("bounds", [[0, 3, 5, 8], [0, 4, 8], [0, 3, 3, 8]])
@pytest.mark.parametrize("cap", [vision_attention.MAX_SCORE_BYTES, 1])
def test_segments_attend_within_themselves(bounds, cap, monkeypatch):
    """Hand-made segments (of mixed lengths, of one length: the view path, an empty one): each
    token's output is attention over its own segment only (a reference loop), in the flash
    layout [1, tokens, heads, dim], whether a call takes all segments of a length or, capped,
    one at a time."""
    monkeypatch.setattr(vision_attention, "MAX_SCORE_BYTES", cap)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=generator)
               for _ in range(3))
    module = torch.nn.Linear(1, 1).eval()
    out, _ = segment_attention(module, q, k, v, cu_seq_lens_q=torch.tensor(bounds), scaling=0.5)
    assert out.shape == (1, 8, 2, 4)
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = (q[0, :, a:b] @ k[0, :, a:b].transpose(-1, -2)) * 0.5
        expected = scores.softmax(-1) @ v[0, :, a:b]  # [heads, length, dim]
        torch.testing.assert_close(out[0, a:b], expected.transpose(0, 1), rtol=0, atol=1e-12)
