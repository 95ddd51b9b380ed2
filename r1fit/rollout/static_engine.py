"""Rollouts on a static KV cache with the decode step replayed as CUDA graphs
(``rollout.engine=static``).

Hugging Face ``generate`` spends a GPU decode step in Python and kernel launches (36 layers x
dozens of small kernels, ~28 ms per token step for a 3B model whose weights take ~2 ms to read).
This engine drives the same transformers model's own forward, no model-family code, with:

- **prefill**: each distinct prompt of a chunk runs once through the model's forward (vision
  tower, M-RoPE positions, everything its own code does) into a ``DynamicCache``; its keys and
  values are copied into the static cache rows of the G rows that share it;
- **a static KV cache** (:class:`StaticRows`): per layer one ``[rows, kv heads, length, head dim]``
  buffer allocated once, rows left-aligned so that every row writes decode step ``s`` into the
  same column (the prompt ends at column ``P``, step ``s`` writes ``P + s - 1``);
- **one decode step with no host synchronisation**: the masks (a 4-D mask per attention type,
  passed as the dict the transformers models accept, so their mask builders never run), the
  positions (``position_ids`` passed, so no position rule of the model runs), the step counter,
  sampling and the finished flags all live on the device; on CUDA the step is captured once per
  batch-size bucket as a ``torch.cuda.CUDAGraph`` and replayed once per token;
- **counter-based sampling** (:func:`r1fit.rollout.generate.counter_uniforms`): the uniform that
  picks a row's token ``s`` is a hash of (row seed, ``s``), so a row's tokens depend only on
  (seed, step, row), never on its batch-mates, the chunking or the process count;
- **compaction**: every ``sync_every`` steps the host reads the finished flags once; when the
  rows still running fit a smaller bucket they move to the front and the smaller graph runs;
- **LoRA merged for generation** (:func:`merged_adapters`): the base weights of the adapted
  layers are copied aside, ``W + s·BA`` is written into them in place (same addresses, so the
  captured graphs stay valid) and the copy is written back afterwards: the base weights are
  bit-identical after any number of cycles, at the price of one copy of the adapted weights
  while generating (counted by the planner).

Semantics match ``generate_completions``: greedy is the argmax of the float32 logits after the
blocked placeholders and ``min_new_tokens`` set the blocked and end ids to -inf; sampling is
``sample_rows`` (temperature, top-p, inverse CDF) fed by the counter uniforms instead of numpy
streams, so for the same seeds the two engines give different, equally valid completions.

**Multi-turn** (``keep``/``previous`` of :meth:`StaticDecoder.generate`): a trajectory's cache is
kept across its turns. The next turn keeps each row's cached tokens that are still a prefix of
its grown context, moves them (one gather per layer) so that every row's context ends at the
same column, and prefills only the rest (the policy's last token and the tool turn) as one
padded block whose padding writes to a scratch column. A tool turn's images go through the
vision tower with it, at the positions the model's own rule gives them in the whole context
(Qwen-VL's ``get_rope_index``); a model without such a rule (Gemma 3, whose image tokens attend
to each other both ways) prefills such a turn whole.

**Shared prompts** (``share_prompt``, :mod:`r1fit.rollout.shared_prompts`): each distinct prompt
of a single-turn call is held once for (up to ``prompt_places`` of) its rows, and a decode step
attends to it and to the row's own completion columns in two parts merged by their
log-sum-exp; the rows' buffers then hold only the completions.

Left out for now: continuous batching (finished rows are compacted away, not replaced by
waiting rows).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from r1fit.data.batch import Prompt, collate, cut_after_eos, image_inputs
from r1fit.errors import R1fitError
from r1fit.models.load import unwrap
from r1fit.rollout.generate import SamplingSettings, TokenIds, counter_uniforms, sample_rows
from r1fit.rollout.prefill import (
    cache_argument,
    distinct_prompts,
    keeps_logits,
    own_position_rule,
    position_rule,
    prefill_forward,
    token_keys,
)
from r1fit.rollout.shared_prompts import (
    SHARED_KEYWORD,
    SharedPrompts,
    float32_products,
    prompt_slots,
    shared_prompt_attention,
    supports_shared_prompts,
)

log = logging.getLogger("r1fit.rollout")

#: attention implementations whose forward takes a ready 4-D mask (boolean for sdpa, additive
#: for eager); flash-attention kernels take none
MASKED_ATTENTION = ("sdpa", "eager")


#: the name the decode attention is registered under (transformers' AttentionInterface)
DECODE_ATTENTION = "r1fit_static_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa over the static cache without copying the keys per query head: transformers' sdpa
    path repeats each KV head for its group of query heads whenever a mask is given (on CUDA),
    which reads and writes the whole cache ``heads / kv heads`` times per layer: per decode
    step, and for an appended tool turn a transient of that size per layer. Here a KV head's
    group of query heads becomes one longer query (query ``l`` of the group's ``g``-th head at
    row ``g * length + l``, its mask row repeated per head: each query's softmax is its own),
    so the cache is read once. A step of the shared-prompt layout (its prompts' half passed as
    ``r1fit_prompts``) goes to :func:`shared_prompt_attention`. Anything else (prefill, no
    mask, no grouping, a mask per head) goes to transformers' own sdpa function."""
    shared = kwargs.pop(SHARED_KEYWORD, None)
    b, heads, length, dim = query.shape
    if shared is not None and length == 1 and attention_mask is not None:
        return shared_prompt_attention(module, query, key, value, attention_mask, shared,
                                       scaling=scaling), None
    kv_heads = key.shape[1]
    if attention_mask is None or attention_mask.ndim != 4 or attention_mask.shape[1] != 1 \
            or kv_heads == heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    group = heads // kv_heads
    # query head h uses KV head h // group (transformers' repeat_kv order)
    grouped = query.reshape(b, kv_heads, group * length, dim)
    mask = attention_mask[:, :, :, :key.shape[-2]]
    if length > 1:
        mask = mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, dropout_p=0.0,
                                         scale=scaling)
    return out.reshape(b, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)


