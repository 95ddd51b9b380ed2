"""Completion log-probs of a batch, micro-batch by micro-batch, with the LM head in token chunks.

The backbone runs without the LM head; only the hidden states that predict completion tokens go
through the head, ``memory.logits_chunk`` tokens at a time, so the [tokens x vocab] logits never
exist in full (see :func:`r1fit.algorithms.logprobs.chunked_token_logprobs`).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from r1fit.algorithms.logprobs import chunked_token_logprobs
from r1fit.models.load import lm_backbone_and_head
from r1fit.data.batch import Batch, Prompt, collate


class CompletionLogProbs(nn.Module):
    """``model`` -> log-probs of the completion tokens of a batch.

    A module rather than a function so that it can be the FSDP root (see
    :mod:`r1fit.distributed.parallelize`): its forward is the one call the loops make, so FSDP
    gathers the root's parameters (LM head, embeddings) around it, and the LM head's weight is used
    directly in chunks without ever building the [tokens x vocab] logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch, chunk_size: int, temperature: float = 1.0) -> torch.Tensor:
        backbone, head = lm_backbone_and_head(self.model)
        hidden = backbone(**batch.inputs)
        width = batch.completion_ids.shape[1]
        # the hidden state at column t predicts the token at column t + 1
        predicting = hidden[:, batch.prompt_len - 1: batch.prompt_len - 1 + width]
        mask = batch.completion_mask.bool()
        token_logp = chunked_token_logprobs(predicting[mask], head.weight,
                                            batch.completion_ids[mask], bias=head.bias,
                                            chunk_size=chunk_size, temperature=temperature)
        out = torch.zeros(mask.shape, dtype=token_logp.dtype, device=token_logp.device)
        return out.masked_scatter(mask, token_logp)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """The model's ``generate``, through the root so that FSDP initialises and gathers the
        root's parameters around it (registered as an FSDP forward method when sharded)."""
        return self.model.generate(**kwargs)


def completion_logprobs(model: Any, batch: Batch, *, chunk_size: int,
                        temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, Tc] (float32) of the completion tokens of ``batch``; 0 where masked.
    ``model``: a :class:`CompletionLogProbs` (the FSDP root when sharded) or a plain model."""
    module = model if isinstance(model, CompletionLogProbs) else CompletionLogProbs(model)
    return module(batch, chunk_size, temperature)


def micro_batches(rows: Sequence[Prompt], completions: Sequence[torch.Tensor],
                  size: int) -> Iterator[tuple[slice, list[Prompt], list[torch.Tensor]]]:
    """Consecutive slices of at most ``size`` rows."""
    for start in range(0, len(rows), size):
        piece = slice(start, min(start + size, len(rows)))
        yield piece, list(rows[piece]), list(completions[piece])


def pad_rows(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D/2-D row tensors of varying width into [N, width] (zeros after each row)."""
    out = torch.zeros((len(values), width), dtype=values[0].dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[-1]] = v.reshape(-1)
    return out


@torch.no_grad()
def logprobs_in_micro_batches(model: Any, rows: Sequence[Prompt],
                              completions: Sequence[torch.Tensor], *, micro_batch: int,
                              chunk_size: int, temperature: float, pad_id: int,
                              device: torch.device) -> torch.Tensor:
    """Log-probs [N, max completion length] of all rows, no gradients, ``micro_batch`` rows at a
    time (the old-policy and reference log-probs)."""
    width = max(int(c.shape[0]) for c in completions)
    parts = []
    for _, prompts, comps in micro_batches(rows, completions, micro_batch):
        batch = collate(prompts, comps, pad_id).to(device)
        parts.extend(completion_logprobs(model, batch, chunk_size=chunk_size,
                                         temperature=temperature).cpu())
    if isinstance(model, FSDPModule):
        # FSDP keeps the root gathered after a forward, for the backward that usually follows;
        # none follows here (and never for the frozen reference), so free it now
        model.reshard()
    return pad_rows(parts, width)
