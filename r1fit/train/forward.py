"""Completion log-probs of many rows, ``memory.micro_batch`` rows at a time (the model call itself
is :func:`r1fit.models.logprobs.completion_logprobs`), each micro-batch collated one row per
completion or, with ``memory.share_prefix``, packed one row per group (:class:`PrefixSharing`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from r1fit.data.batch import Batch, Prompt, collate
from r1fit.distributed.context import all_sum
from r1fit.models.logprobs import completion_logprobs
from r1fit.models.prefix import PackedGroups, pack_groups, shared_prefix_is_exact
from r1fit.rollout.record import Rollout

log = logging.getLogger("r1fit.forward")


def consecutive_groups(prompts: Sequence[Prompt], completions: Sequence[torch.Tensor]
                       ) -> tuple[list[Prompt], list[list[torch.Tensor]]]:
    """Runs of rows sharing one prompt (GRPO's rows are group-contiguous): each prompt once, with
    the completions of its run."""
    unique: list[Prompt] = []
    groups: list[list[torch.Tensor]] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if unique and unique[-1] is prompt:
            groups[-1].append(completion)
        else:
            unique.append(prompt)
            groups.append([completion])
    return unique, groups


class PrefixSharing:
    """How micro-batches reach the model: one row per completion (:func:`collate`), or one per
    group with its prompt once (:func:`pack_groups`) when ``memory.share_prefix`` is on. 'auto'
    decides on the first micro-batch: every process compares the two paths' log-probs on its own
    rows, and sharing is on only if they agree on every process (so all take the same path)."""

    def __init__(self, setting: bool | str) -> None:
        self.on: bool | None = None if setting == "auto" else bool(setting)

    def inputs(self, model: Any, prompts: Sequence[Prompt], completions: Sequence[torch.Tensor],
               *, pad_id: int, device: torch.device, chunk_size: int) -> Batch | PackedGroups:
        """The model inputs of one micro-batch, on ``device``."""
        if self.on is None:
            unique, groups = consecutive_groups(prompts, completions)
            exact = shared_prefix_is_exact(model, unique, groups, pad_id, chunk_size=chunk_size)
            self.on = all_sum([0.0 if exact else 1.0])[0] == 0
            log.info("memory.share_prefix=auto: %s", "on (a group's prompt runs once per "
                     "micro-batch)" if self.on else "off: this model's log-probs differ when "
                     "its completions share a prompt (e.g. bidirectional image attention)")
        if not self.on:
            return collate(prompts, completions, pad_id).to(device)
        unique, groups = consecutive_groups(prompts, completions)
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        return pack_groups(model, unique, groups, pad_id, dtype).to(device)


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
                              device: torch.device, sharing: PrefixSharing | None = None
                              ) -> torch.Tensor:
    """Log-probs [N, max completion length] of all rows, no gradients, ``micro_batch`` rows at a
    time (the old-policy and reference log-probs)."""
    width = max(int(c.shape[0]) for c in completions)
    parts = []
    sharing = sharing or PrefixSharing(False)
    for _, prompts, comps in micro_batches(rows, completions, micro_batch):
        batch = sharing.inputs(model, prompts, comps, pad_id=pad_id, device=device,
                               chunk_size=chunk_size)
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
                temperature=run.cfg.algo.temperature, pad_id=run.ids.pad, device=run.device,
                sharing=run.prefix)
    rows = rollout.rows
    rollout.old_logp = (logprobs_in_micro_batches(run.policy, rows, rollout.completions, **args)
                        if old else None)
    rollout.ref_logp = None
    if reference is not None:
        with reference.model() as ref_model:
            rollout.ref_logp = logprobs_in_micro_batches(ref_model, rows, rollout.completions,
                                                         **args)
