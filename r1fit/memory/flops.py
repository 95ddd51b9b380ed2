"""Model FLOPs of a GRPO step, and the device's peak, for the ``flops`` and ``mfu`` metrics.

Counted as model FLOPs (the work the model needs, as in the PaLM paper's MFU): a multiply-add is
2 FLOPs; a weight matrix of ``n`` entries costs ``2 n`` per token (or vision patch) in the forward
pass and twice that in the backward pass (the input's gradient and the weight's); a frozen weight
(LoRA's base, a frozen vision tower) only the input's gradient, ``2 n``. Recomputation by gradient
checkpointing is not counted, nor the element-wise work (norms, activations, softmax, rotary).

Attention scores count what a causal kernel must do: token ``t`` of a sequence attends to ``t + 1``
positions, ``4 * head_dim * heads`` FLOPs per position and layer (QK^T and the weighted sum of V).
A vision tower attends over each image's patches in full (Qwen2.5-VL's windowed blocks do less:
an overcount of at most the attention part of those blocks). The LM head runs where r1fit applies
it: on every decoded token during generation, on the completion tokens when scoring.

Per step: generation (each row's prompt prefill, the vision tower once per row as transformers'
``generate`` runs it, one forward per decoded token over a growing cache), the old/reference
log-prob passes (forwards) and ``num_iterations`` updates (forward + backward).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from r1fit.data.batch import Prompt, micro_batches
from r1fit.processes import all_sum
from r1fit.rng import rng_untouched
from r1fit.rollout.record import Rollout

# Dense (no sparsity) peak tensor throughput per GPU in TFLOP/s, from the vendors' data sheets:
# (name fragment as torch.cuda.get_device_name reports it, bf16/fp16, tf32 or fp32 without
# tensor cores, fp32 on the CUDA cores: what torch's float32 products run at while
# torch.backends.cuda.matmul.allow_tf32 is off, its default). The first fragment found in the
# device name wins, so longer names come first.
GPU_PEAK_TFLOPS: tuple[tuple[str, float, float, float], ...] = (
    ("GB200", 2500.0, 1250.0, 80.0),
    ("B200", 2250.0, 1100.0, 75.0),
    ("H200", 989.0, 494.0, 67.0),
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100", 989.0, 494.0, 67.0),  # SXM
    ("H800", 989.0, 494.0, 67.0),
    ("H20", 148.0, 74.0, 44.0),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("A10G", 70.0, 35.0, 31.2),
    ("A10", 125.0, 62.5, 31.2),
    ("RTX 4090", 165.0, 82.6, 82.6),
    ("RTX 3090", 71.0, 35.6, 35.6),
    ("V100", 125.0, 15.7, 15.7),
    ("T4", 65.0, 8.1, 8.1),
)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model: its weight matrices per token and per patch."""

    text_matrix: int  # entries of the decoder layers' weight matrices (all layers)
    text_frozen: int  # of those, entries that get no gradient (LoRA's base)
    lora_matrix: int  # entries of the LoRA adapters (A and B) in the decoder layers
    head: int  # entries of the LM head (vocab x hidden)
    head_trains: bool
    attention_width: int  # heads x head_dim, summed over the decoder layers
    vision_matrix: int  # entries of the vision tower's matrices run per patch (embedding, blocks)
    vision_merger: int  # entries of its merger's matrices, run per merged token
    merge: int  # patches per merged token (Qwen: 2 x 2 = 4; 1 for towers without a merger)
    vision_trains: bool
    vision_attention_width: int  # heads x head_dim summed over the vision blocks

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """Read the shape off a loaded model (plain or peft-wrapped, not sharded)."""
        text = vision = merger = text_frozen = lora = 0
        head_module = _unwrapped(model).get_output_embeddings()
        visual_prefixes = tuple(name + "." for name, m in model.named_modules()
                                if name and _is_vision_tower(name, m))
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear | nn.Conv2d | nn.Conv3d) or module is head_module:
                continue
            n = module.weight.numel()
            if "lora_" in name:
                lora += n
            elif name.startswith(visual_prefixes) and ".merger." in name:
                merger += n
            elif name.startswith(visual_prefixes):
                vision += n
            elif ".layers." in name:
                text += n
                text_frozen += 0 if module.weight.requires_grad else n
        config = _unwrapped(model).config
        text_cfg = getattr(config, "text_config", config)
        heads = text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
        vision_cfg = getattr(config, "vision_config", None)
        v_width, merge = 0, 1
        if vision_cfg is not None:
            merge = (getattr(vision_cfg, "spatial_merge_size", None) or 1) ** 2
            v_hidden = getattr(vision_cfg, "embed_dim", None) or vision_cfg.hidden_size
            depth = getattr(vision_cfg, "depth", None) or getattr(vision_cfg, "num_hidden_layers", 0)
            v_width = v_hidden * depth
        visual_params = [p for n, p in model.named_parameters() if n.startswith(visual_prefixes)]
        return cls(text_matrix=text, text_frozen=text_frozen, lora_matrix=lora,
                   head=head_module.weight.numel() if head_module is not None else 0,
                   head_trains=head_module is not None and head_module.weight.requires_grad,
                   attention_width=text_cfg.num_hidden_layers * heads * head_dim,
                   vision_matrix=vision, vision_merger=merger, merge=merge,
                   vision_trains=any(p.requires_grad for p in visual_params),
                   vision_attention_width=v_width)


