"""Log-probs of many rows, micro-batch by micro-batch (rows or packed tokens), equal one pass over
all of them."""

from __future__ import annotations

import logging

import pytest
import torch

from r1fit.data.batch import collate
from r1fit.models.load import special_token_ids
from r1fit.models.logprobs import completion_logprobs
from r1fit.train.forward import BatchLayout, PackingError, logprobs_in_micro_batches


def test_micro_batched_logprobs_equal_one_pass(float64_tiny):
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    with torch.no_grad():
        whole = completion_logprobs(model, collate(rows, completions, pad), chunk_size=64)
    for micro in (1, 4):
        parts = logprobs_in_micro_batches(model, rows, completions, micro_batch=micro,
                                          chunk_size=3, temperature=1.0, pad_id=pad,
                                          device=torch.device("cpu"))
        assert parts.shape == whole.shape
        torch.testing.assert_close(parts, whole, rtol=0, atol=1e-9)


def test_packed_logprobs_equal_one_pass(float64_tiny):
    """memory.micro_batch_tokens: rows packed by tokens, with and without a shared prompt, give
    the per-row log-probs; budgets from 'one row alone' to 'all rows in one'."""
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    with torch.no_grad():
        whole = completion_logprobs(model, collate(rows, completions, pad), chunk_size=64)
    total = sum(p.length + int(c.shape[0]) for p, c in zip(rows, completions))
    for shared in (False, True):
        for tokens in (1, total // 3, total):
            layout = BatchLayout(shared)
            parts = logprobs_in_micro_batches(model, rows, completions, micro_batch=1,
                                              chunk_size=3, temperature=1.0, pad_id=pad,
                                              device=torch.device("cpu"), layout=layout,
                                              tokens=tokens)
            assert layout.checked_packing
            torch.testing.assert_close(parts, whole, rtol=0, atol=1e-9)


def test_auto_shares_a_prompt_within_the_per_row_paths_own_rounding(float64_tiny,
                                                                   batch_shape_rounding, caplog):
    """share_prefix=auto on numbers that depend on the batch's shape (a 16-bit model on a GPU):
    on where the shared path is as far from the per-row path as the per-row path is from itself
    (6 rows batched vs 1; shared: 3 groups of 2), logged with the numbers; the fixed 1e-4 alone
    would have turned it off."""
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    layout = BatchLayout("auto")
    with batch_shape_rounding(model, 1e-3), caplog.at_level(logging.INFO, "r1fit.forward"):
        layout.decide(model, rows, completions, pad_id=pad, chunk_size=8, micro_batch=6,
                      tokens=None)
    assert layout.on is True
    line = next(r.getMessage() for r in caplog.records if "share_prefix=auto" in r.getMessage())
    assert line.startswith("memory.share_prefix=auto: on (a group's prompt runs once per "
                           "micro-batch); log-probs ")
    assert "x the per-row path's own rounding between batch shapes" in line


def test_a_shared_prefix_needs_a_mask_that_flash_attention_does_not_take(float64_tiny,
                                                                           monkeypatch):
    """With flash attention (model.attn_implementation=flash_attention_2) 'auto' turns sharing
    off without trying it and true is refused in one line; packed rows then take the varlen
    layout (no mask). The kernel itself cannot run here: the config attribute is set by hand."""
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2",
                        raising=False)
    auto = BatchLayout("auto")
    auto.decide(model, rows, completions, pad_id=pad, chunk_size=8, micro_batch=4, tokens=None)
    assert auto.on is False
    batch = auto.inputs(model, rows, completions, pad_id=pad, device=torch.device("cpu"),
                        packed=True)
    assert "attention_mask" not in batch.inputs and batch.inputs["position_ids"].shape[0] == 4
    for tokens in (None, 100):  # packed or not
        with pytest.raises(PackingError,
                           match="memory.share_prefix=true needs a 4-D attention mask"):
            BatchLayout(True).decide(model, rows, completions, pad_id=pad, chunk_size=8,
                                     micro_batch=4, tokens=tokens)


def test_packed_masked_rows_give_the_collated_loss_and_gradients(float64_tiny):
    """SFT with memory.micro_batch_tokens: rows whose masks score only some tokens (multi-turn
    answers; None scores all) packed into one row give the collated batch's masked loss and
    gradients, in float64."""
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    gen = torch.Generator().manual_seed(0)
    masks = [None if i % 3 == 0 else (torch.rand(int(c.shape[0]), generator=gen) < 0.5).long()
             for i, c in enumerate(completions)]
    masks[1][0] = 0  # an unscored first token: the packed layout must not score it either
    cpu = torch.device("cpu")

    def loss_and_grads(packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        batch = BatchLayout(False).inputs(model, rows, completions, pad_id=pad, device=cpu,
                                          packed=packed, masks=masks)
        for i, (c, m) in enumerate(zip(completions, masks)):
            expected = torch.ones(c.shape[0]) if m is None else m.double()
            assert torch.equal(batch.completion_mask[i, :c.shape[0]].double(), expected)
        logp = completion_logprobs(model, batch, chunk_size=3)
        loss = -(logp * batch.completion_mask).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    collated, packed = loss_and_grads(False), loss_and_grads(True)
    torch.testing.assert_close(packed[0], collated[0], rtol=1e-12, atol=0)
    assert len(packed[1]) == len(collated[1]) > 0
    for a, b in zip(packed[1], collated[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-10)
    # the masks change the loss: the comparison is not of two unmasked losses
    model.zero_grad(set_to_none=True)
    every_token = collate(rows, completions, pad)
    with torch.no_grad():
        unmasked = completion_logprobs(model, every_token, chunk_size=3)
    assert not torch.isclose(-(unmasked * every_token.completion_mask).sum(), collated[0])
