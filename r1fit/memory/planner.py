"""The memory planner: the peak memory per device of one GRPO step, predicted before launch.

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

The per-token byte counts were derived from the transformers Qwen2-VL / Qwen2.5-VL code (which
tensors autograd saves, which temporaries coexist) and are checked tensor by tensor against
saved-tensor hooks on CPU, float32 and bfloat16, full fine-tuning and LoRA
(tests/memory/test_planner.py); whole steps are checked against the probe's measurement by
benchmarks/plan_accuracy.py. Other architectures get the same formulas, as an estimate. On CUDA,
SDPA's flash and memory-efficient kernels are assumed to save what the CPU kernel saves (q, k, v,
output, log-sum-exp). Not modelled: CUDA kernel workspaces beyond the constants below, and prompts
longer than the prompt estimate. Deliberately pessimistic: every completion is ``max_new_tokens``
long and batches are padded (a padding mask makes SDPA repeat the KV heads).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from r1fit.config import Config, ConfigError
from r1fit.units import format_bytes, parse_bytes

log = logging.getLogger("r1fit.memory")

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
#: Question tokens assumed for JSONL data, whose questions are unknown at plan time: typical VQA
#: and grounding questions are 10-40 tokens.
QUESTION_TOKENS = 64
#: When the model folder has no processor (a bare config.json): tokens of Qwen's chat-template
#: framing around the question, including its default system message, and characters per token
#: of an English system prompt.
CHAT_TEMPLATE_TOKENS = 21
CHARS_PER_TOKEN = 4
#: Bytes per LoRA parameter: peft keeps adapter weights in float32 even on a bf16/fp16 model
#: (``autocast_adapter_dtype``), and so are their gradients and AdamW states.
ADAPTER_BYTES = 4
#: float32 [rows x vocab] tensors alive together in one sampling step of ``generate`` (measured
#: on CPU): this step's float32 copy of the last logits and the suppress-tokens processor's output,
#: plus the previous step's scores and softmax, still referenced until they are reassigned. A
#: temperature other than 1 adds one more (its division), top_p < 1 about four (sorted values,
#: int64 indices, cumulative sum): read from transformers' logits processors, not measured.
GENERATION_LOGITS_F32 = 4
#: Shapes questions sampled to find the longest builtin:shapes prompt.
SHAPES_SAMPLES = 16

F32 = 4
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
PARTS = ("weights", "gradients", "optimizer", "reference", "all_gather", "reduce_scatter",
         "activations", "logits_chunk", "vision", "unsharded_weights", "generation", "inputs",
         "overhead")
#: Parts that exist only under FSDP (--gpus > 1); 0, and not printed, on one GPU.
FSDP_PARTS = ("all_gather", "reduce_scatter", "unsharded_weights")


@dataclass(frozen=True)
class TextDims:
    """The language model's shape, from the model config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's shape (Qwen2-VL / Qwen2.5-VL layout)."""

    hidden: int
    intermediate: int
    depth: int
    heads: int
    pixels_per_patch: int  # channels x temporal patch x patch x patch (1176 for Qwen)
    merge: int  # spatial merge: merge x merge patches become one LM token
    rms_norm: bool  # Qwen2.5-VL: RMSNorm; Qwen2-VL: LayerNorm
    gated_mlp: bool  # Qwen2.5-VL: SiLU-gated MLP (3 linears); Qwen2-VL: fc1 -> GELU -> fc2


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads off the meta model; independent of the run's settings."""

    name: str
    config_dtype: str
    params: int
    param_tensors: int
    vision_params: int
    vision_param_tensors: int
    tied_head: bool
    largest_layer_weight: int  # elements of the biggest Linear in a decoder layer
    lora_in_plus_out: int  # sum of (in + out) over the Linears model.lora.target selects
    lora_layers: int  # how many Linears it selects
    lora_targets: tuple[str, ...]  # their names within one decoder layer (q_proj, ...)
    text: TextDims
    vision: VisionDims | None
    # for FSDP2, which shards every tensor along dim 0: (size(0), numel) of each parameter, the
    # vision tower's apart; (in, out) of each Linear LoRA adapts
    param_shapes: tuple[tuple[int, int], ...]
    vision_param_shapes: tuple[tuple[int, int], ...]
    lora_linears: tuple[tuple[int, int], ...]
    # FSDP units (elements): the largest decoder layer, the largest vision block, and the root's
    # own parameters (everything else: embeddings, head, final norm, vision patch embed/merger)
    layer_params: int
    layer_lora_in_plus_out: int  # sum of (in + out) over the adapted Linears of one layer
    vision_block_params: int
    root_params: int
    root_vision_params: int  # of which the vision tower's (patch embedding, merger)
    processor: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PromptShape:
    tokens: int  # one prompt, images included
    image_tokens: int
    patches: int  # vision-encoder patches of one prompt's images
    how: str


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


