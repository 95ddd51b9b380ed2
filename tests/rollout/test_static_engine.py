"""The static-cache engine (rollout.engine=static) on CPU, where it runs eagerly: greedy tokens
equal Hugging Face generate's on every built-in family, a row's sampled tokens depend on its seed
only (alone, in a batch, across chunk sizes), min_new_tokens and blocked tokens as in the HF
path, compaction exact, LoRA merged and restored bit-exactly, and a multi-turn row continuing
its kept cache gets the tokens of its context prefilled whole."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from r1fit.data.batch import Prompt, encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.models.load import load_policy
from r1fit.rollout.generate import (
    SamplingSettings,
    TokenIds,
    counter_uniforms,
    generate_completions,
    row_seeds,
)
from r1fit.rollout.static_engine import StaticDecoder, Stop, merged_adapters
from r1fit.rollout.turns import STOP_WINDOW, StopAtToolCall

CPU = torch.device("cpu")
FAMILIES = ("tiny", "tiny-qwen2vl", "tiny-qwen3vl", "tiny-gemma3")


def setup(folder, *, lora_r=0, indices=(0, 2, 1, 5), copies=2, dtype="float32"):
    model, processor = load_policy(str(folder), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False, dtype=dtype,
                                   device=CPU, gradient_checkpointing=False)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)
    prompts = encode_prompts(processor, [data[i] for i in indices], "Think, then answer.")
    rows = [p for p in prompts for _ in range(copies)]
    return model, TokenIds.of(model, processor), rows


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return setup(tiny_dir)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family, builtin_folder, tiny_dir):
    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    assert len({p.length for p in rows}) > 1  # padded differently: left alignment is exercised
    settings = SamplingSettings(max_new_tokens=24, greedy=True)
    hf = generate_completions(model, rows, seeds=None, batch_size=len(rows), settings=settings,
                              ids=ids, device=CPU)
    engine = StaticDecoder(model, ids, CPU)
    static = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings)
    assert any(len(c) > 1 for c in hf)
    assert _same(static, hf), [(a.tolist(), b.tolist()) for a, b in zip(static, hf)]
    # a second call reuses the buffers (state from the first must not leak)
    again = engine.generate(rows[:3], seeds=None, batch_size=2, settings=settings)
    assert _same(again, hf[:3])
    # no autograd graph hangs on the buffers (full fine-tuning: the weights require grad), even
    # when called under inference_mode as evaluation does
    assert any(p.requires_grad for p in model.parameters())
    with torch.inference_mode():
        engine.generate(rows[:2], seeds=None, batch_size=2, settings=settings)
    assert not any(t.requires_grad for t in (engine.current, engine.out, *engine.keys))


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_tokens(tiny):
    """rollout.static.compile: the decode forward through torch.compile (on CPU without graphs)
    gives the eager step's greedy tokens."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=6, greedy=True)
    eager = StaticDecoder(model, ids, CPU).generate(rows[:4], seeds=None, batch_size=4,
                                                    settings=settings)
    compiled = StaticDecoder(model, ids, CPU, compile=True)
    assert _same(compiled.generate(rows[:4], seeds=None, batch_size=4, settings=settings), eager)
    assert compiled._compiled is not None
    # other batch sizes (compaction's buckets): a dynamic batch after the first recompile, the
    # same tokens as the eager step
    for n in (2, 3):
        assert _same(compiled.generate(rows[:n], seeds=None, batch_size=n, settings=settings),
                     eager[:n])


def _compile_as(make_call):
    """A stand-in for torch.compile: ``make_call(fn)`` is what "compiling" fn returns."""
    return lambda fn, **kwargs: make_call(fn)


