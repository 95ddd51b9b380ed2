"""A decode step's attention with each prompt's keys and values held once for all the rows that
share it (``rollout.static.share_prompt``).

A GRPO step generates G completions of every prompt. Where each row holds its own copy of the
prompt in the KV cache (the static engine's plain layout), a decode step reads the prompt's
keys and values G times; a VLM prompt (hundreds or thousands of image tokens) is most of each
row's cache. Here the cache is split in two halves:

- **the prompts' half** (:class:`SharedPrompts`): per layer ``[prompts, kv heads, width, head
  dim]``, each distinct prompt of the chunk once, left-padded to the chunk's prompt width, with
  its mask ``[prompts, width]``;
- **the rows' half**: the engine's row buffers, now holding only the completion's columns.

:func:`shared_prompt_attention` attends to both and merges them by their log-sum-exp, exactly
what one softmax over the concatenated columns gives. The prompt half is one matrix product per
(prompt, KV head): the queries of a prompt's rows (and of each KV head's group of query heads)
are placed side by side in that prompt's slots (``prompt_of`` x ``places`` + ``place``), so the
prompt's keys are read once a step, not once a row. Scores are computed as transformers' eager
attention does (the products in the model's dtype, the softmax in float32).

Each row's tokens are the ones the plain layout gives (the same model, the same positions and
masks; greedy tokens compared on every built-in family without sliding-window layers,
tests/rollout/test_static_engine.py). Models whose layers attend within a sliding window
(Gemma 3) keep the plain layout, as does a multi-turn call (a kept cache grows per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: the model-call keyword the shared half travels under (transformers passes unknown keywords
#: of a forward on to each attention layer's function)
SHARED_KEYWORD = "r1fit_prompts"


@dataclass(frozen=True)
class SharedPrompts:
    """The prompts' half of a shared-layout cache: per layer ``keys``/``values`` ``[prompts, kv
    heads, width, head dim]`` (one entry per slot, :func:`prompt_slots`), ``mask`` ``[prompts,
    width]`` (True: a real token), and per row of the engine its slot (``prompt_of``) and its
    place in it (``place`` < ``places``). The tensors are allocated once (a captured graph reads
    them)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    prompt_of: torch.Tensor
    place: torch.Tensor
    places: int
    #: 16-bit products written in float32 (``torch.bmm``'s ``out_dtype``, CUDA): the scores and
    #: weighted values keep float32 as sdpa's kernels do, instead of rounding to the model's
    #: dtype before the softmax (:func:`float32_products`)
    wide: bool = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def first(self, count: int) -> SharedPrompts:
        """Views of the first ``count`` slots (a call's): a step reads only those, not every
        slot an earlier, larger call needed (an evaluation's rows are each their own prompt)."""
        return SharedPrompts(keys=[k[:count] for k in self.keys],
                             values=[v[:count] for v in self.values], mask=self.mask[:count],
                             prompt_of=self.prompt_of, place=self.place, places=self.places,
                             wide=self.wide)


