"""Completion log-probs of many rows a micro-batch at a time (the model call itself is
:func:`r1fit.models.logprobs.completion_logprobs`). A micro-batch is ``memory.micro_batch`` rows,
or with ``memory.micro_batch_tokens`` as many consecutive rows as fit in that many tokens; it
reaches the model as :class:`BatchLayout` says: collated one row per completion, packed one row
per group (``memory.share_prefix``), or all in one row without padding (packed)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from r1fit.data.batch import Batch, Prompt, collate, consecutive_groups, micro_batches, pad_rows
from r1fit.errors import R1fitError
from r1fit.models.load import compute_dtype, unwrap
from r1fit.models.logprobs import completion_logprobs
from r1fit.models.packing import PackingCheck, check_packing
from r1fit.models.prefix import PackedGroups, pack_groups
from r1fit.processes import all_sum
from r1fit.rollout.record import Rollout

log = logging.getLogger("r1fit.forward")


class PackingError(R1fitError, ValueError):
    """The model's log-probs change when its sequences are packed; the message says what to set."""


def _flash_attention(model: Any) -> bool:
    """Whether the model runs a flash-attention kernel, which takes no 4-D mask."""
    config = getattr(unwrap(model), "config", None)
    return "flash" in str(getattr(config, "_attn_implementation", "") or "")


class BatchLayout:
    """How micro-batches reach the model: one row per completion (:func:`collate`), or one per
    group with its prompt once (:func:`pack_groups`) when ``memory.share_prefix`` is on; with
    ``packed`` (``memory.micro_batch_tokens`` set) the micro-batch's sequences (its groups, or
    ``[prompt | completion]`` rows) one after another in a single row, no padding.

    Decided once, on the first micro-batch the run scores (:meth:`decide`): ``share_prefix='auto'`` is
    on only if the shared layout's log-probs equal the per-row path's on every process (so all
    take the same path), up to rounding (:func:`r1fit.models.packing.check_packing`); a packed
    layout is checked the same way and refused in one line when it
    differs (a model whose attention is not plain causal within a sequence). Sharing needs a
    4-D mask, which flash-attention kernels do not take: with them 'auto' is off."""

    def __init__(self, share_prefix: bool | str) -> None:
        self.on: bool | None = None if share_prefix == "auto" else bool(share_prefix)
        self.decided = False  # sharing settled (and checked against the attention kernel)
        self.checked_packing = False

    def decide(self, model: Any, rows: Sequence[Prompt], completions: Sequence[torch.Tensor], *,
               pad_id: int, chunk_size: int, micro_batch: int, tokens: int | None) -> None:
        """Settle sharing (``auto``) and, packed by ``tokens``, check packing, on the first
        micro-batch of ``rows`` as the per-row path cuts it (so the check holds no more than a
        micro-batch does)."""
        packed = tokens is not None
        if self.decided and (self.checked_packing or not packed):
            return
        if self.on and _flash_attention(model):
            raise PackingError("memory.share_prefix=true needs a 4-D attention mask, which "
                               "model.attn_implementation=flash_attention_2 does not take: use "
                               "'sdpa', or memory.share_prefix=auto (off with flash attention)")
        if self.on is False and not packed:  # the per-row path: nothing to check
            self.decided = True
            return
        _, first, first_completions = next(micro_batches(rows, completions, micro_batch,
                                                         tokens=tokens))
        unique, groups = consecutive_groups(first, first_completions)
        checks: dict[bool, tuple[PackingCheck, bool]] = {}

        def exact(shared: bool) -> tuple[PackingCheck, bool]:
            """The check of this layout here, and whether it held on every process."""
            if shared not in checks:
                args = (unique, groups) if shared else (
                    [p for p, g in zip(unique, groups) for _ in g], [[c] for g in groups for c in g])
                check = check_packing(model, *args, pad_id, chunk_size=chunk_size,
                                      one_row=packed)
                checks[shared] = check, all_sum([0.0 if check.exact else 1.0])[0] == 0
            return checks[shared]

        if self.on is None:
            if _flash_attention(model):
                self.on = False
                log.info("memory.share_prefix=auto: off (flash attention takes no 4-D mask)")
            else:
                check, self.on = exact(True)
                log.info("memory.share_prefix=auto: %s; %s on this process", "on (a group's "
                         "prompt runs once per micro-batch)" if self.on else "off: this model's "
                         "log-probs differ when its completions share a prompt (e.g. "
                         "bidirectional image attention)", check.describe())
        self.decided = True
        if packed and not self.checked_packing:
            check, ok = exact(bool(self.on))
            if not ok:
                raise PackingError(
                    "memory.micro_batch_tokens: this model's log-probs differ when its sequences "
                    f"are packed into one row ({check.describe()}; its attention is not plain "
                    "causal within a sequence, e.g. bidirectional image attention); unset "
                    "memory.micro_batch_tokens and use memory.micro_batch")
            self.checked_packing = True
            log.info("memory.micro_batch_tokens: packed micro-batches checked equal to the "
                     "per-row path (%s)", check.describe())

    def inputs(self, model: Any, prompts: Sequence[Prompt], completions: Sequence[torch.Tensor],
               *, pad_id: int, device: torch.device, packed: bool = False,
               masks: Sequence[torch.Tensor | None] | None = None) -> Batch | PackedGroups:
        """The model inputs of one micro-batch, on ``device`` (after :meth:`decide` when
        ``share_prefix`` is 'auto'). ``masks``: per completion, the tokens scored (None: all;
        SFT's multi-turn rows)."""
        assert self.on is not None, "BatchLayout.decide() first"
        if not self.on and not packed:
            return collate(prompts, completions, pad_id, masks).to(device)
        if self.on:
            unique, groups = consecutive_groups(prompts, completions)
        else:
            unique, groups = list(prompts), [[c] for c in completions]
        return pack_groups(model, unique, groups, pad_id, compute_dtype(model), one_row=packed,
                           varlen=_flash_attention(model), masks=masks).to(device)


