"""The peak memory per device of one GRPO step, added up phase by phase from the model's facts
and the per-token formulas.

``r1fit plan CONFIG [key=value ...]`` builds the model from its ``config.json`` on the meta device
(no weights are read or allocated) and adds up what one step of the configured run holds, phase by
phase, the way r1fit's code allocates it:

- for the whole run: weights, AdamW states (after the first update), the KL reference copy;
- generation (r1fit/rollout/generate.py): ``memory.generation_batch`` rows at a time under
  ``no_grad``, KV cache on; the gradients were freed by the previous update;
- old-policy and reference log-probs (r1fit/train/forward.py, ``no_grad``): ``memory.micro_batch``
  rows at a time; only with ``algo.beta > 0`` or ``algo.num_iterations > 1``;
- the update (r1fit/train/grpo.py): ``memory.micro_batch`` rows at a time, each holding its saved
  activations, the LM head's chunk of ``memory.logits_chunk`` tokens (r1fit/algorithms/logprobs.py)
  and, from the second micro-batch on, the gradients of every trainable parameter.

With ``--gpus N`` (N > 1) the plan is per GPU of a torchrun job whose model is sharded by FSDP2
(``fully_shard`` on each decoder layer and vision block, then on the root), as torch 2.x does it:

- weights, gradients, AdamW states and the reference copy are per-parameter shards: each tensor is
  cut into N pieces along dim 0, padded to the first (largest) piece, ``ceil(rows / N)`` rows;
  the plan is for that first GPU;
- forward and backward all-gather one unit at a time, and a unit's all-gather output stays alive
  while the unit computes (forward keeps it for the next unit's copy-out; backward prefetches the
  next unit): two units' unsharded bytes. The root's own parameters (embeddings, LM head, final
  norm, the vision patch embedding and merger) are gathered at the start of the forward and, as
  FSDP2 does for the root, not resharded until its post-backward: they stay gathered throughout,
  and so does the LM head's unsharded gradient during backward;
- backward's reduce-scatter copies a unit's unsharded gradients into one flat buffer before
  freeing them: the largest trainable unit's gradients, twice, at that moment;
- generation runs on the policy gathered whole (``r1fit.distributed.parallelize.gathered``): the
  full unsharded weights beside the shards, which FSDP2 keeps;
- on CUDA (r1fit's MixedPrecisionPolicy) float32 weights are gathered, and computed with, in
  bfloat16, and gradients are reduce-scattered in float32;
- each GPU takes 1/N of a step's rows (prompts_per_step x num_generations): the micro-batches per
  update and the old/reference log-probs are per GPU, a generation chunk and a micro-batch are at
  most that share; every GPU encodes all of the step's prompts (their pixel values).
Unsharded sizes leave out dim-0 padding (under N - 1 rows per tensor).

Peak = what lives for the whole step + the largest phase. A phase's figure is its largest moment
(e.g. the start of a micro-batch's backward: all saved activations, the head's gradient buffer and
one chunk of logits), not the sum of everything it ever allocates; :class:`Plan` keeps the named
parts and the phases apart.

Not modelled: CUDA kernel workspaces beyond the constants below, and prompts longer than the prompt
estimate. Deliberately pessimistic: every completion is ``max_new_tokens`` long and batches are
padded (a padding mask makes SDPA repeat the KV heads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from r1fit.config import Config, ConfigError
from r1fit.memory.planner.facts import (
    ModelFacts,
    PromptShape,
    model_facts,
    prompt_shape,
    shard_elements,
)
from r1fit.memory.planner.formulas import (
    ADAPTER_BYTES,
    F32,
    GENERATION_LOGITS_F32,
    layer_backward_temp_per_token,
    layer_forward_temp_per_token,
    layer_saved_per_token,
    vision_block_saved_per_patch,
    vision_forward_temp_per_patch,
    vision_other_saved_per_patch,
)
from r1fit.units import format_bytes, parse_bytes

#: Headroom kept free of the budget: a plan "fits" when its peak is at most (1 - margin) x budget,
#: and the largest micro_batch / generation_batch are chosen the same way. It absorbs what the plan
#: does not model (allocator rounding, prompts longer than estimated, library workspaces).
SAFETY_MARGIN = 0.10
#: Budget when neither --device-memory nor memory.budget is given: an 80 GB A100/H100.
DEFAULT_DEVICE_MEMORY = "80GiB"
#: Device memory the CUDA context takes outside PyTorch's allocator (driver, kernels loaded
#: lazily, cuBLAS/cuDNN handles). Public reports put it at 0.5-1 GiB on A100/H100 with CUDA 12;
#: not measured here (no GPU on the development machine). 0 on CPU.
CUDA_CONTEXT_BYTES = 768 << 20
#: Reserved-but-unallocated memory the caching allocator holds at the peak, as a fraction of the
#: allocated peak. r1fit turns on expandable segments, which keeps this small; 5% is an estimate,
#: not a measurement. 0 on CPU (the plan there is live tensor bytes, what the probe measures).
CUDA_ALLOCATOR_SLACK = 0.05

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
PARTS = ("weights", "gradients", "optimizer", "reference", "all_gather", "reduce_scatter",
         "activations", "logits_chunk", "vision", "unsharded_weights", "generation", "inputs",
         "overhead")
#: Parts that exist only under FSDP (--gpus > 1); 0, and not printed, on one GPU.
FSDP_PARTS = ("all_gather", "reduce_scatter", "unsharded_weights")

@dataclass
class Plan:
    """A prediction of one GRPO step's peak memory per device. Sizes are bytes.

    ``parts`` (names in ``PARTS``): weights; gradients (trainable parameters); optimizer (AdamW
    states); reference (the frozen copy for a KL term under full fine-tuning) - the four are one
    GPU's FSDP shards with ``gpus > 1``; all_gather (FSDP: the root's gathered parameters and two
    units'); reduce_scatter (FSDP: one unit's gradients copied for the reduce-scatter);
    unsharded_weights (FSDP: the whole policy, gathered for generation); activations (what
    one training micro-batch keeps for backward, as memory.gradient_checkpointing says, with the
    layer a checkpointed backward rebuilds); logits_chunk (the LM head's temporaries: one chunk
    of float32 logits, the head's gradient buffer); vision (the vision tower's activations for one
    micro-batch's images); generation (KV cache and sampling logits of one generation chunk, or
    its prefill if larger); inputs (pixel values the step holds); overhead (CUDA context and
    allocator slack; 0 on CPU). Parts do not add up to the peak: ``phases`` gives each phase's
    peak (persistent parts + the phase's largest moment + overhead), and the largest is
    ``peak_bytes``. ``fits``: the peak is within the budget less ``SAFETY_MARGIN``; the two
    ``max_*`` sizes are the largest that fit the same way (0: not even 1).
    """

    parts: dict[str, int]
    peak_bytes: int
    budget_bytes: int
    fits: bool
    max_micro_batch: int
    max_generation_batch: int
    advice: list[str]
    phases: dict[str, int] = field(default_factory=dict)  # each phase's peak, whole device
    peak_phase: str = ""
    activations_by_checkpointing: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def usable_bytes(self) -> int:
        return int(self.budget_bytes * (1 - SAFETY_MARGIN))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["usable_bytes"] = self.usable_bytes
        out["safety_margin"] = SAFETY_MARGIN
        return out


@dataclass(frozen=True)
class _Sizes:
    """The run's settings the phases depend on, for one GPU."""

    rows: int  # of a step, on this GPU
    gpus: int
    micro: int
    generation: int
    checkpointing: bool


def plan_memory(cfg: Config, *, device_memory_bytes: int | None = None, device_type: str = "cuda",
                gpus: int = 1) -> Plan:
    """Predict the peak memory per device of one GRPO step of ``cfg``.

    ``device_memory_bytes``: the budget (default ``memory.budget``, else 80 GiB). ``device_type``:
    ``"cpu"`` drops the CUDA context and allocator slack, giving live tensor bytes (what
    r1fit.memory.probe measures). ``gpus``: the GPUs of a torchrun job; with more than one the
    model is sharded by FSDP2 and the plan is for one of them (see the module docstring).
    """
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"device type: got {device_type!r}, expected 'cuda' or 'cpu'")
    if gpus < 1:
        raise ConfigError(f"--gpus: got {gpus}, expected a number >= 1")
    if device_memory_bytes is None:
        device_memory_bytes = parse_bytes(cfg.memory.budget or DEFAULT_DEVICE_MEMORY)
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    prompt = prompt_shape(cfg, facts)
    rows = cfg.train.prompts_per_step * cfg.algo.num_generations
    local = -(-rows // gpus)  # the step's rows are split evenly over the GPUs
    micro, generation = cfg.memory.micro_batch, cfg.memory.generation_batch
    sizes = _Sizes(rows=local, gpus=gpus, micro=local if micro == "auto" else min(micro, local),
                   generation=local if generation == "auto" else min(generation, local),
                   checkpointing=cfg.memory.gradient_checkpointing)
    notes = []
    if gpus > 1:
        notes.append(f"per GPU, FSDP2 over {gpus} GPUs: weights, gradients, AdamW states and the "
                     f"reference are 1/{gpus} shards; each GPU takes {local} of the {rows} rows "
                     "of a step; generation gathers the whole policy")
    if device_type == "cpu":
        notes.append("cpu: the plan is live tensor bytes; the process's RSS adds the Python heap "
                     "and libraries (memory.budget caps RSS over the pre-load baseline)")
    usable = int(device_memory_bytes * (1 - SAFETY_MARGIN))
    # each search moves one size; the phase it looks at does not depend on the other size
    max_micro = _largest(lambda m: _estimate(facts, cfg, prompt, replace(sizes, micro=m),
                                             device_type).update_peak, local, usable)
    max_gen = _largest(lambda g: _estimate(facts, cfg, prompt, replace(sizes, generation=g),
                                           device_type).generation_peak, local, usable)
    if micro == "auto":  # plan the run with what 'auto' will pick
        sizes = replace(sizes, micro=max(1, max_micro))
    if generation == "auto":
        sizes = replace(sizes, generation=max(1, max_gen))
    est = _estimate(facts, cfg, prompt, sizes, device_type)
    plan = Plan(parts=est.parts, peak_bytes=est.peak, budget_bytes=device_memory_bytes,
                fits=est.peak <= usable, max_micro_batch=max_micro,
                max_generation_batch=max_gen, advice=[], phases=est.phases,
                peak_phase=max(est.phases, key=est.phases.__getitem__),
                activations_by_checkpointing=est.activations_by_checkpointing,
                details={**est.details, "device_type": device_type, "gpus": gpus,
                         "prompt_tokens": prompt.tokens, "image_tokens": prompt.image_tokens,
                         "vision_patches": prompt.patches, "prompt_estimate": prompt.how,
                         "rows_per_step": rows, "rows_per_gpu": local,
                         "micro_batch": sizes.micro,
                         "generation_batch": sizes.generation,
                         "auto": [k for k, x in (("micro_batch", micro),
                                                 ("generation_batch", generation)) if x == "auto"]},
                notes=notes)
    plan.advice = _advice(plan, facts, cfg, prompt, sizes, device_type, usable)
    return plan


def predict_peak(cfg: Config, *, device_type: str = "cuda") -> int:
    """The predicted peak bytes of one GRPO step on one device (what a probe should measure)."""
    return plan_memory(cfg, device_type=device_type).peak_bytes


def _largest(peak_at: Any, rows: int, usable: int) -> int:
    """Largest size in [1, rows] whose peak fits ``usable`` (peaks grow with size); 0 if none."""
    if peak_at(1) > usable:
        return 0
    low, high = 1, rows
    while low < high:
        mid = (low + high + 1) // 2
        if peak_at(mid) <= usable:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class _Estimate:
    parts: dict[str, int]
    phases: dict[str, int]
    peak: int
    update_peak: int  # the peak of the micro-batch phases alone (log-probs, update)
    generation_peak: int
    activations_by_checkpointing: dict[str, int]
    details: dict[str, Any]


def _estimate(f: ModelFacts, cfg: Config, prompt: PromptShape, s: _Sizes,
              device_type: str) -> _Estimate:
    t, v = f.text, f.vision
    dtype = f.config_dtype if cfg.model.dtype == "auto" else cfg.model.dtype
    b = _DTYPE_BYTES.get(dtype, 4)
    lora = cfg.model.lora.r > 0
    r = cfg.model.lora.r
    algo = cfg.algo
    H, V = t.hidden, t.vocab

    # --- for the whole run: weights, gradients (during updates), AdamW states, reference; on
    # one GPU of several, each tensor's FSDP2 shard (on one GPU: the whole tensor)
    gpus = s.gpus
    frozen_vision = not lora and cfg.model.freeze_vision
    model_shard = shard_elements(f.param_shapes, gpus) * b
    adapter_shard = 0
    if lora:  # lora_A [r x in], lora_B [out x r]
        adapter_shard = ADAPTER_BYTES * sum(-(-r // gpus) * i + -(-o // gpus) * r
                                            for i, o in f.lora_linears)
    weights = model_shard + adapter_shard
    if lora:
        trainable, trainable_tensors = adapter_shard, 2 * f.lora_layers
    else:
        trainable = model_shard - (shard_elements(f.vision_param_shapes, gpus) * b
                                   if frozen_vision else 0)
        trainable_tensors = f.param_tensors - (f.vision_param_tensors if frozen_vision else 0)
    gradients = trainable
    # AdamW: exp_avg and exp_avg_sq in the parameter dtype, plus a float32 step count per tensor
    optimizer = 2 * trainable + F32 * trainable_tensors
    # full fine-tuning with a KL term keeps a frozen copy; LoRA's reference is the policy with
    # its adapters off; beta = 0 loads none
    reference = model_shard if (algo.beta > 0 and not lora) else 0

    # --- FSDP (gpus > 1), set up as r1fit/distributed/parallelize.py does: on CUDA, weights
    # stored in float32 are gathered, and computed with, in bfloat16, and gradients are
    # reduce-scattered in float32; on CPU nothing is cast
    fsdp, cuda = gpus > 1, device_type == "cuda"
    if fsdp and cuda and b == F32:
        b = 2  # from here on, b is the dtype of gathered weights and of the computation
    gathered_adapter = b if fsdp and cuda and dtype == "float32" else ADAPTER_BYTES
    layer_unit = f.layer_params * b + (r * f.layer_lora_in_plus_out * gathered_adapter
                                       if lora else 0)
    block_unit, root_unit = f.vision_block_params * b, f.root_params * b
    # the root stays gathered from its pre-forward to its post-backward; a unit and its
    # all-gather output (forward), or a unit and the next one prefetched (backward)
    all_gather = root_unit + 2 * max(layer_unit, block_unit) if fsdp else 0
    # elements and bytes of each unit's unsharded gradients
    if lora:
        grads = [(r * f.layer_lora_in_plus_out, gathered_adapter)]
    else:
        grads = [(f.layer_params, b),
                 (0 if cfg.model.freeze_vision else f.vision_block_params, b),
                 (f.root_params - (f.root_vision_params if frozen_vision else 0), b)]
    layer_grad = grads[0][0] * grads[0][1]
    root_grad = grads[2][0] * grads[2][1] if fsdp and not lora else 0
    # reduce-scatter's input: a copy of one unit's unsharded gradients, made while they exist
    reduce_scatter = max(x * (F32 if cuda else bytes_) for x, bytes_ in grads) if fsdp else 0
    # generation: every unit gathered whole, beside the shards (which FSDP2 keeps)
    unsharded_weights = 0
    if fsdp:
        unsharded_weights = f.params * b + (r * f.lora_in_plus_out * gathered_adapter
                                            if lora else 0)

    # --- shapes of the step
    P, M = prompt.tokens, algo.max_new_tokens
    T = P + M
    patches = prompt.patches if v is not None else 0
    vision_trains = v is not None and not lora and not cfg.model.freeze_vision
    head_trains = not lora
    pixels = (lambda n: n * patches * v.pixels_per_patch * F32) if v is not None else (lambda n: 0)
    eager = T if cfg.model.attn_implementation == "eager" else 0
    # the step keeps every prompt's pixel values (each GPU encodes all of the step's prompts), and
    # the old/reference log-probs of its rows [rows x M]
    step_inputs = pixels(cfg.train.prompts_per_step) + 2 * s.rows * M * F32

    def kv_cache(rows: int, length: int) -> int:
        return rows * length * t.layers * 2 * t.kv_dim * b

    def vision_forward(rows: int) -> int:  # no-grad vision tower over ``rows`` prompts' images
        if v is None or not patches:
            return 0
        n = rows * patches
        copy = n * v.pixels_per_patch * b if b != F32 else 0  # pixel_values.type(model dtype)
        return copy + n * (vision_forward_temp_per_patch(v, b) + b * v.hidden)

    def lm_forward(rows: int, length: int) -> int:  # no-grad layers
        per_token = (layer_forward_temp_per_token(t, b) + b * H  # inputs_embeds stays referenced
                     + 2 * b * t.head_dim)  # rotary cos/sin shared by the layers
        mask = rows * length * length * (1 + b)  # the boolean mask, one layer's float copy
        eager_scores = rows * t.heads * length * length * (F32 + b) if eager else 0
        return rows * length * per_token + mask + eager_scores

    def chunk_forward(c: int) -> int:
        # _ChunkedLogprobs.forward: a float32 [chunk x vocab] logits tensor and logsumexp's
        # (logits - max) temporary of the same size (a bf16 matmul output is freed before that)
        return 2 * c * V * F32

    def chunk_backward(c: int) -> int:
        # the recomputed float32 chunk, turned into d logp / d logits in place; for a bf16 model
        # its bf16 copy coexists for a moment
        return c * V * (F32 + (b if b != F32 else 0))

    # --- generation: generation_batch rows, KV cache on, no gradients
    g = s.generation
    # the vision tower runs after the text embeddings exist, and its output is merged into them
    prefill_vision = vision_forward(g) + g * (P + prompt.image_tokens) * H * b
    prefill = kv_cache(g, P) + lm_forward(g, P)
    sampling = GENERATION_LOGITS_F32 + (algo.temperature != 1.0) + 4 * (algo.top_p < 1.0)
    decode = (kv_cache(g, T) + g * T * t.kv_dim * b  # torch.cat grows one layer's K (or V)
              + g * V * (b + sampling * F32 + 1))  # + the model's logits and a bool mask
    generation = pixels(g) + max(prefill_vision, prefill, decode)
    # gathering the policy before generate: every unit's all-gather at once (the whole policy in
    # flat buffers), then each unit copied out of its buffer, which is freed: one unit more at most
    gathering = max(layer_unit, block_unit, root_unit) if fsdp else 0

    # --- micro-batches: log-probs (no grad) and the update
    m = s.micro
    tokens = m * T
    n_completion = m * M
    c = min(cfg.memory.logits_chunk, n_completion)
    head_input = n_completion * H * b  # hidden[mask]: the chunked head's saved input
    logprob_head = tokens * H * b + head_input + chunk_forward(c)  # + the backbone's output
    logprobs = pixels(m) + all_gather + max(vision_forward(m), lm_forward(m, T), logprob_head)
    has_logprobs = algo.beta > 0 or algo.num_iterations > 1

    targets = f.lora_targets if lora else None
    layer = layer_saved_per_token(t, b, lora_targets=targets, lora_r=r, mask_len=T, eager_len=eager)
    outside = (2 * b * t.head_dim  # rotary cos/sin, alive for every layer
               + F32 * H + F32 + (b * H if head_trains else 0))  # the final norm
    mask = m * T * T  # the boolean padding mask, shared by the layers
    activations_off = tokens * (t.layers * layer + outside) + head_input + mask
    recompute = tokens * layer  # checkpointing: one layer's activations rebuilt in backward
    activations_on = tokens * (t.layers * b * H + outside) + head_input + mask + recompute
    activations = activations_on if s.checkpointing else activations_off
    saved_lm = activations - (recompute if s.checkpointing else 0)

    if vision_trains and patches:
        n = m * patches
        block = vision_block_saved_per_patch(v, b)
        blocks = v.depth * (b * v.hidden if s.checkpointing else block)
        vision = n * (blocks + vision_other_saved_per_patch(v, b))
        vision_peak = vision + (n * block if s.checkpointing else 0)  # a block recomputed
    else:
        vision = vision_peak = vision_forward(m)  # transient, before the language model runs
    vision_saved = vision if vision_trains else 0

    accumulating = -(-s.rows // m) > 1  # from the second micro-batch on, every .grad exists
    grads_before = gradients if accumulating else 0
    head_grad = V * H * b if head_trains else 0  # grad_weight = zeros_like(head.weight)
    logits_chunk = max(tokens * H * b + chunk_forward(c),  # + the backbone's output, still held
                       head_grad + n_completion * H * b + chunk_backward(c))  # + grad of hidden
    # FSDP: the root keeps the LM head's unsharded gradient from the head's backward to the end
    head_held = V * H * b if fsdp and head_trains else 0
    if fsdp:  # the unit's own unsharded gradients, fresh each micro-batch, + reduce-scatter
        layer_backward = (tokens * layer_backward_temp_per_token(t, b) + layer_grad
                          + reduce_scatter + head_held)
        # the root's post-backward: its gathered weights and gradients (the embedding's dense
        # [vocab x hidden] one included), and their reduce-scatter copy
        end = root_unit + root_grad + reduce_scatter
    else:
        layer_backward = tokens * layer_backward_temp_per_token(t, b) + (
            f.largest_layer_weight * b if (accumulating and not lora) else 0)  # weight grad, +=
        # the embedding's dense [vocab x hidden] gradient, added into an existing .grad
        end = V * H * b if head_trains and (accumulating or f.tied_head) else 0
    base = grads_before + pixels(m) + vision_saved + all_gather
    update = max(
        # vision tower (its backward, or no-grad forward)
        grads_before + pixels(m) + all_gather + vision_peak
        + (reduce_scatter + head_held if vision_trains else 0),
        base + saved_lm + logits_chunk,  # head: forward chunk or the start of backward
        base + saved_lm + (recompute if s.checkpointing else 0) + layer_backward,
        gradients + pixels(m) + end)  # the end of backward

    persistent = weights + optimizer + reference + step_inputs
    phases = {"generation": persistent + unsharded_weights + max(generation, gathering),
              "update": persistent + update}
    if has_logprobs:
        phases["log-probs"] = persistent + logprobs
    allocated = max(phases.values())

    def overhead(peak: int) -> int:
        return (CUDA_CONTEXT_BYTES + int(CUDA_ALLOCATOR_SLACK * peak)) if cuda else 0

    phases = {k: x + overhead(x) for k, x in phases.items()}
    parts = {"weights": weights, "gradients": gradients, "optimizer": optimizer,
             "reference": reference, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
             "activations": activations, "logits_chunk": logits_chunk, "vision": vision,
             "unsharded_weights": unsharded_weights, "generation": generation,
             "inputs": step_inputs + pixels(max(m, g)), "overhead": overhead(allocated)}
    micro_phases = [phases["update"]] + ([phases["log-probs"]] if has_logprobs else [])
    return _Estimate(
        parts=parts, phases=phases, peak=max(phases.values()), update_peak=max(micro_phases),
        generation_peak=phases["generation"],
        activations_by_checkpointing={"on": activations_on, "off": activations_off},
        details={"dtype": dtype, "params": f.params,
                 "trainable_params": trainable // (ADAPTER_BYTES if lora else b),
                 "kv_cache": kv_cache(g, T), "logits_chunk_tokens": c,
                 "micro_batches_per_update": -(-s.rows // m), "persistent": persistent,
                 "fsdp_units": {"decoder_layer": layer_unit, "vision_block": block_unit,
                                "root": root_unit} if fsdp else {}})


def _advice(plan: Plan, facts: ModelFacts, cfg: Config, prompt: PromptShape, sizes: _Sizes,
            device_type: str, usable: int) -> list[str]:
    """What to change: smaller chunks when they are the problem, else the switches that would
    make micro_batch = generation_batch = 1 fit (each tried alone)."""
    out = []
    if 0 < plan.max_micro_batch < sizes.micro:
        out.append(f"memory.micro_batch={plan.max_micro_batch} (now {sizes.micro})")
    if 0 < plan.max_generation_batch < sizes.generation:
        out.append(f"memory.generation_batch={plan.max_generation_batch} "
                   f"(now {sizes.generation})")
    if plan.max_micro_batch and plan.max_generation_batch:
        return out
    switches: list[dict[str, Any]] = []  # each tried alone: one or two keys set together
    if not cfg.memory.gradient_checkpointing:
        switches.append({"memory.gradient_checkpointing": True})
    if cfg.model.lora.r == 0:
        switches.append({"model.lora.r": 16})
        if facts.vision is not None and not cfg.model.freeze_vision:
            switches.append({"model.freeze_vision": True})
        if cfg.algo.beta > 0:  # no reference copy (offloading it is not implemented)
            switches.append({"algo.beta": 0})
    if prompt.patches and cfg.data.max_pixels >= 4 * 28 * 28:
        pixels = max(28 * 28, cfg.data.max_pixels // 4)
        switches.append({"data.max_pixels": pixels})
        if cfg.data.min_pixels > pixels:  # else the config is invalid (min_pixels > max_pixels)
            switches[-1]["data.min_pixels"] = pixels
    dtype = facts.config_dtype if cfg.model.dtype == "auto" else cfg.model.dtype
    if dtype == "float32" and device_type == "cuda":
        switches.append({"model.dtype": "bfloat16"})
    for switch in switches:
        changed = cfg.with_values({**switch, "memory.micro_batch": 1,
                                   "memory.generation_batch": 1})
        p = prompt_shape(changed, facts) if any(k.startswith("data.") for k in switch) else prompt
        f = model_facts(changed.model.path, changed.model.lora.target)
        est = _estimate(f, changed, p, replace(sizes, micro=1, generation=1,
                                               checkpointing=changed.memory.gradient_checkpointing),
                        device_type)
        verdict = "fits" if est.peak <= usable else "still does not fit"
        keys = " ".join(f"{key}={_shown(value)}" for key, value in switch.items())
        out.append(f"{keys}: peak {format_bytes(est.peak)} at micro_batch = "
                   f"generation_batch = 1 ({verdict})")
    if not switches:
        out.append("nothing left to switch: use a device with more memory or a smaller model")
    return out


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