@contextmanager
def decode_attention_on(config: Any) -> Iterator[None]:
    """The text model's attention layers dispatch to :func:`decode_attention` for the block
    (they look the function up by ``config._attn_implementation`` on every forward; a captured
    graph keeps the kernels it was captured with)."""
    before = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


#: buffer lengths are rounded up to these many columns (fewer reallocations): the cache, and in
#: the shared-prompt layout its prompts' width; the shared layout's completion columns (a
#: completion's budget seldom changes). The planner counts the same (STATIC_LENGTH_STEP,
#: STATIC_COMPLETION_STEP in r1fit/memory/planner/estimate.py; rollout does not import memory)
LENGTH_STEP, COMPLETION_STEP = 64, 16


def _rounded(need: int, old: int, step: int) -> int:
    """A buffer length that holds ``need`` columns and the ``old`` length, rounded up to
    ``step``."""
    return max(old, -(-need // step) * step)


#: the per-token input that marks a prompt's image (1) and video (2) tokens (transformers 5's
#: Qwen-VL and Gemma 3 processors)
MM_TYPES = "mm_token_type_ids"


def _image_tokens(row: Prompt) -> torch.Tensor:
    """Which of ``row``'s tokens are image tokens (all False without the processor's marks)."""
    types = row.token_inputs.get(MM_TYPES)
    return types == 1 if types is not None else torch.zeros(row.length, dtype=torch.bool)


class EngineUnsupported(R1fitError, ValueError):
    """The static engine cannot run this model or setting (one line: what and why)."""


class RowsLayer(CacheLayerMixin):
    """One layer of :class:`StaticRows`: views of the first rows of the engine's buffers. A
    forward's ``update`` writes its keys and values at the engine's current column (a device
    tensor, so a replayed graph writes where the step counter says) and returns the whole
    buffers; the mask hides the columns not written yet."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist before the first forward."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.column.ndim == 1:  # a decode step: every row writes the same column
            self.keys.index_copy_(2, self.column, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, self.column, value_states.to(self.values.dtype))
        else:  # an appended block: [rows, tokens] columns, each row its own
            index = self.column[:, None, :, None].expand(-1, key_states.shape[1], -1,
                                                         key_states.shape[3])
            self.keys.scatter_(2, index, key_states.to(self.keys.dtype))
            self.values.scatter_(2, index, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.keys.shape[2]), 0

    def get_seq_length(self) -> int:
        # positions are always passed, so no model reads this to place a token; the buffer's
        # length is the honest answer without a host synchronisation
        return int(self.keys.shape[2])

    def get_max_length(self) -> int:
        return int(self.keys.shape[2])


class StaticRows(Cache):
    """A transformers ``Cache`` over the first ``rows`` rows of the engine's static buffers, and
    their first ``upto`` columns when given (an eager step reads only the columns written)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 column: torch.Tensor, rows: int, upto: int | None = None) -> None:
        super().__init__(layers=[RowsLayer(k[:rows, :, :upto], v[:rows, :, :upto], column)
                                 for k, v in zip(keys, values)])


@contextmanager
def merged_adapters(model: Any) -> Iterator[Any]:
    """The model to generate with: a peft model's LoRA deltas ``s·BA`` added into the base
    weights in place and its adapters disabled, for the block; the base weights are copied aside
    first (a copy that lives for the block only) and copied back after, so they are
    bit-identical after the block, whatever the rounding of the merge. A model without adapters
    is yielded as it is."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft = model if isinstance(model, PeftModel) else getattr(model, "_modules", {}).get("model")
    if not isinstance(peft, PeftModel):
        yield model
        return
    layers = [m for m in peft.modules() if isinstance(m, LoraLayer) and m.active_adapters
              and not m.merged and hasattr(m.get_base_layer(), "weight")]
    merged: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                merged.append((weight, weight.detach().clone()))
                for name in layer.active_adapters:
                    if name in layer.lora_A:
                        weight.add_(layer.get_delta_weight(name).to(weight.dtype))
        with peft.disable_adapter():
            yield model
    finally:
        with torch.no_grad():
            for weight, backup in merged:
                weight.copy_(backup)


@dataclass(frozen=True)
class KeptRows:
    """What the cache holds of each row of the last call made with ``keep=True``: its buffer
    slot, the token ids cached (its context and its turn but the turn's last token, never fed)
    in the columns ``[end - len(ids), end)``, and the position of the token after them."""

    slots: list[int]
    ends: list[int]
    ids: list[torch.Tensor]
    next_positions: list[int]


@dataclass(frozen=True)
class Stop:
    """A text that ends a row (a multi-turn rollout's ``</tool_call>``), as
    :class:`r1fit.rollout.turns.StopAtToolCall` reads it: a row stops after the first token at
    which the text of its last ``window`` tokens holds ``text``."""

    text: str
    tokenizer: Any
    window: int

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def first(self, tokens: list[int]) -> int | None:
        """The number of tokens up to and including the one that completes the stop text, or
        None: the first n whose last ``window`` tokens hold it (found by bisecting on the
        prefixes, which hold it from that n on, then checked with the window)."""
        if self.text not in self.decode(tokens):
            return None
        low, high = 1, len(tokens)
        while low < high:
            mid = (low + high) // 2
            if self.text in self.decode(tokens[:mid]):
                high = mid
            else:
                low = mid + 1
        for n in range(low, len(tokens) + 1):  # a stop text longer than the window: go on
            if self.text in self.decode(tokens[max(0, n - self.window):n]):
                return n
        return None


class StaticDecoder:
    """Generates completions of prompt rows on a static KV cache (see the module docstring).

    ``graphs``: capture the decode step as CUDA graphs; ``compile``: run the decode forward
    through ``torch.compile`` (fused kernels) first (each by default on CUDA devices only:
    compiling costs more than it saves on CPU, where there are no graphs); ``share_prompt``:
    hold each distinct prompt once for its rows (:mod:`r1fit.rollout.shared_prompts`; single-turn
    calls, models without sliding-window layers), a copy for each ``prompt_places`` rows of it
    (GRPO's num_generations: one copy per group). The buffers
    hold ``capacity`` rows of ``length`` columns; a chunk that needs more reallocates them (and
    recaptures), logged. ``sync_every``: decode steps between the host's looks at the finished
    flags (stopping early and compaction happen there)."""

    def __init__(self, model: Any, ids: TokenIds, device: torch.device, *,
                 graphs: bool | None = None, sync_every: int = 16,
                 compile: bool | None = None, share_prompt: bool = False,
                 prompt_places: int = 8) -> None:
        base = unwrap(model)
        config = base.config.get_text_config()
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in MASKED_ATTENTION:
            raise EngineUnsupported(
                f"rollout.engine=static needs sdpa or eager attention (a 4-D mask per step); the "
                f"model uses {impl!r}")
        self.model, self.ids, self.device = model, ids, torch.device(device)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise EngineUnsupported("CUDA graphs need a CUDA device")
        self.sync_every = max(1, int(sync_every))
        # torch.compile of the decode forward (fusing its ~50 small kernels per layer), captured
        # into the same graphs; compiled on a bucket's first step
        self.compile = self.device.type == "cuda" if compile is None else bool(compile)
        self._compiled: Any = None
        self._compiled_rows: set[int] = set()  # batch sizes the compiled forward has run at
        self.additive = impl == "eager"
        self._text_config = config
        self._cache_name, self._keep_logits = cache_argument(base), keeps_logits(base)
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.window = getattr(config, "sliding_window", None)
        # the shared-prompt layout (r1fit/rollout/shared_prompts.py) where the model allows it
        why_not = supports_shared_prompts(base, config) if share_prompt else None
        if why_not:
            log.info("rollout.static.share_prompt: off for this model (%s); each row holds its "
                     "prompt", why_not)
        self.share_prompt = share_prompt and why_not is None
        self.prompt_places = max(1, int(prompt_places))
        self._wide = self.share_prompt and float32_products(self.device)
        self.shared: SharedPrompts | None = None  # the prompts' half, in the shared layout
        self._share_call = False  # this call uses the shared layout
        self._slots: SharedPrompts | None = None  # the slots this call reads (shared layout)
        self.capacity = self.length = 0
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv heads, length, head dim]
        self.values: list[torch.Tensor] = []
        # by (sampling settings, rows, prompt slots read: 0 in the plain layout)
        self._graphs: dict[tuple[Any, ...], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        # the one side stream every warm-up and capture runs on: cuBLAS keeps a workspace per
        # (handle, stream) for the process's life, so a new stream per capture (torch hands out
        # 32 in turn) would leave up to 32 of them behind
        self._stream: Any = None
        self._fingerprint: tuple[int, ...] = ()
        self._settings: tuple[Any, ...] | None = None
        self.captures = 0  # graphs captured so far (a test reads it)
        # what the cache holds of the last call made with keep=True (None after any other call)
        self._kept: KeptRows | None = None
        self.appended = self.refilled = 0  # calls with previous= that appended / prefilled whole
        # read by the captured graphs: made once, so their addresses never change
        self._eos = torch.tensor(ids.eos, dtype=torch.long, device=self.device)
        self._blocked = torch.tensor(ids.blocked or [0], dtype=torch.long, device=self.device)
        self._min_new = torch.zeros(1, dtype=torch.long, device=self.device)

    # --- buffers -------------------------------------------------------------------------------

    def _allocate(self, rows: int, length: int, prefill: DynamicCache,
                  prompts: tuple[int, int, int] | None = None) -> None:
        """Static buffers for ``rows`` x ``length``, shaped like ``prefill``'s layers (the old
        ones, and the graphs that read them, freed first); ``prompts`` (count, width, most rows
        of one prompt): the shared layout, whose prompts' half holds that many prompts of that
        width, and whose row buffers hold the completions' columns only."""
        self._graphs.clear()
        self._pool = None
        self.keys, self.values, self.shared = [], [], None
        dev = self.device
        self.keys = [torch.zeros(rows, *layer.keys.shape[1:2], length, layer.keys.shape[3],
                                 dtype=layer.keys.dtype, device=dev) for layer in prefill.layers]
        self.values = [torch.zeros(rows, *layer.values.shape[1:2], length, layer.values.shape[3],
                                   dtype=layer.values.dtype, device=dev) for layer in prefill.layers]
        self.mask = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=dev)
        self.columns = torch.arange(length, device=dev)
        self.column = torch.zeros(1, dtype=torch.long, device=dev)
        self.base = torch.zeros(1, dtype=torch.long, device=dev)  # P - 1: the column of step 1
        self.counter = torch.zeros(1, dtype=torch.long, device=dev)  # s: the token being picked
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)  # of step 1's input
        self.seeds = torch.zeros(rows, dtype=torch.long, device=dev)
        self.row_of = torch.zeros(rows, dtype=torch.long, device=dev)  # slot -> chunk row
        self.current = torch.zeros(rows, dtype=torch.long, device=dev)
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.limits = torch.zeros(rows, dtype=torch.long, device=dev)  # each row's most tokens
        self.out = torch.zeros(rows, length, dtype=torch.long, device=dev)  # by chunk row
        self.prompt_of = torch.zeros(rows, dtype=torch.long, device=dev)  # shared layout
        self.place = torch.zeros(rows, dtype=torch.long, device=dev)
        self.capacity, self.length = rows, length
        shown = f"{rows} rows x {length} columns"
        if prompts is not None:
            count, width, places = prompts
            layers = prefill.layers
            self.shared = SharedPrompts(
                keys=[torch.zeros(count, *x.keys.shape[1:2], width, x.keys.shape[3],
                                  dtype=x.keys.dtype, device=dev) for x in layers],
                values=[torch.zeros(count, *x.values.shape[1:2], width, x.values.shape[3],
                                    dtype=x.values.dtype, device=dev) for x in layers],
                mask=torch.zeros(count, width, dtype=torch.bool, device=dev),
                prompt_of=self.prompt_of, place=self.place, places=places, wide=self._wide)
            shown = f"{count} prompts x {width} columns + {shown} of completions"
        log.info("rollout.engine=static: KV cache of %s (%.1f MiB)", shown,
                 self.cache_bytes() / 2**20)

    def cache_bytes(self) -> int:
        """Bytes of the static KV cache now allocated (both halves in the shared layout)."""
        rows = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        return rows + (self.shared.nbytes() if self.shared is not None else 0)

    # --- prefill ---------------------------------------------------------------------------------

    def _prefill(self, model: Any, rows: Sequence[Prompt]) -> tuple[torch.Tensor, DynamicCache,
                                                                     dict[str, torch.Tensor],
                                                                     torch.Tensor, torch.Tensor]:
        """Each distinct prompt of ``rows`` once through the model's forward, padded on the left:
        (the last column's logits [unique, vocab] float32, the cache, the padded inputs, each
        row's prompt index, each distinct prompt's position of the first decode input)."""
        unique, index = distinct_prompts(rows)
        inputs = collate(unique, None, self.ids.pad, images=False).inputs
        keys = token_keys(unique)
        batch = {k: v.to(self.device) for k, v in inputs.items() if k in keys}
        batch.update({k: v.to(self.device) for k, v in image_inputs(unique).items()})
        out, cache, holders = prefill_forward(model, batch)
        logits = out.logits[:, -1].float()
        mask = batch["attention_mask"]
        deltas = next((m.rope_deltas for m in holders
                       if isinstance(getattr(m, "rope_deltas", None), torch.Tensor)), None)
        start = mask.long().sum(-1)  # counted from each row's first real token
        if deltas is not None and own_position_rule(model):
            # Qwen-VL's rule for later tokens (transformers 5): the count of real tokens plus the
            # row's M-RoPE offset (how far the images moved the positions after them)
            start = start + deltas.reshape(-1).to(self.device).long()
        return logits, cache, batch, index.to(self.device), start

    # --- one decode step -----------------------------------------------------------------------

    def _masks(self, rows: int, upto: int | None = None) -> Any:
        """The attention mask of the current step for the first ``rows`` rows (and ``upto``
        columns), 4-D, which the transformers models take as it is (their mask builders do not
        run)."""
        return self._kinds(self.mask[:rows, :, :, :upto], self.column)

    def _kinds(self, full: torch.Tensor, query: torch.Tensor) -> Any:
        """``full`` ([rows, 1, queries, columns] bool: what each query may read) as the model
        takes it: per attention type (a sliding layer keeps the columns within the window before
        the query's column, ``query``: the queries' columns, broadcastable to [queries, 1]),
        additive for eager attention."""
        columns = self.columns[:full.shape[-1]]
        kinds = set(self.layer_types) or {"full_attention"}
        masks: dict[str, torch.Tensor] = {}
        for kind in kinds:
            mask = full
            if kind == "sliding_attention" and self.window:
                mask = full & (columns > query - int(self.window))
            if self.additive:
                floor = torch.finfo(self.keys[0].dtype).min
                mask = torch.zeros(mask.shape, dtype=self.keys[0].dtype,
                                   device=self.device).masked_fill_(~mask, floor)
            masks[kind] = mask
        # one kind: the tensor itself (some text models take no dict, e.g. Qwen3-VL's); several
        # (Gemma 3's sliding layers): the dict keyed by layer type, as their forward takes it
        return masks.popitem()[1] if len(masks) == 1 else masks

    def _pick(self, logits: torch.Tensor, rows: int, settings: SamplingSettings) -> torch.Tensor:
        """The token of step ``self.counter`` for the first ``rows`` rows, from float32 logits,
        which it overwrites (they are the step's own: every vocabulary-wide step runs in place,
        with no [rows, vocab] temporary)."""
        if self.ids.blocked:
            logits.index_fill_(1, self._blocked, float("-inf"))
        if settings.min_new_tokens > 0:
            eos = logits.index_select(1, self._eos)
            early = self.counter < self._min_new
            logits.index_copy_(1, self._eos, torch.where(early, float("-inf"), eos))
        if settings.greedy:
            return logits.argmax(dim=-1)
        uniforms = counter_uniforms(self.seeds[:rows], self.counter)
        return sample_rows(logits, uniforms, settings.temperature, settings.top_p,
                           overwrite=True)

    def _record(self, token: torch.Tensor, rows: int, out: torch.Tensor) -> None:
        """Write step ``self.counter``'s tokens: the next input, the output, the finished flags
        (an end-of-sequence token, or the row's limit reached)."""
        self.current[:rows].copy_(token)
        out.index_put_((self.row_of[:rows], self.counter.expand(rows)), token)
        self.done[:rows] |= (token.unsqueeze(-1) == self._eos).any(dim=-1)
        self.done[:rows] |= self.counter + 1 >= self.limits[:rows]

    def _step(self, model: Any, rows: int, settings: SamplingSettings, out: torch.Tensor,
              upto: int | None = None) -> None:
        """One decode step on the first ``rows`` rows, all on the device: feed step s-1's token
        at column P + s - 1, pick token s, advance s. ``upto``: the columns written so far, for
        an eager step (its attention then reads only those; a captured or compiled step reads
        the whole length, its shapes fixed)."""
        self.column.copy_(self.base + self.counter)
        self.mask[:rows].index_fill_(3, self.column, True)
        positions = (self.positions[:rows] + self.counter - 1).unsqueeze(-1)
        cache = StaticRows(self.keys, self.values, self.column, rows, upto)
        kwargs: dict[str, Any] = {self._cache_name: cache, "use_cache": True}
        if self._keep_logits:
            kwargs["logits_to_keep"] = 1
        if self._share_call:
            kwargs[SHARED_KEYWORD] = self._slots
        inputs = {"input_ids": self.current[:rows].unsqueeze(-1),
                  "attention_mask": self._masks(rows, upto), "position_ids": positions, **kwargs}
        with decode_attention_on(self._text_config):
            logits = self._forward(model, rows, inputs)
        self._record(self._pick(logits, rows, settings), rows, out)
        self.counter.add_(1)

    def _forward(self, model: Any, rows: int, inputs: dict[str, Any]) -> torch.Tensor:
        """The decode step's forward for ``rows`` rows: the last column's logits, float32.
        Compiled when ``compile`` is on; a compile that fails at a batch size the compiled
        forward has not run at yet (torch.compile cannot build it on this machine: no compiler,
        an unsupported op) turns ``compile`` off for the engine's life, with a warning, and the
        step runs uncompiled. Any other error (out of memory, or one at a size that ran before)
        is raised."""
        if not self.compile:
            return model(**inputs).logits[:, -1].float()
        if self._compiled is None or self._compiled[0] is not model:
            # dynamic=None: the first bucket (the largest, most of the tokens) compiles with
            # static shapes; the first other size recompiles with a dynamic batch, which every
            # later bucket reuses (compaction makes no 1-row bucket, which would be specialised
            # once more; a call of one row still is): not one compile per bucket (measured on
            # CPU: sizes 4, 2, 1, 3 -> 3 graphs); a cache that grows recompiles once more, with
            # a dynamic length
            self._compiled = (model, torch.compile(model, dynamic=None))
            self._compiled_rows = set()
        try:
            logits = self._compiled[1](**inputs).logits[:, -1].float()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if rows in self._compiled_rows:
                raise
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning("rollout.static.compile: torch.compile of the decode step failed at %d "
                        "rows (%s: %s); decoding without it (rollout.static.compile=false skips "
                        "the attempt)", rows, type(exc).__name__, reason)
            self.compile, self._compiled = False, None
            return model(**inputs).logits[:, -1].float()
        self._compiled_rows.add(rows)
        return logits

    # --- graphs ----------------------------------------------------------------------------------

    def _replay(self, model: Any, rows: int, settings: SamplingSettings, out: torch.Tensor) -> None:
        """Step on the graph of bucket ``rows``, captured on first use (one eager warm-up step
        first, whose effects are undone: the step's state is restored before capture)."""
        key = (self._settings, rows, 0 if self._slots is None else int(self._slots.mask.shape[0]))
        graph = self._graphs.get(key)
        if graph is None:
            saved = [t.clone() for t in (self.counter, self.current, self.done, self.mask)]
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(model, rows, settings, out)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for target, value in zip((self.counter, self.current, self.done, self.mask), saved):
                target.copy_(value)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                self._step(model, rows, settings, out)
            self._graphs[key] = graph
            self.captures += 1
        graph.replay()

    def _bucket(self, live: int) -> int:
        """The smallest batch-size bucket (a power of two from 2, or the capacity) holding
        ``live``. No bucket of one row: torch.compile specialises a batch of 1 (a compile of its
        own, about a minute for a 3B model on a GPU, for a tail that runs as fast in a pair)."""
        size = 2
        while size < live:
            size *= 2
        return min(size, self.capacity)

    def _compact(self, rows: int, bucket: int, keep: bool) -> None:
        """Move the rows still running to the front (the first ``bucket`` slots); ``keep``: the
        finished rows' caches are kept too (moved behind them), for the next turn."""
        order = torch.cat([torch.nonzero(~self.done[:rows]).flatten(),
                           torch.nonzero(self.done[:rows]).flatten()])
        moved = rows if keep else bucket
        for buffer in (*self.keys, *self.values, self.mask, self.positions, self.seeds,
                       self.row_of, self.current, self.done, self.limits, self.prompt_of,
                       self.place):
            buffer[:moved] = buffer[:rows].index_select(0, order[:moved])

    # --- the whole generation ------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, rows: Sequence[Prompt], *, seeds: Sequence[int] | None,
                 batch_size: int, settings: SamplingSettings,
                 limits: Sequence[int] | None = None, stop: Stop | None = None,
                 keep: bool = False, previous: Sequence[int] | None = None,
                 room: int | None = None) -> list[torch.Tensor]:
        """One completion per row, in row order, each cut after its EOS (the contract of
        ``generate_completions``: greedy takes ``seeds=None``, sampling one seed per row).
        ``limits``: row i's most tokens (default ``settings.max_new_tokens`` for all);
        ``stop``: a text that ends a row where it first appears (a multi-turn rollout's
        ``</tool_call>``), checked by the host every ``sync_every`` steps and cut exactly
        after.

        Multi-turn (one chunk: at most ``batch_size`` rows): ``keep=True`` keeps the rows' caches
        after the call; the next call's ``previous[i]`` says which row of that call row i
        continues (its context grown by the turn and what followed it). Such a row's cached
        tokens that are still a prefix of its context stay in the cache and only the rest of the
        context is prefilled (:meth:`_append`); where that cannot be done (the rest holds image
        tokens, the cache is too short, any other call ran between) the contexts are prefilled
        whole, with the same tokens as a result. ``room``: the columns after the rows' contexts
        to allocate when the buffers grow (a trajectory's budget, so that its later turns fit
        without reallocating; default: this call's most tokens)."""
        if limits is not None and len(limits) != len(rows):
            raise ValueError(f"{len(rows)} rows, {len(limits)} limits")
        if settings.greedy and seeds is not None:
            raise ValueError("greedy generation takes seeds=None")
        if not settings.greedy and (seeds is None or len(seeds) != len(rows)):
            raise ValueError(f"sampling needs one seed per row ({len(rows)} rows, "
                             f"{'no' if seeds is None else len(seeds)} seeds)")
        if not settings.greedy and settings.temperature <= 0:
            raise ValueError(f"sampling needs temperature > 0, got {settings.temperature}")
        if (keep or previous is not None) and len(rows) > batch_size:
            raise ValueError(f"keep/previous need the rows in one chunk ({len(rows)} rows, "
                             f"batch_size {batch_size})")
        if previous is not None and len(previous) != len(rows):
            raise ValueError(f"{len(rows)} rows, {len(previous)} previous rows")
        kept, self._kept = self._kept, None  # any call overwrites what an earlier one kept
        # a multi-turn call keeps each row's own cache: the plain layout
        self._share_call = self.share_prompt and not keep and previous is None
        self._slots = None
        if settings.max_new_tokens < 1 or not rows:
            return [torch.zeros(0, dtype=torch.long) for _ in rows]
        model = self.model
        was_training = model.training
        model.eval()
        completions: list[torch.Tensor] = []
        try:
            # buffers must be ordinary tensors even when called under inference_mode (eval):
            # they are written in place by later calls outside it. inference_mode(False) turns
            # grad mode back on, so no_grad follows it: a full fine-tuning model's forward would
            # otherwise record autograd graphs that the buffers' in-place writes keep alive
            # the copy of the merged weights lives for this call only: the update phase that
            # follows does not hold it (the planner counts it in generation)
            with torch.inference_mode(False), torch.no_grad(), \
                    merged_adapters(model) as generator:
                # buffers for the call's largest chunk, not a batch size larger than the call
                # (the planner counts min(generation_batch, a step's rows))
                sized = min(batch_size, len(rows))
                for start in range(0, len(rows), batch_size):
                    chunk = rows[start:start + batch_size]
                    chunk_seeds = None if seeds is None else seeds[start:start + batch_size]
                    chunk_limits = [settings.max_new_tokens] * len(chunk) if limits is None \
                        else [min(int(x), settings.max_new_tokens)
                              for x in limits[start:start + batch_size]]
                    # the transformers model itself: peft's wrapper adds only Python per call
                    # (its adapters are merged and off inside the block)
                    completions.extend(self._chunk(
                        unwrap(generator), chunk, chunk_seeds, sized, settings,
                        chunk_limits, stop, keep, None if previous is None else (previous, kept),
                        room))
        finally:
            model.train(was_training)
        return completions

    def _chunk(self, model: Any, rows: Sequence[Prompt], seeds: Sequence[int] | None,
               batch_size: int, settings: SamplingSettings, limits: Sequence[int],
               stop: Stop | None, keep: bool,
               follows: tuple[Sequence[int], KeptRows | None] | None,
               room: int | None) -> list[torch.Tensor]:
        n, steps = len(rows), max(limits)
        logits = self._start(model, rows, batch_size, steps, follows, room)
        self._bind(model, settings)
        dev = self.device
        self.row_of[:n] = torch.arange(n, device=dev)
        self.done.zero_()
        self.limits[:n] = torch.tensor(list(limits), dtype=torch.long, device=dev)
        if seeds is not None:
            self.seeds[:n] = torch.tensor([int(s) for s in seeds], dtype=torch.long, device=dev)
        out = self.out
        self.counter.zero_()
        self._record(self._pick(logits, n, settings), n, out)
        self.counter.add_(1)
        width = int(self.base) + 1  # the first decode column
        live = n
        for step in range(1, steps):
            if self.graphs:
                self._replay(model, live, settings, out)
            else:
                self._step(model, live, settings, out,
                           None if self.compile else width + step)
            if step % self.sync_every == 0 and step < steps - 1:
                if stop is not None:  # the host reads the rows' newest text for the stop
                    self._mark_stopped(stop, live, step + 1)
                running = int((~self.done[:live]).sum())  # the one host sync per sync_every
                if running == 0:
                    break
                bucket = self._bucket(running)
                if bucket < live:
                    self._compact(live, bucket, keep)
                    live = bucket
        tokens = out[:n, :steps].cpu()
        cut = [row[:limit] for row, limit in zip(tokens, limits, strict=True)]
        if stop is not None:
            cut = [row[:at] if (at := stop.first(row.tolist())) is not None else row
                   for row in cut]
        cut = [cut_after_eos(row, self.ids.eos) for row in cut]
        if keep:
            self._keep(rows, cut, width)
        return cut

    def _start(self, model: Any, rows: Sequence[Prompt], batch_size: int, steps: int,
               follows: tuple[Sequence[int], KeptRows | None] | None,
               room: int | None) -> torch.Tensor:
        """The rows' contexts in the cache (appended to what it kept of them where it can, else
        prefilled whole): the logits of their first token [rows, vocab], float32."""
        if follows is not None:
            previous, kept = follows
            logits = None if kept is None else self._append(model, rows, previous, kept, steps)
            if logits is not None:
                self.appended += 1
                return logits
            self.refilled += 1
        return self._fresh(model, rows, batch_size, max(steps, room or 0))

    def _fresh(self, model: Any, rows: Sequence[Prompt], batch_size: int,
               steps: int) -> torch.Tensor:
        """Prefill ``rows`` whole into the first rows of the buffers (grown to hold ``steps``
        columns after them when too small): the logits of their first token [rows, vocab],
        float32."""
        n = len(rows)
        logits, prefill, batch, index, start = self._prefill(model, rows)
        if self._share_call:
            return self._fresh_shared(rows, batch_size, steps, logits, prefill, batch, index,
                                      start)
        width = int(batch["attention_mask"].shape[1])
        # one column more than the rows fill: the scratch column an appended block's padding
        # writes to (:meth:`_append`)
        need = width + steps + 1
        if n > self.capacity or need > self.length or self.shared is not None:
            # room for the longest prompts seen so far, rounded up: fewer reallocations
            self._allocate(max(batch_size, n, self.capacity),
                           _rounded(need, self.length, LENGTH_STEP), prefill)
        for layer, keys, values in zip(prefill.layers, self.keys, self.values):
            kept = int(layer.keys.shape[2])  # a sliding layer keeps its window's last columns
            keys[:n, :, width - kept:width] = layer.keys.index_select(0, index)
            values[:n, :, width - kept:width] = layer.values.index_select(0, index)
        del prefill
        self.mask.zero_()
        self.mask[:n, 0, 0, :width] = batch["attention_mask"].index_select(0, index).bool()
        self.positions[:n] = start.index_select(0, index)
        self.base.fill_(width - 1)
        return logits.index_select(0, index)

    def _fresh_shared(self, rows: Sequence[Prompt], batch_size: int, steps: int,
                      logits: torch.Tensor, prefill: DynamicCache, batch: dict[str, torch.Tensor],
                      index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The shared layout: each distinct prompt's prefilled keys and values into the
        prompts' half once, the rows' buffers left for their completions (decode step ``s``
        writes column ``s - 1``): the logits of the rows' first token [rows, vocab], float32."""
        n = len(rows)
        width = int(batch["attention_mask"].shape[1])
        slot_of, place, prompt_of_slot = prompt_slots(index.tolist(), self.prompt_places)
        count, places = len(prompt_of_slot), self.prompt_places
        # the present prompts' half as sizes only: no reference to its buffers may outlive
        # _allocate's freeing of them (the planner counts one cache, not two)
        slots, columns_held = ((0, 0) if self.shared is None
                               else tuple(self.shared.mask.shape))
        if (self.shared is None or n > self.capacity or steps > self.length
                or count > slots or width > columns_held):
            # room for the most prompts, widest prompts and longest completions seen so far
            had = self.shared is not None
            self._allocate(max(batch_size, n, self.capacity if had else 0),
                           _rounded(steps, self.length if had else 0, COMPLETION_STEP), prefill,
                           (max(count, slots), _rounded(width, columns_held, LENGTH_STEP),
                            places))
        shared = self.shared
        assert shared is not None
        dev = self.device
        source = torch.tensor(prompt_of_slot, dtype=torch.long, device=dev)
        # each prompt's tokens from column 0 on (the prefill padded it on the left): the
        # columns a row's attention sums over then do not move with its batch-mates' widths
        real = batch["attention_mask"].index_select(0, source).bool()
        lengths = real.sum(-1, keepdim=True)
        columns = torch.arange(width, device=dev).unsqueeze(0)
        moved = (columns + width - lengths).clamp_(max=width - 1)  # [slots, width]
        for layer, keys, values in zip(prefill.layers, shared.keys, shared.values):
            for buffer, source_buffer in ((keys, layer.keys), (values, layer.values)):
                picked = source_buffer.index_select(0, source)
                buffer[:count, :, :width] = picked.gather(2, moved[:, None, :, None].expand(
                    -1, picked.shape[1], -1, picked.shape[3]))
        del prefill
        shared.mask.zero_()
        shared.mask[:count, :width] = columns < lengths
        self.mask.zero_()
        self.positions[:n] = start.index_select(0, index)
        self.prompt_of[:n] = torch.tensor(slot_of, dtype=torch.long, device=dev)
        self.place[:n] = torch.tensor(place, dtype=torch.long, device=dev)
        self.base.fill_(-1)  # step s writes column s - 1 of the rows' half
        self._slots = shared.first(count)
        return logits.index_select(0, index)

    def _keep(self, rows: Sequence[Prompt], cut: Sequence[torch.Tensor], width: int) -> None:
        """Record what the cache holds of each row after its turn: its context and the turn's
        tokens but the last (a token is cached when it is fed, the next step's input)."""
        n = len(rows)
        slot_of = torch.empty(n, dtype=torch.long)
        slot_of[self.row_of[:n].cpu()] = torch.arange(n)
        positions = self.positions[:n].cpu()
        fed = [max(int(tokens.shape[0]) - 1, 0) for tokens in cut]
        slots = slot_of.tolist()
        self._kept = KeptRows(
            slots=slots, ends=[width + f for f in fed],
            ids=[torch.cat([row.input_ids, tokens[:f].to(row.input_ids.dtype)])
                 for row, tokens, f in zip(rows, cut, fed, strict=True)],
            next_positions=[int(positions[slot]) + f for slot, f in zip(slots, fed)])

    def _append(self, model: Any, rows: Sequence[Prompt], previous: Sequence[int],
                kept: KeptRows, steps: int) -> torch.Tensor | None:
        """Continue the rows of the kept call: keep each row's cached tokens that are still a
        prefix of its context, moved so that every row's context ends at the same column (the
        width a whole prefill would have, so the decode steps write one column for all rows),
        and prefill only the rest of each context (the policy's last token and the tool turn,
        its images through the vision tower, placed by the model's own position rule). The
        logits of the rows' first token [rows, vocab] float32, or None where this cannot be
        done (:meth:`_plan_row`; the buffers are too small)."""
        n = len(rows)
        if not self.keys or n > self.capacity:
            return None
        planned = [self._plan_row(model, row, p, kept) for row, p in zip(rows, previous,
                                                                          strict=True)]
        if any(x is None for x in planned):
            return None
        # per row: (slot, cached columns' start, common prefix, rest, rest's position), and the
        # rest's images where it shows some
        plans = [x[0] for x in planned if x is not None]
        seen = [x[1] for x in planned if x is not None]
        width = max(row.length for row in rows)
        if width + steps + 1 > self.length:
            return None
        dev, length = self.device, self.length
        sizes = torch.tensor([len(plan[3]) for plan in plans], device=dev)
        block = int(sizes.max())
        # row r's kept tokens move to [begin, width - its rest), its rest fills up to width
        begin = width - sizes - torch.tensor([plan[2] for plan in plans], device=dev)
        shift = begin - torch.tensor([plan[1] for plan in plans], device=dev)
        index = (self.columns.unsqueeze(0) - shift.unsqueeze(1)).clamp_(0, length - 1)
        source = torch.tensor([plan[0] for plan in plans], device=dev)
        for buffer in (*self.keys, *self.values):
            picked = buffer.index_select(0, source)
            buffer[:n] = picked.gather(2, index[:, None, :, None].expand(
                -1, picked.shape[1], -1, picked.shape[3]))
        # the block: each row's rest right-aligned at width, padded on the left; a pad's keys
        # and values go to the scratch column (the last), which only pads read
        input_ids = torch.full((n, block), self.ids.pad, dtype=torch.long)
        # positions by M-RoPE's three axes (text: three equal ones), from each row's rule
        positions = torch.zeros(3, n, block, dtype=torch.long)
        for r, ((_, _, _, rest, first), shown) in enumerate(zip(plans, seen, strict=True)):
            input_ids[r, block - len(rest):] = rest
            positions[:, r, block - len(rest):] = (first + torch.arange(len(rest))
                                                   if shown is None else shown[0])
        shown_images = [shown[1] for shown in seen if shown is not None]
        vision = {key: torch.cat([images[key] for images in shown_images]).to(dev)
                  for key in ("pixel_values", "image_grid_thw")} if shown_images else {}
        if not shown_images:
            positions = positions[0]  # text alone: the positions every model takes
        queries = width - block + torch.arange(block, device=dev)  # the block's columns
        real = torch.arange(block, device=dev).unsqueeze(0) >= (block - sizes).unsqueeze(1)
        scratch = length - 1
        columns = self.columns
        reads = real[:, :, None] & (columns >= begin[:, None, None]) \
            & (columns <= queries[None, :, None])
        reads |= ~real[:, :, None] & (columns == scratch)
        cache = StaticRows(self.keys, self.values,
                           torch.where(real, queries.unsqueeze(0), scratch), n)
        kwargs: dict[str, Any] = {self._cache_name: cache, "use_cache": True}
        if self._keep_logits:
            kwargs["logits_to_keep"] = 1
        with decode_attention_on(self._text_config):  # the cache read once per KV head
            logits = model(input_ids=input_ids.to(dev),
                           attention_mask=self._kinds(reads.unsqueeze(1), queries.unsqueeze(-1)),
                           position_ids=positions.to(dev), **vision,
                           **kwargs).logits[:, -1].float()
        self.mask.zero_()
        self.mask[:n, 0, 0] = (columns >= begin.unsqueeze(1)) & (columns < width)
        # a rest ends with text (the assistant turn's opening): its three axes are equal
        self.positions[:n] = positions.reshape(-1, n, block)[0, :, -1].to(dev) + 1
        self.base.fill_(width - 1)
        return logits

    def _plan_row(self, model: Any, row: Prompt, p: int, kept: KeptRows) -> tuple[
            tuple[int, int, int, torch.Tensor, int],
            tuple[torch.Tensor, dict[str, torch.Tensor]] | None] | None:
        """How row ``row`` continues row ``p`` of the kept call (see :meth:`_append`), or None
        where it cannot: an unknown row, a placeholder outside the rest's whole images, another
        per-token input in the rest, images the model's rule cannot place."""
        if not 0 <= p < len(kept.slots):
            return None
        cached, ids = kept.ids[p], row.input_ids
        shared = min(len(cached), len(ids) - 1)  # at least one token is fed
        differ = torch.nonzero(cached[:shared] != ids[:shared])
        if len(differ):
            shared = int(differ[0])
        rest = ids[shared:]
        images = _image_tokens(row)[shared:]
        if self.ids.blocked:
            blocked = torch.tensor(self.ids.blocked)  # host side
            if torch.isin(rest, blocked)[~images].any() or \
                    torch.isin(cached[shared:], blocked).any():
                return None
        if any(bool(v[shared:].any()) for k, v in row.token_inputs.items() if k != MM_TYPES):
            return None
        shown = self._rest_images(model, row, shared) if images.any() else None
        if images.any() and shown is None:
            return None
        return ((kept.slots[p], kept.ends[p] - len(cached), shared, rest,
                 kept.next_positions[p] - (len(cached) - shared)), shown)

    def _rest_images(self, model: Any, row: Prompt, shared: int
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """For a row whose context after its first ``shared`` tokens holds whole images (a tool
        turn's): that rest's positions [3, rest] by the model's own rule (Qwen-VL's
        ``get_rope_index``) over the whole context, and the rest's images' tensors. None where
        it cannot be done: no such rule (a model whose images attend otherwise), an image cut
        by ``shared``, videos."""
        rule = position_rule(model)
        types = row.token_inputs.get(MM_TYPES)
        grid, pixels = row.image_inputs.get("image_grid_thw"), row.image_inputs.get("pixel_values")
        if rule is None or types is None or grid is None or pixels is None or (types > 1).any():
            return None
        patches = grid.prod(-1)  # per image
        total = int((types == 1).sum())
        if not total or int(patches.sum()) % total:
            return None
        tokens = (patches // (int(patches.sum()) // total)).cumsum(0)  # image tokens so far
        before = int((types[:shared] == 1).sum())
        whole = int((tokens <= before).sum())  # the images wholly inside the kept part
        if before != (int(tokens[whole - 1]) if whole else 0):
            return None  # an image starts in the kept part and ends in the rest
        positions, _ = rule.get_rope_index(
            row.input_ids[None].to(self.device), mm_token_type_ids=types[None].to(self.device),
            image_grid_thw=grid.to(self.device),
            attention_mask=torch.ones(1, row.length, dtype=torch.long, device=self.device))
        return (positions[:, 0, shared:].cpu(),
                {"pixel_values": pixels[int(patches[:whole].sum()):],
                 "image_grid_thw": grid[whole:]})

    def _mark_stopped(self, stop: Stop, live: int, made: int) -> None:
        """Set the finished flag of every running row whose last tokens hold the stop text
        (``made`` tokens generated so far)."""
        slots = torch.nonzero(~self.done[:live]).flatten().tolist()
        if not slots:
            return
        rows = self.row_of[:live].tolist()
        tail = self.out[:, max(0, made - self.sync_every - stop.window):made].cpu()
        # the rule that cuts the row afterwards (Stop.first: the text within one window), so a
        # row is never stopped where its cut would not end it (its later columns unwritten)
        hits = [slot for slot in slots if stop.first(tail[rows[slot]].tolist()) is not None]
        if hits:
            self.done[torch.tensor(hits, device=self.device)] = True

    def _bind(self, model: Any, settings: SamplingSettings) -> None:
        """Drop the captured graphs when what they read changed: the addresses of the weights
        or buffers (a rotary table replaced by assignment would leave a graph reading the old
        one), or the model object. The sampling settings (baked into a graph) select among the
        graphs instead: an evaluation's greedy graphs and a rollout's sampled ones both stay."""
        fingerprint = (id(model), *(p.data_ptr() for p in model.parameters()),
                       *(b.data_ptr() for b in model.buffers()))
        self._min_new.fill_(settings.min_new_tokens)  # read on the device: no recapture
        self._settings = (settings.greedy, settings.temperature, settings.top_p,
                          settings.min_new_tokens > 0)
        if fingerprint != self._fingerprint:
            if self._graphs:
                log.info("rollout.engine=static: the weights' addresses changed, CUDA graphs "
                         "recaptured")
            self._graphs.clear()
            self._fingerprint = fingerprint
