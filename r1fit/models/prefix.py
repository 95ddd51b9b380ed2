"""Shared-prefix log-probs: a group's prompt runs once and its completions attend to it.

GRPO scores ``G`` completions of one prompt. The per-row path runs ``[prompt | completion_i]`` for
each ``i``: the prompt, its image tokens and the vision tower ``G`` times. Here a group is one
packed sequence ``[prompt | completion_1 | ... | completion_G]`` (the idea of Prefix Grouper,
arXiv 2506.05433) with

* a 4-D attention mask: the prompt is causal; completion ``i`` sees the whole prompt and its own
  earlier tokens, never another completion;
* the position ids each row would have on its own, from the model's own ``get_rope_index`` when it
  has one (Qwen's 3-D M-RoPE positions, computed per row from its image grid), else ``0 .. L-1``
  per row: completion ``i`` starts where the prompt ends, whatever came before it in the packing;
* the image inputs of the prompt once, so the vision tower runs once per group.

:func:`r1fit.models.logprobs.completion_logprobs` takes a :class:`PackedGroups` as it takes a
collated batch, and gives the same [completions, Tc] log-probs.

The hidden state that predicts a completion's first token is the prompt's last one, shared by the
``G`` completions. Log-probs and their gradients then equal the per-row path's up to float
rounding: the same weights see the same tokens at the same positions under the same visibility.
That holds for models whose attention is causal over a sequence and whose positions follow from
``get_rope_index`` or the token index. A model that attends bidirectionally within images (Gemma
3's ``token_type_ids``) or uses sliding windows shorter than a row is not exact this way: the
custom mask replaces the model's own. :func:`r1fit.models.packing.packing_is_exact` checks a model on a batch.

A packed micro-batch (``memory.micro_batch_tokens``, ``one_row=True``) puts several such
sequences (groups, or with sharing off one ``[prompt | completion]`` per row) one after another
in a single row with no padding; each sees only itself, so the same argument holds.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from r1fit.data.batch import Prompt
from r1fit.models.load import unwrap


@dataclass
class PackedGroups:
    """Groups packed one per row: backbone inputs, and where each completion token's predicting
    hidden state is."""

    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask (4-D), position_ids, extras
    predict_at: torch.Tensor  # [rows, Tc] long: column of the hidden state predicting the token
    completion_ids: torch.Tensor  # [rows, Tc] long, pad where masked
    completion_mask: torch.Tensor  # [rows, Tc] float
    row_of: torch.Tensor  # [completions] long: the packed row (group) of each completion

    def predicting(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states [completions, Tc, H] that predict each completion token, from the
        backbone's output [rows, width, H] over the packed rows."""
        return hidden[self.row_of.unsqueeze(1), self.predict_at]

    def to(self, device: torch.device) -> PackedGroups:
        return PackedGroups({k: v.to(device) for k, v in self.inputs.items()},
                            self.predict_at.to(device), self.completion_ids.to(device),
                            self.completion_mask.to(device), self.row_of.to(device))


def completion_extras(prompt: Prompt, n: int) -> dict[str, torch.Tensor]:
    """The per-token extras of ``[prompt | its n-token completion]``, each [prompt.length + n]:
    the prompt's, then the completion's (``prompt.completion_inputs``; 0 for text)."""
    keys = dict.fromkeys([*prompt.token_inputs, *prompt.completion_inputs])
    out = {}
    for key in keys:
        head = prompt.token_inputs.get(key)
        tail = prompt.completion_inputs.get(key)
        like = head if head is not None else tail
        assert like is not None
        out[key] = torch.cat([head if head is not None else like.new_zeros(prompt.length),
                              tail if tail is not None else like.new_zeros(n)])
    return out


def _rope_index(inner: nn.Module, prompt: Prompt, completion: torch.Tensor) -> torch.Tensor:
    """Positions of ``[prompt | completion]`` alone: [D, L] (D = 3 for M-RoPE) or [1, L]."""
    ids = torch.cat([prompt.input_ids, completion.to(prompt.input_ids.dtype)])
    get_rope_index = getattr(inner, "get_rope_index", None)
    if get_rope_index is None:
        return torch.arange(ids.shape[0]).unsqueeze(0)
    accepted = inspect.signature(get_rope_index).parameters
    kwargs: dict[str, Any] = {"attention_mask": torch.ones(1, ids.shape[0], dtype=torch.long)}
    for key, value in completion_extras(prompt, int(completion.shape[0])).items():
        if key in accepted:
            kwargs[key] = value.unsqueeze(0)
    for key, value in prompt.image_inputs.items():
        if key in accepted:
            kwargs[key] = value
    positions, _ = get_rope_index(ids.unsqueeze(0), **kwargs)
    return positions[:, 0] if positions.dim() == 3 else positions


