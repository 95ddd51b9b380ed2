"""The plan printed: its parts, its phases, the largest sizes that fit and the advice, as lines
and tables (rich on a terminal)."""

from __future__ import annotations

from typing import Any

from r1fit.config import Config
from r1fit.memory.planner.estimate import (
    CUBLAS_THREADS,
    ENGINE_PARTS,
    FSDP_PARTS,
    PARTS,
    SAFETY_MARGIN,
    Plan,
    shown_values,
)
from r1fit.units import format_bytes, format_seconds

_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer (AdamW)",
           "reference": "reference model",
           "all_gather": "FSDP all-gather buffers (root + 2 units)",
           "reduce_scatter": "FSDP reduce-scatter buffer (one unit's gradients)",
           "activations": "activations (one micro-batch)",
           "adapter_copies": "LoRA adapters in the model's dtype (autocast's copies)",
           "logits_chunk": "LM head chunk",
           "vision": "vision encoder (one micro-batch)",
           "unsharded_weights": "FSDP unsharded weights (the whole policy)",
           "generation": "generation (KV cache + logits)",
           "engine_weights": "vLLM engine: its copy of the weights",
           "engine_kv_cache": "vLLM engine: KV cache pool",
           "engine_graphs": "static engine: decode step workspace (CUDA graph pool)",
           "inputs": "inputs (pixel values)",
           "workspaces": f"cuBLAS workspaces ({CUBLAS_THREADS} threads)", "overhead": "CUDA context + allocator slack"}
_STATIC_LABELS = {"engine_weights": "static engine: base weights kept while LoRA is merged",
                  "engine_kv_cache": "static engine: static KV cache",
                  "generation": "generation (prefill of a chunk's prompts)"}
_STATIC_WHEN = {"engine_weights": "generation", "generation": "generation"}
_WHEN = {"weights": "always", "gradients": "update", "optimizer": "always", "reference": "always",
         "all_gather": "log-probs, update", "reduce_scatter": "update",
         "activations": "update", "adapter_copies": "update", "logits_chunk": "update",
         "vision": "update",
         "unsharded_weights": "generation", "generation": "generation",
         "engine_weights": "always", "engine_kv_cache": "always", "engine_graphs": "always",
         "inputs": "step",
         "workspaces": "always", "overhead": "always"}


def _completion(cfg: Config, d: dict[str, Any]) -> str:
    """What follows a GRPO row's prompt: a completion, or with tools a whole trajectory."""
    if not cfg.tools:
        return f"completion up to {d['completion_tokens']}"
    return (f"trajectory up to {d['completion_tokens']} tokens (tools: {', '.join(cfg.tools)}; "
            f"{cfg.data.max_images} image(s) per row, {d['row_vision_patches']} vision patches)")


