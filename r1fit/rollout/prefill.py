"""A group's prompt prefilled once per generation batch (``rollout.share_prefill``).

GRPO generates ``G`` completions of each prompt. ``generate`` on the ``G`` copies of a prompt
prefills it ``G`` times: its text, its image tokens and the vision tower. Here the generation
batch's distinct prompts run through the model once each, all but their last token, into a KV
cache; the cache rows are copied to the rows that share them (``Cache.batch_select_indices``),
and ``generate`` continues from that cache. It runs the prompts' last token (a text token of the
generation prompt) for every row, then decodes as before.

The continuation is ``generate``'s own: it takes the rows' full ``input_ids`` and attention mask,
computes their positions and masks, and only skips the cached columns. Qwen-VL models keep their
prefill's M-RoPE offsets (``rope_deltas``, one per row: how far an image's 3-D positions moved
the text after it) on the backbone and add them to every later position; they are copied to the
rows like the cache. A model without a position rule of its own (no ``get_rope_index``) gets
its prefill's positions counted from each row's first real token, as ``generate`` counts them;
its forward alone would count the left padding too. The image inputs are not passed to
``generate``: their tokens are cached.

Each row's cache is the one its own prefill would build (the same weights over the same tokens at
the same positions), so the logits equal the per-row path's up to float rounding between batch
shapes. :func:`prefill_is_exact` checks that on a model (``auto`` runs it once per run).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from r1fit.data.batch import Prompt, collate, image_inputs
from r1fit.models.load import is_16_bit, unwrap
from r1fit.models.logprobs import CompletionLogProbs

log = logging.getLogger("r1fit.rollout")

#: the most the two paths' per-step log-softmax may differ by (max over the vocabulary) in a
#: float32 or float64 model: float rounding between batch shapes, well below what positions
#: shifted by one move it on the random-weight test models (~1e-3)
TOLERANCE = 1e-4
#: the same in a 16-bit model, whose logits of magnitude 32 are 0.25 apart in bfloat16: rounding
#: alone can reach that. It catches gross errors only: on the random-weight built-ins, M-RoPE
#: offsets left off move the log-softmax by 0.001-0.08, within 16-bit rounding of it
HALF_TOLERANCE = 0.25
#: the most the two paths' cached keys of real tokens may differ by, relative to the keys' largest
#: magnitude, in any layer: rotary positions rotate keys, so a position error shows there at full
#: size (measured on the built-ins: 1.3-1.9 with the M-RoPE offsets left off) where rounding
#: between batch shapes stays near one unit of the dtype (at most 5.3e-3 in bfloat16, 7e-4 in
#: float16, 4e-7 in float32)
KEY_TOLERANCE = 1e-4
HALF_KEY_TOLERANCE = 0.05


def distinct_prompts(rows: Sequence[Prompt]) -> tuple[list[Prompt], torch.Tensor]:
    """The distinct prompts of ``rows`` (the same object, in order of first appearance) and, per
    row, the index of its prompt among them."""
    unique: list[Prompt] = []
    position: dict[int, int] = {}
    index = []
    for row in rows:
        if id(row) not in position:
            position[id(row)] = len(unique)
            unique.append(row)
        index.append(position[id(row)])
    return unique, torch.tensor(index, dtype=torch.long)


def rope_holders(model: Any) -> list[torch.nn.Module]:
    """The modules that keep the prefill's per-row M-RoPE offsets (Qwen-VL's backbone)."""
    top = unwrap(model)
    return [m for m in (top, getattr(top, "model", None))
            if isinstance(m, torch.nn.Module) and hasattr(m, "rope_deltas")]


def token_keys(rows: Sequence[Prompt]) -> set[str]:
    """The collated inputs that hold one value per token column (the rest are image tensors)."""
    return {"input_ids", "attention_mask", *(k for p in rows for k in p.token_inputs)}


def prefilled_inputs(model: Any, rows: Sequence[Prompt], inputs: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """``generate``'s inputs for ``rows`` (``inputs``: collated, padded on the left) with each
    distinct prompt run once, all but its last column, into a KV cache copied to the rows that
    share it. Call under ``torch.no_grad`` with the model in eval mode, as ``generate`` runs."""
    unique, index = distinct_prompts(rows)
    device = inputs["input_ids"].device
    first = torch.tensor([index.tolist().index(u) for u in range(len(unique))], device=device)
    keys = token_keys(rows)
    prefix = {k: v[first, :-1] for k, v in inputs.items() if k in keys}
    prefix.update({k: v.to(device) for k, v in image_inputs(unique).items()})
    _, cache, holders = prefill_forward(model, prefix)
    index = index.to(device)
    cache.batch_select_indices(index)
    for module in holders:
        deltas = module.rope_deltas
        if isinstance(deltas, torch.Tensor) and deltas.shape[0] == len(unique) > 1:
            module.rope_deltas = deltas[index.to(deltas.device)]
    out = {k: v for k, v in inputs.items() if k in keys}
    out[cache_argument(unwrap(model))] = cache
    return out


def cache_argument(model: Any) -> str:
    """The transformers ``model``'s forward's name for the KV cache: ``cache`` from transformers
    5.24 on, before it ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """A transformers output's KV cache: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still reads it, with a deprecation warning), before it
    ``past_key_values``."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def keeps_logits(model: Any) -> bool:
    """Whether the transformers ``model``'s forward takes ``logits_to_keep``."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def position_rule(model: Any) -> Any:
    """The module whose ``get_rope_index`` computes the model's positions itself (Qwen-VL's),
    or None."""
    return next((m for m in (unwrap(model), *rope_holders(model))
                 if hasattr(m, "get_rope_index")), None)