@torch.no_grad()
def logprobs_in_micro_batches(model: Any, rows: Sequence[Prompt],
                              completions: Sequence[torch.Tensor], *, micro_batch: int,
                              chunk_size: int, temperature: float, pad_id: int,
                              device: torch.device, layout: BatchLayout | None = None,
                              tokens: int | None = None) -> torch.Tensor:
    """Log-probs [N, max completion length] of all rows, no gradients, ``micro_batch`` rows (or
    with ``tokens`` that many packed tokens) at a time (the old-policy and reference log-probs)."""
    width = max(int(c.shape[0]) for c in completions)
    parts = []
    layout = layout or BatchLayout(False)
    packed = tokens is not None
    layout.decide(model, rows, completions, pad_id=pad_id, chunk_size=chunk_size,
                  micro_batch=micro_batch, tokens=tokens)
    for _, prompts, comps in micro_batches(rows, completions, micro_batch, tokens=tokens,
                                           shared=bool(layout.on)):
        batch = layout.inputs(model, prompts, comps, pad_id=pad_id, device=device, packed=packed)
        parts.extend(completion_logprobs(model, batch, chunk_size=chunk_size,
                                         temperature=temperature).cpu())
    if isinstance(model, FSDPModule):
        # FSDP keeps the root gathered after a forward, for the backward that usually follows;
        # none follows here (and never for the frozen reference), so free it now
        model.reshard()
    return pad_rows(parts, width)


def longest_row(rows: Sequence[Prompt], completions: Sequence[torch.Tensor]) -> int:
    """Tokens of the longest ``[prompt | completion]``: a packed micro-batch no larger holds one
    row (the OOM guard's floor for ``memory.micro_batch_tokens``)."""
    return max(p.length + int(c.shape[0]) for p, c in zip(rows, completions))


def run_logprobs(run: Any, model: Any, rollout: Rollout) -> torch.Tensor:
    """No-grad log-probs of this process's rows of ``rollout`` under ``model``, micro-batched as
    ``run.sizes`` and ``run.layout`` say."""
    run.sizes.note_sequence(longest_row(rollout.rows, rollout.completions))
    return logprobs_in_micro_batches(
        model, rollout.rows, rollout.completions, micro_batch=run.sizes.micro_batch,
        tokens=run.sizes.micro_batch_tokens, chunk_size=run.cfg.head_chunk(),
        temperature=run.cfg.algo.temperature, pad_id=run.ids.pad, device=run.device,
        layout=run.layout)


def add_logprobs(rollout: Rollout, run: Any, reference: Any) -> Rollout:
    """Log-prob stage: ``rollout`` with the reference's log-probs of this process's rows
    (``ref_logp``) when there is one, a micro-batch at a time (``run.sizes``), no gradients, and
    no old-policy ones (``old_logp`` None): those, which a reused rollout
    (``algo.num_iterations`` > 1) needs, come from the first update's forwards
    (r1fit/train/grpo.py), which run the same weights."""
    ref_logp = None
    if reference is not None:
        with reference.model() as ref_model:
            ref_logp = run_logprobs(run, ref_model, rollout)
    return replace(rollout, old_logp=None, ref_logp=ref_logp)
