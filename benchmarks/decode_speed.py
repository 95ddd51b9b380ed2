"""Rollout generation, Hugging Face generate against r1fit's static-cache engine, on one model and
one batch of rows: completion tokens/s, milliseconds per decode step, and the fraction of the
memory roofline a decode step reaches (the bytes it must read, the weights and the KV cache of the
rows' live tokens, over the bandwidth of a device-to-device copy measured in the same process).
benchmarks/gpu_check.py's ``speed`` stage runs it on the GPU (3B LoRA and full at the shipped
recipe's rollout shape); on CPU it runs on any model folder:

    python benchmarks/decode_speed.py MODEL_FOLDER [--lora-r 8] [--prompts 2] [--generations 2]
        [--image-size 56] [--new-tokens 8] [--hf-tokens 4] [--device cpu]

Completions are forced to their full length (end-of-sequence blocked until ``--new-tokens``:
random weights stop at random lengths). Hugging Face generate is timed for ``--hf-tokens``
tokens (fewer than ``--new-tokens`` when its time needs it) and its tokens/s at
``--new-tokens`` is its prefill plus ``--new-tokens`` - 1 decode steps at the measured per-step
time (the table says so); the engine is timed at ``--new-tokens`` after one warm-up call that
captures its CUDA graphs. ``--turn-tokens N`` also times a second turn of every row after N
text tokens of a tool turn (each turn decoding ``TURN_NEW_TOKENS``): the engine continuing its
kept cache (only the new tokens prefilled) against one prefilling the grown contexts whole.
Each timing is the median of ``--repeats`` calls. ``--profile-steps N`` then says where a
decode step's device time goes (:func:`profile_decode`: the engine's call of 1 + N tokens and of
1 token under torch.profiler, the difference per kernel over N): each kind's milliseconds per step
(matmul, attention, fused, copy/index, ...), the kernels' share of the step's unprofiled time (what
is left is the device waiting), the matmuls' bandwidth on the weights, and the top kernels. Exit 0
(targets are judged by the caller: gpu_check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

RECIPE = ROOT / "configs" / "qwen2.5-vl-3b-lora.yaml"
#: tokens each turn of the second-turn timing decodes (``--turn-tokens``)
TURN_NEW_TOKENS = 32
#: kinds of a decode step's kernels (or, on CPU, operators), by fragments of their lowercased
#: names; the first kind that matches wins (a fused attention kernel's name holds "gemm" too)
KERNEL_KINDS = (
    # cuDNN's fused attention: cudnn_generated_fort_native_sdpa_sm90_... (torch prefers it on
    # Hopper with a recent cuDNN)
    ("attention", ("fmha", "flash", "attention", "attn", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::matmul")),
    ("fused (triton)", ("triton",)),
    ("copy/index", ("copy", "index", "scatter", "gather", "cat", "fill", "memcpy", "memset")),
    ("reduction", ("reduce", "sum", "max", "softmax", "scan", "cumsum", "sort")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::")),
)
#: kernels listed by name in a profile
PROFILE_TOP = 12


def copy_bandwidth(device: Any, gib: float = 1.0, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the memory roofline's rate."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    seconds = time.perf_counter() - started
    del src, dst
    return 2 * n * 2 * repeats / seconds


def memory(device: Any, when: str) -> None:
    """Print the CUDA allocator's live and peak bytes (a leak shows here, not as an OOM later)."""
    import torch

    if torch.device(device).type == "cuda":
        print(f"cuda memory {when}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB "
              f"allocated, peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: Any, call: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds of ``repeats`` calls, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        out = call()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def decoder_weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: the language model's and the LM head's
    (each tensor once, so tied embeddings count once), not the vision tower's; LoRA factors
    excluded (the engine generates on merged weights)."""
    from r1fit.models.load import unwrap

    base = unwrap(model)
    inner = getattr(base, "model", base)
    text = getattr(inner, "language_model", inner)
    seen: dict[int, int] = {}
    for module in (text, base.get_output_embeddings()):
        for name, p in module.named_parameters():
            if "lora_" not in name:
                seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def rows_for(processor: Any, prompts: int, generations: int, image_size: int,
             system_prompt: str) -> list[Any]:
    """``prompts`` builtin:shapes questions at ``image_size`` px, each on ``generations`` rows."""
    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset
    from r1fit.data.shapes import ShapesSpec

    pixels = image_size * image_size
    data = load_dataset("builtin:shapes", split="train", min_pixels=min(3136, pixels),
                        max_pixels=pixels, max_images=1, max_bad_fraction=0.0, seed=0,
                        size=prompts, shapes=ShapesSpec(image_size=image_size))
    encoded = encode_prompts(processor, [data[i] for i in range(prompts)], system_prompt)
    return [p for p in encoded for _ in range(generations)]


def measure(  # noqa: PLR0913 -- the benchmark's knobs, all keywords
        folder: str, *, lora_r: int, lora_alpha: int, prompts: int, generations: int,
            image_size: int, new_tokens: int, hf_tokens: int, device: str, dtype: str,
            repeats: int = 3, bandwidth: float | None = None, compile: bool = False,
            turn_tokens: int = 0, profile_steps: int = 0, share_prompt: bool = False,
            partial: Path | None = None, deadline: float | None = None) -> dict[str, Any]:
    """Both engines on one model and batch; the numbers as a dict (see the module docstring).
    ``partial``: a file the result is written to as soon as the main timings are known and
    again after each extra (profile, shared prompts, second turn), so a caller that must kill
    this at its time cap keeps what was measured; ``deadline`` (time.time()): an extra that
    would likely end after it is skipped, and one that fails is recorded, not raised."""
    import torch

    from r1fit.config import load_config
    from r1fit.models.load import load_policy
    from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions, row_seeds
    from r1fit.rollout.prefill import PrefillSharing
    from r1fit.rollout.static_engine import StaticDecoder

    recipe = load_config(str(RECIPE), [])
    dev = torch.device(device)
    model, processor = load_policy(folder, lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                   lora_target=recipe.model.lora.target, freeze_vision=True,
                                   dtype=dtype, device=dev, gradient_checkpointing=False)
    ids = TokenIds.of(model, processor)
    memory(dev, "model loaded")
    rows = rows_for(processor, prompts, generations, image_size, recipe.data.system_prompt)
    seeds = row_seeds(0, 1, 0, len(rows))
    n = len(rows)

    def settings(tokens: int) -> SamplingSettings:
        return SamplingSettings(max_new_tokens=tokens, temperature=1.0, top_p=1.0,
                                min_new_tokens=tokens)

    def hf(tokens: int) -> list[Any]:
        return generate_completions(model, rows, seeds=seeds, batch_size=n,
                                    settings=settings(tokens), ids=ids, device=dev,
                                    sharing=PrefillSharing(True))

    bw = bandwidth or copy_bandwidth(dev, gib=1.0 if dev.type == "cuda" else 0.125)
    hf_result = None
    if hf_tokens:  # 0: the engine alone (a caller compares with another case's HF numbers)
        hf_first, _ = timed(dev, lambda: hf(1), repeats)
        hf_all, out = timed(dev, lambda: hf(hf_tokens), repeats)
        assert all(len(c) == hf_tokens for c in out), "HF completions were not forced to full length"
        hf_step = (hf_all - hf_first) / max(hf_tokens - 1, 1)
        # at new_tokens: prefill + decode steps; where noise outweighs the few steps' time (a
        # loaded machine, a smoke's handful of tokens), the run as measured
        extrapolated = hf_step > 0 and hf_tokens < new_tokens
        hf_seconds = hf_first + (new_tokens - 1) * hf_step if extrapolated else hf_all
        hf_result = {"prefill_seconds": hf_first, "seconds_measured": hf_all,
                     "decode_ms_per_step": hf_step * 1e3, "seconds_at_new_tokens": hf_seconds,
                     "tokens_per_second": n * (new_tokens if extrapolated else hf_tokens)
                     / hf_seconds, "extrapolated": extrapolated}

    memory(dev, "after hf generate")
    engine, error = StaticDecoder(model, ids, dev, compile=compile), None
    try:
        st = static_timings(engine, rows, seeds, settings, new_tokens, dev, repeats)
    except Exception as exc:  # noqa: BLE001 -- a CUDA-graph failure is a result here, not a crash
        import traceback

        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        print(f"static engine failed ({error}); again without CUDA graphs", file=sys.stderr,
              flush=True)
        traceback.print_exc()
        memory(dev, "after the failure")
        engine = StaticDecoder(model, ids, dev, graphs=False, compile=compile)
        st = static_timings(engine, rows, seeds, settings, new_tokens, dev, repeats)
    st_first, st_all, warm_seconds, peak = st
    memory(dev, "after the static engine")
    st_step = (st_all - st_first) / max(new_tokens - 1, 1)

    kv_token = sum(k.shape[1] * k.shape[3] * k.element_size() * 2 for k in engine.keys)
    prompt_mean = statistics.mean(p.length for p in rows)
    live = n * (prompt_mean + new_tokens / 2)  # tokens in the cache, on average over the steps
    weights = decoder_weight_bytes(model)
    must_read = weights + live * kv_token
    roofline = must_read / bw / st_step if st_step > 0 else float("nan")
    result = {
        "rows": n, "prompts": prompts, "generations": generations, "image_size": image_size,
        "prompt_tokens_mean": prompt_mean, "new_tokens": new_tokens, "hf_tokens": hf_tokens,
        "hf_extrapolated": bool(hf_result and hf_result["extrapolated"]), "lora_r": lora_r,
        "dtype": dtype,
        # as it ran: a compile that failed leaves the engine uncompiled (logged)
        "compile": engine.compile, "compile_asked": compile,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "copy_bandwidth_bytes_per_s": bw, "decode_weight_bytes": weights,
        "kv_bytes_per_token": kv_token, "bytes_per_decode_step": must_read,
        "hf": hf_result,
        "static": {"prefill_seconds": st_first, "seconds": st_all, "warmup_seconds": warm_seconds,
                   "decode_ms_per_step": st_step * 1e3, "tokens_per_second": n * new_tokens / st_all,
                   "graphs": engine.graphs, "captures": engine.captures,
                   "cache_bytes": engine.cache_bytes(),
                   "peak_allocated_bytes": peak, "roofline_fraction": roofline,
                   "graphs_error": error, **decode_attention_backend(engine, n)},
    }
    result["speedup_tokens_per_second"] = (
        None if hf_result is None else
        result["static"]["tokens_per_second"] / hf_result["tokens_per_second"])
    save_partial(partial, result)
    # the extras, each after the main numbers are safe: seconds each is expected to take (a
    # second engine's warm-up and interleaved calls of the whole length)
    call = st_all + warm_seconds
    extras: list[tuple[str, float, Callable[[], Any]]] = []
    if profile_steps:
        extras.append(("profile", 2 * st_all + 10, lambda: profile_decode(
            engine, rows, seeds, settings, min(profile_steps, new_tokens - 1), dev,
            step_ms=st_step * 1e3, weight_bytes=weights)))
    if share_prompt:
        extras.append(("shared", (2 * repeats + 1) * call, lambda: shared_timings(
            engine, StaticDecoder(model, ids, dev, graphs=engine.graphs, compile=engine.compile,
                                  share_prompt=True),
            rows, seeds, settings, new_tokens, dev, repeats, must_read=weights,
            kv_token=kv_token, bandwidth=bw)))
    if turn_tokens:
        # each turn decodes TURN_NEW_TOKENS: the two differ in what they prefill
        extras.append(("turn", 2 * repeats * call, lambda: turn_timings(
            engine, StaticDecoder(model, ids, dev, graphs=engine.graphs, compile=engine.compile),
            rows, seeds, settings(min(new_tokens, TURN_NEW_TOKENS)), turn_tokens, dev, repeats)))
    run_extras(result, extras, partial, deadline)
    return result


def run_extras(result: dict[str, Any], extras: Sequence[tuple[str, float, Callable[[], Any]]],
               partial: Path | None, deadline: float | None) -> None:
    """Each extra ``(name, seconds it is expected to take, run)`` into ``result`` (the profile
    under ``result["static"]``): skipped where it would end after ``deadline``, its error kept
    where it fails; the result saved to ``partial`` after each."""
    for name, seconds, run in extras:
        where = result["static"] if name == "profile" else result
        if deadline is not None and time.time() + seconds > deadline:
            where[name] = {"skipped": f"about {seconds:.0f} s needed, "
                                      f"{max(deadline - time.time(), 0):.0f} s left"}
        else:
            try:
                where[name] = run()
            except Exception as exc:  # noqa: BLE001 -- an extra's failure keeps the main numbers
                where[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"decode_speed: {name} failed: {where[name]['error']}", file=sys.stderr,
                      flush=True)
        save_partial(partial, result)


def save_partial(path: Path | None, result: dict[str, Any]) -> None:
    """``result`` into ``path`` (written whole, then renamed: never half a file)."""
    if path is not None:
        scratch = path.with_name(path.name + ".part")
        scratch.write_text(json.dumps(result))
        scratch.replace(path)


def unfinished(part: Any) -> str | None:
    """Why an extra of the result has no numbers ('skipped: ...', 'failed: ...'), or None."""
    if isinstance(part, dict) and "skipped" in part:
        return f"skipped ({part['skipped']})"
    if isinstance(part, dict) and "error" in part:
        return f"FAILED ({part['error']})"
    return None


def shared_timings(  # noqa: PLR0913 -- two engines, the rows and the roofline's facts
        plain: Any, shared: Any, rows: Sequence[Any], seeds: Sequence[int],
                   settings: Callable[[int], Any], new_tokens: int, dev: Any, repeats: int, *,
                   must_read: float, kv_token: int, bandwidth: float) -> dict[str, Any]:
    """The engine with each prompt held once for its rows (``share_prompt``) against the plain
    layout, calls interleaved (medians of ``repeats`` each, after a warm-up call of the shared
    one): ms per decode step (the whole call less a 1-token call, over the steps), the
    caches' bytes, whether the tokens are the same, and the fraction of the roofline of what a
    step must read in this layout (``must_read``, the weights, plus each distinct prompt's KV
    once and the rows' completions')."""
    n = len(rows)
    # the prompts the engine holds: one slot per prompt object and group of its rows
    # (r1fit.rollout.shared_prompts.prompt_slots), not per distinct token sequence
    from r1fit.rollout.prefill import distinct_prompts
    from r1fit.rollout.shared_prompts import prompt_slots

    unique, index = distinct_prompts(rows)
    _, _, prompt_of_slot = prompt_slots(index.tolist(), shared.prompt_places)
    must_read += (sum(unique[i].length for i in prompt_of_slot) + n * new_tokens / 2) * kv_token

    def call(engine: Any, tokens: int) -> Any:
        return engine.generate(rows, seeds=seeds, batch_size=n, settings=settings(tokens))

    started = time.perf_counter()
    call(shared, new_tokens)
    sync(dev)
    warm = time.perf_counter() - started
    times: dict[str, dict[int, list[float]]] = {"plain": {1: [], new_tokens: []},
                                                "shared": {1: [], new_tokens: []}}
    outs: dict[str, Any] = {}
    for _ in range(repeats):
        for tokens in (1, new_tokens):
            for name, engine in (("plain", plain), ("shared", shared)):
                sync(dev)
                begun = time.perf_counter()
                outs[name] = call(engine, tokens)
                sync(dev)
                times[name][tokens].append(time.perf_counter() - begun)
    step = {name: (statistics.median(t[new_tokens]) - statistics.median(t[1]))
            / max(new_tokens - 1, 1) for name, t in times.items()}
    same = all(torch_equal(a, b) for a, b in zip(outs["plain"], outs["shared"], strict=True))
    return {"warmup_seconds": warm, "plain_ms_per_step": step["plain"] * 1e3,
            "shared_ms_per_step": step["shared"] * 1e3,
            "speedup": step["plain"] / step["shared"] if step["shared"] > 0 else float("nan"),
            "plain_cache_bytes": plain.cache_bytes(), "shared_cache_bytes": shared.cache_bytes(),
            "active": shared.share_prompt, "same_tokens": same,
            "shared_tokens_per_second": n * new_tokens / statistics.median(
                times["shared"][new_tokens]),
            "bytes_per_decode_step": must_read,
            "roofline_fraction": (must_read / bandwidth / step["shared"] if step["shared"] > 0
                                  else float("nan"))}


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def turn_timings(engine: Any, whole: Any, rows: Sequence[Any], seeds: Sequence[int],
                 settings: Any, turn_tokens: int, dev: Any, repeats: int) -> dict[str, Any]:
    """A second turn of every row (its context grown by its first turn and ``turn_tokens``
    tokens of a text tool turn) on the engine that kept the first turn's cache (only the new
    tokens prefilled) against a second engine that prefills the grown contexts whole: seconds
    of the turn (median of ``repeats``, each after its own first turn)."""
    import torch

    from r1fit.data.batch import Prompt

    n = len(rows)
    tool = torch.arange(turn_tokens, dtype=torch.long) % 200 + 10  # ordinary text ids (bytes)

    def grown(turns: Sequence[Any]) -> list[Any]:
        out = []
        for row, tokens in zip(rows, turns, strict=True):
            extra = torch.cat([tokens, tool])
            extras = {k: torch.cat([v, torch.zeros(len(extra), dtype=v.dtype)])
                      for k, v in row.token_inputs.items()}
            out.append(Prompt(torch.cat([row.input_ids, extra]), extras, row.image_inputs,
                              row.sample))
        return out

    kept_times, whole_times, same = [], [], True
    for _ in range(repeats + 1):  # the first pair warms the block's kernels up
        first = engine.generate(rows, seeds=seeds, batch_size=n, settings=settings, keep=True)
        contexts = grown(first)
        sync(dev)
        started = time.perf_counter()
        kept = engine.generate(contexts, seeds=seeds, batch_size=n, settings=settings,
                               previous=list(range(n)))
        sync(dev)
        kept_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        again = whole.generate(contexts, seeds=seeds, batch_size=n, settings=settings)
        sync(dev)
        whole_times.append(time.perf_counter() - started)
        same = same and all(torch.equal(a, b) for a, b in zip(kept, again, strict=True))
    kept_s, whole_s = statistics.median(kept_times[1:]), statistics.median(whole_times[1:])
    return {"tool_tokens": turn_tokens, "context_tokens_mean": statistics.mean(
                c.length for c in contexts),
            "kept_seconds": kept_s, "whole_seconds": whole_s, "speedup": whole_s / kept_s,
            "appended": engine.appended, "same_tokens": same}


def decode_attention_backend(engine: Any, rows: int) -> dict[str, Any]:
    """The kernel torch's sdpa dispatch picks for the engine's decode attention (a query of each
    KV head's group of query heads over the whole cache, a boolean mask; r1fit's
    ``decode_attention``), and the cuDNN version it ran with: which attention the profile's
    "attention" row is."""
    import torch
    from torch.nn.attention import SDPBackend

    keys = engine.keys[0][:rows]
    heads = int(engine._text_config.num_attention_heads)
    query = torch.zeros(rows, keys.shape[1], heads // keys.shape[1], keys.shape[3],
                        dtype=keys.dtype, device=keys.device)
    found: dict[str, Any] = {"cudnn_version": torch.backends.cudnn.version()}
    try:
        choice = torch._fused_sdp_choice(query, keys, keys, attn_mask=engine.mask[:rows],
                                         dropout_p=0.0, is_causal=False, scale=None)
        found["sdpa_backend"] = SDPBackend(choice).name
    except Exception as exc:  # noqa: BLE001 -- a private function: a name, not a crash
        found["sdpa_backend"] = f"unknown ({type(exc).__name__}: {exc})"
    return found


def kernel_kind(name: str) -> str:
    """The kind (:data:`KERNEL_KINDS`) of a kernel or operator name; "other" when none matches."""
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def profile_decode(engine: Any, rows: Sequence[Any], seeds: Sequence[int],
                   settings: Callable[[int], Any], steps: int, dev: Any, *, step_ms: float,
                   weight_bytes: int, top: int = PROFILE_TOP) -> dict[str, Any]:
    """Where a decode step's device time goes: the engine's call of ``1 + steps`` tokens and of 1
    token (prefill and the first pick only), each under torch.profiler; per kernel name (CUDA
    kernels on a GPU, replayed graphs' included; operators' self CPU time on CPU) the difference
    of the two over ``steps``. ``step_ms``: the step's unprofiled time, against which the
    kernels' sum is a busy fraction; ``weight_bytes``: what the matmuls must read per step;
    ``top``: the kernels listed by name."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(dev).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]

    def microseconds(tokens: int) -> tuple[dict[str, float], dict[str, int]]:
        sync(dev)
        with profile(activities=activities) as prof:
            engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings(tokens))
            sync(dev)
        times: dict[str, float] = {}
        counts: dict[str, int] = {}
        for event in prof.events():
            if cuda and event.device_type != DeviceType.CUDA:
                continue
            us = event.time_range.elapsed_us() if cuda else event.self_cpu_time_total
            times[event.name] = times.get(event.name, 0.0) + us
            counts[event.name] = counts.get(event.name, 0) + 1
        return times, counts

    first, first_counts = microseconds(1)
    every, every_counts = microseconds(1 + steps)
    # the kernels the decode steps launched: those called more often in the longer call (the
    # prefill's own kernels differ between the two calls by timing noise only)
    calls = {name: (n - first_counts.get(name, 0)) / steps for name, n in every_counts.items()
             if n > first_counts.get(name, 0)}
    per_step = {name: max(0.0, every[name] - first.get(name, 0.0)) / steps / 1e3
                for name in calls}
    kind_of = {name: kernel_kind(name) for name in per_step}
    kinds: dict[str, float] = {}
    for name, ms in per_step.items():
        kinds[kind_of[name]] = kinds.get(kind_of[name], 0.0) + ms
    total = sum(per_step.values())
    listed = sorted(per_step, key=per_step.__getitem__, reverse=True)[:top]
    matmul = kinds.get("matmul", 0.0)
    return {"steps": steps, "what": "CUDA kernels" if cuda else "operators' self CPU time",
            "ms_per_step": total, "calls_per_step": sum(calls.values()),
            "busy_fraction": total / step_ms if step_ms > 0 else None,
            "kinds_ms_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "matmul_bytes_per_s": weight_bytes / (matmul / 1e3) if matmul > 0 else None,
            "top": [{"name": name, "kind": kind_of[name], "ms_per_step": per_step[name],
                     "calls_per_step": calls[name]} for name in listed]}


