"""Log-probs of completion tokens under a model, with the LM head applied in token chunks.

The backbone runs without the LM head; only the hidden states that predict completion tokens go
through the head, ``memory.logits_chunk`` tokens at a time, so the [tokens x vocab] logits never
exist in full (see :func:`r1fit.algorithms.logprobs.chunked_token_logprobs`); the per-token entropy
of the policy comes from the same chunks when asked for (:func:`completion_logprobs_and_entropy`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from peft.helpers import disable_input_dtype_casting
from torch import nn
from torch.distributed.fsdp import FSDPModule

from r1fit.algorithms.embedding import embedding_into_grad, embeds_into_grad
from r1fit.algorithms.logprobs import (
    TokenLoss,
    chunked_logprobs_and_entropy,
    chunked_token_logprobs,
    fused_head_loss,
)
from r1fit.data.batch import Batch
from r1fit.models.load import lm_backbone_and_head, unwrap
from r1fit.models.prefix import PackedGroups


class CompletionLogProbs(nn.Module):
    """``model`` -> log-probs of the completion tokens of a batch.

    A module rather than a function so that it can be the FSDP root (see
    :mod:`r1fit.distributed.parallelize`): its forward is the one call the loops make, so FSDP
    gathers the root's parameters (LM head, embeddings) around it, and the LM head's weight is used
    directly in chunks without ever building the [tokens x vocab] logits.

    ``adapter_dtype``: LoRA's adapters compute in it under ``torch.autocast`` in the backbone's
    forward (``model.lora.compute_dtype=model``; :func:`adapters_in`); None: as peft has them."""

    def __init__(self, model: nn.Module, adapter_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.adapter_dtype = adapter_dtype

    def forward(self, batch: Batch | PackedGroups, chunk_size: int, temperature: float = 1.0,
                entropy: bool = False, into_grad: bool = False, token_loss: TokenLoss | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Log-probs [B, Tc] of the completion tokens; with ``entropy``, also the entropy [B, Tc] of
        the policy's distribution at each of them (both 0 where masked). ``batch``: rows collated
        one per completion, or groups packed with their prompt once (:mod:`r1fit.models.prefix`).
        ``into_grad`` (a loop accumulating micro-batches with ``backward()``, not sharded): the
        LM head's and input embedding's ``[vocab x hidden]`` gradients are added into their
        ``.grad`` in place once it exists, instead of each existing in full first
        (:mod:`r1fit.algorithms.embedding`). ``token_loss``: returns (loss, log-probs,
        entropies or None without ``entropy``), the loss that ``token_loss`` makes of the
        completion tokens, flattened in the order of ``batch.completion_mask``, with the LM
        head's gradients made in its forward (:func:`r1fit.algorithms.logprobs.fused_head_loss`;
        the log-probs and entropies detached)."""
        backbone, head = lm_backbone_and_head(self.model)
        into_grad = into_grad and not isinstance(self, FSDPModule)  # FSDP owns sharded .grads
        with _embedding_into_grad(self.model, into_grad), adapters_in(self.model,
                                                                       self.adapter_dtype):
            hidden = backbone(**batch.inputs)  # the head's float32 work stays out of autocast
        if isinstance(batch, PackedGroups):
            predicting = batch.predicting(hidden)
        else:
            width = batch.completion_ids.shape[1]
            # the hidden state at column t predicts the token at column t + 1
            predicting = hidden[:, batch.prompt_len - 1: batch.prompt_len - 1 + width]
        mask = batch.completion_mask.bool()
        args = (predicting[mask], head.weight, batch.completion_ids[mask])
        options = dict(bias=head.bias, chunk_size=chunk_size, temperature=temperature,
                       into_grad=into_grad)
        if token_loss is not None:
            loss, token_logp, token_entropy = fused_head_loss(*args, token_loss, **options,
                                                              with_entropy=entropy)
            return (loss, _unpack(mask, token_logp),
                    None if token_entropy is None else _unpack(mask, token_entropy))
        if not entropy:
            return _unpack(mask, chunked_token_logprobs(*args, **options))
        token_logp, token_entropy = chunked_logprobs_and_entropy(*args, **options)
        return _unpack(mask, token_logp), _unpack(mask, token_entropy)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """The model's ``generate``, through the root so that FSDP initialises and gathers the
        root's parameters around it (registered as an FSDP forward method when sharded)."""
        return self.model.generate(**kwargs)

    def prefill(self, **kwargs: Any) -> Any:
        """The model's own forward (filling a KV cache before ``generate``:
        :mod:`r1fit.rollout.prefill`), through the root like :meth:`generate`."""
        return self.model(**kwargs)