def _unwrapped(model: nn.Module) -> nn.Module:
    base = model
    while hasattr(base, "get_base_model"):
        base = base.get_base_model()
    return base


def _is_vision_tower(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model") \
        and any(True for _ in module.parameters())


def image_patches(image_inputs: dict[str, torch.Tensor], patch_size: int | None) -> tuple[int, ...]:
    """Patches of each image of a prompt: ``t * h * w`` of its ``image_grid_thw`` row (Qwen), else
    ``(height / patch) * (width / patch)`` of each ``pixel_values`` image (fixed-size towers)."""
    grid = image_inputs.get("image_grid_thw")
    if grid is not None:
        return tuple(int(t * h * w) for t, h, w in grid.tolist())
    pixels = image_inputs.get("pixel_values")
    if pixels is None or pixels.dim() != 4 or not patch_size:
        return ()
    per_image = (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size)
    return (int(per_image),) * int(pixels.shape[0])


def attention_flops(width: int, start: int, length: int) -> int:
    """Score and value FLOPs of ``length`` tokens at positions ``start .. start+length-1``, each
    attending causally to itself and everything before it: ``4 * width * sum(t + 1)``."""
    positions = length * start + length * (length + 1) // 2
    return 4 * width * positions


def forward_flops(shape: ModelShape, *, context: int, tokens: int, head_tokens: int,
                  patches: Sequence[int] = ()) -> int:
    """One forward pass over ``tokens`` new tokens after ``context`` cached ones, the LM head on
    ``head_tokens`` of them, and the vision tower over images of ``patches`` patches each."""
    matrices = 2 * (shape.text_matrix + shape.lora_matrix) * tokens + 2 * shape.head * head_tokens
    vision = sum(2 * shape.vision_matrix * p + 2 * shape.vision_merger * (p // shape.merge)
                 + 4 * shape.vision_attention_width * p * p for p in patches)
    return matrices + attention_flops(shape.attention_width, context, tokens) + vision


def backward_flops(shape: ModelShape, *, tokens: int, head_tokens: int, attention: int,
                   patches: Sequence[int] = ()) -> int:
    """The backward of a forward over ``tokens`` tokens whose attention cost ``attention`` FLOPs:
    the input gradient of every matrix, the weight gradient of the trained ones, twice the
    attention."""
    trained_text = shape.text_matrix - shape.text_frozen + shape.lora_matrix
    text = 2 * (shape.text_matrix + shape.lora_matrix) * tokens + 2 * trained_text * tokens
    head = 2 * shape.head * head_tokens * (2 if shape.head_trains else 1)
    vision = 0
    if shape.vision_trains:  # a frozen tower's output needs no gradient at all
        vision = sum(4 * shape.vision_matrix * p + 4 * shape.vision_merger * (p // shape.merge)
                     + 8 * shape.vision_attention_width * p * p for p in patches)
    return text + head + 2 * attention + vision


@dataclass(frozen=True)
class RowShape:
    """One rollout row: its prompt tokens, completion tokens and its images' patch counts."""

    prompt: int
    completion: int
    patches: tuple[int, ...] = ()


@dataclass(frozen=True)
class GroupShape:
    """Completions scored together with their prompt run once (``memory.share_prefix``); a
    single completion is the per-row path."""

    prompt: int
    completions: tuple[int, ...]
    patches: tuple[int, ...] = ()


def prefill_flops(shape: ModelShape, row: RowShape) -> int:
    """The prompt's prefill: vision tower included, the LM head on its last token."""
    return forward_flops(shape, context=0, tokens=row.prompt, head_tokens=1, patches=row.patches)


def decode_flops(shape: ModelShape, row: RowShape) -> int:
    """One forward per decoded token after the first (each with the LM head)."""
    return sum(forward_flops(shape, context=row.prompt + i, tokens=1, head_tokens=1)
               for i in range(max(row.completion - 1, 0)))


def generation_flops(shape: ModelShape, row: RowShape) -> int:
    """Prefill of the prompt (vision tower included, the LM head on its last token), then one
    forward per decoded token after the first (each with the LM head)."""
    return prefill_flops(shape, row) + decode_flops(shape, row)


def _group_attention(shape: ModelShape, group: GroupShape) -> int:
    return attention_flops(shape.attention_width, 0, group.prompt) + sum(
        attention_flops(shape.attention_width, group.prompt, c) for c in group.completions)


def scoring_flops(shape: ModelShape, group: GroupShape) -> int:
    """A log-prob pass: the prompt once (its last token's hidden state predicts each completion's
    first token), each completion after it, the LM head on the completion tokens."""
    prompt = forward_flops(shape, context=0, tokens=group.prompt, head_tokens=0,
                           patches=group.patches)
    return prompt + sum(forward_flops(shape, context=group.prompt, tokens=c, head_tokens=c)
                        for c in group.completions)


def update_flops(shape: ModelShape, group: GroupShape) -> int:
    """One update's forward and backward of a group."""
    tokens = group.prompt + sum(group.completions)
    return scoring_flops(shape, group) + backward_flops(
        shape, tokens=tokens, head_tokens=sum(group.completions),
        attention=_group_attention(shape, group), patches=group.patches)


def step_flops(shape: ModelShape, rows: Sequence[RowShape], groups: Sequence[GroupShape], *,
               log_prob_passes: int, updates: int) -> dict[str, int]:
    """A step's FLOPs by phase: ``generate`` (each row), ``logprobs`` (``log_prob_passes``
    forwards of each group: old policy and/or reference) and ``update`` (``updates`` forwards and
    backwards of each group)."""
    return {"generate": sum(generation_flops(shape, r) for r in rows),
            "logprobs": log_prob_passes * sum(scoring_flops(shape, g) for g in groups),
            "update": updates * sum(update_flops(shape, g) for g in groups)}


def gpu_peak_flops(device_name: str, dtype: torch.dtype, *, tf32: bool | None = None
                   ) -> float | None:
    """A GPU's dense peak FLOP/s for ``dtype`` (bf16/fp16 on tensor cores; float32 as TF32 where
    ``tf32``, else on the CUDA cores; None: as torch's ``allow_tf32`` now says), or None for a
    GPU not in ``GPU_PEAK_TFLOPS``."""
    if tf32 is None:
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    for fragment, half, tensor_single, single in GPU_PEAK_TFLOPS:
        if fragment in device_name:
            if dtype in (torch.bfloat16, torch.float16):
                return 1e12 * half
            return 1e12 * (tensor_single if tf32 else single)
    return None


def measured_peak_flops(device: torch.device, dtype: torch.dtype, *, size: int = 1024,
                        repeats: int = 5) -> float:
    """The best FLOP/s of ``repeats`` square matrix products of ``size`` on ``device`` (the CPU's
    peak as r1fit sees it, with the threads torch uses)."""
    with rng_untouched(device):  # built when a run first logs its FLOPs: after a resume too
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: thread pool, kernels
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / max(best, 1e-9)


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): a GPU's data-sheet figure, else a measured matmul
    peak (the CPU, or a GPU missing from the table)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        peak = gpu_peak_flops(name, dtype, tf32=tf32)
        if peak is not None:
            how = "" if dtype in (torch.bfloat16, torch.float16) else (
                ", TF32" if tf32 else ", without TF32 (torch default)")
            return peak, f"{name} data sheet{how}"
        return measured_peak_flops(device, dtype, size=4096), f"{name}: measured matmul"
    return measured_peak_flops(device, dtype), "measured CPU matmul"


def row_shapes(prompts: Sequence[Prompt], completions: Sequence[torch.Tensor],
               patch_size: int | None) -> list[RowShape]:
    """The shapes of rollout rows (a prompt and its completion each)."""
    return [RowShape(prompt.length, int(completion.shape[0]),
                     image_patches(prompt.image_inputs, patch_size))
            for prompt, completion in zip(prompts, completions, strict=True)]


def group_shapes(prompts: Sequence[Prompt], completions: Sequence[torch.Tensor],
                 patch_size: int | None, *, micro_batch: int, shared: bool,
                 tokens: int | None = None) -> list[GroupShape]:
    """The groups the log-prob passes and updates run: with ``shared``, the runs of rows with one
    prompt inside each micro-batch (of ``micro_batch`` rows, or ``tokens`` packed tokens: see
    :func:`r1fit.data.batch.micro_batches`); else one group per row. Packing changes no model
    FLOPs: its sequences see only themselves, as rows of their own would."""
    groups: list[GroupShape] = []
    for _, rows, comps in micro_batches(prompts, completions, micro_batch, tokens=tokens,
                                        shared=shared):
        last: Prompt | None = None
        for prompt, completion in zip(rows, comps, strict=True):
            n = int(completion.shape[0])
            if shared and prompt is last:
                groups[-1] = replace(groups[-1], completions=groups[-1].completions + (n,))
            else:
                groups.append(GroupShape(prompt.length, (n,),
                                         image_patches(prompt.image_inputs, patch_size)))
            last = prompt
    return groups


class MfuMeter:
    """The ``flops`` and ``mfu`` of each GRPO step: the model's FLOPs of this process's rows,
    summed over processes by the caller, over the peak of the devices for the step's time. The
    peak is read (GPU data sheet) or measured (CPU matmul) once, when the meter is made."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = ModelShape.of(model)
        vision_cfg = getattr(_unwrapped(model).config, "vision_config", None)
        self.patch_size = getattr(vision_cfg, "patch_size", None)
        self.peak, self.peak_from = device_peak_flops(device, dtype)

    def generation(self, prompts: Sequence[Prompt], completions: Sequence[torch.Tensor], *,
                   layout: GenerationLayout | None = None) -> int:
        """FLOPs of generating these rows as the engine's ``layout`` runs them (default: every
        row's prompt prefilled, adapters unmerged)."""
        layout = layout or GenerationLayout()
        shape = replace(self.shape, lora_matrix=0) if layout.merged else self.shape
        rows = row_shapes(prompts, completions, self.patch_size)
        total = sum(decode_flops(shape, r) for r in rows)
        chunk = layout.prefill_chunk or 1  # 1: each row a chunk of its own, its prompt its own
        for start in range(0, len(rows), chunk):
            # the distinct prompts of a chunk (the same object: a group's rows)
            distinct = {id(p): r for p, r in zip(prompts[start:start + chunk],
                                                 rows[start:start + chunk], strict=True)}
            total += sum(prefill_flops(shape, r) for r in distinct.values())
        return total

    def training(self, prompts: Sequence[Prompt], completions: Sequence[torch.Tensor], *,
                 log_prob_passes: int, updates: int, micro_batch: int, shared: bool,
                 tokens: int | None = None) -> int:
        """FLOPs of the log-prob passes and updates of these rows, as their micro-batches run."""
        groups = group_shapes(prompts, completions, self.patch_size, micro_batch=micro_batch,
                              shared=shared, tokens=tokens)
        return sum(step_flops(self.shape, [], groups, log_prob_passes=log_prob_passes,
                              updates=updates).values())

    def mfu(self, total_flops: float, seconds: float, devices: int) -> float:
        """Model FLOPs utilisation: achieved FLOP/s over the peak of ``devices`` devices."""
        return total_flops / max(seconds, 1e-9) / (self.peak * devices)


@dataclass(frozen=True)
class GenerationLayout:
    """How an engine runs a generation, as far as its FLOPs go: ``prefill_chunk``, the rows of a
    chunk whose distinct prompts it prefills once (None: every row's prompt, as Hugging Face
    generate does without rollout.share_prefill); ``merged``: it decodes on LoRA merged into
    the weights (the static and vLLM engines), so no adapter products."""

    prefill_chunk: int | None = None
    merged: bool = False


def flops_metrics(meter: MfuMeter, run: Any, drawn: Rollout, kept: Rollout | None,
                  with_reference: bool, times: dict[str, float], *,
                  layout: GenerationLayout | None = None) -> dict[str, float]:
    """A GRPO step's model FLOPs (every process's: generating every row drawn as the engine's
    ``layout`` runs it, then the log-prob passes and updates of the kept ones, the way
    ``memory.share_prefix`` and the micro-batch sizes run them) and the MFU they make over the
    step's seconds (the sum of ``times``) on ``world.size`` devices; ``mfu_update``: the log-prob
    passes' and updates' FLOPs over ``seconds_update`` (the phase that runs them), the update's
    own utilisation. ``run``: the run (r1fit/train/run.py), for its config, chunk sizes, layout
    and world."""
    algo = run.cfg.algo
    generated = meter.generation(drawn.rows, drawn.completions, layout=layout)
    trained = 0
    if kept is not None:
        # the old log-probs come from the first update's forwards, except with kl_in_reward,
        # whose pass before the first update provides them
        passes = int(with_reference) + int(algo.kl_in_reward)
        trained = meter.training(kept.rows, kept.completions, log_prob_passes=passes,
                                 updates=algo.num_iterations, micro_batch=run.sizes.micro_batch,
                                 shared=bool(run.layout.on), tokens=run.sizes.micro_batch_tokens)
    generated, trained = all_sum([float(generated), float(trained)])
    total = generated + trained
    out = {"flops": total, "mfu": meter.mfu(total, sum(times.values()), run.world.size)}
    if trained and times.get("seconds_update"):
        out["mfu_update"] = meter.mfu(trained, times["seconds_update"], run.world.size)
    return out
