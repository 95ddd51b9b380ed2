"""Prompts encoded once, and the collation of prompt + completion sequences into model inputs.

Layout of every batch (generation and training alike, the layout ``generate`` itself produces):
``[left pads | prompt | completion | right pads]``, so all prompts of a batch end at the same column
``prompt_len`` and the completion tokens of every row start there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from r1fit.config import ConfigError
from r1fit.data.errors import BadRowError
from r1fit.data.rows import IMAGE_TOKEN
from r1fit.data.sample import Sample
from r1fit.data.specials import row_special_token, special_token_in, special_tokens


@dataclass
class Prompt:
    """One prompt, processed once per step and shared by all its completions."""

    input_ids: torch.Tensor  # [L] long
    # per-token extras such as mm_token_type_ids (Qwen) or token_type_ids (Gemma 3), each [L]
    token_inputs: dict[str, torch.Tensor]
    image_inputs: dict[str, torch.Tensor]  # per-image tensors (pixel_values, image_grid_thw), cat on dim 0
    sample: Sample
    # per-token extras of the completion that follows, each [completion length]: a multi-turn
    # trajectory's tool turns hold image tokens (whose images are in ``image_inputs``, after the
    # prompt's own); empty for a completion of text only (its extras are 0)
    completion_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def _content(text: str) -> list[dict[str, Any]]:
    """A turn's text as chat-template content: an image part at each ``<image>`` placeholder."""
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(IMAGE_TOKEN)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def turn_message(role: str, text: str) -> dict[str, Any]:
    """One ``(role, text)`` turn as a chat message; a ``"tool"`` turn is the user turn that
    :func:`r1fit.tools.append_tool_turn` writes for a tool's results."""
    return {"role": "user" if role == "tool" else role, "content": _content(text)}


def chat_messages(sample: Sample, system_prompt: str, *, answer: bool = False
                  ) -> list[dict[str, Any]]:
    """The chat messages of a sample: the system text (the row's own system turn wins over
    ``system_prompt``), then its turns up to the answer (``answer=True``: the answer too), each
    image where its placeholder is. A sample without turns is its images, then its question."""
    turns = list(sample.turns) or [("user", IMAGE_TOKEN * len(sample.images) + sample.problem),
                                   ("assistant", sample.solution)]
    if not answer:
        turns = turns[:-1]
    messages: list[dict[str, Any]] = []
    if system_prompt and not any(role == "system" for role, _ in turns):
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.extend(turn_message(role, text) for role, text in turns)
    return messages


def encode_prompts(processor: Any, samples: Sequence[Sample], system_prompt: str) -> list[Prompt]:
    """Apply the chat template and the processor to each sample once (images are preprocessed here,
    never per completion). A system prompt holding one of the model's special tokens is a
    ``ConfigError``, a sample whose own text holds one a ``BadRowError``
    (:mod:`r1fit.data.specials`: callers that skip bad rows filter them first)."""
    specials = special_tokens(processor.tokenizer)
    if system_prompt and (token := special_token_in(system_prompt, specials)) is not None:
        raise ConfigError(f"data.system_prompt holds the model's special token {token!r}; "
                          "write the prompt without it (the chat template adds the turns' "
                          "markers itself)")
    prompts = []
    for sample in samples:
        if (why := row_special_token(sample, specials)) is not None:
            raise BadRowError(why)
        text = processor.apply_chat_template(chat_messages(sample, system_prompt), tokenize=False,
                                             add_generation_prompt=True)
        enc = processor(text=[text], images=list(sample.images) or None, return_tensors="pt",
                        **_template_specials(processor, text))
        prompts.append(Prompt(*split_encoded(enc), sample))
    return prompts


