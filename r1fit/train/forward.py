"""Completion log-probs of many rows, ``memory.micro_batch`` rows at a time (the model call itself
is :func:`r1fit.models.logprobs.completion_logprobs`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from r1fit.data.batch import Prompt, collate
from r1fit.models.logprobs import completion_logprobs
from r1fit.rollout.record import Rollout


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


def add_logprobs(rollout: Rollout, run: Any, reference: Any, *, old: bool) -> None:
    """Log-prob stage of a rollout: the old policy's log-probs of this process's rows when the
    rollout is reused (``old``: ``algo.num_iterations`` > 1) and the reference's when there is
    one, ``run.sizes.micro_batch`` rows at a time, no gradients."""
    args = dict(micro_batch=run.sizes.micro_batch, chunk_size=run.cfg.memory.logits_chunk,
                temperature=run.cfg.algo.temperature, pad_id=run.ids.pad, device=run.device)
    rows = rollout.rows
    rollout.old_logp = (logprobs_in_micro_batches(run.policy, rows, rollout.completions, **args)
                        if old else None)
    rollout.ref_logp = None
    if reference is not None:
        with reference.model() as ref_model:
            rollout.ref_logp = logprobs_in_micro_batches(ref_model, rows, rollout.completions,
                                                         **args)
