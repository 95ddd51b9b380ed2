"""The static engine's shared-prompt layout (rollout.static.share_prompt): the attention that
reads each prompt once equals one softmax over the row's whole context (float64, by hand), the
slots follow the rows, and the engine gives the plain layout's tokens on the built-in families
it applies to, with a smaller cache; where it does not apply (sliding-window layers, a
multi-turn call) the plain layout runs."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from r1fit.rollout.generate import SamplingSettings, TokenIds, row_seeds
from r1fit.rollout.shared_prompts import (
    SharedPrompts,
    float32_products,
    prompt_slots,
    shared_prompt_attention,
)
from r1fit.rollout.static_engine import StaticDecoder

from .test_static_engine import CPU, FAMILIES, _same, setup


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return setup(tiny_dir)


def test_prompt_slots_place_each_prompts_rows_side_by_side():
    # rows of prompts 0, 0, 0, 1, 1, 0, 0 with 2 places a slot: prompt 0's rows take 3 slots
    slot_of, place, prompt_of_slot = prompt_slots([0, 0, 0, 1, 1, 0, 0], 2)
    assert slot_of == [0, 0, 1, 2, 2, 1, 3]
    assert place == [0, 1, 0, 0, 1, 1, 0]
    assert prompt_of_slot == [0, 0, 1, 0]
    assert prompt_slots([], 4) == ([], [], [])
    assert prompt_slots([3, 3, 3], 8) == ([0, 0, 0], [0, 1, 2], [3])


def _reference(q, prompt_k, prompt_v, prompt_len, own_k, own_v, own_len, scale):
    """One row's attention by hand: its prompt's real columns then its own written ones, one
    softmax (float64). q [heads, dim]; keys [kv, columns, dim]."""
    heads, kv = q.shape[0], prompt_k.shape[0]
    out = torch.empty_like(q)
    for h in range(heads):
        j = h // (heads // kv)
        keys = torch.cat([prompt_k[j, :prompt_len], own_k[j, :own_len]])
        values = torch.cat([prompt_v[j, :prompt_len], own_v[j, :own_len]])
        weights = torch.softmax(keys @ q[h] * scale, dim=0)
        out[h] = weights @ values
    return out


@pytest.mark.parametrize("additive", [False, True])
def test_attention_equals_one_softmax_over_prompt_and_completion(additive):
    """Rows of 2 prompts (3 slots of 2 places: prompt 0 has 3 rows), a row's own columns
    partly written: each row's output is the softmax attention over its prompt's real tokens
    and its written tokens, within 1e-12 (float64); boolean and additive masks alike."""
    torch.manual_seed(0)
    rows, heads, kv, dim, width, own = 5, 4, 2, 8, 7, 6
    prompt_of_row = [0, 0, 1, 0, 1]
    slot_of, place, prompt_of_slot = prompt_slots(prompt_of_row, 2)
    lengths = [5, 7]  # prompt 0 has 5 real tokens (columns 0-4), prompt 1 all 7
    pk = torch.randn(2, kv, width, dim, dtype=torch.float64)
    pv = torch.randn(2, kv, width, dim, dtype=torch.float64)
    slots = len(prompt_of_slot)
    source = torch.tensor(prompt_of_slot)
    capacity = 8  # the engine's row buffers are longer than the rows of a step
    shared = SharedPrompts(
        keys=[pk.index_select(0, source)], values=[pv.index_select(0, source)],
        mask=torch.arange(width)[None] < torch.tensor(lengths)[source][:, None],
        prompt_of=torch.tensor(slot_of + [0] * (capacity - rows)),
        place=torch.tensor(place + [0] * (capacity - rows)), places=2)
    assert shared.mask.shape == (slots, width)
    q = torch.randn(rows, heads, 1, dim, dtype=torch.float64)
    k = torch.randn(rows, kv, own, dim, dtype=torch.float64)
    v = torch.randn(rows, kv, own, dim, dtype=torch.float64)
    written = [1, 3, 6, 2, 4]
    mask = torch.arange(own)[None] < torch.tensor(written)[:, None]
    mask = mask[:, None, None, :]
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(
            ~mask, torch.finfo(torch.float64).min)
    scale = 1 / math.sqrt(dim)
    got = shared_prompt_attention(SimpleNamespace(layer_idx=0), q, k, v, mask, shared,
                                  scaling=scale)
    assert got.shape == (rows, 1, heads, dim)
    for r in range(rows):
        p = prompt_of_row[r]
        want = _reference(q[r, :, 0], pk[p], pv[p], lengths[p], k[r], v[r], written[r], scale)
        assert torch.allclose(got[r, 0], want, rtol=0, atol=1e-12), r


def _shared(model, ids, **kwargs):
    return StaticDecoder(model, ids, CPU, share_prompt=True, prompt_places=2, **kwargs)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "tiny-gemma3"])
def test_greedy_tokens_equal_the_plain_layouts(family, builtin_folder, tiny_dir):
    """Greedy on the Qwen families (prompts of differing lengths, 2 rows each): the shared
    layout's tokens are the plain layout's, with a smaller cache; a second call with fewer
    rows reuses its buffers."""
    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    settings = SamplingSettings(max_new_tokens=24, greedy=True)
    plain_engine = StaticDecoder(model, ids, CPU)
    plain = plain_engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
    engine = _shared(model, ids)
    shared = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
    assert engine.share_prompt and engine.shared is not None
    assert _same(shared, plain), [(a.tolist(), b.tolist()) for a, b in zip(shared, plain)]
    assert engine.cache_bytes() < plain_engine.cache_bytes()
    assert _same(engine.generate(rows[:3], seeds=None, batch_size=3, settings=settings),
                 plain[:3])


def test_sampled_rows_do_not_depend_on_batch_or_chunk(tiny):
    """Sampling: a row's tokens alone, in the whole batch and in chunks of 3 (a chunk edge
    splits a prompt's rows) are the same, and the plain layout's."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0)
    seeds = row_seeds(3, 1, 0, len(rows))
    plain = StaticDecoder(model, ids, CPU).generate(rows, seeds=seeds, batch_size=len(rows),
                                                    settings=settings)
    engine = _shared(model, ids)
    whole = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    chunks = engine.generate(rows, seeds=seeds, batch_size=3, settings=settings)
    alone = [_shared(model, ids).generate([row], seeds=[seed], batch_size=1,
                                          settings=settings)[0]
             for row, seed in zip(rows, seeds)]
    assert _same(whole, plain) and _same(chunks, plain) and _same(alone, plain)


