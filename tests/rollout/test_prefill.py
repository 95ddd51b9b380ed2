"""Shared prefill: generate from each distinct prompt's KV cache copied to its rows gives the
per-row path's logits and completions (float64, mixed groups, padding, chunks that split a group,
text-only rows, LoRA, r1fit's log-prob root, three architectures), and the check behind ``auto``
sees a cache whose positions are off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from r1fit.data.batch import collate, encode_prompts
from r1fit.data.sample import Sample
from r1fit.models.logprobs import CompletionLogProbs
from r1fit.rollout.generate import (
    SamplingSettings,
    TokenIds,
    generate_completions,
    generation_config,
    row_seeds,
)
from r1fit.rollout.prefill import (
    HALF_KEY_TOLERANCE,
    HALF_TOLERANCE,
    KEY_TOLERANCE,
    TOLERANCE,
    PrefillSharing,
    distinct_prompts,
    keys_differ,
    logits_differ,
    output_cache,
    prefill_check,
    prefill_is_exact,
    prefilled_inputs,
)

CPU = torch.device("cpu")
SAMPLING = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=0.95)
GREEDY = SamplingSettings(max_new_tokens=6, greedy=True)


def setup(float64_model, folder, lora_r=0):
    """(model, ids, rows): ``folder``'s model in float64 and 12 rows, group-contiguous: 3 image
    prompts of two lengths and a text-only one, 3 rows each."""
    model, processor, prompts = float64_model(folder, lora_r=lora_r, checkpointing=False,
                                              indices=(0, 2, 1))
    text_only = encode_prompts(processor, [Sample([], "What is two plus two?", "4", "t#0")],
                               "Think, then answer.")
    prompts = prompts + text_only
    assert len({p.length for p in prompts}) > 2
    return model, TokenIds.of(model, processor), [p for p in prompts for _ in range(3)]


@pytest.fixture(scope="module")
def tiny64(tiny_dir, float64_model):
    return setup(float64_model, tiny_dir)


def both(model, ids, rows, settings, batch_size, seeds=None):
    """(per-row completions, shared-prefill completions, the sharing decision)."""
    plain = generate_completions(model, rows, seeds=seeds, batch_size=batch_size,
                                 settings=settings, ids=ids, device=CPU)
    sharing = PrefillSharing("auto")
    shared = generate_completions(model, rows, seeds=seeds, batch_size=batch_size,
                                  settings=settings, ids=ids, device=CPU, sharing=sharing)
    return plain, shared, sharing.on


def step_logits(model, ids, rows, shared):
    """Raw per-step logits of greedy ``generate`` on ``rows`` (one chunk)."""
    config = generation_config(GREEDY, ids)
    config.output_logits, config.return_dict_in_generate = True, True
    batch = collate(rows, None, ids.pad).to(CPU)
    inputs = prefilled_inputs(model, rows, batch.inputs) if shared else batch.inputs
    with torch.no_grad():
        return model.generate(**inputs, generation_config=config, synced_gpus=False).logits


def test_distinct_prompts_by_identity(tiny64):
    rows = tiny64[2]
    a, b = rows[0], rows[3]
    unique, index = distinct_prompts([a, b, a, a, b])
    assert unique == [a, b] and index.tolist() == [0, 1, 0, 0, 1]


def test_logits_differ_on_hand_numbers():
    x = torch.tensor([[0.0, 0.0]])
    # log-softmax [-ln 2, -ln 2] against [ln(e/(e+1)) , ln(1/(e+1))]: the larger gap is
    # ln 2 - ln(1/(1+e)) = ln((1+e)/2) = 0.6201
    y = torch.tensor([[1.0, 0.0]])
    assert logits_differ([x], [y]) == pytest.approx(0.620115, abs=1e-6)
    assert logits_differ([x, x], [x + 5, x]) == 0.0  # a shift of all logits changes nothing
    assert logits_differ([x], [x, x]) == float("inf")


def cache(*keys):
    return SimpleNamespace(layers=[SimpleNamespace(keys=k) for k in keys])


def test_keys_differ_on_hand_numbers():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    base = torch.ones(2, 1, 3, 2)
    moved = base.clone()
    moved[0, 0, 0] = 100.0  # a padding column: not compared
    moved[1, 0, 2, 1] = 1.5  # a real one: 0.5 of the largest key
    assert keys_differ(cache(moved), cache(base), mask) == 0.5
    # a sliding-window layer keeps the last 2 columns: the mask's last 2 apply to it
    window = torch.ones(2, 1, 2, 2)
    window[0, 0, 0, 0] = 1.25
    assert keys_differ(cache(base, window), cache(base, torch.ones(2, 1, 2, 2)), mask) == 0.25
    assert keys_differ(cache(base), cache(base[:, :, :2]), mask) == float("inf")
    assert keys_differ(SimpleNamespace(), cache(base), mask) is None  # not a readable cache


def test_step_logits_equal_the_per_row_path(tiny64):
    """Every row's logits at every step, the first one included (the uncached last prompt
    token), in one chunk of all 12 rows: mixed groups, left padding, a text-only prompt."""
    model, ids, rows = tiny64
    plain = step_logits(model, ids, rows, shared=False)
    shared = step_logits(model, ids, rows, shared=True)
    assert len(plain) == len(shared) == GREEDY.max_new_tokens
    assert logits_differ(plain, shared) < 1e-9


def test_text_only_chunk_after_an_image_chunk(tiny64):
    """A stale M-RoPE offset from an earlier image prompt must not shift a text-only prompt."""
    model, ids, rows = tiny64
    step_logits(model, ids, rows[:3], shared=True)  # leaves the image prompt's offsets behind
    text_rows = rows[9:]
    assert not text_rows[0].image_inputs
    shared = step_logits(model, ids, text_rows, shared=True)  # right after: offsets still there
    assert logits_differ(step_logits(model, ids, text_rows, shared=False), shared) < 1e-9


@pytest.mark.parametrize("batch_size", [12, 5, 2])
def test_sampled_completions_equal(tiny64, batch_size):
    """5 and 2 rows per chunk split groups across chunks and put parts of two groups in one."""
    model, ids, rows = tiny64
    seeds = row_seeds(7, 3, 0, len(rows))
    plain, shared, on = both(model, ids, rows, SAMPLING, batch_size, seeds)
    assert on is True
    assert [c.tolist() for c in plain] == [c.tolist() for c in shared]
    assert len({tuple(c.tolist()) for c in plain[:3]}) > 1  # the group's rows differ


def test_greedy_completions_equal(tiny64):
    model, ids, rows = tiny64
    plain, shared, on = both(model, ids, rows, GREEDY, 8)
    assert on is True
    assert [c.tolist() for c in plain] == [c.tolist() for c in shared]


def test_through_the_log_prob_root(tiny64):
    """Under FSDP the policy is r1fit's log-prob root: the prefill goes through it too."""
    model, ids, rows = tiny64
    seeds = row_seeds(1, 0, 0, 6)
    plain, shared, on = both(CompletionLogProbs(model), ids, rows[:6], SAMPLING, 6, seeds)
    assert on is True
    assert [c.tolist() for c in plain] == [c.tolist() for c in shared]


