"""On the real tiny Qwen2.5-VL: chunked completion log-probs equal the model's own logits, and
micro-batched gradient accumulation equals the unbatched gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from r1fit.config import load_config
from r1fit.data.batch import collate, encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.memory.sizes import ChunkSizes
from r1fit.models.load import load_policy, special_token_ids
from r1fit.models.logprobs import completion_logprobs
from r1fit.rollout.record import Rollout
from r1fit.train.forward import logprobs_in_micro_batches
from r1fit.train.grpo import accumulate_policy_gradients

CPU = torch.device("cpu")


def _model(tiny_dir, lora_r=0):
    model, processor = load_policy(str(tiny_dir), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False, dtype="float32",
                                   device=CPU, gradient_checkpointing=True)
    return model.double(), processor


def _rows(processor, n_prompts=3, group=2, seed=0):
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=seed, size=16)
    prompts = encode_prompts(processor, [data[i] for i in range(n_prompts)], "Think, then answer.")
    for p in prompts:  # pixels in float64 like the model under test
        p.image_inputs["pixel_values"] = p.image_inputs["pixel_values"].double()
    rows = [p for p in prompts for _ in range(group)]
    gen = torch.Generator().manual_seed(seed)
    vocab = len(processor.tokenizer)
    # completions of different lengths, so padding and masks matter
    completions = [torch.randint(10, vocab - 30, (3 + (i * 5) % 7,), generator=gen)
                   for i in range(len(rows))]
    return rows, completions


def test_chunked_logprobs_equal_full_logits(tiny_dir):
    model, processor = _model(tiny_dir)
    rows, completions = _rows(processor)
    pad = special_token_ids(model, processor)["pad"]
    batch = collate(rows, completions, pad)
    chunked = completion_logprobs(model, batch, chunk_size=5)
    logits = model(**batch.inputs).logits.double()
    start = batch.prompt_len - 1
    width = batch.completion_ids.shape[1]
    full = torch.log_softmax(logits[:, start:start + width], -1).gather(
        -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-10)
    # each row's log-probs do not depend on what else is in the batch
    single = completion_logprobs(model, collate(rows[-1:], completions[-1:], pad), chunk_size=2)
    n = completions[-1].shape[0]
    torch.testing.assert_close(single[0, :n], chunked[-1, :n], rtol=0, atol=1e-9)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("lora_r, beta", [(0, 0.0), (4, 0.0), (0, 0.1)])
def test_micro_batched_gradient_equals_unbatched(tiny_dir, aggregation, lora_r, beta):
    model, processor = _model(tiny_dir, lora_r)
    rows, completions = _rows(processor)
    pad = special_token_ids(model, processor)["pad"]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # old log-probs a little off the current ones, so clipping is exercised
        old = logprobs_in_micro_batches(model, rows, completions, micro_batch=6, chunk_size=64,
                                        temperature=1.0, pad_id=pad, device=CPU)
        old = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1),
                                      dtype=old.dtype)
        ref = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2),
                                      dtype=old.dtype) if beta else None
    results = {}
    for micro in (6, 4, 1):
        cfg = load_config(None, [f"memory.micro_batch={micro}", f"algo.loss_aggregation={aggregation}",
                                 "algo.max_new_tokens=10", "memory.logits_chunk=4", f"algo.beta={beta}"])
        model.zero_grad(set_to_none=True)
        # the whole step is these 6 rows: one process, groups of one (advantages are given)
        rollout = Rollout(1, rows, 1, slice(0, len(rows)), completions=completions,
                          total_tokens=sum(int(c.shape[0]) for c in completions),
                          advantages=advantages, old_logp=old, ref_logp=ref)
        run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=pad), policy=model,
                              sizes=ChunkSizes(micro, 64, asked={}))
        sums = accumulate_policy_gradients(run, rollout)
        assert (sums["kl"] is None) == (ref is None)
        results[micro] = (sums["loss"], [p.grad.clone() for p in params])
    loss6, grads6 = results[6]
    assert any(g.abs().sum() > 0 for g in grads6)
    for micro in (4, 1):
        loss, grads = results[micro]
        assert loss == pytest.approx(loss6, rel=1e-10, abs=1e-12)
        for a, b in zip(grads, grads6):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