def test_more_rows_of_a_prompt_than_places_take_more_slots(tiny):
    """Four rows of each prompt with 2 places a slot: each prompt is copied into 2 slots; the
    tokens stay the plain layout's."""
    model, ids, rows = tiny
    rows = [r for r in rows for _ in range(2)]  # 4 rows of each prompt
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    plain = StaticDecoder(model, ids, CPU).generate(rows, seeds=None, batch_size=len(rows),
                                                    settings=settings)
    engine = _shared(model, ids)
    assert _same(engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings),
                 plain)
    assert int(engine.shared.mask.any(-1).sum()) == 8  # 4 prompts x 2 slots each


def test_compaction_moves_each_rows_slot(tiny):
    """Rows that end early leave the batch (sync_every 2); the rows left still read their own
    prompt: the tokens of the plain layout without compaction."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=20, temperature=2.0)
    seeds = row_seeds(5, 2, 0, len(rows))
    first = StaticDecoder(model, ids, CPU, sync_every=1000).generate(
        rows, seeds=seeds, batch_size=len(rows), settings=settings)
    counts: dict[int, set[int]] = {}
    for i, row in enumerate(first):
        for token in row.tolist()[2:]:
            counts.setdefault(token, set()).add(i)
    stop = max((t for t, where in counts.items() if len(where) < len(rows)),
               key=lambda t: len(counts[t]))
    ids_stop = TokenIds(pad=ids.pad, eos=[*ids.eos, stop], blocked=ids.blocked)
    whole = StaticDecoder(model, ids_stop, CPU, sync_every=1000).generate(
        rows, seeds=seeds, batch_size=len(rows), settings=settings)
    assert min(len(c) for c in whole) < 12 and max(len(c) for c in whole) == 20
    compact = _shared(model, ids_stop, sync_every=2).generate(
        rows, seeds=seeds, batch_size=len(rows), settings=settings)
    assert _same(compact, whole)


def test_where_it_does_not_apply_the_plain_layout_runs(builtin_folder, tiny, caplog):
    """Gemma 3 (sliding-window layers): refused at construction, logged, plain tokens. A
    multi-turn call (keep=True) keeps each row's own cache: the plain layout for that call."""
    model, ids, rows = setup(builtin_folder("tiny-gemma3"))
    with caplog.at_level(logging.INFO, "r1fit.rollout"):
        engine = _shared(model, ids)
    assert not engine.share_prompt and "sliding window" in caplog.text
    settings = SamplingSettings(max_new_tokens=8, greedy=True)
    assert _same(engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings),
                 StaticDecoder(model, ids, CPU).generate(rows, seeds=None, batch_size=len(rows),
                                                         settings=settings))
    model, ids, rows = tiny
    engine = _shared(model, ids)
    kept = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings, keep=True)
    assert engine.shared is None and engine._kept is not None
    assert _same(kept, StaticDecoder(model, ids, CPU).generate(
        rows, seeds=None, batch_size=len(rows), settings=settings))
    # and the next single-turn call goes back to the shared layout
    engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
    assert engine.shared is not None