def test_lora_model(tiny_dir, float64_model):
    model, ids, rows = setup(float64_model, tiny_dir, lora_r=4)
    assert type(model).__name__.startswith("Peft")
    assert logits_differ(step_logits(model, ids, rows[:6], shared=False),
                         step_logits(model, ids, rows[:6], shared=True)) < 1e-9


def test_no_repeated_prompt_takes_the_plain_path(tiny64):
    model, ids, rows = tiny64
    sharing = PrefillSharing("auto")
    config = generation_config(GREEDY, ids)
    assert sharing.use(model, rows[::3], config, ids.pad, CPU) is False
    assert sharing.on is None  # nothing to decide yet: the next batch with a group decides
    assert sharing.use(model, rows[:4], config, ids.pad, CPU) is True
    assert PrefillSharing(False).use(model, rows, config, ids.pad, CPU) is False


@pytest.mark.parametrize("name", ["tiny-qwen2vl", "tiny-qwen3vl", "tiny-gemma3"])
def test_other_architectures(builtin_folder, float64_model, name):
    """Qwen2-VL and Qwen3-VL (M-RoPE offsets; Qwen3-VL's deepstack features) and Gemma 3 (no
    position rule of its own: r1fit counts positions from each row's first real token, as
    ``generate`` does; sliding window layers; bidirectional attention within images) share
    exactly, padded or not."""
    model, ids, rows = setup(float64_model, builtin_folder(name))
    config = generation_config(GREEDY, ids)
    for checked in (rows, rows[:3]):
        exact, why = prefill_is_exact(model, checked, config, ids.pad, CPU)
        assert exact, why
    assert logits_differ(step_logits(model, ids, rows, shared=False),
                         step_logits(model, ids, rows, shared=True)) < 1e-9
    seeds = row_seeds(3, 1, 0, 6)
    plain, shared, on = both(model, ids, rows[:6], SAMPLING, 6, seeds)
    assert on is True
    assert [c.tolist() for c in plain] == [c.tolist() for c in shared]


