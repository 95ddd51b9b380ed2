"""Seeded sampling: a row's completion depends on its prompt and seed only, never on its chunk;
the sampler's maths (temperature, top-p, inverse CDF) checked on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TopPLogitsWarper

from r1fit.data.batch import encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.models.load import load_policy
from r1fit.rollout.generate import (
    SAMPLE_BLOCK,
    SamplingSettings,
    SeededSampler,
    TokenIds,
    filter_top_p,
    generate_completions,
    row_seeds,
    sample_rows,
)

CPU = torch.device("cpu")
SAMPLING = SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The tiny model, its token ids and 8 rows: 4 prompts (lengths 45 and 50, so chunks are
    padded differently) x 2 completions, group-contiguous like GRPO's rows."""
    model, processor = load_policy(str(tiny_dir), lora_r=0, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False, dtype="float32",
                                   device=CPU, gradient_checkpointing=False)
    ids = TokenIds.of(model, processor)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)
    prompts = encode_prompts(processor, [data[i] for i in (0, 2, 1, 5)], "Think, then answer.")
    assert len({p.length for p in prompts}) > 1
    rows = [p for p in prompts for _ in range(2)]
    return model, ids, rows


def generate(tiny, rows=None, seeds=None, batch_size=8, settings=SAMPLING, ids=None):
    model, tiny_ids, all_rows = tiny
    rows = all_rows if rows is None else rows
    return generate_completions(model, rows, seeds=seeds, batch_size=batch_size, settings=settings,
                                ids=ids or tiny_ids, device=CPU)


def test_completions_do_not_depend_on_chunking(tiny):
    rows = tiny[2]
    seeds = row_seeds(7, 3, 0, len(rows))
    full = generate(tiny, seeds=seeds, batch_size=len(rows))
    assert any(len(c) > 1 for c in full)
    for batch_size in (1, 3):
        chunked = generate(tiny, seeds=seeds, batch_size=batch_size)
        assert all(torch.equal(a, b) for a, b in zip(chunked, full, strict=True)), batch_size
    # another process generating rows 2.. (seeded by their global index) gets the same rows
    tail = generate(tiny, rows=rows[2:], seeds=row_seeds(7, 3, 2, len(rows) - 2), batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(tail, full[2:], strict=True))


def test_different_seeds_give_different_completions(tiny):
    rows = tiny[2]
    first = generate(tiny, seeds=row_seeds(0, 1, 0, len(rows)))
    second = generate(tiny, seeds=row_seeds(0, 2, 0, len(rows)))
    assert sum(not torch.equal(a, b) for a, b in zip(first, second)) >= len(rows) - 1
    # the two completions of each prompt differ too (a group is not G copies)
    assert sum(not torch.equal(first[i], first[i + 1]) for i in range(0, len(rows), 2)) >= 3


def test_blocked_tokens_are_never_generated(tiny):
    model, ids, rows = tiny
    vocab = model.config.get_text_config().vocab_size
    # block every other token (keeping EOS) at a high temperature, so blocking has work to do
    blocked = [t for t in range(0, vocab, 2) if t not in ids.eos] + ids.blocked
    hot = SamplingSettings(max_new_tokens=16, temperature=5.0, top_p=1.0)
    out = generate(tiny, seeds=row_seeds(0, 0, 0, len(rows)), settings=hot,
                   ids=TokenIds(ids.pad, ids.eos, blocked))
    generated = torch.cat(out)
    assert generated.numel() > len(rows)
    assert not torch.isin(generated, torch.tensor(blocked)).any()


@pytest.mark.parametrize("greedy", [False, True])
def test_min_new_tokens_blocks_every_end_token_until_then(tiny, greedy, nearly_all_stop):
    model, ids, rows = tiny
    stop_ids = nearly_all_stop(model, ids)
    eos = stop_ids.eos
    seeds = None if greedy else row_seeds(0, 0, 0, len(rows))
    free = generate(tiny, seeds=seeds, ids=stop_ids,
                    settings=SamplingSettings(max_new_tokens=16, greedy=greedy))
    assert max(len(c) for c in free) <= 2  # nearly every token ends it at once
    forced = generate(tiny, seeds=seeds, ids=stop_ids,
                      settings=SamplingSettings(max_new_tokens=16, greedy=greedy, min_new_tokens=6))
    assert all(len(c) >= 7 for c in forced)
    for completion in forced:
        assert not torch.isin(completion[:6], torch.tensor(eos)).any()


def test_seeds_must_match_the_decoding_mode(tiny):
    rows = tiny[2]
    greedy = SamplingSettings(max_new_tokens=4, greedy=True)
    with pytest.raises(ValueError, match="greedy generation takes seeds=None"):
        generate(tiny, seeds=row_seeds(0, 0, 0, len(rows)), settings=greedy)
    with pytest.raises(ValueError, match="sampling needs one seed per row"):
        generate(tiny, seeds=None)
    with pytest.raises(ValueError, match="sampling needs one seed per row"):
        generate(tiny, seeds=[1, 2])