def own_position_rule(model: Any) -> bool:
    """Whether the model computes its positions itself (Qwen-VL's ``get_rope_index``)."""
    return position_rule(model) is not None


def prefill_forward(model: Any, inputs: dict[str, torch.Tensor]
                    ) -> tuple[Any, DynamicCache, list[torch.nn.Module]]:
    """``inputs`` (token columns padded on the left, and their image tensors) through the model's
    forward into a new ``DynamicCache``, only the last column's logits computed: ``(output,
    cache, the modules holding the M-RoPE offsets)``. A stale offset from an earlier call is
    cleared first; a model without its own position rule, or a batch without images or videos,
    gets positions counted from each row's first real token, as ``generate`` counts them (its
    forward alone would count padding too)."""
    base = unwrap(model)
    cache = DynamicCache(config=base.config)
    holders = rope_holders(model)
    for module in holders:
        module.rope_deltas = None
    kwargs: dict[str, Any] = {cache_argument(base): cache, "use_cache": True}
    # Qwen-VL's rule places a batch's tokens only where it has images or videos; a text-only
    # batch would be counted from its first column, padding included (transformers 5)
    if not own_position_rule(model) or not any(
            inputs.get(key) is not None for key in ("image_grid_thw", "video_grid_thw")):
        mask = inputs["attention_mask"]
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 0)
    if keeps_logits(base):
        kwargs["logits_to_keep"] = 1  # the prefill's other logits are not needed: skip [L x vocab]
    # through r1fit's log-prob root when it holds the model (FSDP gathers around its methods)
    out = (model.prefill if isinstance(model, CompletionLogProbs) else model)(**inputs, **kwargs)
    return out, cache, holders