def completion_logprobs(model: Any, batch: Batch | PackedGroups, *, chunk_size: int,
                        temperature: float = 1.0, into_grad: bool = False) -> torch.Tensor:
    """Log-probs [B, Tc] (float32) of the completion tokens of ``batch``; 0 where masked.
    ``model``: a :class:`CompletionLogProbs` (the FSDP root when sharded) or a plain model.
    ``into_grad``: see :meth:`CompletionLogProbs.forward`."""
    module = model if isinstance(model, CompletionLogProbs) else CompletionLogProbs(model)
    return module(batch, chunk_size, temperature, False, into_grad)


def completion_logprobs_and_entropy(model: Any, batch: Batch | PackedGroups, *, chunk_size: int,
                                    temperature: float = 1.0, into_grad: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, Tc] (float32) of the completion tokens of ``batch``, from one pass
    through the LM head; 0 where masked. Both carry gradients (see
    :func:`r1fit.algorithms.logprobs.chunked_logprobs_and_entropy`). ``into_grad``: see
    :meth:`CompletionLogProbs.forward`."""
    module = model if isinstance(model, CompletionLogProbs) else CompletionLogProbs(model)
    return module(batch, chunk_size, temperature, True, into_grad)


def completion_loss(model: Any, batch: Batch | PackedGroups, token_loss: TokenLoss, *,
                    chunk_size: int, temperature: float = 1.0, into_grad: bool = False,
                    entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loss ``token_loss`` makes of the completion tokens of ``batch`` (flattened in the
    order of ``batch.completion_mask``), with the LM head's gradients made in the forward pass,
    and the tokens' log-probs and entropies [B, Tc] (float32, detached; 0 where masked; the
    entropies None, and not computed, without ``entropy``). See
    :func:`r1fit.algorithms.logprobs.fused_head_loss`; ``into_grad``: see
    :meth:`CompletionLogProbs.forward`."""
    module = model if isinstance(model, CompletionLogProbs) else CompletionLogProbs(model)
    return module(batch, chunk_size, temperature, entropy, into_grad, token_loss)


@contextmanager
def adapters_in(model: nn.Module, dtype: torch.dtype | None, *, forward: bool = True
                ) -> Iterator[None]:
    """peft's LoRA adapters computing in ``dtype`` (None: nothing changes): their cast of the
    input to their own float32 off and, in a ``forward``, ``torch.autocast`` to ``dtype``, so
    their products run in it from float32 weights whose gradients stay float32. A backward
    (``forward=False``) takes the cast off too: gradient checkpointing recomputes a layer's
    forward there, under the autocast state it saved (:func:`adapter_backward`)."""
    if dtype is None:
        yield
        return
    device = next(model.parameters()).device.type
    with disable_input_dtype_casting(model):
        if not forward:
            yield
            return
        with torch.autocast(device, dtype=dtype):
            yield


def adapter_backward(model: Any) -> Any:
    """The context a backward through ``model`` (a :class:`CompletionLogProbs` root) runs in:
    :func:`adapters_in` for its ``adapter_dtype``; nothing for any other model."""
    if not isinstance(model, CompletionLogProbs):
        return nullcontext()
    return adapters_in(model.model, model.adapter_dtype, forward=False)


@contextmanager
def _embedding_into_grad(model: nn.Module, on: bool) -> Iterator[None]:
    """While on: the input embedding's output comes from
    :func:`r1fit.algorithms.embedding.embedding_into_grad` (a forward hook replaces the module's
    output with the same values, so its weight gradient goes into ``.grad`` in place). Only for
    a trainable plain ``nn.Embedding`` (a subclass may scale its output, as Gemma's does; a
    max_norm or per-frequency scaling changes the gradient; :func:`embeds_into_grad`):
    anything else is left alone."""
    embed = unwrap(model).get_input_embeddings()
    if not (on and embeds_into_grad(embed) and embed.weight.requires_grad):
        yield
        return

    def replace_output(module: nn.Embedding, args: tuple[Any, ...], output: torch.Tensor
                       ) -> torch.Tensor:
        return embedding_into_grad(args[0], module.weight, module.padding_idx)

    handle = embed.register_forward_hook(replace_output)
    try:
        yield
    finally:
        handle.remove()


def _unpack(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The values of the masked positions back in a [B, Tc] tensor, 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask, values)
