"""Bytes per token (or per vision patch) that each piece of the model saves for backward or holds
for a moment, read off the transformers Qwen2-VL / Qwen2.5-VL code; and from those, the bytes of
whole tensors (pixel values, a KV cache, a forward without autograd, a chunk of logits).

The counts were derived from that code (which tensors autograd saves, which temporaries coexist)
and are checked tensor by tensor against saved-tensor hooks on CPU, float32 and bfloat16, full
fine-tuning and LoRA (tests/memory/test_planner.py); whole steps are checked against the probe's
measurement by benchmarks/plan_accuracy.py. Other architectures get the same formulas, as an
estimate. On CUDA, SDPA's flash and memory-efficient kernels are assumed to save what the CPU
kernel saves (q, k, v, output, log-sum-exp).
"""

from __future__ import annotations

from r1fit.memory.planner.facts import TextDims, VisionDims

#: Bytes per LoRA parameter: peft keeps adapter weights in float32 even on a bf16/fp16 model
#: (``autocast_adapter_dtype``), and so are their gradients and AdamW states.
ADAPTER_BYTES = 4
#: float32 [rows x vocab] tensors alive together in one sampling step of ``generate`` (measured
#: on CPU): this step's float32 copy of the last logits and the suppress-tokens processor's output,
#: plus the previous step's scores and softmax, still referenced until they are reassigned. A
#: temperature other than 1 adds one more (its division), top_p < 1 about four (sorted values,
#: int64 indices, cumulative sum): read from transformers' logits processors, not measured.
GENERATION_LOGITS_F32 = 4
#: rows of the chunked LM head's slices with temporaries of their own (r1fit/algorithms/
#: logprobs.py's SLICE_TOKENS; the planner does not import torch)
SLICE_TOKENS = 32
#: Bytes of a float32 element (what norms, softmax and logits compute in).
F32 = 4


def layer_saved_per_token(t: TextDims, b: int, *, lora_targets: tuple[str, ...] | None = None,
                          lora_r: int = 0, mask_len: int = 0, eager_len: int = 0,
                          mask_copy: bool = True, adapter_bytes: int = ADAPTER_BYTES) -> int:
    """Bytes one decoder layer saves for backward per token (no checkpointing).

    ``b``: bytes of the model dtype. ``lora_targets``: None for full fine-tuning, else the adapted
    projections. ``mask_len``: the sequence length when a padding mask is present; SDPA then gets
    the KV heads repeated to all query heads (transformers' repeat_kv) and saves its own float
    copy of the boolean mask, one row of ``mask_len`` per token (``mask_copy`` False: the mask
    is additive in the model's dtype already, and SDPA saves it without a copy). ``eager_len``:
    the sequence length under eager attention. ``adapter_bytes``: of the element the adapters
    compute in (float32 as peft has them; ``b`` with ``model.lora.compute_dtype=model``).
    Checked against saved-tensor hooks (tests/memory).
    """
    H, inter = t.hidden, t.intermediate
    kv = t.q_dim if mask_len and t.kv_heads < t.heads else t.kv_dim
    # SDPA (flash/efficient kernels) saves q, k, v, its output (which is also o_proj's input:
    # same storage) and a float32 log-sum-exp per head
    attn = b * (2 * t.q_dim + 2 * kv + (mask_len if mask_copy else 0)) + F32 * t.heads
    if eager_len:  # eager attention also keeps the float32 softmax and its model-dtype copy
        attn += t.heads * eager_len * (F32 + b)
    # each RMSNorm saves its float32 input (the input itself in float32) and 1/rms: the layer's
    # norms of the hidden state (Qwen: 2, before attention and MLP; Gemma 3: 4, also after them)
    # and, with per-head q/k norms (Qwen3, Gemma 3), theirs over the q and k heads
    norm = F32 * H + F32
    heads_norm = (F32 * (t.q_dim + t.kv_dim + t.heads + t.kv_heads)) if t.head_norms else 0
    if lora_targets is None:
        # + the normalised value each trained norm weight multiplies, and the output of the two
        # norms before attention and MLP that q/k/v (resp. gate/up) save; MLP: gate (activation
        # input), activation output, up, their product
        product = t.norm_product_bytes(b)
        heads_norm += product * (t.q_dim + t.kv_dim) if t.head_norms else 0
        return (t.hidden_norms * (norm + product * H) + 2 * b * H + heads_norm + attn
                + 4 * b * inter)
    # frozen norm weights save nothing; gate, act, up
    saved = t.hidden_norms * norm + heads_norm + attn + 3 * b * inter
    groups = ((("q_proj", "k_proj", "v_proj"), H), (("o_proj",), t.q_dim),
              (("gate_proj", "up_proj"), H), (("down_proj",), inter))
    for names, width in groups:
        hits = sum(name in lora_targets for name in names)
        if not hits:
            continue  # a frozen Linear saves nothing for its weight
        if adapter_bytes == b:
            # lora_A saves the input itself, shared by the layers reading it; o_proj's input is
            # SDPA's output, counted above
            saved += 0 if names == ("o_proj",) else b * width
        else:
            saved += adapter_bytes * width * hits  # peft casts the input to float32, per layer
    return saved + adapter_bytes * lora_r * len(lora_targets)  # lora_A outputs