def test_greedy_completions_do_not_depend_on_chunking(tiny):
    greedy = SamplingSettings(max_new_tokens=8, greedy=True)
    full = generate(tiny, settings=greedy)
    one = generate(tiny, settings=greedy, batch_size=1)
    assert all(torch.equal(a, b) for a, b in zip(one, full, strict=True))


def test_checkpoint_generation_defaults_do_not_leak_in(tiny):
    model, ids, rows = tiny
    # one token in 4 ends a completion, so most end early and a minimum length that leaked in
    # would show
    vocab = model.config.get_text_config().vocab_size
    ids = TokenIds(ids.pad, [t for t in range(0, vocab, 4) if t not in ids.blocked], ids.blocked)
    seeds = row_seeds(1, 1, 0, len(rows))
    plain = generate(tiny, seeds=seeds, ids=ids)
    assert min(len(c) for c in plain) < 12
    saved = model.generation_config
    longest_prompt = max(row.length for row in rows)
    # what Qwen2.5-VL-Instruct's generation_config.json sets, plus an n-gram ban; then minimum
    # lengths (min_new_tokens overrides min_length in transformers, so one at a time)
    for extra in ({}, {"min_length": longest_prompt + 12}, {"min_new_tokens": 12}):
        model.generation_config = GenerationConfig(
            **saved.to_diff_dict(), do_sample=True, temperature=0.1, top_k=1, top_p=0.001,
            repetition_penalty=1.05, no_repeat_ngram_size=2, **extra)
        try:
            leaked = generate(tiny, seeds=seeds, ids=ids)
        finally:
            model.generation_config = saved
        assert all(torch.equal(a, b) for a, b in zip(leaked, plain, strict=True)), extra


def test_row_seeds_are_a_function_of_the_global_row():
    seeds = row_seeds(5, 9, 0, 6)
    assert row_seeds(5, 9, 2, 4) == seeds[2:]
    assert len(set(seeds + row_seeds(5, 10, 0, 6) + row_seeds(6, 9, 0, 6))) == 18
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError):
        row_seeds(-1, 0, 0, 1)


# --- the sampler on hand-made logits ----------------------------------------------------------

def frequencies(scores: torch.Tensor, n_seeds: int, temperature: float, top_p: float) -> torch.Tensor:
    """How often each token is picked from a [1, V] score row, one seed (one stream) at a time."""
    counts = torch.zeros(scores.shape[-1])
    for seed in row_seeds(0, 0, 0, n_seeds):
        out = SeededSampler([seed], temperature, top_p)(torch.zeros(1, 1, dtype=torch.long), scores)
        assert out.isinf().sum() == scores.shape[-1] - 1 and out.max() == 0
        counts[out.argmax()] += 1
    return counts / n_seeds


def five_sigma(p: torch.Tensor, n: int) -> torch.Tensor:
    """5 binomial standard deviations of a frequency over n draws: a correct sampler fails this
    with probability < 1e-6 per token, while a wrong distribution (e.g. 0.6 vs 0.625) shows."""
    return 5 * torch.sqrt(p * (1 - p) / n)


def test_top_p_keeps_the_nucleus_and_samples_it_by_its_probabilities():
    probs = torch.tensor([0.3, 0.04, 0.5, 0.06, 0.1])
    scores = probs.log().unsqueeze(0)
    # sorted: 0.5, 0.3 (mass 0.8 >= 0.75): the nucleus is tokens {2, 0}, renormalised to 0.625/0.375
    expected = torch.tensor([0.375, 0.0, 0.625, 0.0, 0.0])
    n = 4000
    freq = frequencies(scores, n, temperature=1.0, top_p=0.75)
    assert freq[[1, 3, 4]].sum() == 0
    assert ((freq - expected).abs() <= five_sigma(expected, n)).all(), freq  # 5 sigma = 0.038


