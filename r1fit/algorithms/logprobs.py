"""Log-probabilities of target tokens without materialising the ``[tokens x vocab]`` logits.

With Qwen's 151,936-token vocabulary the logits of a GRPO micro-batch dominate memory (in float32,
1,000 completion tokens cost 0.6 GB, and autograd keeps them plus the log-softmax for backward).
``chunked_token_logprobs`` applies the LM head to ``chunk_size`` tokens at a time, turns each chunk's
logits into log-probs in place, and recomputes in backward the logits of every chunk but the last
(whose buffer it keeps), so only one chunk's logits are alive at any moment.
``chunked_logprobs_and_entropy`` also returns each token's entropy of the (temperature-scaled)
distribution, from the same chunks, with its exact gradient (for an entropy bonus).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from r1fit.algorithms.embedding import grad_to_accumulate_into


def full_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Reference implementation: ``log_softmax(hidden @ weight.T + bias) / temperature`` at ``targets``.

    Materialises all logits (``N x V`` floats, kept again for backward); fine for small vocabularies and
    as the ground truth in tests. Shapes and dtypes as in ``chunked_token_logprobs``.
    """
    _check_inputs(hidden, weight, targets, bias, chunk_size=1, temperature=temperature)
    logits = F.linear(hidden, weight, bias).to(_compute_dtype(hidden)) / temperature
    return logits.log_softmax(dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    into_grad: bool = False,
) -> Tensor:
    """Log-probs of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``, chunked over tokens.

    Shapes: ``hidden [..., H]``, ``weight [V, H]``, ``bias [V]``, ``targets [...]`` (long) -> ``[...]``.
    The matmul runs in the inputs' dtype; the log-sum-exp and the result are float32 (float64 for
    float64 inputs), so bf16 models get float32 log-probs.

    Memory bound: forward and backward each hold at most one chunk's logits, ``chunk_size * V * 4``
    bytes, plus either the bf16 matmul output of a bf16 model or a ``SLICE_TOKENS``-row temporary,
    instead of ``N * V`` floats. For backward ``hidden``, ``targets`` and a float32 ``[N]``
    log-sum-exp are saved (plus references to ``weight`` and ``bias``, which are parameters anyway),
    and, when a gradient is needed, the last chunk's log-probs buffer, which backward starts with
    (it was alive at the end of forward anyway).
    Gradients reach ``hidden``, ``weight`` and ``bias``; a frozen ``weight`` (``requires_grad=False``, e.g.
    under LoRA) gets no gradient buffer. ``weight``'s gradient accumulates in its own dtype. Not twice
    differentiable. ``into_grad``: when ``weight`` already has a ``.grad`` (the micro-batches after
    the first of an accumulation), add its gradient into it in place instead of returning a new
    ``[V, H]`` one (see :mod:`r1fit.algorithms.embedding`; only for loops that call ``backward()``).
    """
    return _chunked(hidden, weight, targets, bias, chunk_size, temperature, with_entropy=False,
                    into_grad=into_grad)[0]


def chunked_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    into_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """``chunked_token_logprobs`` plus each token's entropy ``H = -sum_v p_v log p_v`` of
    ``p = softmax(logits / temperature)``, both ``[...]``, from the same chunks of logits.

    The entropy costs one more elementwise pass per chunk in forward and, only when a loss uses it
    (an entropy bonus), one more ``[chunk x V]`` float buffer in backward; its gradient is exact:
    ``dH/dz_v = -p_v (log p_v + H)`` for ``z = logits / temperature``. ``into_grad``: as in
    ``chunked_token_logprobs``.
    """
    logp, entropy = _chunked(hidden, weight, targets, bias, chunk_size, temperature, with_entropy=True,
                             into_grad=into_grad)
    return logp, entropy


def _chunked(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, chunk_size: int,
             temperature: float, *, with_entropy: bool, into_grad: bool = False) -> tuple[Tensor, ...]:
    """Check the inputs, run ``_ChunkedLogprobs`` on the flattened tokens, restore the leading dims."""
    _check_inputs(hidden, weight, targets, bias, chunk_size=chunk_size, temperature=temperature)
    out = _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                 targets.reshape(-1).long(), chunk_size, temperature, with_entropy,
                                 into_grad)
    return tuple(t.view(targets.shape) for t in (out if with_entropy else (out,)))


