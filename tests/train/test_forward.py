"""Log-probs of many rows, micro-batch by micro-batch, equal one pass over all of them."""

from __future__ import annotations

import torch

from r1fit.data.batch import collate
from r1fit.models.load import special_token_ids
from r1fit.models.logprobs import completion_logprobs
from r1fit.train.forward import logprobs_in_micro_batches, micro_batches


def test_micro_batches_cover_the_rows_in_order():
    rows, comps = list("abcde"), [torch.tensor([i]) for i in range(5)]
    pieces = [(p, r) for p, r, _ in micro_batches(rows, comps, 2)]
    assert pieces == [(slice(0, 2), ["a", "b"]), (slice(2, 4), ["c", "d"]), (slice(4, 5), ["e"])]


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