def test_a_compile_that_fails_falls_back_to_the_uncompiled_step(tiny, monkeypatch, caplog):
    """rollout.static.compile on a machine where torch.compile cannot build the step (no compiler,
    an unsupported op): the engine warns once, turns compile off and decodes the eager tokens."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=6, greedy=True)
    eager = StaticDecoder(model, ids, CPU).generate(rows[:4], seeds=None, batch_size=4,
                                                    settings=settings)

    def broken(fn):
        def call(*args, **kwargs):
            raise RuntimeError("backend compiler failed\nits long traceback")
        return call

    monkeypatch.setattr(torch, "compile", _compile_as(broken))
    engine = StaticDecoder(model, ids, CPU, compile=True)
    with caplog.at_level("WARNING", logger="r1fit.rollout"):
        got = engine.generate(rows[:4], seeds=None, batch_size=4, settings=settings)
    assert _same(got, eager) and engine.compile is False
    assert "torch.compile of the decode step failed at 4 rows (RuntimeError: backend compiler " \
           "failed); decoding without it" in caplog.text
    assert caplog.text.count("torch.compile of the decode step failed") == 1


def test_an_error_where_the_compiled_step_ran_before_is_raised(tiny, monkeypatch):
    """Only a first run at a batch size can be a compile failure: an error of the compiled step
    at a size it ran at (a lost device, say) is the run's error, not a reason to fall back."""
    model, ids, rows = tiny
    calls = []

    def flaky(fn):
        def call(*args, **kwargs):
            calls.append(len(args) + len(kwargs))
            if len(calls) == 3:
                raise RuntimeError("device lost")
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "compile", _compile_as(flaky))
    engine = StaticDecoder(model, ids, CPU, compile=True)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(rows[:4], seeds=None, batch_size=4,
                        settings=SamplingSettings(max_new_tokens=6, greedy=True))
    assert len(calls) == 3 and engine.compile is True


def test_sampled_row_depends_on_its_seed_only(tiny):
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=0.95)
    seeds = row_seeds(7, 3, 0, len(rows))
    engine = StaticDecoder(model, ids, CPU)
    full = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    assert any(len(c) > 1 for c in full)
    for batch_size in (1, 3):
        chunked = engine.generate(rows, seeds=seeds, batch_size=batch_size, settings=settings)
        assert _same(chunked, full), batch_size
    alone = StaticDecoder(model, ids, CPU).generate(rows[5:6], seeds=seeds[5:6], batch_size=1,
                                                    settings=settings)
    assert _same(alone, full[5:6])
    other = engine.generate(rows, seeds=row_seeds(7, 4, 0, len(rows)), batch_size=len(rows),
                            settings=settings)
    assert sum(not torch.equal(a, b) for a, b in zip(full, other)) >= len(rows) - 1
    # the two rows of each prompt differ (a group is not G copies)
    assert sum(not torch.equal(full[i], full[i + 1]) for i in range(0, len(rows), 2)) >= 3


def test_min_new_tokens_and_blocked_tokens(tiny):
    model, tiny_ids, rows = tiny
    vocab = model.config.get_text_config().vocab_size
    blocked = [t for t in range(0, vocab, 2) if t not in tiny_ids.eos] + tiny_ids.blocked
    ids = TokenIds(pad=tiny_ids.pad, eos=tiny_ids.eos, blocked=blocked)
    settings = SamplingSettings(max_new_tokens=12, temperature=3.0, min_new_tokens=12)
    out = StaticDecoder(model, ids, CPU).generate(rows, seeds=row_seeds(1, 1, 0, len(rows)),
                                                  batch_size=4, settings=settings)
    assert all(len(c) == 12 for c in out)
    assert not any(bool(torch.isin(c, torch.tensor(blocked)).any()) for c in out)
    assert not any(bool(torch.isin(c[:-1], torch.tensor(ids.eos)).any()) for c in out)


