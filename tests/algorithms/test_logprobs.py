import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from r1fit.algorithms.logprobs import (
    chunked_logprobs_and_entropy,
    chunked_token_logprobs,
    full_token_logprobs,
    fused_head_loss,
)

F64 = torch.float64


def _inputs(n: int = 37, hidden_size: int = 8, vocab: int = 50, dtype: torch.dtype = F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=F64)  # a non-uniform d loss / d logp
    return hidden, weight, bias, targets, upstream


def _value_and_grads(fn, hidden, weight, bias, targets, upstream, **kwargs):
    out = fn(hidden, weight, targets, bias=bias, **kwargs)
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    grads = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), leaves)
    return out.detach(), grads


def test_full_logprobs_hand_example():
    # hidden [1, 0], weight rows [0, 0], [ln 3, 0]: logits [0, ln 3] -> softmax [1/4, 3/4].
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=F64)
    out = full_token_logprobs(torch.tensor([[1.0, 0.0]], dtype=F64), weight, torch.tensor([1]))
    assert out.item() == pytest.approx(math.log(0.75), abs=1e-12)
    # temperature 2 halves the logits: [0, ln 3 / 2] -> p(1) = sqrt 3 / (1 + sqrt 3).
    hot = full_token_logprobs(torch.tensor([[1.0, 0.0]], dtype=F64), weight, torch.tensor([1]), temperature=2.0)
    assert hot.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 64])  # 7 does not divide 37; 64 > N
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_full_values_and_grads(chunk_size, use_bias, temperature):
    hidden, weight, bias, targets, upstream = _inputs()
    bias = bias if use_bias else None
    out, grads = _value_and_grads(
        chunked_token_logprobs, hidden, weight, bias, targets, upstream, chunk_size=chunk_size, temperature=temperature
    )
    ref, ref_grads = _value_and_grads(full_token_logprobs, hidden, weight, bias, targets, upstream,
                                      temperature=temperature)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert len(grads) == len(ref_grads) == (3 if use_bias else 2)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_gradcheck_against_finite_differences():
    hidden, weight, bias, targets, _ = _inputs(n=5, hidden_size=3, vocab=6)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_token_logprobs(h, w, targets, bias=b, chunk_size=2, temperature=0.9),
        (hidden, weight, bias),
    )


def test_frozen_weight_gets_no_gradient_buffer():
    hidden, weight, _, targets, upstream = _inputs()
    weight.requires_grad_(False)  # LoRA: the LM head is frozen
    with LiveBytes() as tracker:
        _, (grad_hidden,) = _value_and_grads(chunked_token_logprobs, hidden, weight, None, targets, upstream,
                                             chunk_size=8)
    _, (ref_grad_hidden,) = _value_and_grads(full_token_logprobs, hidden, weight, None, targets, upstream)
    torch.testing.assert_close(grad_hidden, ref_grad_hidden, atol=1e-12, rtol=0)
    assert tuple(weight.shape) not in tracker.shapes  # no [V, H] gradient was ever allocated


def test_leading_dims_are_flattened_and_restored():
    hidden, weight, bias, targets, _ = _inputs(n=12)
    out = chunked_token_logprobs(hidden.view(3, 4, -1), weight, targets.view(3, 4), bias=bias, chunk_size=5)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out.reshape(-1), full_token_logprobs(hidden, weight, targets, bias=bias))


def test_bf16_inputs_give_float32_logprobs_close_to_float32_reference():
    hidden, weight, _, targets, upstream = _inputs(dtype=torch.bfloat16)
    out, (grad_hidden, grad_weight) = _value_and_grads(
        chunked_token_logprobs, hidden, weight, None, targets, upstream, chunk_size=8
    )
    assert out.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref, (ref_grad_hidden, _) = _value_and_grads(full_token_logprobs, h32, w32, None, targets, upstream)
    # bf16 logits carry ~3 significant digits; the float32 log-sum-exp adds no further error.
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.02)
    torch.testing.assert_close(grad_hidden.float(), ref_grad_hidden, atol=0.1, rtol=0.05)