def pack_groups(model: nn.Module, prompts: Sequence[Prompt],
                groups: Sequence[Sequence[torch.Tensor]], pad_id: int,
                dtype: torch.dtype, *, one_row: bool = False, varlen: bool = False,
                masks: Sequence[torch.Tensor | None] | None = None) -> PackedGroups:
    """Pack each prompt with its group of completions (see the module's text). ``one_row=False``:
    one row per group, rows right-padded to the longest. ``one_row=True`` (a packed micro-batch,
    ``memory.micro_batch_tokens``): the groups one after another in a single row, no padding.
    ``dtype``: the additive mask's (the model's).

    The sequences see one another through an additive block mask in the model's dtype (SDPA
    saves it as it is; a boolean mask it would copy to float in every layer). ``varlen`` (for
    flash-attention kernels, which take no 4-D mask; one row of groups of one completion each):
    no mask, the padding-free layout transformers knows instead: text positions that restart at
    0 where each sequence starts (for M-RoPE models as the first of 4 position rows), from which
    the model runs the sequences as varlen ones (``cu_seq_lens``), or with SDPA/eager builds the
    block mask itself. Groups sharing a prompt always need the mask: no position layout says
    "sees the prompt, not its siblings". ``masks`` (one per completion, in order; 1 = scored)
    replaces the all-ones mask of a completion where given, as in :func:`collate` (SFT on
    multi-turn rows scores the assistant turns only)."""
    inner = unwrap(model).model
    lengths = [p.length + sum(int(c.shape[0]) for c in g) for p, g in zip(prompts, groups)]
    if one_row:
        rows, width = 1, sum(lengths)
        offsets = [sum(lengths[:r]) for r in range(len(lengths))]
    else:
        rows, width = len(prompts), max(lengths)
        offsets = [0] * len(lengths)
    padding_free = varlen and one_row and all(len(g) == 1 for g in groups)
    widest = max(int(c.shape[0]) for g in groups for c in g)
    n_completions = sum(len(g) for g in groups)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    visible = (torch.zeros((rows, width, width), dtype=torch.bool) if not padding_free
               else None)
    text_positions = torch.zeros((rows, width), dtype=torch.long)
    row_positions: torch.Tensor | None = None  # [D, rows, width]
    extras = {k: torch.zeros((rows, width), dtype=v.dtype) for p in prompts
              for k, v in [*p.token_inputs.items(), *p.completion_inputs.items()]}
    predict_at = torch.zeros((n_completions, widest), dtype=torch.long)
    completion_ids = torch.full((n_completions, widest), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n_completions, widest))
    row_of = torch.zeros(n_completions, dtype=torch.long)
    causal = torch.ones(max(lengths), max(lengths), dtype=torch.bool).tril()
    out = 0
    for g, (prompt, group) in enumerate(zip(prompts, groups)):
        assert not prompt.completion_inputs or len(group) == 1, \
            "completion_inputs belong to one completion: a trajectory's row is never shared"
        r = 0 if one_row else g
        o, n = offsets[g], prompt.length
        input_ids[r, o:o + n] = prompt.input_ids
        text_positions[r, o:o + lengths[g]] = torch.arange(lengths[g])
        for key, value in prompt.token_inputs.items():
            extras[key][r, o:o + n] = value
        if visible is not None:
            visible[r, o:o + n, o:o + n] = causal[:n, :n]
        start = o + n
        for completion in group:
            k = int(completion.shape[0])
            alone = _rope_index(inner, prompt, completion)  # [D, n + k]
            if row_positions is None:
                row_positions = torch.zeros((alone.shape[0], rows, width), dtype=alone.dtype)
            row_positions[:, r, o:o + n] = alone[:, :n]
            row_positions[:, r, start:start + k] = alone[:, n:]
            input_ids[r, start:start + k] = completion
            for key, value in prompt.completion_inputs.items():  # a trajectory's image tokens
                extras[key][r, start:start + k] = value
            if visible is not None:
                visible[r, start:start + k, o:o + n] = True
                visible[r, start:start + k, start:start + k] = causal[:k, :k]
            # token 0 is predicted by the prompt's last hidden state, token j by token j - 1
            predict_at[out, :k] = torch.cat([torch.tensor([o + n - 1]),
                                             torch.arange(start, start + k - 1)])
            completion_ids[out, :k] = completion
            mask = masks[out] if masks is not None else None
            completion_mask[out, :k] = 1.0 if mask is None else mask.to(torch.float32)
            row_of[out] = r
            out += 1
            start += k
    assert row_positions is not None, "a group without completions"
    position_ids = row_positions  # [D, rows, width]
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
    if visible is None:
        # no mask: the model reads the sequence starts off the text positions
        if position_ids.shape[0] == 3:  # M-RoPE: text positions first, as transformers expects
            position_ids = torch.cat([text_positions.unsqueeze(0), position_ids])
    else:
        # padding columns see only themselves (a softmax over nothing would be NaN); nothing
        # sees them
        pads = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
        if not one_row:
            visible |= torch.diag_embed(pads)
        mask = torch.zeros((rows, 1, width, width), dtype=dtype)
        mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(dtype).min)
        inputs["attention_mask"] = mask
    if position_ids.shape[0] == 1:
        position_ids = position_ids[0]
    inputs.update(position_ids=position_ids, **extras)
    for key in dict.fromkeys(k for p in prompts for k in p.image_inputs):
        inputs[key] = torch.cat([p.image_inputs[key] for p in prompts if key in p.image_inputs])
    return PackedGroups(inputs, predict_at, completion_ids, completion_mask, row_of)


def packed_tokens(prompts: Sequence[Prompt], groups: Sequence[Sequence[torch.Tensor]]) -> int:
    """Tokens the model runs for these groups packed (each prompt once, then its completions)."""
    return sum(p.length + sum(int(c.shape[0]) for c in g) for p, g in zip(prompts, groups))