# ---------------------------------------------------------------------------------------------
# the model and the prompt


def model_facts(path: str, lora_target: str = "all-linear") -> ModelFacts:
    """Shapes and parameter counts of ``model.path`` (a folder, builtin:NAME, or a hub id in the
    local Hugging Face cache), from a model built on the meta device."""
    source = _model_source(path)
    return _facts(source, path, lora_target)


def _model_source(path: str) -> str:
    from r1fit.models.load import resolve_model_path

    return resolve_model_path(path)  # builtin:NAME -> its folder (built on first use)


@functools.lru_cache(maxsize=16)
def _facts(source: str, path: str, lora_target: str) -> ModelFacts:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForImageTextToText

    from r1fit.models.load import ModelConfigError, language_model_lora_regex, vision_tower

    regex = re.compile(language_model_lora_regex(lora_target))
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelConfigError(
            f"cannot plan for {path!r}: not a local folder, and its config.json is not in the "
            "Hugging Face cache; point model.path at a folder holding config.json (the planner "
            "reads no weights)") from err
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelConfigError(f"cannot build {path!r} from its config: "
                               f"{' '.join(str(err).split())}") from err
    text_cfg = getattr(config, "text_config", config)
    heads = text_cfg.num_attention_heads
    text = TextDims(hidden=text_cfg.hidden_size, intermediate=text_cfg.intermediate_size,
                    layers=text_cfg.num_hidden_layers, heads=heads,
                    kv_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
                    head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
                    vocab=text_cfg.vocab_size)
    params = list(model.parameters())  # unique: a tied head is counted once
    visual = vision_tower(model)
    vision_params = list(visual.parameters()) if visual is not None else []
    layers, blocks = _fsdp_units(model, visual)
    in_layer_0 = {id(m) for m in layers[0].modules()} if layers else set()
    lora_linears: list[tuple[int, int]] = []
    lora_layer_0 = 0
    targets: set[str] = set()
    largest = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if ".layers.0." in name and "language_model" in name:
            largest = max(largest, module.in_features * module.out_features)
        if regex.fullmatch(name):
            lora_linears.append((module.in_features, module.out_features))
            lora_layer_0 += (module.in_features + module.out_features) * (id(module) in in_layer_0)
            targets.add(name.rsplit(".", 1)[-1])
    layer_sizes = [_numel(unit.parameters()) for unit in layers]
    block_sizes = [_numel(unit.parameters()) for unit in blocks]
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return ModelFacts(
        name=path, config_dtype=str(dtype).replace("torch.", ""),
        params=_numel(params), param_tensors=len(params),
        vision_params=_numel(vision_params),
        vision_param_tensors=len(vision_params),
        tied_head=head is not None and embed is not None and head.weight is embed.weight,
        largest_layer_weight=largest,
        lora_in_plus_out=sum(i + o for i, o in lora_linears), lora_layers=len(lora_linears),
        lora_targets=tuple(sorted(targets)), text=text, vision=vision_dims(config, visual),
        param_shapes=_shapes(params), vision_param_shapes=_shapes(vision_params),
        lora_linears=tuple(lora_linears), layer_params=max(layer_sizes, default=0),
        layer_lora_in_plus_out=lora_layer_0, vision_block_params=max(block_sizes, default=0),
        root_params=_numel(params) - sum(layer_sizes) - sum(block_sizes),
        root_vision_params=_numel(vision_params) - sum(block_sizes),
        processor=_processor(source))