def static_timings(engine: Any, rows: Sequence[Any], seeds: Sequence[int],
                   settings: Callable[[int], Any], new_tokens: int, dev: Any, repeats: int
                   ) -> tuple[float, float, float, int | None]:
    """The engine's (prefill seconds, seconds at new_tokens, warm-up seconds, peak allocated)."""
    import torch

    n = len(rows)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    started = time.perf_counter()
    engine.generate(rows, seeds=seeds, batch_size=n, settings=settings(new_tokens))
    sync(dev)
    warm = time.perf_counter() - started
    memory(dev, "after the engine's warm-up call")
    first, _ = timed(dev, lambda: engine.generate(rows, seeds=seeds, batch_size=n,
                                                  settings=settings(1)), repeats)
    every, out = timed(dev, lambda: engine.generate(rows, seeds=seeds, batch_size=n,
                                                    settings=settings(new_tokens)), repeats)
    assert all(len(c) == new_tokens for c in out), "engine completions were not forced to full length"
    peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
    return first, every, warm, peak


def lines(name: str, r: dict[str, Any]) -> list[str]:
    """A result as table lines."""
    hf, st = r["hf"], r["static"]
    extra = f" (extrapolated from {r['hf_tokens']} tokens)" if r["hf_extrapolated"] else ""
    speedup = r["speedup_tokens_per_second"]
    return [
        f"{name}: {r['rows']} rows ({r['prompts']} x G={r['generations']}, {r['image_size']} px, "
        f"prompt {r['prompt_tokens_mean']:.0f} tokens), {r['new_tokens']} forced tokens",
        "  hf generate: not run here" if hf is None else
        f"  hf generate: {hf['decode_ms_per_step']:.1f} ms/step, {hf['tokens_per_second']:,.0f} "
        f"tokens/s{extra}",
        f"  static: {st['decode_ms_per_step']:.2f} ms/step, {st['tokens_per_second']:,.0f} "
        f"tokens/s ({'-' if speedup is None else f'{speedup:.1f}'}x hf), prefill {st['prefill_seconds']:.2f} "
        f"s, warm-up {st['warmup_seconds']:.1f} s, {st['captures']} graphs"
        f"{'' if st['graphs'] else ' (eager)'}{' compiled' if r.get('compile') else ''}"
        + (f"; CUDA graphs FAILED: {st['graphs_error']}" if st.get("graphs_error") else ""),
        f"  roofline: {r['bytes_per_decode_step'] / 2**30:.2f} GiB per step at "
        f"{r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s -> {st['roofline_fraction']:.0%}; "
        f"decode attention: sdpa picks {st.get('sdpa_backend', '?')} (cuDNN "
        f"{st.get('cudnn_version')})",
        *([f"  {name}: {why}" for name, part in (("second turn", r.get("turn")),
                                                  ("shared prompts", r.get("shared")),
                                                  ("profile", st.get("profile")))
           if (why := unfinished(part))]),
        *([] if not r.get("turn") or unfinished(r["turn"]) else [
            f"  second turn ({r['turn']['tool_tokens']} tool tokens, contexts of "
            f"{r['turn']['context_tokens_mean']:.0f}): kept cache {r['turn']['kept_seconds']:.2f} "
            f"s, whole prefill {r['turn']['whole_seconds']:.2f} s ({r['turn']['speedup']:.2f}x; "
            f"same tokens: {r['turn']['same_tokens']})"]),
        *([] if not r.get("shared") or unfinished(r["shared"]) else [shared_line(r["shared"])]),
        *([] if unfinished(st.get("profile")) else profile_lines(st.get("profile"))),
    ]


