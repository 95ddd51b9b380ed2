"""On the real tiny Qwen2.5-VL in float64: chunked completion log-probs (and entropies) equal the
model's own logits, and a row's log-probs do not depend on the rest of its batch."""

from __future__ import annotations

import torch

from r1fit.data.batch import collate
from r1fit.models.load import special_token_ids
from r1fit.models.logprobs import completion_logprobs, completion_logprobs_and_entropy


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


def test_entropy_equals_full_logits_with_exact_gradients(float64_tiny):
    """The per-token entropy of the temperature-scaled policy, from the chunked pass, equals the one of
    the model's full logits, and so do the gradients of an entropy bonus on the LM head and below."""
    model, processor, rows, completions = float64_tiny()
    pad = special_token_ids(model, processor)["pad"]
    batch = collate(rows, completions, pad)
    mask = batch.completion_mask.bool()
    params = [p for p in model.parameters() if p.requires_grad]
    logp, entropy = completion_logprobs_and_entropy(model, batch, chunk_size=5, temperature=0.7)
    # a loss mixing both, as the GRPO loss with an entropy bonus does
    grads = torch.autograd.grad((logp * 0.3).sum() - (entropy * 0.05).sum(), params, allow_unused=True)
    logits = model(**batch.inputs).logits.double()
    start, width = batch.prompt_len - 1, batch.completion_ids.shape[1]
    log_p = torch.log_softmax(logits[:, start:start + width] / 0.7, -1)
    full_entropy = -(log_p.exp() * log_p).sum(-1) * mask
    full_logp = log_p.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * mask
    ref_grads = torch.autograd.grad((full_logp * 0.3).sum() - (full_entropy * 0.05).sum(), params,
                                    allow_unused=True)
    torch.testing.assert_close(entropy, full_entropy, rtol=0, atol=1e-10)
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-10)
    assert (entropy[mask] > 0).all() and (entropy[~mask] == 0).all()
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
