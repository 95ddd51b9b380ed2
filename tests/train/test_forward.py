"""Log-probs of many rows, micro-batch by micro-batch (rows or packed tokens), equal one pass over
all of them."""

from __future__ import annotations

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