def test_the_check_reports_its_distances(tiny64, monkeypatch):
    """``prefill_check`` gives the distances behind ``prefill_is_exact`` (``r1fit doctor
    --check`` prints them) and the bounds of the model's dtype: rounding only when sharing is
    right, above the bound when the M-RoPE offsets are left behind, NaN and an error when no
    prompt repeats."""
    import r1fit.rollout.prefill as prefill

    model, ids, rows = tiny64
    config = generation_config(GREEDY, ids)
    check = prefill_check(model, rows, config, ids.pad, CPU)
    assert check.exact and check.error is None
    assert 0.0 <= check.logits < 1e-9 and check.keys is not None and 0.0 <= check.keys < 1e-9
    assert (check.logits_tolerance, check.keys_tolerance) == (TOLERANCE, KEY_TOLERANCE)
    assert prefill_is_exact(model, rows, config, ids.pad, CPU) == (True, check.reason())
    alone = prefill_check(model, distinct_prompts(rows)[0], config, ids.pad, CPU)
    assert not alone.exact and alone.logits != alone.logits  # NaN: nothing was compared
    assert alone.reason() == "no prompt has two rows to share it"
    with monkeypatch.context() as m:
        m.setattr(prefill, "rope_holders", lambda model: [])
        step_logits(model, ids, rows[:3], shared=False)  # leaves an image prompt's offset behind
        wrong = prefill_check(model, rows, config, ids.pad, CPU)
    assert not wrong.exact and wrong.logits > TOLERANCE and "differ" in wrong.reason()
    # the bounds follow the dtype the model computes in (a stand-in: nothing is run without rows)
    half = prefill_check(torch.nn.Linear(1, 1, dtype=torch.bfloat16), [], config, ids.pad, CPU)
    assert (half.logits_tolerance, half.keys_tolerance) == (HALF_TOLERANCE, HALF_KEY_TOLERANCE)


def test_the_check_catches_positions_that_are_off(tiny64, monkeypatch):
    """With the M-RoPE offsets neither cleared nor copied (as if r1fit did not know where a
    model keeps them), the check sees the shifted positions and ``auto`` stays off; the
    completions are the per-row path's."""
    import r1fit.rollout.prefill as prefill

    model, ids, rows = tiny64
    monkeypatch.setattr(prefill, "rope_holders", lambda model: [])
    step_logits(model, ids, rows[:3], shared=False)  # leaves one image prompt's offset behind
    exact, why = prefill_is_exact(model, rows, generation_config(GREEDY, ids), ids.pad, CPU)
    assert not exact and "differ from the per-row path's" in why
    seeds = row_seeds(5, 0, 0, len(rows))
    plain, shared, on = both(model, ids, rows, SAMPLING, 12, seeds)
    assert on is False
    assert [c.tolist() for c in plain] == [c.tolist() for c in shared]


def test_the_check_catches_positions_that_are_off_in_bfloat16(tiny_dir, float64_model,
                                                             monkeypatch):
    """In bfloat16 the same position error moves the logits by less than rounding may (0.008
    against a 0.25 tolerance on this model), but the cached keys of the generated tokens are
    rotated to other positions: the check refuses on them, and accepts the real sharing."""
    import r1fit.rollout.prefill as prefill

    model, ids, rows = setup(float64_model, tiny_dir)
    model = model.to(torch.bfloat16)
    for prompt in distinct_prompts(rows)[0]:
        if "pixel_values" in prompt.image_inputs:  # not the text-only one
            prompt.image_inputs["pixel_values"] = prompt.image_inputs["pixel_values"].bfloat16()
    config = generation_config(GREEDY, ids)
    exact, why = prefill_is_exact(model, rows, config, ids.pad, CPU)
    assert exact, why
    monkeypatch.setattr(prefill, "rope_holders", lambda model: [])
    step_logits(model, ids, rows[:3], shared=False)  # leaves one image prompt's offset behind
    exact, why = prefill_is_exact(model, rows, config, ids.pad, CPU)
    assert not exact and "cached keys differ" in why, why


def test_an_outputs_cache_is_read_by_its_current_name():
    """transformers 5.24 names a generate output's KV cache ``cache`` (``past_key_values`` still
    reads it, with a deprecation warning per process); before it, ``past_key_values``."""
    from types import SimpleNamespace

    new, old = object(), object()
    assert output_cache(SimpleNamespace(cache=new, past_key_values=old)) is new
    assert output_cache(SimpleNamespace(past_key_values=old)) is old
    assert output_cache(SimpleNamespace(cache=None, past_key_values=old)) is old
