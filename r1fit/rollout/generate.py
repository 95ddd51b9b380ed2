"""Rollout generation with Hugging Face ``generate``, in chunks of ``generation_batch`` sequences.

Peak memory of generation is set by the chunk size (KV cache of ``generation_batch`` sequences), not
by how many completions a step asks for. The model is put in eval mode while generating: that turns
gradient checkpointing off (transformers only checkpoints in training mode) and keeps the KV cache on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import GenerationConfig

from r1fit.rollout.batch import Prompt, collate, cut_after_eos


@dataclass
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass
class TokenIds:
    """Token ids generation needs, read from the model's config and tokenizer."""

    pad: int
    eos: list[int]
    blocked: list[int]  # image/video placeholders must never be sampled


def generation_config(settings: SamplingSettings, ids: TokenIds) -> GenerationConfig:
    """A complete generation config, so a checkpoint's own defaults (top_k=50, ...) never leak in."""
    common = dict(max_new_tokens=settings.max_new_tokens, pad_token_id=ids.pad,
                  eos_token_id=list(ids.eos), use_cache=True,
                  suppress_tokens=list(ids.blocked) or None)
    if settings.greedy:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=settings.temperature, top_p=settings.top_p,
                            top_k=0, **common)


@torch.no_grad()
def generate_completions(model: Any, prompts: Sequence[Prompt], *, repeats: int, batch_size: int,
                         settings: SamplingSettings, ids: TokenIds, device: torch.device,
                         on_chunk: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Sample ``repeats`` completions per prompt; returns them group-contiguous, each cut after EOS.

    Row ``i * repeats + j`` is completion ``j`` of prompt ``i``.
    """
    rows = [p for p in prompts for _ in range(repeats)]
    gen_config = generation_config(settings, ids)
    was_training = model.training
    model.eval()
    completions: list[torch.Tensor] = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            batch = collate(chunk, None, ids.pad).to(device)
            out = model.generate(**batch.inputs, generation_config=gen_config)
            new_tokens = out[:, batch.prompt_len:].cpu()
            completions.extend(cut_after_eos(row, ids.eos) for row in new_tokens)
            if on_chunk is not None:
                on_chunk(len(chunk))
    finally:
        model.train(was_training)
    return completions