def float32_products(device: torch.device) -> bool:
    """Whether 16-bit batched products on ``device`` can be written in float32
    (``torch.bmm(a, b, out_dtype=torch.float32)``: CUDA, recent torch); asked once per engine,
    before anything is captured or compiled."""
    if device.type != "cuda":
        return False
    try:
        a = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.dtype, wide: bool) -> torch.Tensor:
    """``a @ b`` over matching leading dims, in ``out`` (float32 or wider); ``wide``: 16-bit
    inputs written straight to float32 by one batched product, else in the inputs' dtype and
    converted."""
    if wide and a.dtype in (torch.bfloat16, torch.float16):
        lead = a.shape[:-2]
        product = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
                            out_dtype=torch.float32)
        return product.view(*lead, a.shape[-2], b.shape[-1])
    return torch.matmul(a, b).to(out)


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor, wide: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted values in the scores' dtype, the scores' max, the sum of their exponentials
    after it) of ``scores`` [..., columns] (float32 or wider) over ``values`` [..., columns,
    dim]."""
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    return _product(weights.to(values.dtype), values, scores.dtype, wide), top, total


def shared_prompt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            shared: SharedPrompts, scaling: float | None = None
                            ) -> torch.Tensor:
    """One decode step's attention (``query`` [rows, heads, 1, dim]) over the row's prompt
    (``shared``, layer ``module.layer_idx``) and its own completion columns (``key``/``value``
    [rows, kv heads, columns, dim] under ``attention_mask`` [rows, 1, 1, >= columns], boolean
    or additive): [rows, 1, heads, dim], as transformers' attention functions return it."""
    rows, heads, _, dim = query.shape
    kv = key.shape[1]
    group = heads // kv
    scale = dim ** -0.5 if scaling is None else scaling
    # query head h reads KV head h // group (transformers' repeat_kv order)
    q = query.reshape(rows, kv, group, dim)
    acc = torch.promote_types(query.dtype, torch.float32)  # the softmax's dtype
    # the rows' own columns
    own = _product(q, key.transpose(-1, -2), acc, shared.wide) * scale  # [rows, kv, group, cols]
    mask = attention_mask[:, :, :, :key.shape[-2]]
    own = own.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else own + mask
    own_out, own_top, own_total = _softmax_parts(own, value, shared.wide)
    # the prompts' columns: each prompt's rows side by side in its slots
    layer = module.layer_idx
    keys, values = shared.keys[layer], shared.values[layer]
    prompts, places = keys.shape[0], shared.places
    slots = shared.prompt_of[:rows] * places + shared.place[:rows]
    placed = q.new_zeros(prompts * places, kv, group, dim).index_copy_(0, slots, q)
    placed = placed.view(prompts, places, kv, group, dim).transpose(1, 2).reshape(
        prompts, kv, places * group, dim)
    scores = _product(placed, keys.transpose(-1, -2), acc, shared.wide) * scale
    scores = scores.masked_fill(~shared.mask[:, None, None, :], float("-inf"))
    parts = _softmax_parts(scores, values, shared.wide)

    def by_row(t: torch.Tensor) -> torch.Tensor:  # [prompts, kv, places x group, n] -> rows
        n = t.shape[-1]
        return t.view(prompts, kv, places, group, n).transpose(1, 2).reshape(
            prompts * places, kv, group, n).index_select(0, slots)

    prompt_out, prompt_top, prompt_total = (by_row(t) for t in parts)
    top = torch.maximum(own_top, prompt_top)
    own_scale, prompt_scale = torch.exp(own_top - top), torch.exp(prompt_top - top)
    out = (own_out * own_scale + prompt_out * prompt_scale) / (
        own_total * own_scale + prompt_total * prompt_scale)
    return out.to(query.dtype).reshape(rows, 1, heads, dim)


def supports_shared_prompts(model: Any, config: Any) -> str | None:
    """None where the static engine can share prompts for ``model`` (its text ``config``), else
    why not (one line)."""
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        return f"its layers attend within a sliding window ({', '.join(sorted(kinds))})"
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    indexed = {m.layer_idx for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")}
    if layers and not set(range(layers)) <= indexed:
        return "its attention layers do not say their index (layer_idx)"
    return None


def prompt_slots(index: list[int], places: int) -> tuple[list[int], list[int], list[int]]:
    """The prompts' half's slots for rows whose prompts are ``index`` (each row's distinct
    prompt), each slot serving at most ``places`` rows of one prompt: (each row's slot, each
    row's place in it, each slot's prompt). A prompt with more rows than ``places`` takes
    several slots, each its own copy.

    ``places`` is fixed for the engine's life, not taken from the call: the matrix product
    that reads a slot's prompt runs over ``places`` x the query heads of a KV head whatever the
    batch, so a row's numbers (and its sampled tokens) do not depend on its batch-mates."""
    slot_of, place, prompt_of_slot = [], [], []
    open_slot: dict[int, int] = {}  # prompt -> its slot still taking rows
    taken: list[int] = []  # rows placed in each slot so far
    for p in index:
        slot = open_slot.get(p)
        if slot is None or taken[slot] >= places:
            slot = len(prompt_of_slot)
            prompt_of_slot.append(p)
            taken.append(0)
            open_slot[p] = slot
        place.append(taken[slot])
        taken[slot] += 1
        slot_of.append(slot)
    return slot_of, place, prompt_of_slot