def logits_differ(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest difference of log-softmax between two runs' raw per-step logits ([rows,
    vocab] each); infinite when they ran different numbers of steps."""
    if len(a) != len(b):
        return float("inf")
    return max((float((x.double().log_softmax(-1) - y.double().log_softmax(-1)).abs().max())
                for x, y in zip(a, b)), default=0.0)


def keys_differ(a: Any, b: Any, mask: torch.Tensor) -> float | None:
    """The largest relative difference between two caches' keys (``Cache.layers[i].keys``,
    [rows, heads, length, dim]) over the columns ``mask`` marks (its last ``length`` columns
    for a layer that keeps fewer, as sliding-window layers do): max |a - b| / max |b| per layer,
    the worst layer. Infinite when their shapes differ; None when a cache has no such keys (a
    model whose cache r1fit cannot read: the check then rests on the logits)."""
    layers_a, layers_b = getattr(a, "layers", None), getattr(b, "layers", None)
    if not layers_a or not layers_b or len(layers_a) != len(layers_b):
        return None
    worst = 0.0
    for layer_a, layer_b in zip(layers_a, layers_b):
        ka, kb = getattr(layer_a, "keys", None), getattr(layer_b, "keys", None)
        if not isinstance(ka, torch.Tensor) or not isinstance(kb, torch.Tensor):
            return None
        if ka.shape != kb.shape or ka.shape[2] > mask.shape[1]:
            return float("inf")
        real = mask[:, -ka.shape[2]:].to(ka.device).bool()[:, None, :, None]
        diff = ((ka.double() - kb.double()).abs() * real).amax()
        scale = (kb.double().abs() * real).amax().clamp_min(torch.finfo(torch.float64).tiny)
        worst = max(worst, float(diff / scale))
    return worst


def _sample_rows(rows: Sequence[Prompt]) -> list[Prompt]:
    """Two rows of each of the first two prompts that have two: the smallest check of a copied
    cache, and of copies of different prompts in one batch."""
    unique, index = distinct_prompts(rows)
    shared = [p for i, p in enumerate(unique) if int((index == i).sum()) >= 2][:2]
    return [p for p in shared for _ in range(2)]


def _padded_left(inputs: dict[str, torch.Tensor], keys: set[str], columns: int, pad_id: int
                 ) -> dict[str, torch.Tensor]:
    """``inputs`` with ``columns`` more padding columns on the left of every row."""
    out = dict(inputs)
    for key in keys & inputs.keys():
        value = inputs[key]
        fill = value.new_full((value.shape[0], columns), pad_id if key == "input_ids" else 0)
        out[key] = torch.cat([fill, value], dim=1)
    return out


#: padding columns the check adds to every row: a prefill whose positions count the padding (as
#: Gemma 3's forward alone does, before r1fit passes positions) must show even when the checked
#: prompts are of equal length
CHECK_PADDING = 3


@dataclass(frozen=True)
class PrefillCheck:
    """What :func:`prefill_check` measured: the two paths' distances and the bounds they are held
    to (16-bit models get the wider ``HALF_*`` ones)."""

    logits: float  # largest log-softmax difference (:func:`logits_differ`); NaN when not run
    keys: float | None  # largest relative key difference (:func:`keys_differ`); None: unreadable
    logits_tolerance: float
    keys_tolerance: float
    error: str | None = None  # why the shared path could not be compared at all

    @property
    def exact(self) -> bool:
        """Both distances within their bounds (NaN is not) and no error."""
        return self.error is None and self.logits <= self.logits_tolerance and (
            self.keys is None or self.keys <= self.keys_tolerance)

    def reason(self) -> str:
        """One line: why it is exact or not, with the distances."""
        if self.error is not None:
            return self.error
        if not self.logits <= self.logits_tolerance:
            return (f"its logits differ from the per-row path's by {self.logits:.3g} "
                    f"(tolerance {self.logits_tolerance:g})")
        if self.keys is not None and not self.keys <= self.keys_tolerance:
            return (f"its cached keys differ from the per-row path's by {self.keys:.3g} of "
                    f"their magnitude (tolerance {self.keys_tolerance:g}): positions differ")
        return (f"logits equal the per-row path's within {self.logits:.2g}" +
                (f", cached keys within {self.keys:.2g}" if self.keys is not None else
                 "; its cache's keys are not readable, so only the logits were compared"))


def prefill_check(model: Any, rows: Sequence[Prompt], config: GenerationConfig, pad_id: int,
                  device: torch.device, steps: int = 2) -> PrefillCheck:
    """Run ``generate`` from a shared prefill and per row on a few of ``rows``, each padded on
    the left (greedy, ``steps`` tokens), and measure how far apart their logits and cached keys
    are. Any error of the shared path (a model whose cache cannot be copied by rows) is recorded
    as ``error`` (not exact)."""
    half = is_16_bit(model)
    bounds = ((HALF_TOLERANCE, HALF_KEY_TOLERANCE) if half else (TOLERANCE, KEY_TOLERANCE))
    sample = _sample_rows(rows)
    if not sample:
        return PrefillCheck(float("nan"), None, *bounds,
                            error="no prompt has two rows to share it")
    check = copy.deepcopy(config)
    check.max_new_tokens, check.min_new_tokens = steps, None
    check.output_logits, check.return_dict_in_generate = True, True
    check.use_cache = True  # the caches' keys are compared too
    inputs = _padded_left(collate(sample, None, pad_id).to(device).inputs, token_keys(sample),
                          CHECK_PADDING, pad_id)
    plain = model.generate(**inputs, generation_config=check, synced_gpus=False)
    try:
        shared = model.generate(**prefilled_inputs(model, sample, inputs),
                                generation_config=check, synced_gpus=False)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError,
            NotImplementedError) as err:
        return PrefillCheck(float("nan"), None, *bounds, error=(
            f"generate from a copied cache fails ({type(err).__name__}: {err})"))
    # the cache holds the prompt and every generated token but the last
    mask = inputs["attention_mask"]
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], max(len(plain.logits) - 1, 0))], dim=1)
    return PrefillCheck(logits_differ(plain.logits, shared.logits),
                        keys_differ(output_cache(shared), output_cache(plain), mask), *bounds)


def prefill_is_exact(model: Any, rows: Sequence[Prompt], config: GenerationConfig, pad_id: int,
                     device: torch.device, steps: int = 2) -> tuple[bool, str]:
    """Whether ``generate`` from a shared prefill gives the per-row path's logits on a few of
    ``rows``, each padded on the left (greedy, ``steps`` tokens), with the reason when not
    (:func:`prefill_check` has the distances). Any error of the shared path (a model whose
    cache cannot be copied by rows) counts as not exact."""
    check = prefill_check(model, rows, config, pad_id, device, steps)
    return check.exact, check.reason()


class PrefillSharing:
    """``rollout.share_prefill``: whether a generation batch's prompts are prefilled once.
    ``auto`` settles on the first batch that has a prompt on two rows (:func:`prefill_is_exact`),
    logged once; the decision is this process's own (generation has no collectives)."""

    def __init__(self, setting: bool | str) -> None:
        self.on: bool | None = None if setting == "auto" else bool(setting)

    def use(self, model: Any, rows: Sequence[Prompt], config: GenerationConfig, pad_id: int,
            device: torch.device) -> bool:
        """Whether to prefill ``rows``' prompts once (False when none repeats)."""
        if self.on is False or len(distinct_prompts(rows)[0]) == len(rows):
            return False
        if self.on is None:
            self.on, why = prefill_is_exact(model, rows, config, pad_id, device)
            log.info("rollout.share_prefill=auto: %s", f"on ({why})" if self.on else
                     f"off: {why}")
        return self.on
