"""The whole-tensor formulas of r1fit/memory/planner/formulas.py, on sizes counted by hand (the
per-token ones are checked against autograd's saved tensors in tests/memory/test_planner.py)."""

from __future__ import annotations

from r1fit.algorithms import logprobs
from r1fit.memory.planner.formulas import (
    SLICE_TOKENS,
    chunk_backward_bytes,
    chunk_forward_bytes,
    kv_cache_bytes,
    lm_forward_bytes,
    pixel_bytes,
    sampling_logits_f32,
    vision_forward_bytes,
)


def test_kv_cache_is_k_and_v_of_every_layer(text):
    # 3 rows x 10 tokens x 2 layers x (K, V) x 16 x bfloat16
    assert kv_cache_bytes(text, 2, rows=3, length=10) == 3 * 10 * 2 * 2 * 16 * 2 == 3_840


def test_pixel_values_are_float32_and_absent_without_a_vision_tower(vision):
    assert pixel_bytes(vision, 64) == 64 * 1176 * 4
    assert pixel_bytes(None, 64) == 0


def test_vision_forward_copies_the_pixels_only_when_the_model_is_not_float32(vision):
    assert vision_forward_bytes(None, 2, 64) == vision_forward_bytes(vision, 2, 0) == 0
    f32, bf16 = vision_forward_bytes(vision, 4, 10), vision_forward_bytes(vision, 2, 10)
    # float32: a block's largest moment + the running hidden states, per patch
    # (the attention: 4 x (2 + 3 + 1) x 16 + 4 x 4 x 16 = 640, + rotary 2 x 4 x 8 = 64; + 4 x 16)
    assert f32 == 10 * (640 + 64 + 64)
    # bfloat16: the same at 2 bytes (attention 2 x 96 + 256 = 448, + 64; + 32), + the pixel copy
    assert bf16 == 10 * 1176 * 2 + 10 * (448 + 64 + 32)


def test_eager_attention_adds_its_scores(text):
    sdpa = lm_forward_bytes(text, 2, rows=3, length=10, eager=False)
    eager = lm_forward_bytes(text, 2, rows=3, length=10, eager=True)
    # rows x heads x length x length, float32 softmax + its bfloat16 copy
    assert eager - sdpa == 3 * 4 * 10 * 10 * (4 + 2)


def test_logits_chunks():
    assert SLICE_TOKENS == logprobs.SLICE_TOKENS  # the planner's copy of the head's constant
    # forward: the float32 logits (log-probs in place) and the exponentials of 32 of their rows
    assert chunk_forward_bytes(vocab=100, b=4, chunk=8) == 2 * 8 * 100 * 4
    assert chunk_forward_bytes(vocab=100, b=4, chunk=256) == (256 + 32) * 100 * 4
    # a bfloat16 model: the bfloat16 matmul output beside its float32 copy is the larger moment
    assert chunk_forward_bytes(vocab=100, b=2, chunk=256) == 256 * 100 * (4 + 2)
    # backward: the float32 chunk (+ its bfloat16 copy in a bfloat16 model)
    assert chunk_backward_bytes(vocab=100, b=4, chunk=8) == 8 * 100 * 4
    assert chunk_backward_bytes(vocab=100, b=2, chunk=8) == 8 * 100 * (4 + 2)
    # an entropy bonus's gradient: the chunk's float32 probabilities and the mask of their zeros
    assert chunk_backward_bytes(vocab=100, b=4, chunk=8, entropy_grad=True) == 8 * 100 * (4 + 5)


def test_sampling_logits_grow_with_temperature_and_top_p():
    assert sampling_logits_f32(1.0, 1.0) == 4
    assert sampling_logits_f32(0.7, 1.0) == 5  # the division by the temperature
    assert sampling_logits_f32(0.7, 0.9) == 9  # + top-p's sorted values, indices, cumulative sum