def render_blocks(plan: Plan, cfg: Config) -> list[Any]:
    """Lines and tables ``(headers, rows, right_aligned_columns)`` describing ``plan``."""
    d = plan.details
    mode = f"LoRA r={cfg.model.lora.r}" if cfg.model.lora.r else "full fine-tuning"
    ckpt = "on" if cfg.memory.gradient_checkpointing else "off"
    if cfg.memory.gradient_checkpointing and cfg.memory.checkpoint_every > 1:
        ckpt += f" (1 layer in {cfg.memory.checkpoint_every})"

    def auto(key: str) -> str:
        return " (auto)" if key in d["auto"] else ""

    dtype = d["dtype"]
    if d["dtype_from"] != "model.dtype":  # 'auto': the checkpoint's, like from_pretrained
        dtype += f": model.dtype=auto, from {d['dtype_from']}"
    gpus = d["gpus"]
    where = (f"per GPU, FSDP over {gpus} GPUs" if gpus > 1 else f"one {d['device_type']} device")
    per_gpu = f", {d['rows_per_gpu']} per GPU" if gpus > 1 else ""
    blocks: list[Any] = [
        (f"r1fit plan: {cfg.model.path} ({_parameters(d['params'])} parameters, {dtype}), "
         f"{mode}, {where}"),
        (f"  {d['rows_per_step']} rows per step ({cfg.train.prompts_per_step} prompts x "
         f"{cfg.algo.num_generations}{per_gpu}); prompt {d['prompt_tokens']} tokens "
         f"({d['image_tokens']} image), {_completion(cfg, d)}"
         if d["kind"] == "grpo" else
         f"  r1fit sft: {d['rows_per_step']} rows per step (sft.batch_size{per_gpu}); prompt "
         f"{d['prompt_tokens']} tokens ({d['image_tokens']} image), answer up to "
         f"{cfg.sft.max_answer_tokens} (sft.max_answer_tokens)"),
        f"  prompt {d['prompt_estimate']}",
        (f"  micro_batch {d['micro_batch']}{auto('micro_batch')}"
         + (f" rows, packed by memory.micro_batch_tokens={d['micro_batch_tokens']}"
            f"{auto('micro_batch_tokens')}" if d.get("micro_batch_tokens") else "")
         + f" ({d['micro_batches_per_update']} per update), generation_batch "
         f"{d['generation_batch']}{auto('generation_batch')}, gradient checkpointing {ckpt}, "
         f"shared prefix {d['share_prefix']}"),
    ]
    blocks += [f"  note: {n}" for n in plan.notes]
    engine = d.get("engine", cfg.rollout.engine)
    blocks.append(f"  rollout.engine {engine}" + ("" if d.get("engine_why", "set") == "set"
                                                  else f" (auto: {d['engine_why']})"))
    rows = _part_rows(plan, cfg, engine)
    blocks.append((("part", "size", "when"), rows, {1}))
    phase_rows = [(name + (" <- peak" if name == plan.peak_phase else ""), format_bytes(size))
                  for name, size in plan.phases.items()]
    blocks.append((("phase (whole device)", "peak"), phase_rows, {1}))
    verdict = "fits" if plan.fits else "does NOT fit"
    if plan.problems and plan.peak_bytes <= plan.usable_bytes:
        verdict += " (the peak would, but see the problem below)"
    blocks.append(f"peak {format_bytes(plan.peak_bytes)} of {format_bytes(plan.budget_bytes)} "
                  f"(usable with a {SAFETY_MARGIN:.0%} margin: {format_bytes(plan.usable_bytes)}): "
                  f"{verdict}")
    blocks += [f"problem: {p}" for p in plan.problems]
    rows = d["rows_per_gpu"]  # of a step, on one GPU
    of = " on a GPU" if gpus > 1 else ""
    blocks.append(f"largest memory.micro_batch that fits: "
                  f"{_size(plan.max_micro_batch, rows, of)}")
    if d.get("micro_batch_tokens"):
        tokens = plan.max_micro_batch_tokens
        blocks.append("largest memory.micro_batch_tokens that fits: "
                      + (str(tokens) if tokens else "none (even one row alone does not fit)"))
    blocks.append(f"largest memory.generation_batch that fits: "
                  f"{_size(plan.max_generation_batch, rows, of)}")
    if plan.advice:
        blocks.append("advice:")
        blocks += [f"  {a}" for a in plan.advice]
    if plan.time:
        blocks += time_blocks(plan.time, cfg)
    if plan.faster:
        blocks.append("faster configurations that fit (predicted):")
        blocks.append((("set", "step", "speed-up", "peak"), [
            (shown_values(x["values"]), format_seconds(x["step_seconds"]), f"{x['speedup']:.2f}x",
             format_bytes(x["peak_bytes"])) for x in plan.faster], {1, 2, 3}))
    return blocks



