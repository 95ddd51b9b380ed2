"""benchmarks/decode_speed.py's decode profile: kernels sorted into kinds by name (names as CUDA
and the CPU profiler print them), and the per-step difference of two profiled engine calls,
checked against the matmul count of the tiny model's decode step, worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import time

import decode_speed
import pytest
import torch

from r1fit.data.batch import encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.models.load import load_policy
from r1fit.rollout.generate import SamplingSettings, TokenIds, row_seeds
from r1fit.rollout.static_engine import StaticDecoder

CPU = torch.device("cpu")


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn>",
     "matmul"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
     "attention"),  # a cutlass kernel, but attention's
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused (triton)"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy/index"),
    ("Memcpy DtoD (Device -> Device)", "copy/index"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>",
     "elementwise"),
    ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::mul", "elementwise"),
    ("cudaGraphLaunch", "other"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
])
def test_kernel_kinds(name, kind):
    assert decode_speed.kernel_kind(name) == kind


def tiny_rows(folder, copies):
    """The tiny model, its token ids and 2 image prompts x ``copies`` rows."""
    model, processor = load_policy(str(folder), lora_r=0, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=True, dtype="float32",
                                   device=CPU, gradient_checkpointing=False)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=4)
    rows = [p for p in encode_prompts(processor, [data[i] for i in range(2)], "Answer.")
            for _ in range(copies)]
    return model, TokenIds.of(model, processor), rows


def settings(tokens):
    """decode_speed's settings: sampled, forced to ``tokens`` tokens."""
    return SamplingSettings(max_new_tokens=tokens, temperature=1.0, top_p=1.0,
                            min_new_tokens=tokens)


def test_the_profile_counts_a_decode_steps_operators(tiny_dir):
    model, ids, rows = tiny_rows(tiny_dir, 2)
    engine = StaticDecoder(model, ids, CPU)

    got = decode_speed.profile_decode(engine, rows, row_seeds(0, 1, 0, len(rows)), settings, 3,
                                      CPU, step_ms=10.0, weight_bytes=1000, top=1000)
    calls = {k["name"]: k["calls_per_step"] for k in got["top"]}
    # one decode step's matmuls: q, k, v (with biases: addmm), o, gate, up, down per layer (mm),
    # and the LM head (mm)
    layers = model.config.get_text_config().num_hidden_layers
    assert calls.get("aten::addmm", 0) == 3 * layers
    assert calls.get("aten::mm", 0) == 4 * layers + 1
    assert got["steps"] == 3 and got["what"] == "operators' self CPU time"
    assert got["ms_per_step"] > 0 and got["busy_fraction"] == got["ms_per_step"] / 10.0
    assert sum(got["kinds_ms_per_step"].values()) == pytest.approx(got["ms_per_step"])
    assert got["matmul_bytes_per_s"] == 1000 / (got["kinds_ms_per_step"]["matmul"] / 1e3)
    shown = [k["ms_per_step"] for k in got["top"]]
    assert shown == sorted(shown, reverse=True) and all(c > 0 for c in calls.values())
    assert any(line.startswith("    ") for line in decode_speed.profile_lines(got))


def test_the_decode_attention_backend_is_named(tiny_dir):
    """The sdpa kernel for the engine's decode attention shape (on CPU: the flash kernel for CPU,
    which takes a mask), read after a call has sized the cache."""
    model, ids, rows = tiny_rows(tiny_dir, 2)
    engine = StaticDecoder(model, ids, CPU)
    engine.generate(rows, seeds=row_seeds(0, 1, 0, len(rows)), batch_size=len(rows),
                    settings=settings(2))
    got = decode_speed.decode_attention_backend(engine, len(rows))
    assert got == {"cudnn_version": torch.backends.cudnn.version(),
                   "sdpa_backend": "FLASH_ATTENTION"}


def test_shared_timings_compare_the_two_layouts_on_the_same_rows(tiny_dir):
    """decode_speed --share-prompt: both layouts timed on the same rows, the same tokens, the
    shared cache smaller, and a roofline of what the shared layout must read (the weights, each
    distinct prompt's KV once, the rows' completions')."""
    model, ids, rows = tiny_rows(tiny_dir, 4)
    plain = StaticDecoder(model, ids, CPU)
    shared = StaticDecoder(model, ids, CPU, share_prompt=True, prompt_places=4)
    kv_token = 1000
    got = decode_speed.shared_timings(plain, shared, rows, row_seeds(0, 1, 0, len(rows)),
                                      settings, 6, CPU, 1, must_read=5e6, kv_token=kv_token,
                                      bandwidth=1e9)
    assert got["active"] and got["same_tokens"]
    assert got["shared_cache_bytes"] < got["plain_cache_bytes"]
    assert got["plain_ms_per_step"] > 0 and got["shared_ms_per_step"] > 0
    # 2 prompts held once (a slot per prompt object and its 4 rows), 8 rows' completions at
    # half the 6 tokens on average
    prompts = sum(r.length for r in {id(r): r for r in rows}.values())
    assert got["bytes_per_decode_step"] == 5e6 + (prompts + 8 * 3) * kv_token
    # two prompts of the same tokens are two slots, as the engine holds them
    twin = [r for p in (rows[0], dataclasses.replace(rows[0])) for r in [p] * 4]
    twins = decode_speed.shared_timings(plain, shared, twin, row_seeds(0, 1, 0, len(twin)),
                                        settings, 6, CPU, 1, must_read=5e6, kv_token=kv_token,
                                        bandwidth=1e9)
    assert twins["bytes_per_decode_step"] == 5e6 + (2 * rows[0].length + 8 * 3) * kv_token
    assert "shared prompts (interleaved" in decode_speed.shared_line(got)


def test_extras_are_skipped_at_the_deadline_and_their_failures_kept(tmp_path):
    """The main timings are written to the partial file first; an extra that would end after the
    deadline is skipped, one that raises leaves its error, and the file follows each."""
    partial = tmp_path / "result.json"
    result = {"static": {"tokens_per_second": 5.0}}
    seen = []

    def boom():
        seen.append(json.loads(partial.read_text()))  # the main numbers were saved before
        raise RuntimeError("graphs lost")

    decode_speed.save_partial(partial, result)
    extras = [("profile", 1.0, lambda: {"ms_per_step": 2.0}), ("shared", 1.0, boom),
              ("turn", 1e6, lambda: pytest.fail("ran past its deadline"))]
    decode_speed.run_extras(result, extras, partial, deadline=time.time() + 100)
    assert seen == [{"static": {"tokens_per_second": 5.0, "profile": {"ms_per_step": 2.0}}}]
    assert result["shared"] == {"error": "RuntimeError: graphs lost"}
    assert result["turn"]["skipped"].startswith("about 1000000 s needed")
    assert json.loads(partial.read_text()) == result
    assert decode_speed.unfinished(result["shared"]) == "FAILED (RuntimeError: graphs lost)"
    assert decode_speed.unfinished(result["turn"]).startswith("skipped (")
    assert decode_speed.unfinished(result["static"]["profile"]) is None