#: ``loss_of(rows, logp, entropy) -> scalar``: the loss terms of the head's input tokens ``rows``
#: (a slice of its flattened tokens), given their log-probs and entropies ``[n]`` (float leaves
#: that require grad; the entropies None when not asked for); the loss must be the sum of these
#: terms over its chunks of tokens
TokenLoss = Callable[[slice, Tensor, Tensor | None], Tensor]


def fused_head_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss_of: TokenLoss,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    into_grad: bool = False,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A loss made of per-token terms of the log-probs of ``targets`` and the entropies, with the
    LM head's gradients computed in the forward pass: returns the loss (a scalar with gradients to
    ``hidden``, ``weight`` and ``bias``) and the log-probs and entropies ``[...]`` (detached).

    Shapes and dtypes as in ``chunked_logprobs_and_entropy``. For a loss whose every token's term
    depends only on that token's log-prob and entropy (and constants: advantages, old and
    reference log-probs, the batch's normalisers), each chunk's d loss / d logits is known as soon
    as its logits are: ``loss_of`` gives the chunk's terms, autograd their gradient (a few floats
    per token), and the chunk's logits buffer becomes its gradient in place. So no chunk is
    recomputed in backward and nothing of the head is kept for it but the gradients themselves
    (``[N x H]`` for ``hidden``; the weight's, which a trainable head needs anyway): a small
    ``chunk_size`` costs no extra matmul, unlike ``chunked_token_logprobs``'s recompute. The
    idea of fused linear cross-entropy kernels (Liger-Kernel), here for policy-gradient losses.

    Not for a loss that couples tokens (GSPO's sequence ratio, Clip-Cov/KL-Cov's selection over a
    micro-batch): its per-token gradient is not known chunk by chunk. ``into_grad``: when
    ``weight`` already has a ``.grad``, its gradient is added there during this forward, and the
    backward then needs a gradient of exactly 1 for the loss (``loss.backward()``), since what
    was added cannot be rescaled. ``with_entropy=False``: no entropies are computed (one pass
    over each chunk fewer); ``loss_of`` gets None for them, and None is returned. Not twice
    differentiable.
    """
    _check_inputs(hidden, weight, targets, bias, chunk_size=chunk_size, temperature=temperature)
    loss, logp, entropy = _FusedHeadLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                               targets.reshape(-1).long(), loss_of, chunk_size,
                                               temperature, into_grad, with_entropy)
    return loss, logp.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


class _FusedHeadLoss(torch.autograd.Function):
    """Forward: per chunk, logits -> log-probs and entropies -> the chunk's loss terms and their
    gradient -> d loss / d logits in the same buffer -> the head's gradients. Backward only
    scales what forward computed by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                targets: Tensor, loss_of: TokenLoss, chunk_size: int, temperature: float,
                into_grad: bool, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
        logp = torch.empty(hidden.shape[0], dtype=_compute_dtype(hidden), device=hidden.device)
        # (without entropies an empty stand-in, which the wrapper turns into None)
        entropy = torch.empty(logp.shape if with_entropy else 0, dtype=logp.dtype,
                              device=logp.device)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        into = grad_to_accumulate_into(weight) if need_weight and into_grad else None
        grad_weight = (into if into is not None else torch.zeros_like(weight)) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))  # the tokens loss_of gets, exactly
            h = hidden[rows]
            log_probs = _chunk_logits(h, weight, bias, temperature)
            _to_log_probs_(log_probs, entropy[rows] if with_entropy else None)
            logp[rows] = log_probs.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            with torch.enable_grad():
                leaves = [logp[rows].detach().requires_grad_()]
                if with_entropy:
                    leaves.append(entropy[rows].detach().requires_grad_())
                part = loss_of(rows, leaves[0], leaves[1] if with_entropy else None)
                grads = (torch.autograd.grad(part, leaves, allow_unused=True)
                         if part.requires_grad else [None] * len(leaves))
                grad_logp, grad_entropy = grads[0], grads[1] if with_entropy else None
            loss += part.detach()
            if grad_hidden is not None or grad_weight is not None or grad_bias is not None:
                log_probs = _to_logits_grad_(
                    log_probs, torch.zeros_like(leaves[0]) if grad_logp is None else grad_logp,
                    targets[rows], temperature, grad_entropy,
                    None if grad_entropy is None else entropy[rows]).to(hidden.dtype)
                _add_chunk_grads(log_probs, h, weight, rows, grad_hidden, grad_weight, grad_bias)
            del log_probs  # free this chunk before the next one is allocated
        ctx.mark_non_differentiable(logp, entropy)
        ctx.into = into is not None
        ctx.grads = (grad_hidden, None if ctx.into else grad_weight, grad_bias)
        return loss, logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor, *unused: Tensor | None
                 ) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        unit = bool(grad_loss == 1)
        if ctx.into and not unit:
            raise RuntimeError("fused_head_loss with into_grad added the LM head's gradient into "
                               ".grad in its forward pass and cannot rescale it: call backward() on "
                               f"the loss itself (incoming gradient {float(grad_loss)}, not 1)")
        if not unit:
            grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return (*grads, None, None, None, None, None, None)