def test_no_grad_forward_works_for_old_and_reference_logprobs():
    hidden, weight, _, targets, _ = _inputs()
    with torch.no_grad():
        out = chunked_token_logprobs(hidden, weight, targets, chunk_size=8)
    assert not out.requires_grad
    torch.testing.assert_close(out, full_token_logprobs(hidden, weight, targets).detach())


# ---------------------------------------------------------------- entropy


def dense_entropy(hidden, weight, bias, temperature):
    """The obvious definition on the full logits: H = -sum_v p_v log p_v, p = softmax(logits / T)."""
    logits = (hidden @ weight.T + (0 if bias is None else bias)) / temperature
    p = torch.softmax(logits, dim=-1)
    return -(p * torch.log(p)).sum(dim=-1)


def test_entropy_hand_example():
    # Logits [0, ln 3] -> p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.25 * 1.386294 + 0.75 * 0.287682
    # = 0.562335. Temperature 2: p = [1, sqrt 3] / (1 + sqrt 3) = [0.366025, 0.633975], H = 0.656807.
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=F64)
    hidden = torch.tensor([[1.0, 0.0]], dtype=F64)
    _, entropy = chunked_logprobs_and_entropy(hidden, weight, torch.tensor([1]), chunk_size=1)
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-12)
    _, hot = chunked_logprobs_and_entropy(hidden, weight, torch.tensor([1]), chunk_size=1, temperature=2.0)
    p = 1 / (1 + math.sqrt(3))
    assert hot.item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), abs=1e-12)
    assert hot.item() == pytest.approx(0.656807, abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("uses", ["both", "entropy", "logp"])
def test_chunked_entropy_matches_dense_values_and_grads(chunk_size, use_bias, temperature, uses):
    """Values and exact gradients (float64) of a loss using the log-probs, the entropies or both,
    against the dense definition (full softmax, autograd)."""
    hidden, weight, bias, targets, upstream = _inputs()
    bias = bias if use_bias else None
    up_entropy = torch.randn(upstream.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    def loss_of(logp, entropy):
        parts = {"logp": (logp * upstream).sum(), "entropy": (entropy * up_entropy).sum()}
        return parts["logp"] + parts["entropy"] if uses == "both" else parts[uses]

    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, bias=bias, chunk_size=chunk_size,
                                                 temperature=temperature)
    grads = torch.autograd.grad(loss_of(logp, entropy), leaves)
    ref_logp = full_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature)
    ref_entropy = dense_entropy(hidden, weight, bias, temperature)
    ref_grads = torch.autograd.grad(loss_of(ref_logp, ref_entropy), leaves)
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-12, rtol=0)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_entropy_gradcheck_against_finite_differences():
    hidden, weight, bias, targets, _ = _inputs(n=5, hidden_size=3, vocab=6)

    def both(h, w, b):
        logp, entropy = chunked_logprobs_and_entropy(h, w, targets, bias=b, chunk_size=2, temperature=0.9)
        return logp, entropy

    assert torch.autograd.gradcheck(both, (hidden, weight, bias))


def test_entropy_leading_dims_and_no_grad():
    hidden, weight, bias, targets, _ = _inputs(n=12)
    logp, entropy = chunked_logprobs_and_entropy(hidden.view(3, 4, -1), weight, targets.view(3, 4), bias=bias,
                                                 chunk_size=5)
    assert logp.shape == entropy.shape == (3, 4)
    torch.testing.assert_close(entropy.reshape(-1), dense_entropy(hidden, weight, bias, 1.0))
    with torch.no_grad():
        _, no_grad_entropy = chunked_logprobs_and_entropy(hidden, weight, targets, bias=bias, chunk_size=5)
    assert not no_grad_entropy.requires_grad



# ---------------------------------------------------------------- memory

N, V, H, CHUNK = 2048, 50_000, 16, 128
FULL_LOGITS_BYTES = N * V * 4  # 409.6 MB: what the unchunked logits alone would cost


