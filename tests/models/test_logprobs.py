"""On the real tiny Qwen2.5-VL in float64: chunked completion log-probs (and entropies) equal the
model's own logits, and a row's log-probs do not depend on the rest of its batch."""

from __future__ import annotations

import pytest
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


# --- model.lora.compute_dtype: the adapters' products in the model's dtype under autocast


def lora_model(folder, *, r: int = 8, checkpointing: bool = True, dtype: str = "bfloat16"):
    """The model in ``folder`` with LoRA r (alpha 2r) whose B matrices are not zero (the adapters
    count), and its processor."""
    from r1fit.models.load import load_policy

    torch.manual_seed(0)
    model, processor = load_policy(str(folder), lora_r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False, dtype=dtype,
                                   device="cpu", gradient_checkpointing=checkpointing)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model, processor


def bf16_lora(tiny_dir, checkpointing: bool = True):
    """builtin:tiny in bfloat16 with LoRA r=8 (:func:`lora_model`), 3 builtin:shapes prompts x 2
    rows with completions of different lengths, collated."""
    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset

    from ..conftest import random_completions

    model, processor = lora_model(tiny_dir, checkpointing=checkpointing)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)
    prompts = encode_prompts(processor, [data[i] for i in (0, 1, 2)], "Think, then answer.")
    rows = [p for p in prompts for _ in range(2)]
    completions = random_completions(len(processor.tokenizer), [3 + (i * 5) % 7 for i in range(6)])
    return model, collate(rows, completions, special_token_ids(model, processor)["pad"])


def both_paths(model, batch, chunk_size: int) -> dict:
    """{None: peft's float32 path, bfloat16: under autocast}: each path's log-probs and the
    adapters' gradients (flattened) of their sum, every adapter's product checked to take and
    give that path's dtype, and every gradient float32."""
    from r1fit.models.logprobs import CompletionLogProbs, adapter_backward

    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    out = {}
    for dtype in (None, torch.bfloat16):
        root = CompletionLogProbs(model, adapter_dtype=dtype)
        seen, remove = adapter_dtypes(model)
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(root, batch, chunk_size=chunk_size)
        with adapter_backward(root):
            logp.sum().backward()
        remove()
        want = torch.float32 if dtype is None else torch.bfloat16
        assert seen and all(pair == (want, want) for pair in seen), seen[:3]
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters)
        assert logp.dtype == torch.float32  # the head computes in float32 either way
        out[dtype] = logp.detach(), torch.cat([p.grad.flatten() for p in adapters])
    return out


def adapter_dtypes(model) -> tuple[list, object]:
    """Hooks recording (input dtype, output dtype) of every lora_A call; (the list, remover)."""
    seen: list = []
    handles = [m.register_forward_hook(lambda m, a, o: seen.append((a[0].dtype, o.dtype)))
               for name, m in model.named_modules() if name.endswith("lora_A.default")]
    return seen, lambda: [h.remove() for h in handles]


def test_which_models_compute_adapters_in_their_dtype(tiny_dir):
    from r1fit.models.load import adapter_autocast_dtype, load_policy

    model, _ = bf16_lora(tiny_dir)
    assert adapter_autocast_dtype(model, "model") == torch.bfloat16
    assert adapter_autocast_dtype(model, "float32") is None
    full, _ = load_policy(str(tiny_dir), lora_r=0, lora_alpha=16, lora_dropout=0.0,
                          lora_target="all-linear", freeze_vision=False, dtype="bfloat16",
                          device="cpu", gradient_checkpointing=False)
    assert adapter_autocast_dtype(full, "model") is None  # no adapters
    fp32, _ = lora_model(tiny_dir, dtype="float32")
    assert adapter_autocast_dtype(fp32, "model") is None  # float32 already: nothing to change


def test_adapters_compute_in_bfloat16_from_float32_weights(tiny_dir):
    """compute_dtype=model: every adapter's product takes and gives bfloat16 (peft's own path
    float32); its weights and gradients stay float32; the log-probs move by bfloat16 rounding
    only, and the gradients point the same way."""
    model, batch = bf16_lora(tiny_dir)
    results = both_paths(model, batch, chunk_size=5)
    (logp32, grad32), (logp16, grad16) = results[None], results[torch.bfloat16]
    mask = batch.completion_mask.bool()
    assert not torch.equal(logp32[mask], logp16[mask])  # the products did change
    torch.testing.assert_close(logp16, logp32, rtol=0, atol=0.05)
    assert torch.nn.functional.cosine_similarity(grad16.double(), grad32.double(), dim=0) > 0.99
    # the cast is peft's again after the context
    assert all(m.cast_input_dtype_enabled for n, m in model.named_modules() if hasattr(
        m, "cast_input_dtype_enabled"))


def test_an_adapted_linear_is_the_hand_computed_bfloat16_sum(tiny_dir):
    """Under the context an adapted Linear gives exactly base(x) + B(A(x)) * scale, every product
    and the sum in bfloat16 from the float32 weights rounded to bfloat16."""
    from r1fit.models.logprobs import adapters_in

    model, _ = bf16_lora(tiny_dir)
    layer = next(m for n, m in model.named_modules() if n.endswith("q_proj")
                 and hasattr(m, "lora_A"))
    x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
    with adapters_in(model, torch.bfloat16):
        got = layer(x)
    a = layer.lora_A["default"].weight.to(torch.bfloat16)
    b = layer.lora_B["default"].weight.to(torch.bfloat16)
    want = layer.base_layer(x) + torch.nn.functional.linear(
        torch.nn.functional.linear(x, a), b) * layer.scaling["default"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_checkpointing_recomputes_the_adapters_exactly(tiny_dir):
    """Gradient checkpointing recomputes each layer in backward under the forward's autocast and
    without peft's cast: the adapters' gradients equal those of a run that keeps activations."""
    from r1fit.models.logprobs import CompletionLogProbs, adapter_backward

    grads = []
    for checkpointing in (False, True):
        model, batch = bf16_lora(tiny_dir, checkpointing=checkpointing)
        root = CompletionLogProbs(model, adapter_dtype=torch.bfloat16)
        logp = completion_logprobs(root, batch, chunk_size=5)
        seen, remove = adapter_dtypes(model)
        with adapter_backward(root):
            logp.sum().backward()
        remove()
        # the recomputed adapters (checkpointing only) take their input uncast, in bfloat16
        assert bool(seen) == checkpointing
        assert all(pair == (torch.bfloat16, torch.bfloat16) for pair in seen)
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                                if "lora_" in n]))
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("name", ["tiny-qwen2vl", "tiny-qwen3vl", "tiny-gemma3"])
def test_every_family_runs_its_adapters_in_bfloat16(builtin_folder, name):
    """The same on the other built-in families' transformers classes (text rows): bf16 products,
    log-probs within bf16 rounding of the float32 path, float32 gradients."""
    from r1fit.data.batch import Batch

    model, _ = lora_model(builtin_folder(name), r=4)
    ids = torch.randint(10, 90, (2, 12))
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 6, ids[:, 6:],
                  torch.ones(2, 6))
    out = {dtype: logp for dtype, (logp, _) in both_paths(model, batch, chunk_size=4).items()}
    torch.testing.assert_close(out[torch.bfloat16], out[None], rtol=0, atol=0.05)