def test_compaction_keeps_every_row_exact(tiny):
    """Rows that finish early leave the batch every sync_every steps; the rows left give the
    tokens they give without compaction (sampled: the uniforms follow the row, not its slot)."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=20, temperature=2.0)
    seeds = row_seeds(5, 2, 0, len(rows))
    plain = StaticDecoder(model, ids, CPU, sync_every=1000).generate(
        rows, seeds=seeds, batch_size=len(rows), settings=settings)
    # a stop id that some rows sample early and others never: rows end at differing steps
    first = {}
    for i, row in enumerate(plain):
        for t, token in enumerate(row.tolist()[2:], start=2):
            first.setdefault(token, {}).setdefault(i, t)
    stop = max((t for t, where in first.items() if len(where) < len(rows)),
               key=lambda t: len(first[t]))
    ids_stop = TokenIds(pad=ids.pad, eos=[*ids.eos, stop], blocked=ids.blocked)
    whole = StaticDecoder(model, ids_stop, CPU, sync_every=1000).generate(
        rows, seeds=seeds, batch_size=len(rows), settings=settings)
    lengths = sorted(len(c) for c in whole)
    assert lengths[0] < 12 and lengths[-1] == 20, lengths  # some stop early, some do not
    engine = StaticDecoder(model, ids_stop, CPU, sync_every=2)
    compact = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    assert _same(compact, whole)


def test_buffers_hold_the_calls_rows_not_a_larger_batch_size(tiny):
    """A step of 8 rows under memory.generation_batch=64 allocates a KV cache of 8 rows (what the
    planner counts: min(generation_batch, the step's rows)); a later larger call grows it, a
    smaller one keeps it."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=4, greedy=True)
    engine = StaticDecoder(model, ids, CPU)
    engine.generate(rows, seeds=None, batch_size=64, settings=settings)
    assert engine.capacity == len(rows) == 8
    assert engine.keys[0].shape[0] == 8
    engine.generate(rows[:3], seeds=None, batch_size=64, settings=settings)
    assert engine.capacity == 8
    engine.generate(rows + rows, seeds=None, batch_size=64, settings=settings)
    assert engine.capacity == 16
    chunked = StaticDecoder(model, ids, CPU)
    chunked.generate(rows, seeds=None, batch_size=3, settings=settings)
    assert chunked.capacity == 3


def test_a_larger_shared_call_frees_the_old_prompts_half_first(tiny):
    """Reallocating the shared-prompt layout (a call with more prompts than before) holds one
    cache, not the old prompts' keys beside the new ones (the planner counts one)."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=4, greedy=True)
    engine = StaticDecoder(model, ids, CPU, share_prompt=True, prompt_places=2)
    engine.generate(rows[:4], seeds=None, batch_size=8, settings=settings)  # 2 prompt slots
    old = weakref.ref(engine.shared.keys[0])
    alive = []
    allocate = engine._allocate

    def watched(*args, **kwargs):
        allocate(*args, **kwargs)
        alive.append(old() is not None)  # the new buffers exist now

    engine._allocate = watched
    engine.generate(rows, seeds=None, batch_size=8, settings=settings)  # 4 slots
    assert alive == [False]


class _Scripted(StaticDecoder):
    """The engine with every row's token s read from ``script`` (the forward still runs)."""

    script: torch.Tensor

    def _pick(self, logits, rows, settings):
        return self.script.index_select(0, self.counter).expand(rows).clone()


def test_a_stop_text_spread_past_the_window_does_not_stop_the_row(tiny, tiny_dir):
    """A stop text whose pieces lie further apart than one window (tokens that decode to nothing
    between them) ends no row, as in the HF path (StopAtToolCall) and Stop.first: the engine's
    early check uses the same rule, so the row runs on and every token returned was generated."""
    model, ids, rows = tiny
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    piece = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    empty = tok.convert_tokens_to_ids("<|box_end|>")
    assert tok.decode([empty], skip_special_tokens=True) == ""
    tokens = piece("he") + piece("</tool") + [empty] * (STOP_WINDOW + 3) + piece("_call>")
    while len(tokens) < 64:
        tokens += piece(" hello world")
    script = torch.tensor(tokens[:64])
    stop = Stop("</tool_call>", tok, STOP_WINDOW)
    hf = StopAtToolCall(tok, 0, [64])
    for n in range(1, 65):
        hf(script[None, :n], None)
    assert hf.stops == [64] and stop.first(script.tolist()) is None
    engine = _Scripted(model, ids, CPU, sync_every=16)
    engine.script = script
    got = engine.generate(rows[:1], seeds=None, batch_size=1, stop=stop,
                          settings=SamplingSettings(max_new_tokens=64, greedy=True))
    assert got[0].tolist() == script.tolist()
    # within one window the text stops the row right after its last piece
    near = torch.tensor((piece("he") + piece("</tool") + [empty] * 3 + piece("_call>")
                         + piece(" hello world") * 40)[:64])
    engine.script = near
    got = engine.generate(rows[:1], seeds=None, batch_size=1, stop=stop,
                          settings=SamplingSettings(max_new_tokens=64, greedy=True))
    assert got[0].tolist() == near[:stop.first(near.tolist())].tolist()
    assert len(got[0]) < 20


def test_lora_merge_is_restored_bit_exactly(tiny_dir):
    model, ids, rows = setup(tiny_dir, lora_r=4)
    for name, p in model.named_parameters():  # nonzero adapters: B starts at 0 in peft
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = {"input_ids": rows[0].input_ids[None], "attention_mask": torch.ones(1, rows[0].length, dtype=torch.long),
         **{k: v[None] for k, v in rows[0].token_inputs.items()}, **rows[0].image_inputs}
    with torch.no_grad():
        adapted = model(**x).logits
        with merged_adapters(model) as merged:
            inside = merged(**x).logits
            changed = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert changed
    torch.testing.assert_close(inside, adapted, rtol=1e-4, atol=1e-4)  # W + sBA = W x + s B A x
    for _ in range(1000):
        with merged_adapters(model):
            pass
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items())
    # the peft model's adapters are on again after the block
    with torch.no_grad():
        assert torch.equal(model(**x).logits, adapted)


def test_lora_generation_reads_the_adapters(tiny_dir):
    model, ids, rows = setup(tiny_dir, lora_r=4)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    hf = generate_completions(model, rows, seeds=None, batch_size=len(rows), settings=settings,
                              ids=ids, device=CPU)
    static = StaticDecoder(model, ids, CPU).generate(rows, seeds=None, batch_size=len(rows),
                                                     settings=settings)
    assert _same(static, hf)


def test_counter_uniforms_are_uniform_and_pure():
    seeds = torch.tensor(row_seeds(3, 1, 0, 20000))
    u = counter_uniforms(seeds, torch.tensor([5]))
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Kolmogorov-Smirnov: sqrt(n) * D over 1.95 has probability 0.001 for uniform draws
    x = u.sort().values
    n = x.numel()
    steps = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert float(torch.maximum(steps - x, x - (steps - 1 / n)).max()) * n ** 0.5 < 1.95
    assert torch.equal(counter_uniforms(seeds[7:9], torch.tensor([5])), u[7:9])
    assert not torch.equal(counter_uniforms(seeds, torch.tensor([6])), u)


def test_decode_attention_equals_sdpa_with_repeated_heads():
    """One query token, 8 query heads on 2 KV heads, a padding mask: the grouped path gives
    transformers' sdpa result (which repeats each KV head 4 times)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from r1fit.rollout.static_engine import decode_attention

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    query = torch.randn(3, 8, 1, 16)
    key, value = torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False
    mask[2, ..., 7:] = False
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (3, 1, 8, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_of_an_appended_block_equals_sdpa_with_repeated_heads():
    """A block of 4 query tokens (an appended tool turn), 8 query heads on 2 KV heads, a mask of
    its own per query (causal within the block, a padded row): the grouped path gives
    transformers' sdpa result with no copy of the keys per head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from r1fit.rollout.static_engine import decode_attention

    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    query = torch.randn(3, 8, 4, 16, dtype=torch.float64)
    key, value = (torch.randn(3, 2, 12, 16, dtype=torch.float64) for _ in range(2))
    columns, queries = torch.arange(12), 6 + torch.arange(4)  # the block at columns 6..9
    mask = (columns[None, None, None, :] <= queries[None, None, :, None]).repeat(3, 1, 1, 1)
    mask[1, ..., :3] = False  # padding on the left of row 1
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (3, 4, 8, 16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _grown(rows, turns, text_ids):
    """Each row's context grown by its turn and a tool turn's text (new Prompt objects: a row of
    the next turn is its own conversation)."""
    out = []
    for row, tokens in zip(rows, turns, strict=True):
        extra = torch.cat([tokens, torch.tensor(text_ids, dtype=torch.long)])
        extras = {k: torch.cat([v, torch.zeros(len(extra), dtype=v.dtype)])
                  for k, v in row.token_inputs.items()}
        out.append(Prompt(torch.cat([row.input_ids, extra]), extras, row.image_inputs,
                          row.sample))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_cache_gives_the_tokens_of_a_whole_prefill(family, builtin_folder, tiny_dir):
    """Multi-turn: a turn that continues the kept cache (only the new tokens prefilled) gives the
    greedy tokens of the same contexts prefilled whole, and Hugging Face generate's, on every
    family; rows leave between turns (the kept rows are picked by ``previous``), and early
    finishers were compacted away in the first turn."""
    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    settings = SamplingSettings(max_new_tokens=24, greedy=True)
    engine = StaticDecoder(model, ids, CPU, sync_every=2)
    first = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings,
                            keep=True)
    text = [7, 8, 9, 10, 11] if family != "tiny-gemma3" else [107, 108, 109]
    previous = [5, 0, 2, 7]  # rows 1, 3, 4, 6 ended
    contexts = _grown([rows[i] for i in previous], [first[i] for i in previous], text)
    limits = [24, 9, 17, 24]
    kept = engine.generate(contexts, seeds=None, batch_size=len(rows), settings=settings,
                           limits=limits, keep=True, previous=previous)
    assert engine.appended == 1 and engine.refilled == 0
    whole = StaticDecoder(model, ids, CPU).generate(contexts, seeds=None, batch_size=4,
                                                    settings=settings, limits=limits)
    hf = [generate_completions(model, [c], seeds=None, batch_size=1, settings=replace(
        settings, max_new_tokens=limit), ids=ids, device=CPU)[0]
        for c, limit in zip(contexts, limits, strict=True)]
    assert any(len(c) > 1 for c in kept)
    assert _same(kept, whole), [(a.tolist(), b.tolist()) for a, b in zip(kept, whole)]
    assert _same(kept, hf)
    # a third turn keeps what the second appended and decoded
    third = _grown(contexts[1:3], kept[1:3], text)
    again = engine.generate(third, seeds=None, batch_size=len(rows), settings=settings,
                            previous=[1, 2])
    assert engine.appended == 2
    assert _same(again, StaticDecoder(model, ids, CPU).generate(
        third, seeds=None, batch_size=2, settings=settings))


def _grown_with_image(rows, turns, processor, sizes):
    """Each row's context grown by its turn and a tool turn showing an image (a zoom's result:
    ``sizes[i]`` px square), as a trajectory's context holds it (its image's tokens marked,
    its tensors after the prompt's)."""
    from PIL import Image

    from r1fit.tools import ToolResult
    from r1fit.tools.conversation import tool_turn_tokens

    out = []
    for row, tokens, size in zip(rows, turns, sizes, strict=True):
        ids, extras, images, _ = tool_turn_tokens(
            processor, [ToolResult("zoom", (Image.new("RGB", (size, size), (200, 30, 90)),))])
        extra = torch.cat([tokens, ids])
        token_inputs = {k: torch.cat([v, torch.zeros(len(tokens), dtype=v.dtype),
                                      extras[k].to(v.dtype)])
                        for k, v in row.token_inputs.items()}
        image_inputs = {k: torch.cat([row.image_inputs[k], images[k]]) for k in images}
        out.append(Prompt(torch.cat([row.input_ids, extra]), token_inputs, image_inputs,
                          row.sample))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_cache_appends_a_tool_turns_image(family, builtin_folder, tiny_dir):
    """A tool turn that shows an image (zooms of two sizes) is appended to the kept cache, its
    image through the vision tower at the positions the model's rule gives it in the whole
    context: the greedy tokens of the contexts prefilled whole, and of HF generate, on each
    Qwen-VL family; a third turn after it appends again. Gemma 3's image tokens attend to each
    other both ways, which a causal block cannot do: it prefills the turn whole."""
    from transformers import AutoProcessor

    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    processor = AutoProcessor.from_pretrained(folder)
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    engine = StaticDecoder(model, ids, CPU, sync_every=2)
    first = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings,
                            keep=True, room=400)
    previous = [4, 1, 6]
    contexts = _grown_with_image([rows[i] for i in previous], [first[i] for i in previous],
                                 processor, [56, 84, 56])
    gemma = family == "tiny-gemma3"
    shown = "pixel_values" if gemma else "image_grid_thw"  # a row per image
    assert all(int(c.image_inputs[shown].shape[0]) == 2 for c in contexts)
    kept = engine.generate(contexts, seeds=None, batch_size=len(rows), settings=settings,
                           keep=True, previous=previous)
    assert (engine.appended, engine.refilled) == ((0, 1) if gemma else (1, 0))
    whole = StaticDecoder(model, ids, CPU).generate(contexts, seeds=None, batch_size=3,
                                                    settings=settings)
    hf = [generate_completions(model, [c], seeds=None, batch_size=1, settings=settings,
                               ids=ids, device=CPU)[0] for c in contexts]
    assert _same(kept, whole), [(a.tolist(), b.tolist()) for a, b in zip(kept, whole)]
    assert _same(kept, hf)
    third = _grown_with_image(contexts[:2], kept[:2], processor, [84, 56])
    again = engine.generate(third, seeds=None, batch_size=len(rows), settings=settings,
                            previous=[0, 1])
    assert engine.appended == (0 if gemma else 2)
    assert _same(again, StaticDecoder(model, ids, CPU).generate(
        third, seeds=None, batch_size=2, settings=settings))


