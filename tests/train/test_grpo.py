"""On the real tiny Qwen2.5-VL in float64: the GRPO update's gradient, accumulated over
micro-batches, equals the unbatched gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from r1fit.algorithms.losses import LossSettings
from r1fit.config import load_config
from r1fit.memory.sizes import ChunkSizes
from r1fit.models.load import special_token_ids
from r1fit.rollout.record import Rollout
from r1fit.train.forward import BatchLayout, logprobs_in_micro_batches
from r1fit.train.grpo import accumulate_policy_gradients

CPU = torch.device("cpu")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("lora_r, beta", [(0, 0.0), (4, 0.0), (0, 0.1)])
def test_micro_batched_gradient_equals_unbatched(float64_tiny, aggregation, lora_r, beta):
    model, processor, rows, completions = float64_tiny(lora_r)
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
    # rows by count (6: one pass), then packed by tokens (memory.micro_batch_tokens), per row or
    # with each group's prompt once: a budget that cuts the rows in 2-3 pieces, and 1 (every row
    # alone)
    layouts = [(6, None, False), (4, None, False), (1, None, False),
               (6, 60, False), (6, 1, False), (6, 60, True), (6, 1, True)]
    for micro, tokens, shared in layouts:
        cfg = load_config(None, [f"memory.micro_batch={micro}", f"algo.loss_aggregation={aggregation}",
                                 "algo.max_new_tokens=10", "memory.logits_chunk=4", f"algo.beta={beta}"])
        model.zero_grad(set_to_none=True)
        # the whole step is these 6 rows: one process, groups of one (advantages are given)
        rollout = Rollout(1, rows, 1, slice(0, len(rows)), completions=completions,
                          total_tokens=sum(int(c.shape[0]) for c in completions),
                          advantages=advantages, old_logp=old, ref_logp=ref)
        run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=pad), policy=model,
                              sizes=ChunkSizes(micro, 64, asked={}, micro_batch_tokens=tokens),
                              layout=BatchLayout(shared))
        sums = accumulate_policy_gradients(run, rollout, loss=LossSettings.of(cfg.algo)).sums
        assert (sums["kl"] is None) == (ref is None)
        results[(micro, tokens, shared)] = (sums["loss"], [p.grad.clone() for p in params])
    loss6, grads6 = results[(6, None, False)]
    assert any(g.abs().sum() > 0 for g in grads6)
    for key in layouts[1:]:
        loss, grads = results[key]
        assert loss == pytest.approx(loss6, rel=1e-10, abs=1e-12), key
        for a, b in zip(grads, grads6):
            if key[2]:
                # one prompt's gradient summed over its completions before the float32 casts of
                # the norms and rotary embeddings, not after (see tests/models/test_prefix.py)
                assert (a - b).abs().max() <= 1e-6 * max(b.abs().max().item(), 1.0), key
            else:
                torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12, msg=str(key))


@pytest.mark.parametrize("tokens", [None, 60])
def test_the_first_update_records_the_old_logprobs_a_separate_pass_would_give(float64_tiny,
                                                                             tokens):
    """algo.num_iterations > 1: the first update's forwards run the weights that generated the
    rollout, so their log-probs are the old ones; they equal a separate no-grad pass, and the
    gradient equals the one taken with that pass's log-probs."""
    model, processor, rows, completions = float64_tiny(0)
    pad = special_token_ids(model, processor)["pad"]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = load_config(None, ["memory.micro_batch=4", "algo.num_iterations=2", "algo.beta=0",
                             "algo.max_new_tokens=10", "memory.logits_chunk=4"])
    separate = logprobs_in_micro_batches(model, rows, completions, micro_batch=6, chunk_size=4,
                                         temperature=1.0, pad_id=pad, device=CPU)
    grads = {}
    for old in (separate, None):
        model.zero_grad(set_to_none=True)
        rollout = Rollout(1, rows, 1, slice(0, len(rows)), completions=completions,
                          total_tokens=sum(int(c.shape[0]) for c in completions),
                          advantages=advantages, old_logp=old)
        run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=pad), policy=model,
                              sizes=ChunkSizes(4, 64, asked={}, micro_batch_tokens=tokens),
                              layout=BatchLayout(False))
        made = accumulate_policy_gradients(run, rollout, loss=LossSettings.of(cfg.algo),
                                           capture_old=old is None)
        grads[old is None] = [p.grad.clone() for p in params]
        assert rollout.old_logp is old  # returned, not written back
        if old is None:
            assert made.old_logp.shape == separate.shape
            torch.testing.assert_close(made.old_logp, separate, rtol=0, atol=1e-12)
        else:
            assert made.old_logp is None
    assert any(g.abs().sum() > 0 for g in grads[True])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("lora_r, overrides", [
    (0, []),
    (0, ["algo.beta=0.1", "algo.num_iterations=2"]),
    (0, ["algo.entropy_coef=0.05", "algo.temperature=0.7", "algo.epsilon_high=0.28",
         "algo.loss_aggregation=seq_mean_token_mean"]),
    (4, ["algo.loss_aggregation=seq_mean_token_sum_norm", "algo.beta=0.1"]),
])
@pytest.mark.parametrize("micro, tokens", [(4, None), (6, 60)])
def test_fused_loss_gives_the_gradient_of_the_recomputing_head(float64_tiny, lora_r, overrides,
                                                               micro, tokens):
    """memory.fused_loss (the LM head's gradient made in its forward) against the head that
    recomputes its chunks in backward: the same loss, statistics and gradients, in float64."""
    model, processor, rows, completions = float64_tiny(lora_r)
    pad = special_token_ids(model, processor)["pad"]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        old = logprobs_in_micro_batches(model, rows, completions, micro_batch=6, chunk_size=64,
                                        temperature=1.0, pad_id=pad, device=CPU)
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
        old, ref = old + 0.3 * noise, old - 0.2 * noise
    results = {}
    for fused in (False, True):
        cfg = load_config(None, [f"memory.micro_batch={micro}", "algo.max_new_tokens=10",
                                 "memory.logits_chunk=4", f"memory.fused_loss={str(fused).lower()}",
                                 *overrides])
        assert cfg.fuses_loss() == fused
        model.zero_grad(set_to_none=True)
        rollout = Rollout(1, rows, 1, slice(0, len(rows)), completions=completions,
                          total_tokens=sum(int(c.shape[0]) for c in completions),
                          advantages=advantages, old_logp=old,
                          ref_logp=ref if cfg.algo.beta else None)
        run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=pad), policy=model,
                              sizes=ChunkSizes(micro, 64, asked={}, micro_batch_tokens=tokens),
                              layout=BatchLayout(False))
        sums = accumulate_policy_gradients(run, rollout, loss=LossSettings.of(cfg.algo)).sums
        results[fused] = (sums, [p.grad.clone() for p in params])
    (sums, grads), (fused_sums, fused_grads) = results[False], results[True]
    assert any(g.abs().sum() > 0 for g in grads)
    assert fused_sums.keys() == sums.keys()
    for key, value in sums.items():
        if value is None:  # a statistic that did not occur (e.g. no token clipped): on both paths
            assert fused_sums[key] is None, key
        else:
            assert fused_sums[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    for a, b in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("micro, tokens", [(4, None), (6, 60)])
def test_a_trajectorys_tool_turns_are_out_of_the_loss(float64_tiny, micro, tokens):
    """With trajectories the update trains the policy's tokens only: its gradient equals the
    hand-written GRPO gradient at ratio 1, -sum_i A_i sum_{t in policy(i)} grad log p_it / N,
    where N counts the policy's tokens of the step, collated or packed."""
    from r1fit.data.batch import collate
    from r1fit.models.logprobs import completion_logprobs
    from r1fit.rollout.record import Trajectory

    model, processor, rows, completions = float64_tiny(0)
    pad = special_token_ids(model, processor)["pad"]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    # a "tool turn" of context in the middle of every row longer than 4 tokens
    masks = []
    for c in completions:
        mask = torch.ones(c.shape[0])
        if c.shape[0] > 4:
            mask[2:c.shape[0] - 2] = 0.0
        masks.append(mask)
    trajectories = [Trajectory(p, token_ids=c, policy_mask=m)
                    for p, c, m in zip(rows, completions, masks, strict=True)]
    policy_tokens = int(sum(m.sum() for m in masks))
    assert policy_tokens < sum(int(c.shape[0]) for c in completions)
    cfg = load_config(None, [f"memory.micro_batch={micro}", "algo.beta=0", "algo.max_new_tokens=10",
                             "memory.logits_chunk=4"])
    rollout = Rollout(1, rows, 1, slice(0, len(rows)), completions=completions,
                      total_tokens=policy_tokens, advantages=advantages, trajectories=trajectories)
    run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=pad), policy=model,
                          sizes=ChunkSizes(micro, 64, asked={}, micro_batch_tokens=tokens),
                          layout=BatchLayout(False))
    model.zero_grad(set_to_none=True)
    accumulate_policy_gradients(run, rollout, loss=LossSettings.of(cfg.algo))
    trained = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, collate(rows, completions, pad), chunk_size=4)
    width = logp.shape[1]
    mask = torch.stack([torch.nn.functional.pad(m, (0, width - m.shape[0])) for m in masks])
    (-(advantages.unsqueeze(1) * logp * mask).sum() / policy_tokens).backward()
    assert any(g.abs().sum() > 0 for g in trained)
    for a, p in zip(trained, params, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-8, atol=1e-12)


