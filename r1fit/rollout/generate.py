"""Rollout generation with Hugging Face ``generate``, in chunks of ``generation_batch`` sequences.

Peak memory of generation is set by the chunk size (KV cache of ``generation_batch`` sequences), not
by how many completions a step asks for. The model is put in eval mode while generating: that turns
gradient checkpointing off (transformers only checkpoints in training mode) and keeps the KV cache on.

Sampling does not depend on how rows are split into chunks or over processes: each row samples from
its own random stream (``row_seeds``), drawn by ``SeededSampler`` instead of by HF's
``torch.multinomial`` over the global RNG, which would make a row's completion depend on its chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from r1fit.data.batch import Prompt, collate, cut_after_eos, pad_rows
from r1fit.models.load import PLACEHOLDER_TOKENS, special_token_ids, stop_token_ids, unwrap
from r1fit.processes import all_sum
from r1fit.rollout.prefill import PrefillSharing, prefilled_inputs
from r1fit.rollout.record import Rollout


@dataclass
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    min_new_tokens: int = 0  # no end-of-sequence token before this many (rollout.min_new_tokens)


@dataclass
class TokenIds:
    """Token ids generation needs, read from the model's config, tokenizer and generation config."""

    pad: int
    eos: list[int]
    blocked: list[int]  # image/video placeholders must never be sampled

    @classmethod
    def of(cls, model: Any, processor: Any) -> TokenIds:
        special = special_token_ids(model, processor)
        # Only the placeholders the model fills with vision features are blocked: one more would
        # make the next forward fail. Delimiters (<|vision_start|>, <start_of_image>) stay
        # sampleable, as in Hugging Face's generate; they are harmless to the forward, and
        # blocking them would change every rollout's distribution.
        return cls(pad=special["pad"], eos=stop_token_ids(model, processor),
                   blocked=[special[key] for key, _ in PLACEHOLDER_TOKENS if key in special])


def generation_config(settings: SamplingSettings, ids: TokenIds) -> GenerationConfig:
    """A complete greedy config: transformers fills every field left ``None`` from the checkpoint's
    ``generation_config.json`` (Qwen-VL's sets repetition_penalty=1.05), so the ones that change
    logits are set to their neutral values here (``min_new_tokens=0`` also overrides ``min_length``).
    Sampling is done by ``SeededSampler`` on top of it; temperature/top_p are left out, as HF warns
    about them when ``do_sample=False``. ``min_length=0`` and ``min_new_tokens=0`` keep a
    checkpoint's minimum lengths out (``generate_completions`` drops the second when the
    checkpoint sets none). ``settings.min_new_tokens`` > 0 sets transformers' own minimum, which
    gives the end-of-sequence ids -inf before the sampler sees the scores (and leaves
    ``min_length`` unset: it would be overridden, with a warning)."""
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens, pad_token_id=ids.pad, eos_token_id=list(ids.eos),
        use_cache=True, suppress_tokens=list(ids.blocked) or None, do_sample=False, num_beams=1,
        num_return_sequences=1, min_new_tokens=settings.min_new_tokens, repetition_penalty=1.0,
        encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
        # min_new_tokens > 0 takes precedence over a checkpoint's min_length anyway (transformers
        # warns when both are set)
        min_length=None if settings.min_new_tokens else 0, renormalize_logits=False,
        remove_invalid_values=False)


def row_seeds(seed: int, step: int, first_row: int, n: int) -> list[int]:
    """63-bit seeds of global rows ``first_row .. first_row + n - 1`` of a step.

    A pure function of (seed, step, global row index), so a row gets the same random stream
    whichever process or chunk generates it."""
    if min(seed, step, first_row) < 0:
        raise ValueError(f"row_seeds needs non-negative seed/step/first_row, got {seed}/{step}/{first_row}")
    return [int(np.random.SeedSequence([seed, step, row]).generate_state(1, dtype=np.uint64)[0] >> 1)
            for row in range(first_row, first_row + n)]