def test_temperature_divides_the_logits():
    scores = torch.tensor([[0.0, math.log(2), math.log(4)]])
    # logits / 2 = [0, ln sqrt2, ln 2]: probabilities 1 : sqrt2 : 2 over 3 + sqrt2
    expected = torch.tensor([1, math.sqrt(2), 2]) / (3 + math.sqrt(2))  # 0.2265, 0.3204, 0.4531
    n = 4000
    freq = frequencies(scores, n, temperature=2.0, top_p=1.0)
    assert ((freq - expected).abs() <= five_sigma(expected, n)).all(), freq
    # the inverse CDF picks the first token whose cumulative probability exceeds u:
    # CDF = 0.2265, 0.5469, 1
    u = torch.tensor([0.0, 0.22, 0.23, 0.54, 0.55, 0.999999], dtype=torch.float64)
    tokens = sample_rows(scores.expand(len(u), -1), u, temperature=2.0, top_p=1.0)
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_sampling_in_place_picks_the_same_tokens(temperature, top_p):
    """overwrite=True (the static engine's own logits) runs the vocabulary-wide steps in place:
    the same tokens, the scores overwritten; without it the caller's scores are left as they
    were, and a 16-bit input's float32 copy is worked on in place without touching the input."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 3000, generator=generator)
    scores[:, 7] = float("-inf")
    u = torch.rand(6, dtype=torch.float64, generator=generator)
    kept = scores.clone()
    expected = sample_rows(scores, u, temperature, top_p)
    assert torch.equal(scores, kept)
    assert torch.equal(sample_rows(scores, u, temperature, top_p, overwrite=True), expected)
    assert not torch.equal(scores, kept)  # worked on in place
    half = kept.to(torch.bfloat16)
    before = half.clone()
    assert torch.equal(sample_rows(half, u, temperature, top_p),
                       sample_rows(half.float(), u, temperature, top_p))
    assert torch.equal(half, before)


def test_suppressed_tokens_are_never_picked_even_at_the_edges_of_u():
    # HF sets suppressed tokens to -inf before custom processors run; first and last are suppressed
    scores = torch.tensor([[float("-inf"), 1.0, float("-inf"), 0.5, float("-inf")]])
    u = torch.tensor([0.0, 0.5, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0: u * total rounded up
    tokens = sample_rows(scores.expand(4, -1), u, temperature=1.0, top_p=1.0)
    assert set(tokens.tolist()) <= {1, 3}
    assert tokens.tolist()[0] == 1 and tokens.tolist()[-1] == 3


def test_two_level_cdf_finds_mass_across_block_edges_and_the_tail():
    # two blocks and a 5-entry tail; mass only at the last entry of block 0 and the first of the
    # tail (weights 1 and 1, total 2), every other entry suppressed: whole blocks without mass
    vocab = 2 * SAMPLE_BLOCK + 5
    scores = torch.full((1, vocab), float("-inf"))
    scores[0, [SAMPLE_BLOCK - 1, 2 * SAMPLE_BLOCK]] = 0.0
    # threshold u * 2: 0 and 0.5 -> cdf 1 at 1023 exceeds; 1.0 -> cdf 1 does not exceed 1, cdf 2
    # at the tail's first entry does; 1.0 (rounded u * total = total) -> the last positive entry
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-53, 1.0], dtype=torch.float64)
    tokens = sample_rows(scores.expand(len(u), -1), u, temperature=1.0, top_p=1.0)
    last, tail = SAMPLE_BLOCK - 1, 2 * SAMPLE_BLOCK
    assert tokens.tolist() == [last, last, tail, tail, tail, tail]


def test_two_level_cdf_agrees_with_one_float64_cumsum():
    # against the one-level inverse CDF over the whole row; a disagreement is allowed only where
    # the threshold lies within rounding (1e-6 relative) of a step of the CDF
    gen = torch.Generator().manual_seed(3)
    vocab = 3 * SAMPLE_BLOCK + 37
    scores = torch.randn(1, vocab, generator=gen) * 4
    scores[0, SAMPLE_BLOCK:2 * SAMPLE_BLOCK] = float("-inf")  # one whole block without mass
    u = torch.rand(4000, generator=gen, dtype=torch.float64)
    tokens = sample_rows(scores.expand(len(u), -1), u, temperature=0.8, top_p=1.0)
    cdf = (scores[0].double() / 0.8).softmax(-1).cumsum(-1)
    reference = torch.searchsorted(cdf, u * cdf[-1], right=True)
    differ = tokens != reference
    assert not torch.isinf(scores[0, tokens]).any()
    assert differ.sum() <= 2
    for i in differ.nonzero().flatten().tolist():
        assert (cdf - u[i] * cdf[-1]).abs().min() < 1e-6


def test_top_p_filter_matches_hf_and_rows_are_independent():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(16, 50, generator=gen) * 3
    for top_p in (0.3, 0.9, 0.999):
        ours = filter_top_p(scores, top_p)
        hf = TopPLogitsWarper(top_p)(torch.zeros(16, 1, dtype=torch.long), scores.clone())
        assert torch.equal(ours.isinf(), hf.isinf()), top_p
    # a row's token is the same alone or inside a batch
    u = torch.rand(16, generator=gen, dtype=torch.float64)
    batched = sample_rows(scores, u, temperature=0.7, top_p=0.9)
    alone = torch.cat([sample_rows(scores[i:i + 1], u[i:i + 1], 0.7, 0.9) for i in range(16)])
    assert torch.equal(batched, alone)


def test_min_length_is_left_unset_where_min_new_tokens_takes_precedence():
    """min_length=0 keeps a checkpoint's minimum out; with min_new_tokens > 0 that minimum is
    overridden anyway, and setting both makes transformers warn on every call."""
    from r1fit.rollout.generate import generation_config

    ids = TokenIds(pad=0, eos=[1], blocked=[])
    assert generation_config(SamplingSettings(max_new_tokens=8), ids).min_length == 0
    forced = generation_config(SamplingSettings(max_new_tokens=8, min_new_tokens=8), ids)
    assert forced.min_length is None and forced.min_new_tokens == 8
    assert "min_length" not in forced.to_diff_dict()