def test_no_step_is_profiled_while_the_tensor_probe_holds_the_profiler(monkeypatch, caplog):
    from r1fit.config import load_config
    from r1fit.train import grpo

    cfg = load_config(None, ["report.profile_step=3"])
    assert grpo.step_to_profile(cfg) == 3
    monkeypatch.setattr(grpo, "tensor_probe_on", lambda: True)
    with caplog.at_level("WARNING", logger="r1fit"):
        assert grpo.step_to_profile(cfg) == 0
    assert "memory.cpu_peak=tensors keeps the profiler running" in caplog.text


def test_a_steps_records_are_gone_before_the_next_step(use_tiny_cache, tmp_path, monkeypatch):
    """The loop lets a step's rollout go before the next step draws its own: while step 2 scores
    its rows, no record of step 1 is alive (it held the prompts' pixel values, tokens and
    log-probs through the next step, beside the new ones, which the memory plan does not count)."""
    import gc
    import warnings

    from r1fit.cli import main
    from r1fit.train import grpo

    alive: dict[int, set[int]] = {}
    score = grpo.score_rollout

    def watched(batch, *args, **kwargs):
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on deprecated torch proxies warns
            warnings.simplefilter("ignore")
            alive[batch.step] = {o.step for o in gc.get_objects() if isinstance(o, Rollout)}
        return score(batch, *args, **kwargs)

    monkeypatch.setattr(grpo, "score_rollout", watched)
    assert main(["train", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
                 "train.prompts_per_step=2", "algo.num_generations=2", "algo.max_new_tokens=4",
                 "sft.format_warmup_steps=0", "data.eval=null", "eval.before_train=false",
                 "data.shapes.train_size=20", "data.shapes.image_size=56",
                 "data.max_pixels=3136", "checkpoint.every=0", "report.to=[]"]) == 0
    assert alive == {1: {1}, 2: {2}}