def split_encoded(enc: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(input_ids [L], per-token extras each [L], per-image tensors)`` of one text the processor
    encoded (a batch of one): a tensor of shape ``[1, L]`` is per-token, any other is per-image."""
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
    return input_ids, token_inputs, image_inputs


def _template_specials(processor: Any, text: str) -> dict[str, bool]:
    """``add_special_tokens=False`` for a rendered chat that already starts with the tokenizer's
    bos (Gemma 3's template writes ``<bos>``; a tokenizer that adds one would double it), as
    transformers' own ``apply_chat_template(tokenize=True)`` decides; else the processor's default."""
    bos = processor.tokenizer.bos_token
    return {"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}


class TooLong(str):
    """The message of a row refused because its prompt is longer than ``data.max_prompt_tokens``:
    a ``str`` like every bad-row message, that also keeps the ``length`` and the ``limit``, so a
    summary of many refusals can say how long the prompts were."""

    source: str
    length: int
    limit: int

    def __new__(cls, source: str, length: int, limit: int) -> TooLong:
        message = super().__new__(cls, f"{source}: the prompt has {length} tokens, more than "
                                       f"data.max_prompt_tokens={limit}")
        message.source, message.length, message.limit = source, length, limit
        return message

    def __getnewargs__(self) -> tuple[str, int, int]:  # type: ignore[override]
        return self.source, self.length, self.limit  # so copies and pickles rebuild it


def split_too_long(prompts: Sequence[Prompt], max_tokens: int | None
                   ) -> tuple[list[Prompt], list[str]]:
    """(prompts of at most ``max_tokens`` tokens, one ``"<source>: ..."`` message (a
    :class:`TooLong`) per longer one). A long prompt is never truncated: that would cut image
    tokens out of it."""
    kept: list[Prompt] = []
    errors: list[str] = []
    for prompt in prompts:
        if max_tokens is not None and prompt.length > max_tokens:
            errors.append(TooLong(prompt.sample.source, prompt.length, max_tokens))
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
            pad_id: int, masks: Sequence[torch.Tensor | None] | None = None, *,
            images: bool = True) -> Batch:
    """Left-pad the prompts to a common length and right-pad the completions after them.
    ``masks[i]`` (1 = scored) replaces the all-ones mask of completion ``i`` where given (SFT
    on multi-turn rows scores the assistant turns only). ``images=False`` leaves the image
    tensors out (their tokens' columns stay): for a caller that feeds each distinct prompt's
    images itself."""
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
    token_dtypes = {k: v.dtype for p in prompts
                    for k, v in [*p.token_inputs.items(), *p.completion_inputs.items()]}
    extras = {k: torch.zeros((rows, width), dtype=dtype) for k, dtype in token_dtypes.items()}
    for i, (prompt, comp) in enumerate(zip(prompts, comps)):
        start = prompt_len - prompt.length
        n = int(comp.shape[0])
        input_ids[i, start:prompt_len] = prompt.input_ids
        attention[i, start:prompt_len] = 1
        # a completion's per-token extras (mm_token_type_ids, token_type_ids: 1 on image tokens)
        # stay 0 unless it has image tokens (a trajectory's tool turns)
        for key, value in prompt.token_inputs.items():
            extras[key][i, start:prompt_len] = value
        for key, value in prompt.completion_inputs.items():
            extras[key][i, prompt_len:prompt_len + n] = value
        input_ids[i, prompt_len:prompt_len + n] = comp
        attention[i, prompt_len:prompt_len + n] = 1
        completion_ids[i, :n] = comp
        mask = masks[i] if masks is not None else None
        completion_mask[i, :n] = 1.0 if mask is None else mask.to(torch.float32)
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention, **extras,
                                       **(image_inputs(prompts) if images else {})}
    return Batch(inputs, prompt_len, completion_ids, completion_mask)


def image_inputs(prompts: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    """The image tensors of ``prompts`` (pixel_values, image_grid_thw, ...), each key's
    concatenated over the prompts that have it, in order."""
    keys = dict.fromkeys(k for p in prompts for k in p.image_inputs)
    return {key: torch.cat([p.image_inputs[key] for p in prompts if key in p.image_inputs], dim=0)
            for key in keys}


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


def token_slices(prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
                 continues: Sequence[bool], tokens: int) -> Iterator[tuple[int, int, int, int]]:
    """The greedy cut of rows into consecutive slices of at most ``tokens`` tokens each (a row
    longer than that alone), as ``(start, end, tokens used, prompts run)``. A row costs its
    completion, plus its prompt unless ``continues[i]`` (it shares row i-1's prompt, which the
    slice already holds: memory.share_prefix) and it is not the slice's first. Shared by the loop
    (:func:`micro_batches`) and the planner, so the two cut alike."""
    start = used = prompts = 0
    for i, (prompt, completion, cont) in enumerate(zip(prompt_lengths, completion_lengths,
                                                       continues, strict=True)):
        opens = not (cont and i > start)
        cost = completion + (prompt if opens else 0)
        if i > start and used + cost > tokens:
            yield start, i, used, prompts
            start, used, prompts = i, prompt + completion, 1
        else:
            used, prompts = used + cost, prompts + int(opens)
    if start < len(prompt_lengths):
        yield start, len(prompt_lengths), used, prompts


def micro_batches(rows: Sequence[Prompt], completions: Sequence[torch.Tensor], size: int, *,
                  tokens: int | None = None, shared: bool = False
                  ) -> Iterator[tuple[slice, list[Prompt], list[torch.Tensor]]]:
    """Consecutive slices of at most ``size`` rows; with ``tokens``, of as many rows as fit in
    that many tokens as the model runs them (each row's prompt and completion; with ``shared``
    a group's prompt once per slice), a row longer than ``tokens`` alone (:func:`token_slices`)."""
    if tokens is None:
        bounds = [(start, min(start + size, len(rows))) for start in range(0, len(rows), size)]
    else:
        continues = [shared and i > 0 and rows[i - 1] is row for i, row in enumerate(rows)]
        bounds = [(start, end) for start, end, _, _ in token_slices(
            [p.length for p in rows], [int(c.shape[0]) for c in completions], continues, tokens)]
    for start, end in bounds:
        yield slice(start, end), list(rows[start:end]), list(completions[start:end])


def cut_after_eos(tokens: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """A generated row up to and including its first end-of-sequence token."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos_ids), dtype=tokens.dtype))
    hits = torch.nonzero(is_eos, as_tuple=False)
    if hits.numel() == 0:
        return tokens.clone()
    return tokens[: int(hits[0, 0]) + 1].clone()


def pad_rows(rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Rows of different lengths (1-D, or ``[1, L]``) as one ``[rows, width]`` tensor, zero-padded
    on the right; ``width`` defaults to the longest row's (per-row log-probs of a rollout)."""
    if width is None:
        width = max((int(r.shape[-1]) for r in rows), default=0)
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.float32)
    for i, row in enumerate(rows):
        out[i, :row.shape[-1]] = row.reshape(-1)
    return out