def layer_forward_temp_per_token(t: TextDims, b: int) -> int:
    """Largest moment inside a decoder layer without autograd, per token: the MLP's SiLU output,
    up projection and their product next to the residual stream and the normed input, or the
    attention's projections, rotary copies and repeated KV heads."""
    H, inter = t.hidden, t.intermediate
    mlp = b * (2 * H + 3 * inter)
    attn = b * (2 * H + 4 * t.q_dim + 4 * t.kv_dim)
    return max(mlp, attn) + F32 * H  # + the RMSNorm's float32 square


def layer_backward_temp_per_token(t: TextDims, b: int) -> int:
    """Gradients alive inside a layer's backward: of the MLP product, SiLU output and up
    projection (3 x intermediate), plus the incoming and outgoing hidden gradients."""
    return b * (3 * t.intermediate + 2 * t.hidden)


def vision_block_saved_per_patch(v: VisionDims, b: int) -> int:
    """Bytes one vision block saves per patch when the tower trains (checked on Qwen2.5-VL and
    Qwen2-VL blocks): two norms, their outputs, q/k after the rotary embedding, v (a view that
    keeps the whole qkv output), the attention output and proj's input, the MLP."""
    h = v.hidden
    norm = (F32 * h + F32 + b * h) if v.rms_norm else (b * h + 2 * F32)
    mlp = (4 if v.gated_mlp else 3) * b * v.intermediate
    return 2 * norm + 2 * b * h + b * (2 * h + 3 * h + 2 * h) + F32 * v.heads + mlp


def vision_other_saved_per_patch(v: VisionDims, b: int) -> int:
    """Outside the blocks, per patch: the patch embedding's input (a model-dtype copy of the
    float32 pixel values; in float32 it is the batch's own tensor, counted with the inputs), the
    rotary cos/sin, and the merger (its norm, then its two Linears' inputs and the GELU's)."""
    h = v.hidden
    norm = (F32 * h + F32 + b * h) if v.rms_norm else (b * h + 2 * F32)
    pixels = b * v.pixels_per_patch if b != F32 else 0
    return pixels + 2 * F32 * (h // v.heads) + norm + 3 * b * h


def vision_forward_temp_per_patch(v: VisionDims, b: int) -> int:
    """Largest moment inside a vision block without autograd, per patch (MLP or attention with
    its float32 rotary copies)."""
    h = v.hidden
    mlp = b * (2 * h + 3 * v.intermediate)
    attn = b * (2 * h + 3 * h + h) + 4 * F32 * h
    return max(mlp, attn) + 2 * F32 * (h // v.heads)


# ---------------------------------------------------------------------------------------------
# whole tensors, from the per-token counts: bytes of ``rows`` rows (or ``patches`` patches)


def pixel_bytes(v: VisionDims | None, patches: int) -> int:
    """The float32 pixel values of ``patches`` vision patches, as the processor returns them."""
    return patches * v.pixels_per_patch * F32 if v is not None else 0


def kv_cache_bytes(t: TextDims, b: int, rows: int, length: int) -> int:
    """The KV cache of ``rows`` sequences of ``length`` tokens: K and V of every layer."""
    return rows * length * t.layers * 2 * t.kv_dim * b


def vision_forward_bytes(v: VisionDims | None, b: int, patches: int) -> int:
    """The vision tower's largest moment without autograd, over ``patches`` patches."""
    if v is None or not patches:
        return 0
    copy = patches * v.pixels_per_patch * b if b != F32 else 0  # pixel_values.type(model dtype)
    return copy + patches * (vision_forward_temp_per_patch(v, b) + b * v.hidden)


def lm_forward_bytes(t: TextDims, b: int, rows: int, length: int, eager: bool) -> int:
    """The decoder layers' largest moment without autograd, over ``rows`` x ``length`` tokens."""
    per_token = (layer_forward_temp_per_token(t, b) + b * t.hidden  # inputs_embeds stays referenced
                 + 2 * b * t.head_dim * t.rotary_sets)  # rotary cos/sin shared by the layers
    mask = rows * length * length * (1 + b)  # the boolean mask, one layer's float copy
    scores = rows * t.heads * length * length * (F32 + b) if eager else 0  # eager attention's
    return rows * length * per_token + mask + scores


def chunk_forward_bytes(vocab: int, b: int, chunk: int) -> int:
    """The chunked LM head's forward (_ChunkedLogprobs) over ``chunk`` tokens."""
    # a float32 [chunk x vocab] buffer turned into log-probs in place, beside either the bf16
    # matmul output it was converted from or, later, the exponentials of SLICE_TOKENS of its rows
    converted = chunk * vocab * b if b != F32 else 0
    return chunk * vocab * F32 + max(converted, min(chunk, SLICE_TOKENS) * vocab * F32)


def chunk_backward_bytes(vocab: int, b: int, chunk: int, entropy_grad: bool = False) -> int:
    """The chunked LM head's backward over ``chunk`` tokens (``entropy_grad``: with an entropy
    bonus's gradient, algo.entropy_coef > 0)."""
    # the recomputed float32 chunk, turned into d logp / d logits in place; for a bf16 model its
    # bf16 copy coexists for a moment; the entropy's gradient needs the chunk's probabilities
    # beside it (float32) and the mask of their zeros (r1fit/algorithms/logprobs.py
    # _to_logits_grad_)
    entropy = F32 + 1 if entropy_grad else 0
    return chunk * vocab * (F32 + (b if b != F32 else 0) + entropy)


def sampling_logits_f32(temperature: float, top_p: float) -> int:
    """How many float32 [rows x vocab] tensors one sampling step of ``generate`` holds."""
    return GENERATION_LOGITS_F32 + (temperature != 1.0) + 4 * (top_p < 1.0)