def _big_inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    del out
    return sum(storages.values())


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive at once among those created inside the block (CPU-safe).

    Every op's outputs are seen here; a storage counts from creation until it is freed (weakref on the
    storage, which outlives its views), so in-place ops and views are not counted twice.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[int] = set()
        self.shapes: set[tuple[int, ...]] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.tracked.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            self.shapes.add(tuple(tensor.shape))
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.tracked:
                continue
            self.tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def test_saved_for_backward_is_far_below_full_logits():
    hidden, weight, targets = _big_inputs()
    saved = _saved_bytes(lambda: chunked_token_logprobs(hidden, weight, targets, chunk_size=CHUNK))
    # hidden (131 kB) + weight (3.2 MB, a parameter anyway) + targets + log-sum-exp: ~3.4 MB.
    assert saved < FULL_LOGITS_BYTES / 50
    # The hook really sees what autograd keeps: the reference on 256 tokens saves >= its 256 x V logits.
    full_saved = _saved_bytes(lambda: full_token_logprobs(hidden[:256], weight, targets[:256]))
    assert full_saved >= 256 * V * 4


def test_entropy_bonus_keeps_memory_at_chunks_of_logits():
    # An entropy bonus needs one more [chunk x V] buffer in backward (the probabilities beside the
    # log-probs): two chunks (51.2 MB) + the weight's gradient (3.2 MB) + [N x H] gradients, measured
    # 57.9 MB; never the [N x V] logits (409.6 MB). Without a bonus the entropy costs no more memory.
    hidden, weight, targets = _big_inputs()
    chunk_logits_bytes = CHUNK * V * 4
    weight_grad_bytes = V * H * 4
    with LiveBytes() as tracker:
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=CHUNK)
        (logp.sum() - 0.01 * entropy.sum()).backward()
    assert tracker.peak < 2.5 * chunk_logits_bytes + weight_grad_bytes
    assert (N, V) not in tracker.shapes
    hidden.grad = weight.grad = None
    with LiveBytes() as tracker:
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=CHUNK)
        logp.sum().backward()  # the entropy only logged
    assert tracker.peak < 2 * chunk_logits_bytes + weight_grad_bytes
    saved = _saved_bytes(lambda: chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=CHUNK))
    assert saved < FULL_LOGITS_BYTES / 50


def test_peak_live_memory_in_forward_and_backward_is_one_chunk_of_logits():
    # one [chunk x V] buffer (25.6 MB) turned into log-probs in place, plus a temporary of
    # SLICE_TOKENS rows (32 of 128: 6.4 MB) for the exponentials, never logsumexp's second
    # [chunk x V]; the last chunk's buffer is kept for backward, which starts with it
    hidden, weight, targets = _big_inputs()
    chunk_logits_bytes = CHUNK * V * 4  # 25.6 MB
    weight_grad_bytes = V * H * 4  # 3.2 MB
    with LiveBytes() as tracker:
        out = chunked_token_logprobs(hidden, weight, targets, chunk_size=CHUNK)
    assert tracker.peak < 1.5 * chunk_logits_bytes
    with LiveBytes() as tracker:
        out.sum().backward()
    assert tracker.peak < 1.5 * chunk_logits_bytes + weight_grad_bytes
    assert tracker.peak < FULL_LOGITS_BYTES / 10
    assert (N, V) not in tracker.shapes