class Capturing(StaticDecoder):
    """The engine, keeping each step's logits (before the blocked ids are set to -inf)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []

    def _pick(self, logits, rows, settings):
        self.logits.append(logits[:rows].clone())
        return super()._pick(logits, rows, settings)


@pytest.mark.parametrize("family", ("tiny", "tiny-qwen3vl"))
def test_a_text_only_padded_batch_is_placed_as_each_row_alone(family, builtin_folder, tiny_dir):
    """Prompts without images, padded on the left: Qwen-VL's own rule places no text-only batch
    (transformers counts from the first column, padding too), so the prefill counts each row
    from its first real token: every step's logits are those of the row run alone."""
    from transformers import AutoProcessor

    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    processor = AutoProcessor.from_pretrained(folder)
    text = encode_prompts(processor, [replace(r.sample, images=[]) for r in rows[::2]],
                          "Think, then answer.")
    assert len({row.length for row in text}) > 1  # some rows are padded
    engine = Capturing(model, ids, CPU)
    out = engine.generate(text, seeds=None, batch_size=4,
                          settings=SamplingSettings(max_new_tokens=3, greedy=True))
    for i, row in enumerate(text):
        grown = torch.cat([row.input_ids, out[i][:1]])[None]
        with torch.no_grad():
            alone = model(input_ids=grown).logits[0, -2:].float()
        for step in (0, 1):
            got = engine.logits[step][i]
            shown = torch.isfinite(got)
            torch.testing.assert_close(got[shown], alone[step][shown], rtol=1e-4, atol=1e-5)


