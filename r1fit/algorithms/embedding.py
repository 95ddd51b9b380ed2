"""An embedding lookup whose backward adds into the weight's existing ``.grad`` in place.

Over several micro-batches autograd accumulates a parameter's gradient as ``.grad += new``: the
new gradient exists in full first. For the input embedding that is a dense ``[vocab x hidden]``
tensor (``embedding_dense_backward``), though only the rows of the micro-batch's tokens are
non-zero: with Qwen's 151,936-token vocabulary and hidden size 1,024, 622 MB of float32 alive at
the end of every micro-batch's backward beside the ``.grad`` it is added into. Here, when the
weight already has a dense ``.grad`` of its own dtype (every micro-batch after the first), the
rows are added into it directly and no gradient is returned for the weight (the trick is
Megatron-LM's gradient-accumulation fusion). With no ``.grad`` yet the dense gradient is returned
as usual, and becomes ``.grad`` without a copy.

Only for loops that accumulate into ``.grad`` with ``backward()``: ``torch.autograd.grad`` would
not see the part written into ``.grad``. Not for FSDP-sharded weights, whose ``.grad`` FSDP
manages. The sum is the same as autograd's, in another order (``index_add_``): float results may
differ in the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable


def embeds_into_grad(module: nn.Module) -> bool:
    """Whether :func:`embedding_into_grad` can stand in for ``module``'s lookup: a plain
    ``nn.Embedding`` (a subclass may scale its output, as Gemma's does) without max_norm,
    per-frequency scaling or sparse gradients, all of which change its gradient."""
    return (type(module) is nn.Embedding and not module.sparse and module.max_norm is None
            and not module.scale_grad_by_freq)


def grad_to_accumulate_into(weight: Tensor) -> Tensor | None:
    """``weight.grad`` when a gradient of ``weight`` can be added into it in place (dense, same
    dtype, device and shape, not itself part of a graph); else None."""
    grad = weight.grad
    if (grad is None or grad.layout != torch.strided or grad.dtype != weight.dtype
            or grad.device != weight.device or grad.shape != weight.shape or grad.requires_grad):
        return None
    return grad


def embedding_into_grad(ids: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)``, whose weight gradient is added into
    ``weight.grad`` in place when it exists (see the module's text); ``padding_idx``'s row gets
    no gradient, as in ``nn.Embedding``."""
    return _EmbeddingIntoGrad.apply(ids, weight, padding_idx)


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        ids, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        flat_ids = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)
        if ctx.padding_idx is not None:
            keep = flat_ids != ctx.padding_idx
            flat_ids, rows = flat_ids[keep], rows[keep]
        target = grad_to_accumulate_into(weight)
        if target is not None:
            target.index_add_(0, flat_ids, rows)
            return None, None, None
        dense = torch.zeros_like(weight)
        dense.index_add_(0, flat_ids, rows)
        return None, dense, None