def test_the_kept_last_chunk_is_used_once():
    # backward turns the kept buffer into a gradient in place; a second backward through a
    # retained graph recomputes that chunk and gets the same gradients
    hidden, weight, bias, targets, upstream = _inputs()
    for chunk_size in (7, 64):
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, bias=bias,
                                                     chunk_size=chunk_size, temperature=0.7)
        loss = (logp * upstream).sum() + 0.1 * entropy.sum()
        first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
        second = torch.autograd.grad(loss, (hidden, weight, bias))
        for a, b in zip(first, second, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_minus_infinite_logits_give_finite_entropy_and_gradients():
    # a -inf bias entry: p = 0 there, p log p counts 0 (not NaN) in the entropy, and the token
    # gets no gradient; the values match the distribution over the other entries
    hidden, weight, bias, targets, _ = _inputs(n=6, hidden_size=3, vocab=5)
    bias = bias.detach().clone()
    bias[2] = float("-inf")
    bias.requires_grad_()
    targets = torch.tensor([0, 1, 3, 4, 0, 1])
    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, bias=bias, chunk_size=4)
    keep = [0, 1, 3, 4]
    ref_logp = full_token_logprobs(hidden, weight[keep], torch.tensor([0, 1, 2, 3, 0, 1]),
                                   bias=bias[keep])
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, dense_entropy(hidden, weight[keep], bias[keep], 1.0),
                               atol=1e-12, rtol=0)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    assert weight.grad[2].abs().max() == 0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"targets": torch.tensor([0, 50, 1])}, r"targets must lie in \[0, 50\)"),
        ({"targets": torch.tensor([0.0, 1.0, 2.0])}, "targets must be an int64"),
        ({"targets": torch.tensor([0, 1])}, "targets shape"),
        ({"weight": torch.zeros(50, 5)}, "weight must be"),
        ({"bias": torch.zeros(49)}, "bias must be"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"temperature": 0.0}, "temperature must be > 0"),
    ],
)
def test_bad_inputs_raise_value_error(overrides, message):
    args = {"hidden": torch.zeros(3, 4), "weight": torch.zeros(50, 4), "targets": torch.tensor([0, 1, 2])}
    kwargs = {"bias": None, "chunk_size": 2, "temperature": 1.0}
    args.update({k: v for k, v in overrides.items() if k in args})
    kwargs.update({k: v for k, v in overrides.items() if k in kwargs})
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(args["hidden"], args["weight"], args["targets"], **kwargs)


# ---------------------------------------------------------------- the head's gradient in forward


def _token_terms(n: int, seed: int = 7):
    """Per-token constants and a non-linear per-token loss of (logp, entropy): a clipped
    ratio-like term, a square and an entropy term, so d loss / d logp differs per token."""
    g = torch.Generator().manual_seed(seed)
    a, c, k = (torch.randn(n, generator=g, dtype=F64) for _ in range(3))

    def terms(rows, logp, entropy):
        ratio = torch.exp(logp - logp.detach() * 0.5)
        return (a[rows] * torch.clamp(ratio, 0.8, 1.2) + c[rows] * logp ** 2
                + k[rows] * entropy).sum()

    def dense(logp, entropy):
        return terms(slice(None), logp, entropy)

    return terms, dense


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 64])  # 7 does not divide 37; 64 > N
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_loss_matches_dense_values_and_grads(chunk_size, use_bias, temperature):
    """The loss, log-probs, entropies and gradients (float64) of a non-linear per-token loss, with
    the head's gradient made in forward, against autograd through the dense logits."""
    hidden, weight, bias, targets, _ = _inputs()
    bias = bias if use_bias else None
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    terms, dense = _token_terms(hidden.shape[0])
    loss, logp, entropy = fused_head_loss(hidden, weight, targets, terms, bias=bias,
                                          chunk_size=chunk_size, temperature=temperature)
    assert not logp.requires_grad and not entropy.requires_grad
    grads = torch.autograd.grad(loss, leaves)
    ref_logp = full_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature)
    ref_entropy = dense_entropy(hidden, weight, bias, temperature)
    ref_loss = dense(ref_logp, ref_entropy)
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(logp, ref_logp.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-12, rtol=0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_fused_loss_hand_example():
    # logits [0, ln 3] -> p = [1/4, 3/4]; target 1, loss = 2 * logp: value 2 ln 3/4, and
    # d loss / d logits = 2 (onehot - p) = [-1/2, 1/2], so d loss / d hidden = [-1/2, 1/2] @ W
    # = [ln 3 / 2, 0] and d loss / d W = outer([-1/2, 1/2], [1, 0])
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=F64, requires_grad=True)
    hidden = torch.tensor([[1.0, 0.0]], dtype=F64, requires_grad=True)
    loss, logp, _ = fused_head_loss(hidden, weight, torch.tensor([1]),
                                    lambda rows, lp, ent: 2 * lp.sum())
    assert loss.item() == pytest.approx(2 * math.log(0.75), abs=1e-12)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[math.log(3) / 2, 0.0]], dtype=F64))
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.5, 0.0], [0.5, 0.0]], dtype=F64))