def test_kept_cache_sampled_and_where_the_context_differs(tiny):
    """Sampled rows continue the kept cache with the tokens a whole prefill gives them; a row
    whose context no longer starts with its turn (a scripted turn replaced it) keeps only the
    common prefix."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=0.95)
    seeds = row_seeds(3, 1, 0, len(rows))
    engine = StaticDecoder(model, ids, CPU)
    first = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings, keep=True)
    turns = list(first)
    turns[1] = torch.tensor([5, 6, 7, 8])  # not what the model wrote: the cache keeps the prompt
    contexts = _grown(rows, turns, [7, 8, 9])
    kept = engine.generate(contexts, seeds=seeds, batch_size=len(rows), settings=settings,
                           keep=True, previous=list(range(len(rows))))
    whole = StaticDecoder(model, ids, CPU).generate(contexts, seeds=seeds, batch_size=len(rows),
                                                    settings=settings)
    assert engine.appended == 1 and _same(kept, whole)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_plans_decode_workspace_is_what_a_decode_step_holds(builtin_folder, top_p):
    """The planner's static-engine step workspace (static_step_bytes, per row and vocabulary
    entry) against the live-tensor peak of a whole generate call over what was alive before it
    (the buffers from an earlier call): on the real 151,936-entry vocabulary, where [rows x
    vocab] tensors are most of a step, within -5%..+10%."""
    from r1fit.memory.planner.estimate import static_step_bytes
    from r1fit.memory.probe import TensorProbe

    model, ids, rows = setup(builtin_folder("small-realvocab"), indices=(0,), copies=16)
    blocked = replace(ids, blocked=list(ids.blocked) + list(ids.eos))  # every step runs
    settings = SamplingSettings(max_new_tokens=6, temperature=0.7, top_p=top_p,
                                min_new_tokens=3)
    seeds = row_seeds(0, 1, 0, len(rows))
    engine = StaticDecoder(model, blocked, CPU)
    engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    probe = TensorProbe()
    probe.start()
    engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    measured = probe.peak() - probe.before_bytes
    vocab = model.config.get_text_config().vocab_size
    planned = len(rows) * vocab * static_step_bytes(4, top_p)
    assert 0.95 <= planned / measured <= 1.10, (planned, measured)
