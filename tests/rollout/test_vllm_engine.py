"""A real vLLM engine (CPU build) against Hugging Face generate and the trainer's log-probs, on
builtin:tiny-hd32: after weight syncs (full and LoRA-merged), greedy completions are equal token
for token on image and text prompts, and the engine's log-probs of the sampled tokens agree with
the trainer's; seeded sampling does not depend on which rows are generated together."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from r1fit.data.batch import collate, encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.models.load import load_policy
from r1fit.models.weights import full_named_weights
from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions, row_seeds

pytestmark = pytest.mark.vllm
CPU = torch.device("cpu")
NEW_TOKENS = 12


def policy(folder, lora_r=0):
    return load_policy(str(folder), lora_r=lora_r, lora_alpha=8, lora_dropout=0.0,
                       lora_target="all-linear", freeze_vision=False, dtype="float32",
                       device=CPU, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def setup(hd32_dir, start_vllm):
    """(engine, processor, prompts): 3 image prompts of builtin:shapes and 2 text-only ones."""
    model, processor = policy(hd32_dir)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=8)
    samples = [data[i] for i in range(3)] + [dataclasses.replace(data[i], images=())
                                              for i in range(3, 5)]
    prompts = encode_prompts(processor, samples, "Think, then answer.")
    assert [bool(p.sample.images) for p in prompts] == [True] * 3 + [False] * 2
    engine = start_vllm(hd32_dir, model, processor, max_images=1)
    yield engine, processor, prompts
    engine.close()


def engine_greedy(engine, ids, prompts):
    return engine.generate(prompts, seeds=None, max_new_tokens=NEW_TOKENS, temperature=1.0,
                           top_p=1.0, eos=ids.eos, blocked=ids.blocked)


def trainer_logprobs(model, prompts, completions, ids):
    """Log-probs of the completion tokens from the model's full logits, with the image
    placeholders masked out as the engine (and HF generate) never sample them."""
    batch = collate(prompts, completions, ids.pad)
    with torch.no_grad():
        logits = model(**batch.inputs).logits.double()
    start, width = batch.prompt_len - 1, batch.completion_ids.shape[1]
    logits = logits[:, start:start + width]
    logits[..., ids.blocked] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def check_equal_to_hf(engine, model, processor, prompts):
    ids = TokenIds.of(model, processor)
    completions, logprobs = engine_greedy(engine, ids, prompts)
    hf = generate_completions(model, prompts, seeds=None, batch_size=len(prompts),
                              settings=SamplingSettings(NEW_TOKENS, greedy=True), ids=ids,
                              device=CPU)
    assert [c.tolist() for c in completions] == [c.tolist() for c in hf]
    reference = trainer_logprobs(model, prompts, completions, ids)
    for i, row in enumerate(logprobs):
        assert row.shape == completions[i].shape
        torch.testing.assert_close(row.double(), reference[i, :len(row)], rtol=0, atol=1e-3)


def test_greedy_equals_hf_after_full_weight_syncs(setup, hd32_dir):
    engine, processor, prompts = setup
    model, _ = policy(hd32_dir)
    gen = torch.Generator().manual_seed(0)
    before = None
    for _ in range(3):  # the weights move by more than a training step would; sync each time
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        engine.load_weights(full_named_weights(model))
        check_equal_to_hf(engine, model, processor, prompts)
        now = [c.tolist() for c in engine_greedy(engine, TokenIds.of(model, processor),
                                                 prompts)[0]]
        assert now != before  # the syncs changed what the engine generates
        before = now


def test_greedy_equals_hf_with_lora_merged_per_layer(setup, hd32_dir):
    engine, processor, prompts = setup
    model, _ = policy(hd32_dir, lora_r=4)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA starts with B = 0; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine.load_weights(full_named_weights(model))
    check_equal_to_hf(engine, model, processor, prompts)
    for name, p in model.named_parameters():  # the trainable copy is untouched
        if p.requires_grad:
            assert torch.equal(p, adapters[name]), name


def test_seeded_rows_do_not_depend_on_their_batch(setup, hd32_dir):
    engine, processor, prompts = setup
    model, _ = policy(hd32_dir)
    engine.load_weights(full_named_weights(model))
    ids = TokenIds.of(model, processor)
    rows = [p for p in prompts for _ in range(2)]  # two completions of each prompt
    seeds = row_seeds(7, 3, 0, len(rows))

    def sample(part):
        completions, logprobs = engine.generate([rows[i] for i in part],
                                                seeds=[seeds[i] for i in part],
                                                max_new_tokens=NEW_TOKENS, temperature=1.0,
                                                top_p=0.9, eos=ids.eos, blocked=ids.blocked)
        return {i: (c.tolist(), lp.tolist()) for i, c, lp in zip(part, completions, logprobs)}

    together = sample(list(range(len(rows))))
    # another order and other batches, as another rank or a resumed run would generate them
    apart = {**sample([9, 3, 5, 1, 7]), **sample([8, 0, 6, 2, 4])}
    assert together == apart
    # the two completions of a prompt differ: each row has its own stream
    assert any(together[2 * i][0] != together[2 * i + 1][0] for i in range(len(prompts)))


def test_min_new_tokens_blocks_every_end_token_until_then(setup, hd32_dir, nearly_all_stop):
    engine, processor, prompts = setup
    model, _ = policy(hd32_dir)
    engine.load_weights(full_named_weights(model))
    stop_ids = nearly_all_stop(model, TokenIds.of(model, processor))

    def lengths(minimum):
        completions, _ = engine.generate(prompts, seeds=list(range(len(prompts))),
                                         max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0,
                                         eos=stop_ids.eos, blocked=stop_ids.blocked,
                                         min_new_tokens=minimum)
        for completion in completions:  # no end token before the minimum
            assert not torch.isin(completion[:minimum], torch.tensor(stop_ids.eos)).any()
        return [len(c) for c in completions]

    assert max(lengths(0)) <= 2  # nearly every token ends it at once
    assert min(lengths(6)) >= 7