#: tokens per slice of a chunk that gets a temporary of its own (the exponentials of the
#: log-sum-exp and of the entropy), so a chunk holds one [chunk x vocab] float buffer, not two
SLICE_TOKENS = 32


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward/backward of chunked target log-probs (and, with ``with_entropy``, entropies).

    Forward turns each chunk's logits into log-probabilities in place. When a gradient will be
    needed, the last chunk's buffer is kept for backward, which starts with it: its logits are
    not recomputed, and the buffer was alive at the end of forward anyway, so the peak does not
    grow. The other chunks' logits are recomputed in backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
        into_grad: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        out = torch.empty(hidden.shape[0], dtype=_compute_dtype(hidden), device=hidden.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else None
        keep = any(ctx.needs_input_grad[:3])
        kept = None
        starts = range(0, hidden.shape[0], chunk_size)
        for start in starts:
            rows = slice(start, start + chunk_size)
            logp = _chunk_logits(hidden[rows], weight, bias, temperature)
            lse[rows] = _to_log_probs_(logp, None if entropy is None else entropy[rows])
            out[rows] = logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            if keep and start == starts[-1]:
                kept = logp
            del logp  # free this chunk before the next one is allocated
        # an unused output (the entropy when no loss term uses it) gets None, not a zero gradient
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_size, ctx.temperature, ctx.into_grad = chunk_size, temperature, into_grad
        ctx.kept = kept  # not through save_for_backward: backward turns it into a gradient in place
        return out if entropy is None else (out, entropy)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor | None,
                 grad_entropy: Tensor | None = None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # with into_grad and an existing .grad, the weight's gradient is added there in place
        into = grad_to_accumulate_into(weight) if need_weight and ctx.into_grad else None
        grad_weight = (into if into is not None else torch.zeros_like(weight)) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        if grad_out is None:  # only the entropy is used
            grad_out = torch.zeros_like(lse)
        starts = list(range(0, hidden.shape[0], ctx.chunk_size))
        for start in reversed(starts):  # the kept last chunk first, while it is still alive
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            # the gradient is built in place in the chunk's log-probs buffer (kept from forward,
            # or its logits recomputed): one [chunk x V] float tensor is live
            if start == starts[-1] and kept is not None:
                grad_logits, kept = kept, None
            else:
                grad_logits = _chunk_logits(h, weight, bias, ctx.temperature)
                grad_logits.sub_(lse[rows].unsqueeze(-1))  # log p
            grad_logits = _to_logits_grad_(
                grad_logits, grad_out[rows], targets[rows], ctx.temperature,
                None if grad_entropy is None else grad_entropy[rows],
                None if entropy is None else entropy[rows]).to(hidden.dtype)
            _add_chunk_grads(grad_logits, h, weight, rows, grad_hidden, grad_weight, grad_bias)
            del grad_logits
        if into is not None:
            grad_weight = None  # already in weight.grad
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _to_logits_grad_(log_probs: Tensor, grad_logp: Tensor, targets: Tensor, temperature: float,
                     grad_entropy: Tensor | None = None, entropy: Tensor | None = None) -> Tensor:
    """Turn a chunk's log-probs [n, V] into d loss / d logits in place and return it, given
    d loss / d logp[target] (``grad_logp`` [n]) and, for an entropy term, d loss / d H
    (``grad_entropy`` [n]) with the rows' ``entropy`` [n].

    One [n x V] float tensor is live (two with an entropy gradient). With z = logits / T,
    p = softmax(z), g = grad_logp and e = grad_entropy: d logp[target] / dz = onehot(target) - p,
    dH/dz = -p (log p + H), so d loss / dz = g onehot - p (g + e (log p + H)), and
    d z / d logits = 1/T (folded into the per-row g and e, so it costs no pass over the chunk)."""
    g = (grad_logp / temperature).unsqueeze(-1)
    if grad_entropy is None:
        log_probs.exp_().mul_(g.neg())
    else:
        assert entropy is not None
        e = (grad_entropy / temperature).unsqueeze(-1)
        probs = log_probs.exp()
        log_probs.add_(entropy.unsqueeze(-1)).mul_(e).add_(g).mul_(probs).neg_()
        # p = 0 (a -inf logit): the gradient is 0 there, not 0 * -inf
        log_probs.masked_fill_(probs == 0, 0.0)
        del probs
    return log_probs.scatter_add_(-1, targets.unsqueeze(-1), g)


def _add_chunk_grads(grad_logits: Tensor, h: Tensor, weight: Tensor, rows: slice,
                     grad_hidden: Tensor | None, grad_weight: Tensor | None,
                     grad_bias: Tensor | None) -> None:
    """Add one chunk's d loss / d logits (``grad_logits`` [n, V], in ``h``'s dtype) to the
    gradients of the head's input rows ``rows``, its weight and its bias (those not None)."""
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits @ weight
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.T, h)
    if grad_bias is not None:
        grad_bias.add_(grad_logits.sum(dim=0))