def _fsdp_units(model: Any, visual: Any) -> tuple[list[Any], list[Any]]:
    """The modules r1fit's FSDP2 shards one by one (r1fit.distributed.parallelize.shard_units:
    instances of the model's ``_no_split_modules``), as (decoder layers, vision blocks); the root
    takes the rest."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    in_vision = {id(m) for m in visual.modules()} if visual is not None else set()
    units = [m for m in model.modules() if type(m).__name__ in names]
    return ([m for m in units if id(m) not in in_vision], [m for m in units if id(m) in in_vision])


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def _shapes(params: list[Any]) -> tuple[tuple[int, int], ...]:
    """(size(0), numel) of each tensor; a 0-d (or empty) tensor counts as one row."""
    return tuple((max(p.shape[0] if p.dim() else 1, 1), p.numel()) for p in params)


def shard_elements(shapes: Any, n: int) -> int:
    """Elements of the largest FSDP2 shard of tensors of these (size(0), numel) over ``n`` GPUs:
    FSDP2 chunks each tensor along dim 0 (torch.chunk) and pads every rank's piece to the first,
    ``ceil(rows / n)`` rows."""
    return sum(-(-rows // n) * (numel // rows) for rows, numel in shapes)


def vision_dims(config: Any, visual: Any) -> VisionDims | None:
    vc = getattr(config, "vision_config", None)
    if vc is None or visual is None:
        return None
    # Qwen2-VL calls the block width embed_dim (its hidden_size is the merger's output width)
    hidden = getattr(vc, "embed_dim", None) or vc.hidden_size
    intermediate = (getattr(vc, "intermediate_size", None)
                    or int(hidden * getattr(vc, "mlp_ratio", 4)))
    block = visual.blocks[0] if hasattr(visual, "blocks") else None
    patch = getattr(vc, "patch_size", 14)
    return VisionDims(
        hidden=hidden, intermediate=intermediate, depth=getattr(vc, "depth", 0),
        heads=getattr(vc, "num_heads", 16),
        pixels_per_patch=(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3))
        * getattr(vc, "temporal_patch_size", 2) * patch * patch,
        merge=getattr(vc, "spatial_merge_size", 2),
        rms_norm=block is None or "RMSNorm" in type(getattr(block, "norm1", None)).__name__,
        gated_mlp=block is None or hasattr(getattr(block, "mlp", None), "gate_proj"))


def _processor(source: str) -> Any:
    """The model's processor when its files are at hand (builtins, full model folders, the HF
    cache); None for a bare config.json."""
    from transformers import AutoProcessor

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoProcessor.from_pretrained(source, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "no processor": fall back to estimates
        return None


def prompt_shape(cfg: Config, facts: ModelFacts) -> PromptShape:
    """Tokens of the longest prompt the run will see: system prompt + question + images.

    With the model's processor, prompts are encoded for real (builtin:shapes: its own questions
    and images; JSONL: a blank image at ``data.max_pixels`` and ``QUESTION_TOKENS`` question
    tokens). Without one, the same is estimated from Qwen's 28 px per token.
    """
    d = cfg.data
    images = d.max_images if facts.vision is not None else 0
    shapes = d.train.startswith("builtin:")
    if facts.processor is not None:
        try:
            return _encoded_prompt(cfg, facts.processor, images, shapes)
        except Exception as err:  # noqa: BLE001 - e.g. a processor that is not Qwen-like
            log.debug("plan: encoding a prompt failed (%s); estimating instead", err)
    side = _image_side(cfg, shapes)
    merge = facts.vision.merge if facts.vision else 2
    unit = 14 * merge  # one LM token covers a 28 x 28 px square
    side = max(unit, round(side / unit) * unit)  # the processor rounds sides to whole tokens
    tokens_per_image = (side // unit) ** 2
    system = (math.ceil(len(d.system_prompt) / CHARS_PER_TOKEN) if d.system_prompt else 0)
    text = CHAT_TEMPLATE_TOKENS + system + QUESTION_TOKENS + 2 * images  # + vision start/end
    return PromptShape(tokens=text + images * tokens_per_image,
                       image_tokens=images * tokens_per_image,
                       patches=images * tokens_per_image * merge * merge,
                       how=f"estimated: {QUESTION_TOKENS} question tokens, "
                           f"{CHARS_PER_TOKEN} characters per system-prompt token")


def _image_side(cfg: Config, shapes: bool) -> int:
    """Side of the square image fitted to [min_pixels, max_pixels] (r1fit/data/images.py)."""
    d = cfg.data
    area = d.shapes.image_size ** 2 if shapes else d.max_pixels
    area = min(max(area, d.min_pixels), d.max_pixels)
    return max(28, math.isqrt(area))


def _encoded_prompt(cfg: Config, processor: Any, images: int, shapes: bool) -> PromptShape:
    from PIL import Image

    from r1fit.data.images import fit_pixel_budget
    from r1fit.data.sample import Sample
    from r1fit.data.batch import encode_prompts

    d = cfg.data
    if shapes:
        from r1fit.data.build import build_datasets

        dataset, _ = build_datasets(cfg.with_values({"data.eval": None,
                                                      "data.shapes.train_size": SHAPES_SAMPLES}))
        samples = [dataset[i] for i in range(len(dataset))]
        extra, how = 0, f"encoded by the model's processor ({d.train} questions and images)"
    else:
        side = _image_side(cfg, shapes=False)
        image = fit_pixel_budget(Image.new("RGB", (side, side)), d.min_pixels, d.max_pixels)
        samples = [Sample(images=[image] * images, problem="?", solution="", source="plan")]
        extra = QUESTION_TOKENS
        how = (f"encoded by the model's processor with {images} image(s) of {image.width}x"
               f"{image.height} px and {QUESTION_TOKENS} question tokens")
    best = max(encode_prompts(processor, samples, d.system_prompt), key=lambda p: p.length)
    grid = best.image_inputs.get("image_grid_thw")
    patches = int(grid.prod(-1).sum()) if grid is not None else 0
    merge = getattr(getattr(processor, "image_processor", None), "merge_size", 2)
    return PromptShape(tokens=best.length + extra, image_tokens=patches // (merge * merge),
                       patches=patches, how=how)


# ---------------------------------------------------------------------------------------------
# per-token bytes, read off the transformers Qwen2-VL / Qwen2.5-VL code


def layer_saved_per_token(t: TextDims, b: int, *, lora_targets: tuple[str, ...] | None = None,
                          lora_r: int = 0, mask_len: int = 0, eager_len: int = 0) -> int:
    """Bytes one decoder layer saves for backward per token (no checkpointing).

    ``b``: bytes of the model dtype. ``lora_targets``: None for full fine-tuning, else the adapted
    projections. ``mask_len``: the sequence length when a padding mask is present; SDPA then gets
    the KV heads repeated to all query heads (transformers' repeat_kv) and saves its own float
    copy of the boolean mask, one row of ``mask_len`` per token. ``eager_len``: the sequence
    length under eager attention. Checked against saved-tensor hooks (tests/memory).
    """
    H, I = t.hidden, t.intermediate
    kv = t.q_dim if mask_len and t.kv_heads < t.heads else t.kv_dim
    # SDPA (flash/efficient kernels) saves q, k, v, its output (which is also o_proj's input:
    # same storage) and a float32 log-sum-exp per head
    attn = b * (2 * t.q_dim + 2 * kv + mask_len) + F32 * t.heads
    if eager_len:  # eager attention also keeps the float32 softmax and its model-dtype copy
        attn += t.heads * eager_len * (F32 + b)
    # each RMSNorm saves its float32 input (the input itself in float32) and 1/rms
    norm = F32 * H + F32
    if lora_targets is None:
        # + the normalised value the trained norm weight multiplies, and the norm's output that
        # q/k/v (resp. gate/up) save; MLP: gate (SiLU input), SiLU output, up, their product
        return 2 * (norm + b * H) + 2 * b * H + attn + 4 * b * I
    saved = 2 * norm + attn + 3 * b * I  # frozen norm weights save nothing; gate, act, up
    groups = ((("q_proj", "k_proj", "v_proj"), H), (("o_proj",), t.q_dim),
              (("gate_proj", "up_proj"), H), (("down_proj",), I))
    for names, width in groups:
        hits = sum(name in lora_targets for name in names)
        if not hits:
            continue  # a frozen Linear saves nothing for its weight
        if ADAPTER_BYTES == b:
            # lora_A saves the input itself, shared by the layers reading it; o_proj's input is
            # SDPA's output, counted above
            saved += 0 if names == ("o_proj",) else b * width
        else:
            saved += ADAPTER_BYTES * width * hits  # peft casts the input to float32, per layer
    return saved + ADAPTER_BYTES * lora_r * len(lora_targets)  # lora_A outputs


def layer_forward_temp_per_token(t: TextDims, b: int) -> int:
    """Largest moment inside a decoder layer without autograd, per token: the MLP's SiLU output,
    up projection and their product next to the residual stream and the normed input, or the
    attention's projections, rotary copies and repeated KV heads."""
    H, I = t.hidden, t.intermediate
    mlp = b * (2 * H + 3 * I)
    attn = b * (2 * H + 4 * t.q_dim + 4 * t.kv_dim)
    return max(mlp, attn) + F32 * H  # + the RMSNorm's float32 square


def layer_backward_temp_per_token(t: TextDims, b: int) -> int:
    """Gradients alive inside a layer's backward: of the MLP product, SiLU output and up
    projection (3 x intermediate), plus the incoming and outgoing hidden gradients."""
    return b * (3 * t.intermediate + 2 * t.hidden)


def vision_block_saved_per_patch(v: VisionDims, b: int) -> int:
    """Bytes one vision block saves per patch when the tower trains (checked on Qwen2.5-VL and
    Qwen2-VL blocks): two norms, their outputs, q/k after the rotary embedding, v (a view that
    keeps the whole qkv output), the attention output and proj's input, the MLP."""
    h = v.hidden
    norm = (F32 * h + F32 + b * h) if v.rms_norm else (b * h + 2 * F32)
    mlp = (4 if v.gated_mlp else 3) * b * v.intermediate
    return 2 * norm + 2 * b * h + b * (2 * h + 3 * h + 2 * h) + F32 * v.heads + mlp


def vision_other_saved_per_patch(v: VisionDims, b: int) -> int:
    """Outside the blocks, per patch: the patch embedding's input (a model-dtype copy of the
    float32 pixel values; in float32 it is the batch's own tensor, counted with the inputs), the
    rotary cos/sin, and the merger (its norm, then its two Linears' inputs and the GELU's)."""
    h = v.hidden
    norm = (F32 * h + F32 + b * h) if v.rms_norm else (b * h + 2 * F32)
    pixels = b * v.pixels_per_patch if b != F32 else 0
    return pixels + 2 * F32 * (h // v.heads) + norm + 3 * b * h


def vision_forward_temp_per_patch(v: VisionDims, b: int) -> int:
    """Largest moment inside a vision block without autograd, per patch (MLP or attention with
    its float32 rotary copies)."""
    h = v.hidden
    mlp = b * (2 * h + 3 * v.intermediate)
    attn = b * (2 * h + 3 * h + h) + 4 * F32 * h
    return max(mlp, attn) + 2 * F32 * (h // v.heads)


# ---------------------------------------------------------------------------------------------
# the plan


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


# ---------------------------------------------------------------------------------------------
# printing

_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer (AdamW)",
           "reference": "reference model",
           "all_gather": "FSDP all-gather buffers (root + 2 units)",
           "reduce_scatter": "FSDP reduce-scatter buffer (one unit's gradients)",
           "activations": "activations (one micro-batch)", "logits_chunk": "LM head chunk",
           "vision": "vision encoder (one micro-batch)",
           "unsharded_weights": "FSDP unsharded weights (the whole policy)",
           "generation": "generation (KV cache + logits)", "inputs": "inputs (pixel values)",
           "overhead": "CUDA context + allocator slack"}
_WHEN = {"weights": "always", "gradients": "update", "optimizer": "always", "reference": "always",
         "all_gather": "log-probs, update", "reduce_scatter": "update",
         "activations": "update", "logits_chunk": "update", "vision": "update",
         "unsharded_weights": "generation", "generation": "generation", "inputs": "step",
         "overhead": "always"}


def render_blocks(plan: Plan, cfg: Config) -> list[Any]:
    """Lines and tables ``(headers, rows, right_aligned_columns)`` describing ``plan``."""
    d = plan.details
    mode = f"LoRA r={cfg.model.lora.r}" if cfg.model.lora.r else "full fine-tuning"
    ckpt = "on" if cfg.memory.gradient_checkpointing else "off"

    def auto(key: str) -> str:
        return " (auto)" if key in d["auto"] else ""

    gpus = d["gpus"]
    where = (f"per GPU, FSDP over {gpus} GPUs" if gpus > 1 else f"one {d['device_type']} device")
    per_gpu = f", {d['rows_per_gpu']} per GPU" if gpus > 1 else ""
    blocks: list[Any] = [
        (f"r1fit plan: {cfg.model.path} ({d['params'] / 1e9:.2f}B parameters, {d['dtype']}), "
         f"{mode}, {where}"),
        (f"  {d['rows_per_step']} rows per step ({cfg.train.prompts_per_step} prompts x "
         f"{cfg.algo.num_generations}{per_gpu}); prompt {d['prompt_tokens']} tokens "
         f"({d['image_tokens']} image), completion up to {cfg.algo.max_new_tokens}"),
        f"  prompt {d['prompt_estimate']}",
        (f"  micro_batch {d['micro_batch']}{auto('micro_batch')} "
         f"({d['micro_batches_per_update']} per update), generation_batch "
         f"{d['generation_batch']}{auto('generation_batch')}, gradient checkpointing {ckpt}"),
    ]
    blocks += [f"  note: {n}" for n in plan.notes]
    other = "off" if cfg.memory.gradient_checkpointing else "on"
    rows = []
    for name in PARTS:
        if name in FSDP_PARTS and gpus == 1:
            continue
        size = plan.parts[name]
        label = _LABELS[name]
        if gpus > 1 and name in ("weights", "gradients", "optimizer", "reference"):
            label += f", 1/{gpus} shard"
        if name == "activations":
            alternative = format_bytes(plan.activations_by_checkpointing[other])
            label += f" [checkpointing {other}: {alternative}]"
        rows.append((label, format_bytes(size), _WHEN[name]))
    blocks.append((("part", "size", "when"), rows, {1}))
    phase_rows = [(name + (" <- peak" if name == plan.peak_phase else ""), format_bytes(size))
                  for name, size in plan.phases.items()]
    blocks.append((("phase (whole device)", "peak"), phase_rows, {1}))
    verdict = "fits" if plan.fits else "does NOT fit"
    blocks.append(f"peak {format_bytes(plan.peak_bytes)} of {format_bytes(plan.budget_bytes)} "
                  f"(usable with a {SAFETY_MARGIN:.0%} margin: {format_bytes(plan.usable_bytes)}): "
                  f"{verdict}")
    rows = d["rows_per_gpu"]  # of a step, on one GPU
    of = " on a GPU" if gpus > 1 else ""
    blocks.append(f"largest memory.micro_batch that fits: "
                  f"{_size(plan.max_micro_batch, rows, of)}")
    blocks.append(f"largest memory.generation_batch that fits: "
                  f"{_size(plan.max_generation_batch, rows, of)}")
    if plan.advice:
        blocks.append("advice:")
        blocks += [f"  {a}" for a in plan.advice]
    return blocks


def _size(n: int, rows: int, of: str) -> str:
    if n == 0:
        return "none (even 1 does not fit)"
    return f"{n} (all {rows} rows of a step{of})" if n >= rows else str(n)


def render(plan: Plan, cfg: Config, *, rich: bool = False) -> None:
    """Print ``plan``: rich tables on a terminal, aligned plain text otherwise."""
    from r1fit.report.blocks import print_blocks

    print_blocks(render_blocks(plan, cfg), rich=rich)
