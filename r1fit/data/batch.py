"""Prompts encoded once, and the collation of prompt + completion sequences into model inputs.

Layout of every batch (generation and training alike, the layout ``generate`` itself produces):
``[left pads | prompt | completion | right pads]``, so all prompts of a batch end at the same column
``prompt_len`` and the completion tokens of every row start there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from r1fit.data.sample import Sample


@dataclass
class Prompt:
    """One prompt, processed once per step and shared by all its completions."""

    input_ids: torch.Tensor  # [L] long
    token_inputs: dict[str, torch.Tensor]  # per-token extras such as mm_token_type_ids, each [L]
    image_inputs: dict[str, torch.Tensor]  # per-image tensors (pixel_values, image_grid_thw), cat on dim 0
    sample: Sample

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def chat_messages(sample: Sample, system_prompt: str) -> list[dict[str, Any]]:
    """The Qwen-style chat messages of a sample: system text, then the user's images and question."""
    user = [{"type": "image"} for _ in sample.images] + [{"type": "text", "text": sample.problem}]
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": user})
    return messages


def encode_prompts(processor: Any, samples: Sequence[Sample], system_prompt: str) -> list[Prompt]:
    """Apply the chat template and the processor to each sample once (images are preprocessed here,
    never per completion)."""
    prompts = []
    for sample in samples:
        text = processor.apply_chat_template(chat_messages(sample, system_prompt), tokenize=False,
                                             add_generation_prompt=True)
        enc = processor(text=[text], images=list(sample.images) or None, return_tensors="pt")
        input_ids = enc["input_ids"][0]
        length = input_ids.shape[0]
        token_inputs, image_inputs = {}, {}
        for key, value in enc.items():
            if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 2 and value.shape == (1, length):
                token_inputs[key] = value[0]
            else:
                image_inputs[key] = value
        prompts.append(Prompt(input_ids, token_inputs, image_inputs, sample))
    return prompts


def split_too_long(prompts: Sequence[Prompt], max_tokens: int | None
                   ) -> tuple[list[Prompt], list[str]]:
    """(prompts of at most ``max_tokens`` tokens, one ``"<source>: ..."`` message per longer one).
    A long prompt is never truncated: that would cut image tokens out of it."""
    kept, errors = [], []
    for prompt in prompts:
        if max_tokens is not None and prompt.length > max_tokens:
            errors.append(f"{prompt.sample.source}: the prompt has {prompt.length} tokens, more "
                          f"than data.max_prompt_tokens={max_tokens}")
        else:
            kept.append(prompt)
    return kept, errors


def decode_completions(processor: Any, completions: Sequence[torch.Tensor]) -> list[str]:
    """Completion token rows as text (special tokens left out)."""
    return processor.tokenizer.batch_decode([c.tolist() for c in completions],
                                            skip_special_tokens=True)


@dataclass
class Batch:
    """Model inputs for rows of ``[pads | prompt | completion | pads]``."""

    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask, per-token extras, image tensors
    prompt_len: int  # column where every completion starts
    completion_ids: torch.Tensor  # [B, Tc] (pad where masked)
    completion_mask: torch.Tensor  # [B, Tc] float, 1 on real completion tokens

    def to(self, device: torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.prompt_len,
                     self.completion_ids.to(device), self.completion_mask.to(device))


def collate(prompts: Sequence[Prompt], completions: Sequence[torch.Tensor] | None,
            pad_id: int) -> Batch:
    """Left-pad the prompts to a common length and right-pad the completions after them."""
    rows = len(prompts)
    prompt_len = max(p.length for p in prompts)
    comps = list(completions) if completions is not None else [torch.zeros(0, dtype=torch.long)] * rows
    comp_len = max((int(c.shape[0]) for c in comps), default=0)
    width = prompt_len + comp_len
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    completion_ids = torch.full((rows, comp_len), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((rows, comp_len), dtype=torch.float32)
    # text-only prompts may lack keys that image prompts carry: absent per-token extras are zeros
    token_dtypes = {k: v.dtype for p in prompts for k, v in p.token_inputs.items()}
    token_keys = list(token_dtypes)
    extras = {k: torch.zeros((rows, width), dtype=token_dtypes[k]) for k in token_keys}
    for i, (prompt, comp) in enumerate(zip(prompts, comps)):
        start = prompt_len - prompt.length
        input_ids[i, start:prompt_len] = prompt.input_ids
        attention[i, start:prompt_len] = 1
        # completion tokens are text: their per-token extras (mm_token_type_ids) stay 0
        for key in token_keys:
            if key in prompt.token_inputs:
                extras[key][i, start:prompt_len] = prompt.token_inputs[key]
        n = int(comp.shape[0])
        input_ids[i, prompt_len:prompt_len + n] = comp
        attention[i, prompt_len:prompt_len + n] = 1
        completion_ids[i, :n] = comp
        completion_mask[i, :n] = 1.0
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention, **extras}
    image_keys = dict.fromkeys(k for p in prompts for k in p.image_inputs)
    for key in image_keys:
        inputs[key] = torch.cat([p.image_inputs[key] for p in prompts if key in p.image_inputs], dim=0)
    return Batch(inputs, prompt_len, completion_ids, completion_mask)


def cut_after_eos(tokens: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """A generated row up to and including its first end-of-sequence token."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos_ids), dtype=tokens.dtype))
    hits = torch.nonzero(is_eos, as_tuple=False)
    if hits.numel() == 0:
        return tokens.clone()
    return tokens[: int(hits[0, 0]) + 1].clone()