def test_the_plan_counts_the_cache_the_engine_allocates(tiny, tiny_dir):
    """The planner's static KV cache (static_engine_memory) with share_prompt, for the rows,
    prompt width and completion the engine ran: the bytes the engine allocated, both layouts."""
    from r1fit.config import load_config
    from r1fit.memory.planner import model_facts
    from r1fit.memory.planner.estimate import static_engine_memory

    model, ids, rows = tiny
    rows = [r for r in rows for _ in range(2)]  # 4 prompts x G=4, in groups
    rows.sort(key=lambda r: id(r.input_ids))
    width = max(r.length for r in rows)
    steps = 20
    settings = SamplingSettings(max_new_tokens=steps, greedy=True)
    facts = model_facts(str(tiny_dir))
    for share in (False, True):
        cfg = load_config(None, [f"model.path={tiny_dir}", "algo.num_generations=4",
                                 f"rollout.static.share_prompt={str(share).lower()}",
                                 "data.eval=null"])
        engine = StaticDecoder(model, ids, CPU, share_prompt=share, prompt_places=4)
        engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
        planned = static_engine_memory(facts, cfg, 4, width, len(rows), steps)
        assert planned.kv_cache == engine.cache_bytes(), share


def test_a_call_reads_only_its_own_prompt_slots(tiny):
    """After a call that needed more slots (here 8: each prompt's 4 rows in 2), a call of 4
    slots reads 4 (a view of the allocation), with the plain layout's tokens."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=8, greedy=True)
    engine = _shared(model, ids)
    engine.generate([r for r in rows for _ in range(2)], seeds=None, batch_size=16,
                    settings=settings)
    assert engine.shared.mask.shape[0] == 8 and engine._slots.mask.shape[0] == 8
    got = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
    assert engine.shared.mask.shape[0] == 8 and engine._slots.mask.shape[0] == 4
    assert _same(got, StaticDecoder(model, ids, CPU).generate(rows, seeds=None,
                                                              batch_size=len(rows),
                                                              settings=settings))


@pytest.mark.slow
def test_the_compiled_step_reads_the_shared_prompts(tiny):
    """rollout.static.compile with share_prompt (torch.compile on CPU, the prompts' half passed
    through the forward as a keyword): the eager plain layout's greedy tokens, at the first
    batch size and at the dynamic ones after it, and no fallback to the uncompiled step."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=6, greedy=True)
    eager = StaticDecoder(model, ids, CPU).generate(rows[:4], seeds=None, batch_size=4,
                                                    settings=settings)
    compiled = _shared(model, ids, compile=True)
    for n in (4, 2, 3):
        assert _same(compiled.generate(rows[:n], seeds=None, batch_size=n, settings=settings),
                     eager[:n])
    assert compiled.compile and compiled._compiled is not None and compiled.shared is not None


def test_sixteen_bit_products_written_in_float32(monkeypatch):
    """``wide`` (CUDA: torch.bmm's out_dtype): bfloat16 scores and weighted values kept in
    float32, as sdpa's kernels keep them, come closer to the float64 attention than products
    rounded to bfloat16. On CPU torch.bmm has no out_dtype: stood in for by a float32 product
    of the same bfloat16 inputs. Without CUDA the engine does not ask for it."""
    original = torch.bmm

    def bmm(a, b, out_dtype=None):
        return original(a.float(), b.float()) if out_dtype is not None else original(a, b)

    torch.manual_seed(1)
    rows, heads, kv, dim, width, own = 4, 4, 2, 16, 96, 5
    slot_of, place, prompt_of_slot = prompt_slots([0, 0, 1, 1], 2)
    q, k, v = (torch.randn(rows, *shape) * 3 for shape in ((heads, 1, dim), (kv, own, dim),
                                                           (kv, own, dim)))
    pk, pv = torch.randn(2, kv, width, dim) * 3, torch.randn(2, kv, width, dim)
    mask = torch.ones(rows, 1, 1, own, dtype=torch.bool)

    def run(dtype, wide):
        shared = SharedPrompts(keys=[pk.to(dtype)], values=[pv.to(dtype)],
                               mask=torch.ones(2, width, dtype=torch.bool),
                               prompt_of=torch.tensor(slot_of), place=torch.tensor(place),
                               places=2, wide=wide)
        return shared_prompt_attention(SimpleNamespace(layer_idx=0), q.to(dtype), k.to(dtype),
                                       v.to(dtype), mask, shared).double()

    exact = run(torch.float64, False)
    rounded = (run(torch.bfloat16, False) - exact).abs().max()
    monkeypatch.setattr(torch, "bmm", bmm)
    kept = (run(torch.bfloat16, True) - exact).abs().max()
    assert kept < rounded / 2, (kept, rounded)
    assert float32_products(torch.device("cpu")) is False