def shared_line(s: dict[str, Any]) -> str:
    """The shared-prompt timing (:func:`shared_timings`) as a table line."""
    if not s["active"]:
        return "  shared prompts: not applicable to this model (the plain layout ran)"
    return (f"  shared prompts (interleaved with the plain layout): {s['shared_ms_per_step']:.2f} "
            f"vs {s['plain_ms_per_step']:.2f} ms/step ({s['speedup']:.2f}x), KV cache "
            f"{s['shared_cache_bytes'] / 2**20:,.0f} vs {s['plain_cache_bytes'] / 2**20:,.0f} MiB, "
            f"roofline {s['roofline_fraction']:.0%} of its own "
            f"{s['bytes_per_decode_step'] / 2**30:.2f} GiB; same tokens: {s['same_tokens']}")


def profile_lines(profile: dict[str, Any] | None) -> list[str]:
    """A decode profile (:func:`profile_decode`) as table lines."""
    if not profile:
        return []
    busy = profile["busy_fraction"]
    rate = profile["matmul_bytes_per_s"]
    return [
        f"  profile ({profile['what']}, {profile['steps']} steps): {profile['ms_per_step']:.2f} ms "
        f"per step in {profile['calls_per_step']:.0f} calls"
        + ("" if busy is None else f", {busy:.0%} of the step's time")
        + ("" if rate is None else f"; matmuls read the weights at {rate / 1e12:.2f} TB/s"),
        "    " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in profile["kinds_ms_per_step"].items()),
        *(f"    {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.0f} {k['kind']}: "
          f"{k['name'][:90]}" for k in profile["top"]),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=2)
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--hf-tokens", type=int, default=None,
                   help="tokens HF generate is timed over (default --new-tokens; 0: not run)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's decode step")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="copy bandwidth in bytes/s (default: measured here)")
    p.add_argument("--turn-tokens", type=int, default=0,
                   help="also time a second turn after this many tool-turn tokens: the kept "
                        "cache against a whole prefill of the grown contexts (0: not run)")
    p.add_argument("--share-prompt", action="store_true",
                   help="also time the engine holding each prompt once for its rows "
                        "(rollout.static.share_prompt), interleaved with the plain layout")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then profile this many decode steps of the engine: milliseconds per step "
                        "by kind of kernel, and the top kernels (0: not run)")
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--partial", type=Path, default=None,
                   help="write the result here as soon as the main timings are known, and after "
                        "each extra (a caller that kills this at a time cap keeps them)")
    p.add_argument("--deadline", type=float, default=None,
                   help="time.time() by which to be done: extras that would end later are "
                        "skipped")
    a = p.parse_args(argv)
    r = measure(a.folder, lora_r=a.lora_r, lora_alpha=a.lora_alpha, prompts=a.prompts,
                generations=a.generations, image_size=a.image_size, new_tokens=a.new_tokens,
                hf_tokens=a.new_tokens if a.hf_tokens is None else a.hf_tokens, device=a.device, dtype=a.dtype,
                repeats=a.repeats, bandwidth=a.bandwidth, compile=a.compile,
                turn_tokens=a.turn_tokens, profile_steps=a.profile_steps,
                share_prompt=a.share_prompt, partial=a.partial, deadline=a.deadline)
    print("\n".join(lines("decode", r)), file=sys.stderr, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