def filter_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's ``TopPLogitsWarper`` (min_tokens_to_keep=1) with a stable sort: keep the smallest set of
    most probable tokens whose mass is >= top_p, always at least the most probable one."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False, stable=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= 1 - top_p
    remove_sorted[..., -1].fill_(False)  # no host scalar in a captured step
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" finaliser) of int64 values in [0, 2**32): each
    product is cut back to its low 32 bits, which wrapping int64 arithmetic keeps exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: a hash of (the row's 63-bit seed, ``counter``),
    computed on the seeds' device with no host round trip (the static engine's sampling inside
    a CUDA graph). A pure function of the two, so a row's k-th draw is the same whatever rows
    share its batch; 53 random bits from two chained hashes."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    first = _mix32(lo ^ _mix32(hi ^ _mix32(counter.long() & MASK32)))
    second = _mix32(first ^ 0x9E3779B9)
    bits = (first << 21) | (second >> 11)
    return bits.double() * (1.0 / 2**53)


#: vocabulary entries per block of the two-level inverse CDF in ``sample_rows``
SAMPLE_BLOCK = 1024


def sample_rows(scores: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                top_p: float, *, overwrite: bool = False) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row of ``scores`` [B, V], given one uniform in [0, 1)
    per row: temperature, then top-p, then unnormalised probabilities ``exp(z - max z)`` in
    float32; the token is the first index whose cumulative probability exceeds ``u * total``.

    The cumulative sum runs in two levels, so it never runs over the whole vocabulary (a float64
    cumsum of [B, 151,936] cost more than the LM head of a decode step on CPU): the sums of blocks
    of ``SAMPLE_BLOCK`` entries, their float64 cumsum to find the block that holds ``u * total``,
    then a float64 cumsum inside that block only. Every operation works along the vocabulary
    only, so a row's token does not depend on the other rows of the batch. Tokens of probability 0
    (such as those suppressed to -inf) are never picked: the cumulative sums do not grow over
    them; where rounding makes ``u * total`` reach a total, the last token of positive probability
    (of the last block with mass) is taken.

    ``overwrite``: ``scores`` may be overwritten (the static engine's logits are its own), so the
    vocabulary-wide steps run in place, as they do on the float32 copy of 16-bit scores: no
    [B, vocab] temporaries, the same numbers. On a CPU every new temporary of that size cost
    page faults at every decode step (the freed blocks go back to the system)."""
    logits = scores.float()
    overwrite = overwrite or logits is not scores  # a copy made here is ours
    if temperature != 1.0:
        logits = logits.div_(temperature) if overwrite else logits / temperature
    logits = filter_top_p(logits, top_p)
    peak = logits.amax(dim=-1, keepdim=True)
    weights = (logits.sub_(peak) if overwrite else logits - peak).exp_()  # -inf -> 0
    rows, vocab = weights.shape
    whole = vocab // SAMPLE_BLOCK * SAMPLE_BLOCK
    sums = weights[:, :whole].view(rows, -1, SAMPLE_BLOCK).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=-1)
    cdf = sums.double().cumsum(dim=-1)
    threshold = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    block = first_above(cdf, threshold)
    before = cdf.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1))
    before = before.masked_fill_((block == 0).unsqueeze(-1), 0.0)
    index = block.unsqueeze(-1) * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=weights.device)
    inside = weights.gather(-1, index.clamp(max=vocab - 1)).double()
    inside = inside.masked_fill_(index >= vocab, 0.0).cumsum(dim=-1).add_(before)
    return block * SAMPLE_BLOCK + first_above(inside, threshold)


def first_above(cdf: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where the non-decreasing ``cdf`` [B, n] exceeds ``threshold``
    [B, 1]; where none does (rounding put the threshold at the total), the first index where
    the cdf reaches its maximum (an entry of positive mass, not a trailing zero one)."""
    found = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return torch.minimum(found, cdf.argmax(dim=-1))


class SeededSampler(LogitsProcessor):
    """Samples each row from its own ``numpy`` stream and returns scores that are 0 on the sampled
    token and -inf elsewhere, so HF's greedy step picks exactly that token.

    HF appends custom processors after its own (``_merge_criteria_processor_list``), so the scores
    seen here already have ``suppress_tokens`` at -inf. Every call draws one uniform for every row,
    finished rows included: the k-th draw of a stream always belongs to generated position k."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float) -> None:
        if temperature <= 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature}")
        self.streams = [np.random.default_rng(seed) for seed in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.streams):
            raise ValueError(f"SeededSampler has {len(self.streams)} streams for {scores.shape[0]} rows")
        uniforms = torch.tensor([stream.random() for stream in self.streams], dtype=torch.float64)
        tokens = sample_rows(scores, uniforms.to(scores.device), self.temperature, self.top_p)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens.unsqueeze(-1), 0.0)


@torch.no_grad()
def generate_completions(model: Any, rows: Sequence[Prompt], *, seeds: Sequence[int] | None,
                         batch_size: int, settings: SamplingSettings, ids: TokenIds,
                         device: torch.device, sharing: PrefillSharing | None = None
                         ) -> list[torch.Tensor]:
    """One completion per row, in row order, each cut after its EOS. With ``sharing`` (on, or
    ``auto`` and checked exact), a chunk's distinct prompts are prefilled once each
    (:mod:`r1fit.rollout.prefill`).

    Greedy (``settings.greedy``) takes ``seeds=None``; sampling needs one seed per row (see
    ``row_seeds``), and row i's completion then depends only on its prompt, seed and the model,
    not on ``batch_size`` nor on the other rows (up to float differences of the logits between
    batch shapes, which change a token only if a uniform lands within rounding of a CDF step)."""
    if settings.greedy and seeds is not None:
        raise ValueError("greedy generation takes seeds=None")
    if not settings.greedy and (seeds is None or len(seeds) != len(rows)):
        raise ValueError(f"sampling needs one seed per row ({len(rows)} rows, "
                         f"{'no' if seeds is None else len(seeds)} seeds)")
    gen_config = generation_config(settings, ids)
    if not settings.min_new_tokens and \
            getattr(unwrap(model).generation_config, "min_new_tokens", None) is None:
        # nothing to override: min_new_tokens=0 would make transformers add a MinLength
        # processor that never acts but clones and scans the [rows x vocab] scores every step
        gen_config.min_new_tokens = None
    was_training = model.training
    model.eval()
    completions: list[torch.Tensor] = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            shared = sharing is not None and sharing.use(model, chunk, gen_config, ids.pad, device)
            # a shared prefill takes each distinct prompt's images itself: the rows' copies of
            # them (G per prompt) are not collated
            batch = collate(chunk, None, ids.pad, images=not shared).to(device)
            processors = LogitsProcessorList()
            if seeds is not None:  # fresh streams per chunk: row i's draws start at its position 0
                processors.append(SeededSampler(seeds[start:start + batch_size],
                                                settings.temperature, settings.top_p))
            # synced_gpus=False: transformers would otherwise sync every token step across
            # ranks for an FSDP model; r1fit gathers the weights first (gathered()) and each rank
            # decodes its own rows to their own lengths, with no collectives
            inputs = prefilled_inputs(model, chunk, batch.inputs) if shared else batch.inputs
            out = model.generate(**inputs, generation_config=gen_config,
                                 logits_processor=processors, synced_gpus=False)
            new_tokens = out[:, batch.prompt_len:].cpu()
            completions.extend(cut_after_eos(row, ids.eos) for row in new_tokens)
    finally:
        model.train(was_training)
    return completions


#: ``generate(rows, seeds) -> (completions, engine log-probs or None)``: one engine's generation
Generate = Callable[[Sequence[Prompt], Sequence[int]], tuple[list[torch.Tensor], list[torch.Tensor] | None]]


def generate_rollout(rollout: Rollout, generate: Generate, *, seed: int) -> Rollout:
    """Generation stage: ``rollout`` with ``num_generations`` completions of each of this
    process's rows, sampled from per-row streams (the same completions whatever the chunking or
    rank), the engine's log-probs when it gives them, and the whole step's completion-token
    count (the loss normaliser; one sum over processes)."""
    seeds = row_seeds(seed, rollout.step, rollout.first_row, len(rollout.rows))
    completions, engine_logp = generate(rollout.rows, seeds)
    local = sum(int(c.shape[0]) for c in completions)
    return replace(rollout, completions=completions,
                   engine_logp=None if engine_logp is None else pad_rows(engine_logp),
                   total_tokens=int(all_sum([local])[0]))