def time_blocks(t: dict[str, Any], cfg: Config) -> list[Any]:
    """The time model's prediction (r1fit/memory/planner/timing.py) as lines and a table."""
    step = t["step_seconds"] or 1e-9
    rows = []
    for name, seconds in t["phases"].items():
        if not seconds:
            continue
        label = name
        if name == "generate":
            d = t["details"]
            label += (f" (prefill {format_seconds(d['prefill_seconds'])}, decode "
                      f"{format_seconds(d['decode_step_seconds'])} per token step)")
        rows.append((label, format_seconds(seconds), f"{seconds / step:.0%}"))
    run = (f"{t['steps']} steps"
           + (f" + {t['evaluations']} evaluations of {format_seconds(t['eval_seconds'])}"
              if t["evaluations"] and t["eval_seconds"] is not None else "")
           + (f"; the {t['warmup_steps']}-step format warm-up before them not counted"
              if t.get("warmup_steps") else ""))
    blocks: list[Any] = [
        f"time (predicted; rates: {t['source']}):",
        (("phase", "per step", "share"), rows, {1, 2}),
        f"step {format_seconds(t['step_seconds'])}, {t['tokens_per_second']:,.0f} completion "
        f"tokens/s; "
        f"run ({run}): {format_seconds(t['run_seconds'])}; {t['dominant']} dominates"]
    d = t["details"]
    if d.get("turns"):
        blocks.append(f"  with tools: a trajectory of {d['turns']:.3g} policy turns (as many as "
                      f"its budget holds, at most rollout.max_turns, or --turns) of up to "
                      f"{d['turn_tokens']:.0f} tokens each, tool turns of about "
                      f"{d['tool_turn_tokens']:.0f} tokens"
                      + (", each later turn prefilling the whole context" if d.get("refill")
                         else "")
                      + "; the tool calls' own time is not counted (a run logs tools/seconds)")
    if t.get("link"):
        collectives = t["details"].get("collectives_seconds", 0.0)
        blocks.append(f"  FSDP2's collectives {format_seconds(collectives)} a step (in the "
                      f"phases above; on CUDA beside the compute); link: {t['link']}")
    blocks += [f"  {a}" for a in t["advice"]]
    return blocks


def _part_rows(plan: Plan, cfg: Config, engine: str) -> list[tuple[str, str, str]]:
    """The parts table's rows: (label, size, when), the parts this run has."""
    d = plan.details
    gpus = d["gpus"]
    other = "off" if cfg.memory.gradient_checkpointing else "on"
    rows = []
    for name in PARTS:
        if name in FSDP_PARTS and gpus == 1:
            continue
        vllm, static = engine == "vllm", engine == "static"
        if name in ENGINE_PARTS and not (vllm or static) or name == "generation" and vllm:
            continue
        if static and name == "engine_weights" and not plan.parts[name]:
            continue  # no LoRA: nothing is merged
        if name == "engine_graphs" and not static:
            continue  # the static engine's alone (vLLM's graphs are in its own pool)
        if name == "adapter_copies" and not plan.parts[name]:
            continue  # model.lora.compute_dtype=model on a 16-bit model alone
        size = plan.parts[name]
        label = _STATIC_LABELS.get(name, _LABELS[name]) if static else _LABELS[name]
        if gpus > 1 and name in ("weights", "gradients", "optimizer", "reference"):
            label += f", 1/{gpus} shard"
        if name == "activations":
            alternative = format_bytes(plan.activations_by_checkpointing[other])
            label += f" [checkpointing {other}: {alternative}]"
        when = _WHEN[name]
        if vllm and name in ENGINE_PARTS and d["device_type"] == "cuda" \
                and cfg.rollout.vllm.sleep_level:
            when = "generation (asleep while training)"
        if static:
            when = _STATIC_WHEN.get(name, when)
        rows.append((label, format_bytes(size), when))
    return rows


def _size(n: int, rows: int, of: str) -> str:
    if n == 0:
        return "none (even 1 does not fit)"
    return f"{n} (all {rows} rows of a step{of})" if n >= rows else str(n)


def render(plan: Plan, cfg: Config, *, rich: bool = False) -> None:
    """Print ``plan``: rich tables on a terminal, aligned plain text otherwise."""
    from r1fit.report.blocks import print_blocks

    print_blocks(render_blocks(plan, cfg), rich=rich)


def _parameters(count: int) -> str:
    """A parameter count as models are named: 8.29B, 0.74B; under 0.01B in millions (0.36M)."""
    return f"{count / 1e9:.2f}B" if count >= 1e7 else f"{count / 1e6:.2f}M"
