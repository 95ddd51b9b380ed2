"""embedding_into_grad: the values of F.embedding, the gradient of nn.Embedding (padding row
included), added into an existing .grad in place without a dense gradient of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r1fit.algorithms.embedding import embedding_into_grad, grad_to_accumulate_into
from r1fit.algorithms.logprobs import chunked_token_logprobs


def test_values_and_gradient_equal_nn_embedding_with_its_padding_row():
    """ids 1, 2, 2, 0 with padding_idx 0: rows 1 and 2 get 1x and 2x the upstream gradient (here
    the weights 1..4 per position, so row 1 gets 1, row 2 gets 2 + 3 = 5), row 0 none."""
    weight = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 2], [2, 0]])
    upstream = torch.arange(1.0, 5.0, dtype=torch.float64).view(2, 2, 1).expand(2, 2, 3)
    out = embedding_into_grad(ids, weight, 0)
    assert torch.equal(out, F.embedding(ids, weight, 0))
    (out * upstream).sum().backward()  # no .grad yet: a dense gradient, as autograd's
    expected = torch.zeros(5, 3, dtype=torch.float64)
    expected[1], expected[2] = 1.0, 5.0
    assert torch.equal(weight.grad, expected)
    reference = weight.detach().clone().requires_grad_()
    (F.embedding(ids, reference, 0) * upstream).sum().backward()
    assert torch.equal(weight.grad, reference.grad)


def test_a_second_micro_batch_adds_into_the_existing_grad_in_place():
    weight = torch.randn(6, 4, requires_grad=True)
    (embedding_into_grad(torch.tensor([1, 3]), weight).sum()).backward()
    grad = weight.grad
    storage = grad.data_ptr()
    (embedding_into_grad(torch.tensor([3, 3, 5]), weight) * 2).sum().backward()
    assert weight.grad is grad and weight.grad.data_ptr() == storage  # the same tensor
    expected = torch.zeros(6, 4)
    expected[1], expected[3], expected[5] = 1.0, 1.0 + 2 * 2, 2.0
    assert torch.equal(weight.grad, expected)


def test_a_dense_gradient_of_the_vocabulary_never_exists_beside_the_grad():
    """The point of it, measured: the second micro-batch's backward allocates no [V x H] tensor
    (autograd's path allocates one, the gradient it then adds)."""
    vocab, hidden = 4096, 64
    dense_bytes = vocab * hidden * 4

    def largest_allocation(use_into_grad: bool) -> int:
        weight = torch.randn(vocab, hidden, requires_grad=True)
        weight.grad = torch.zeros_like(weight)
        ids = torch.randint(0, vocab, (32,))
        out = embedding_into_grad(ids, weight) if use_into_grad else F.embedding(ids, weight)
        with torch.profiler.profile(profile_memory=True) as prof:
            out.sum().backward()
        return max(e.cpu_memory_usage for e in prof.key_averages())

    assert largest_allocation(False) >= dense_bytes
    assert largest_allocation(True) < dense_bytes // 10


def test_the_lm_head_adds_into_the_existing_grad_too():
    """chunked_token_logprobs(into_grad=True): from the second micro-batch on the head's gradient
    is added into .grad in place; the sum equals autograd's over both micro-batches."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    reference = weight.detach().clone().requires_grad_()
    batches = [(torch.randn(5, 8, generator=gen, dtype=torch.float64),
                torch.randint(0, 50, (5,), generator=gen)) for _ in range(2)]
    for i, (hidden, targets) in enumerate(batches):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=2, into_grad=True).sum().backward()
        chunked_token_logprobs(hidden, reference, targets, chunk_size=2).sum().backward()
        if i == 0:
            first = weight.grad
    assert weight.grad is first  # the first micro-batch's gradient, added into
    torch.testing.assert_close(weight.grad, reference.grad, rtol=1e-12, atol=1e-12)


def test_only_a_plain_grad_of_the_weights_kind_is_accumulated_into():
    weight = torch.zeros(3, 2, requires_grad=True)
    assert grad_to_accumulate_into(weight) is None
    weight.grad = torch.zeros(3, 2).to_sparse()
    assert grad_to_accumulate_into(weight) is None  # a sparse .grad: autograd's own rules
    weight.grad = torch.zeros(3, 2)
    assert grad_to_accumulate_into(weight) is weight.grad