def test_fused_loss_scales_by_the_incoming_gradient_and_leaves_a_frozen_weight_alone():
    hidden, weight, _, targets, _ = _inputs()
    terms, _ = _token_terms(hidden.shape[0])
    loss, _, _ = fused_head_loss(hidden, weight, targets, terms, chunk_size=7)
    once = torch.autograd.grad(loss, (hidden, weight))
    loss, _, _ = fused_head_loss(hidden, weight, targets, terms, chunk_size=7)
    thrice = torch.autograd.grad(3 * loss, (hidden, weight))
    for a, b in zip(once, thrice, strict=True):
        torch.testing.assert_close(3 * a, b, atol=1e-12, rtol=0)
    frozen = weight.detach()
    loss, _, _ = fused_head_loss(hidden, frozen, targets, terms, chunk_size=7)
    loss.backward()
    assert frozen.grad is None
    torch.testing.assert_close(hidden.grad, once[0], atol=1e-12, rtol=0)


def test_fused_loss_without_entropies():
    # a loss of the log-probs alone (SFT's cross-entropy): the entropies are neither computed
    # nor handed to the terms, and the values and gradients are those with them
    hidden, weight, bias, targets, upstream = _inputs()
    seen = []

    def terms(rows, lp, ent):
        seen.append(ent)
        return (upstream[rows] * lp).sum()

    loss, logp, entropy = fused_head_loss(hidden, weight, targets, terms, bias=bias, chunk_size=7,
                                          with_entropy=False)
    assert entropy is None and seen and all(e is None for e in seen)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    ref, ref_grads = _value_and_grads(full_token_logprobs, hidden, weight, bias, targets, upstream)
    torch.testing.assert_close(logp, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(loss, (ref * upstream).sum(), atol=1e-12, rtol=0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_fused_loss_into_grad_adds_in_forward_and_refuses_a_scaled_backward():
    # two micro-batches accumulated: the second adds into the .grad the first made, which
    # equals both gradients summed; a backward of a scaled loss cannot be honoured then
    hidden, weight, _, targets, _ = _inputs()
    terms, _ = _token_terms(hidden.shape[0])
    parts = [slice(0, 20), slice(20, None)]
    expected = sum(torch.autograd.grad(fused_head_loss(hidden[p], weight, targets[p],
                                                       lambda rows, lp, ent, p=p: terms(
                                                           slice(p.start + rows.start,
                                                                 p.start + rows.stop), lp, ent),
                                                       chunk_size=8)[0], weight)[0]
                   for p in parts)
    weight.grad = None
    for p in parts:
        loss, _, _ = fused_head_loss(hidden[p], weight, targets[p],
                                     lambda rows, lp, ent, p=p: terms(
                                         slice(p.start + rows.start, p.start + rows.stop), lp, ent),
                                     chunk_size=8, into_grad=True)
        loss.backward()
    torch.testing.assert_close(weight.grad, expected, atol=1e-12, rtol=0)
    loss, _, _ = fused_head_loss(hidden, weight, targets, terms, chunk_size=8, into_grad=True)
    with pytest.raises(RuntimeError, match="cannot rescale"):
        (2 * loss).backward()


def test_fused_loss_memory_is_one_chunk_and_backward_allocates_no_logits():
    # forward holds one [chunk x V] buffer (its logits, then their gradient, in place) plus a
    # SLICE_TOKENS-row temporary and the gradients (two buffers with an entropy term, as in
    # chunked_logprobs_and_entropy's backward); backward only hands the gradients over
    hidden, weight, targets = _big_inputs()
    chunk_logits_bytes = CHUNK * V * 4
    weight_grad_bytes = V * H * 4
    for terms, chunks in ((lambda rows, lp, ent: lp.sum(), 1.5),
                          (lambda rows, lp, ent: lp.sum() - 0.01 * ent.sum(), 2.5)):
        with LiveBytes() as tracker:
            loss, _, _ = fused_head_loss(hidden, weight, targets, terms, chunk_size=CHUNK)
        assert tracker.peak < chunks * chunk_logits_bytes + weight_grad_bytes
        assert (N, V) not in tracker.shapes
        with LiveBytes() as tracker:
            loss.backward()
        # the tracker sees the storages of the gradients forward made as they reach .grad
        assert tracker.peak <= weight_grad_bytes + hidden.numel() * 4 + 64
        assert not any(V in shape for shape in tracker.shapes - {(V, H)})
        hidden.grad = weight.grad = None
