"""On the real tiny Qwen2.5-VL in float64: chunked completion log-probs equal the model's own
logits, and a row's log-probs do not depend on the rest of its batch."""

from __future__ import annotations

import torch

from r1fit.data.batch import collate
from r1fit.models.load import special_token_ids
from r1fit.models.logprobs import completion_logprobs


def test_chunked_logprobs_equal_full_logits(float64_tiny):
    model, processor, rows, completions = float64_tiny()
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
