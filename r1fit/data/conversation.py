"""SFT targets of multi-turn rows, and the tokens a chat template writes between two assistant
turns (the tool turn of a multi-turn rollout, a user turn of a conversation).

A row whose conversation holds tool turns (``("tool", text)`` in ``Sample.turns``: a tool
demonstration, :mod:`r1fit.tools.demonstrations`) is laid out as a multi-turn rollout lays out a
trajectory (r1fit/rollout/turns.py), so SFT trains on the tokens GRPO's rollouts produce: each
assistant turn's text tokenized on its own, the turns between two assistant turns encoded by the
processor with their images (:func:`after_assistant_tokens`, which the rollout's tool turns go
through too), the last turn closed by the end-of-turn token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from PIL import Image

from r1fit.data.batch import Prompt, chat_messages, encode_prompts, split_encoded, turn_message
from r1fit.data.errors import BadRowError
from r1fit.data.rows import IMAGE_TOKEN
from r1fit.data.sample import Sample

# written as an assistant turn's text: what the template writes after it follows the marker
_MARKER = "R1FIT-ASSISTANT-TURN-MARKER"

Encoded = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def after_assistant_text(processor: Any, messages: Sequence[dict[str, Any]]) -> str:
    """What the chat template writes after an assistant turn's text when ``messages`` follow it:
    the turn's close, ``messages``, the next assistant turn's opening. Found by rendering them
    after a marker written as the assistant's text, so a template that trims or rewrites
    assistant text cannot shift it."""
    base = [{"role": "user", "content": [{"type": "text", "text": "."}]},
            {"role": "assistant", "content": [{"type": "text", "text": _MARKER}]}]
    text = processor.apply_chat_template([*base, *messages], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_MARKER) != 1:
        raise ValueError("the chat template does not write an assistant turn's text as given; "
                         "the turns after it cannot be told apart")
    return text.split(_MARKER)[1]


def after_assistant_tokens(processor: Any, messages: Sequence[dict[str, Any]],
                           images: Sequence[Image.Image]) -> Encoded:
    """:func:`after_assistant_text` encoded by the processor with the images of ``messages``:
    ``(ids, per-token extras, image tensors)``."""
    return _encode(processor, after_assistant_text(processor, messages), images)


def _encode(processor: Any, text: str, images: Sequence[Image.Image]) -> Encoded:
    """A piece of a conversation (no special tokens added) with its images turned into vision
    tokens."""
    return split_encoded(processor(text=[text], images=list(images) or None, return_tensors="pt",
                                   add_special_tokens=False))


def conversation_target(processor: Any, sample: Sample, system_prompt: str, answer: str, *,
                        end_of_turn: int) -> tuple[Prompt, torch.Tensor, torch.Tensor] | None:
    """For SFT on a row with several assistant turns: ``(prompt, completion ids, mask)``, where
    the prompt runs to the first assistant turn after the row's last image (tool turns' images
    aside), the completion is the rest of the conversation (its last turn replaced by
    ``answer``) and the mask is 1 on the assistant turns. ``None`` for a row with one answer to
    learn (prompt + answer as usual).

    A completion with tool turns is laid out as a rollout's trajectory (the module docstring):
    ``prompt`` holds the tool images' tensors after its own and their per-token extras as
    ``completion_inputs``, each assistant turn that calls a tool is learned up to its last
    character (its close is the tool turn's), the last one with ``end_of_turn``. Without, the
    chat template renders the conversation turn by turn and each piece is tokenized on its own.
    A template whose rendering of a shorter conversation is not a prefix of the longer one makes
    the row bad (``BadRowError``)."""
    turns = list(sample.turns)
    if not turns:
        return None
    last_image = max((i for i, (role, text) in enumerate(turns)
                      if IMAGE_TOKEN in text and role != "tool"), default=-1)
    first = next(i for i, (role, _) in enumerate(turns) if role == "assistant" and i > last_image)
    learned = [i for i in range(first, len(turns)) if turns[i][0] == "assistant"]
    if len(learned) == 1:
        return None
    turns[-1] = ("assistant", answer)
    row = replace(sample, turns=tuple(turns))
    held = sum(text.count(IMAGE_TOKEN) for _, text in turns[:first])
    (prompt,) = encode_prompts(processor, [replace(
        row, turns=tuple(turns[:first + 1]), images=list(row.images[:held]),
        source_images=row.source_images[:held])], system_prompt)
    if any(role == "tool" for role, _ in turns[first:]):
        return _rollout_layout(processor, row, prompt, first, system_prompt, end_of_turn)
    ids, mask = _rendered_layout(processor, row, first, learned, system_prompt)
    return prompt, ids, mask


def _rendered(processor: Any, sample: Sample, turns: Sequence[tuple[str, str]],
              system_prompt: str, generation_prompt: bool) -> str:
    shown = replace(sample, turns=tuple(turns) + ((("assistant", ""),) if generation_prompt else ()))
    return processor.apply_chat_template(chat_messages(shown, system_prompt,
                                                       answer=not generation_prompt),
                                         tokenize=False, add_generation_prompt=generation_prompt)


def _not_turn_by_turn(sample: Sample) -> BadRowError:
    return BadRowError(f"{sample.source}: the chat template does not render this conversation "
                       "turn by turn; SFT cannot tell its assistant turns")


def _rendered_layout(processor: Any, row: Sample, first: int, learned: list[int],
                     system_prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask of a text conversation after turn ``first``'s opening: each turn as the
    template renders it (an assistant turn with its close, scored)."""
    turns, tokenizer = row.turns, processor.tokenizer
    ids: list[int] = []
    mask: list[float] = []
    done = _rendered(processor, row, turns[:first], system_prompt, True)
    for index in learned:
        before = _rendered(processor, row, turns[:index], system_prompt, True)
        after = _rendered(processor, row, turns[:index + 1], system_prompt, False)
        if not (before.startswith(done) and after.startswith(before)):
            raise _not_turn_by_turn(row)
        for text, scored in ((before[len(done):], 0.0), (after[len(before):], 1.0)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids.extend(piece)
            mask.extend([scored] * len(piece))
        done = after
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask)


@dataclass
class _Completion:
    """A completion built piece by piece: ids, mask, per-token extras (0 where a piece has
    none), image tensors and text, as a trajectory grows."""

    ids: list[torch.Tensor] = field(default_factory=list)
    mask: list[torch.Tensor] = field(default_factory=list)
    extras: list[dict[str, torch.Tensor]] = field(default_factory=list)
    images: list[dict[str, torch.Tensor]] = field(default_factory=list)
    text: str = ""

    def add(self, ids: torch.Tensor, mask: torch.Tensor, text: str,
            extras: dict[str, torch.Tensor] | None = None,
            images: dict[str, torch.Tensor] | None = None) -> None:
        self.ids.append(ids.to(torch.long))
        self.mask.append(mask.to(torch.float32))
        self.extras.append(extras or {})
        self.images.append(images or {})
        self.text += text

    def token_inputs(self) -> dict[str, torch.Tensor]:
        keys = dict.fromkeys(k for extras in self.extras for k in extras)
        return {key: torch.cat([extras.get(key, torch.zeros(len(ids), dtype=torch.long))
                                for ids, extras in zip(self.ids, self.extras)]) for key in keys}


def _cat_images(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = dict.fromkeys(k for part in parts for k in part)
    return {key: torch.cat([part[key] for part in parts if key in part]) for key in keys}


def _rollout_layout(processor: Any, row: Sample, prompt: Prompt, first: int, system_prompt: str,
                    end_of_turn: int) -> tuple[Prompt, torch.Tensor, torch.Tensor]:
    """The row laid out as a trajectory after ``prompt`` (the module docstring)."""
    turns, tokenizer = row.turns, processor.tokenizer
    completion = _Completion()
    shown = len(prompt.sample.images)
    index = first
    while index < len(turns):
        role, text = turns[index]
        if role == "assistant":
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if index == len(turns) - 1:
                ids, text = [*ids, end_of_turn], text + tokenizer.decode([end_of_turn])
            completion.add(torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)), text)
            index += 1
            continue
        end = next(i for i in range(index, len(turns)) if turns[i][0] == "assistant")
        count = sum(text.count(IMAGE_TOKEN) for _, text in turns[index:end])
        _add_between(completion, processor, turns[index:end], row.images[shown:shown + count],
                     end_of_turn, row)
        shown, index = shown + count, end
    whole = processor.apply_chat_template(chat_messages(row, system_prompt, answer=True),
                                          tokenize=False)
    start = _rendered(processor, prompt.sample, row.turns[:first], system_prompt, True)
    if not whole.startswith(start + completion.text):
        raise _not_turn_by_turn(row)
    grown = replace(prompt, image_inputs=_cat_images([prompt.image_inputs, *completion.images]),
                    completion_inputs=completion.token_inputs())
    return grown, torch.cat(completion.ids), torch.cat(completion.mask)


def _add_between(completion: _Completion, processor: Any, turns: Sequence[tuple[str, str]],
                 images: Sequence[Image.Image], end_of_turn: int, row: Sample) -> None:
    """The turns between two assistant turns, encoded with their images as a rollout's tool turn
    is; context, but for the close of an assistant turn that called no tool (its first token,
    learned as the end of that turn)."""
    messages = [turn_message(role, text) for role, text in turns]
    try:
        text = after_assistant_text(processor, messages)
    except ValueError:
        raise _not_turn_by_turn(row) from None
    ids, extras, image_inputs = _encode(processor, text, images)
    mask = torch.zeros(len(ids))
    if turns[0][0] != "tool":
        if int(ids[0]) != end_of_turn:
            raise _not_turn_by_turn(row)
        mask[0] = 1.0
    completion.add(ids, mask, text, extras, image_inputs)