def _to_log_probs_(logits: Tensor, entropy: Tensor | None = None) -> Tensor:
    """Turn a chunk's logits [n, V] into log-probabilities in place; returns the log-sum-exp [n]
    and, given an ``entropy`` [n] to fill, each row's entropy from the same exponentials.

    With ``x = z - max z``, ``e = exp(x)`` and ``S = sum e``: ``lse = max z + log S`` and the
    entropy ``-sum p log p = log S - (sum e x) / S``, a batched dot product. The exponentials get
    a temporary of ``SLICE_TOKENS`` rows at a time, not one of the chunk's size
    (``torch.logsumexp`` of the whole chunk would allocate a second [n, V] buffer)."""
    peak = logits.amax(dim=-1, keepdim=True)
    # a row that is -inf everywhere has no distribution; keep it from turning into NaN here
    peak = peak.masked_fill_(peak.isinf(), 0.0)
    logits.sub_(peak)
    lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
    for start in range(0, logits.shape[0], SLICE_TOKENS):
        rows = slice(start, start + SLICE_TOKENS)
        exps = logits[rows].exp()
        total = exps.sum(dim=-1)
        lse[rows] = total.log()
        if entropy is not None:
            dot = (exps.unsqueeze(-2) @ logits[rows].unsqueeze(-1)).flatten()
            entropy[rows] = lse[rows] - dot / total
        del exps  # before the next slice's are made
    if entropy is not None and entropy.isnan().any():
        # only a -inf logit (a -inf bias) gets here: p = 0 there, and p log p is 0, not 0 * -inf
        x = logits.masked_fill(logits.isinf(), 0.0)
        entropy.copy_(lse - (logits.exp() * x).sum(dim=-1) / lse.exp())
    logits.sub_(lse.unsqueeze(-1))
    return lse.add_(peak.squeeze(-1))


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Logits of one chunk in the compute dtype (float32 for bf16/fp16 models), divided by the temperature."""
    logits = F.linear(h, weight, bias).to(_compute_dtype(h))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    # float32 at least: a bf16 log-sum-exp over 150k logits loses the ratio precision PPO clipping needs.
    return torch.promote_types(hidden.dtype, torch.float32)


def _check_inputs(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, *, chunk_size: int, temperature: float
) -> None:
    """Raise ``ValueError`` naming the first inconsistent argument."""
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an int64 or int32 tensor of token ids, got {targets.dtype}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]}), got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
