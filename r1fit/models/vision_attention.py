"""Vision attention over many images in a few calls instead of one per image or window.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers pack every image's patches into one sequence
and attend within segments of it (``cu_seqlens``: an image each, or Qwen2.5-VL's windows of 8x8
patches). With ``sdpa`` their attention splits the sequence and calls attention once per segment
from Python: a 448x448 image is 16 windows, so a Qwen2.5-VL-3B forward over a step's 128 images
makes 28 x 2,048 + 4 x 128 attention calls, each a few small kernels and a host round trip, with
the GPU waiting on the loop. Their flash-attention path instead hands one call a layer the whole
packed sequence with the segments' bounds (transformers takes that path for an implementation
whose name holds "flash").

:func:`segment_attention` takes that call: it runs torch's ``scaled_dot_product_attention`` once
per distinct segment length, the segments of a length stacked as a batch (a view when they are
all of one length, as a square image's windows are), with the same inputs, scale and
non-causal mask as the per-segment loop, so the outputs are the same up to float rounding.
:func:`batch_vision_segments` points a loaded model's vision attention at it, where the model
uses ``sdpa`` and its vision attention takes ``cu_seqlens``; nothing else changes (the text model
keeps its own attention). Registered through transformers' ``AttentionInterface``, the
extension point for attention functions: no model class is patched.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from r1fit.errors import R1fitError

log = logging.getLogger("r1fit.models")

#: the name the function is registered under: "flash" in it is what makes the vision attention
#: of Qwen2-VL, Qwen2.5-VL and Qwen3-VL pass the packed sequence and its bounds in one call
#: (transformers' ``is_flash_attention_requested`` tests the name); no flash-attention kernel runs
SEGMENT_ATTENTION = "r1fit_flash_layout_sdpa"


#: at most this many bytes of float32 attention scores a call would hold if the kernel kept them
#: (torch's math fallback does; its flash and memory-efficient kernels do not): a call takes as
#: many segments of a length as fit (Qwen2.5-VL's 8x8-patch windows: 4,096 at 16 heads; whole
#: 448 px images: 16)
MAX_SCORE_BYTES = 1 << 30


class SegmentAttentionError(R1fitError, RuntimeError):
    """The vision attention called :func:`segment_attention` without the segments' bounds."""


def segment_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      scaling: float | None = None, dropout: float = 0.0,
                      cu_seq_lens_q: torch.Tensor | None = None,
                      cu_seq_lens_k: torch.Tensor | None = None, is_causal: bool = False,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention within the segments ``cu_seq_lens_q`` of one packed sequence: ``query``,
    ``key``, ``value`` [1, heads, tokens, head dim]; returns [1, tokens, heads, head dim], as
    the flash-attention functions do. One ``scaled_dot_product_attention`` per distinct segment
    length, its segments batched."""
    if cu_seq_lens_q is None or query.shape[0] != 1 or attention_mask is not None:
        # attending across the packed sequence would mix images: never do it silently
        raise SegmentAttentionError(
            f"{SEGMENT_ATTENTION}: called without the segments' bounds (cu_seq_lens_q) on "
            f"{type(module).__name__}; this transformers version's vision attention calls it "
            "differently from the one r1fit was built for (r1fit/models/vision_attention.py)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise SegmentAttentionError(f"{SEGMENT_ATTENTION}: query and key segments differ")
    bounds = cu_seq_lens_q.tolist()  # one host read a layer (the per-segment loop makes it too)
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    p = dropout if module.training else 0.0
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)

    def attend(parts: list[torch.Tensor], length: int) -> torch.Tensor:
        """Attention of [segments, heads, length, dim] inputs, at most ``per_call`` segments a
        call: [segments, length, heads, dim]."""
        per_call = max(1, MAX_SCORE_BYTES // (4 * heads * length * length))
        outs = [F.scaled_dot_product_attention(*(t[i:i + per_call] for t in parts),
                                               dropout_p=p, scale=scaling)
                for i in range(0, parts[0].shape[0], per_call)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(1, 2)

    q, k, v = query[0], key[0], value[0]  # [heads, tokens, dim]
    if len(by_length) == 1 and bounds[0] == 0 and bounds[-1] == tokens:
        # all one length (a square image's windows, images of one size): views, no copy
        length = bounds[1] - bounds[0]
        parts = [t.reshape(heads, -1, length, dim).transpose(0, 1) for t in (q, k, v)]
        return attend(parts, length).reshape(1, tokens, heads, dim), None
    out = query.new_zeros(tokens, heads, dim)
    for length, starts in by_length.items():
        index = (torch.tensor(starts, device=query.device).unsqueeze(1)
                 + torch.arange(length, device=query.device)).flatten()
        parts = [t.index_select(1, index).reshape(heads, len(starts), length, dim)
                 .transpose(0, 1) for t in (q, k, v)]
        out = out.index_copy(0, index, attend(parts, length).reshape(-1, heads, dim))
    return out.unsqueeze(0), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)


def _takes_segments(module: nn.Module) -> bool:
    """Whether ``module`` is an attention layer whose forward takes ``cu_seqlens``."""
    forward = getattr(type(module), "forward", None)
    try:
        return forward is not None and "cu_seqlens" in inspect.signature(forward).parameters \
            and hasattr(module, "config")
    except (TypeError, ValueError):
        return False


def batch_vision_segments(model: nn.Module) -> int:
    """Point the vision attention layers of ``model`` that take ``cu_seqlens`` and run ``sdpa``
    at :func:`segment_attention` (their config's attention implementation); returns how many
    layers now use it (0: nothing to do, e.g. Gemma 3's vision tower, eager attention)."""
    configs = {}
    for module in model.modules():
        if _takes_segments(module) and getattr(module.config, "_attn_implementation",
                                               None) in ("sdpa", SEGMENT_ATTENTION):
            configs.setdefault(id(module.config), [module.config, 0])[1] += 1
    for config, _ in configs.values():
        config._attn_implementation = SEGMENT_ATTENTION
    layers = sum(count for _, count in configs.values())
    if layers:
        log.debug("vision attention: %d layers attend to their segments batched (%s)", layers,
                  SEGMENT_ATTENTION)
    return layers
