"""What the planner reads off the model and the data, before any of the run's memory settings:
the model's shapes and parameter counts from a build on the meta device (no weights are read or
allocated), its FSDP2 units and shard sizes, and the longest prompt the run will see."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from r1fit.config import Config

log = logging.getLogger("r1fit.memory")

#: Question tokens assumed for JSONL data, whose questions are unknown at plan time: typical VQA
#: and grounding questions are 10-40 tokens.
QUESTION_TOKENS = 64
#: When the model folder has no processor (a bare config.json): tokens of Qwen's chat-template
#: framing around the question, including its default system message, and characters per token
#: of an English system prompt.
CHAT_TEMPLATE_TOKENS = 21
CHARS_PER_TOKEN = 4
#: the model types whose image tokens have positions of their own rule (M-RoPE) and attend
#: causally, as the text does
M_ROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Shapes questions sampled to find the longest builtin:shapes prompt.
SHAPES_SAMPLES = 16


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
    hidden_norms: int = 2  # norms of the hidden state per decoder layer (Gemma 3: 4)
    head_norms: bool = False  # per-head q and k norms (Qwen3, Gemma 3)
    rotary_sets: int = 1  # rotary cos/sin tables (Gemma 3: one for sliding, one for global layers)
    #: some layers attend within a sliding window (Gemma 3): the static engine's shared-prompt
    #: layout does not apply
    sliding: bool = False
    #: a norm multiplies its weight in float32 (Gemma 3: ``(1 + weight.float())``), so the
    #: normalised value it saves for the weight's gradient is float32, not the model's dtype
    norm_weight_f32: bool = False

    def norm_product_bytes(self, b: int) -> int:
        """Bytes of an element of the normalised value a trained norm weight multiplies."""
        return 4 if self.norm_weight_f32 else b

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's shape, from its config and first block: a Qwen-VL-style tower (images
    at their own size, ``merge`` x ``merge`` patches per LM token) or a fixed-size one (Gemma 3's
    SigLIP: every image resized to ``image_size``, its patches pooled to ``tokens_per_image``)."""

    hidden: int
    intermediate: int
    depth: int
    heads: int
    pixels_per_patch: int  # channels x temporal patch x patch x patch (1176 for Qwen)
    merge: int  # spatial merge: merge x merge patches become one LM token
    rms_norm: bool  # Qwen2.5-VL: RMSNorm; Qwen2-VL, SigLIP: LayerNorm
    gated_mlp: bool  # Qwen2.5-VL: SiLU-gated MLP (3 linears); Qwen2-VL, SigLIP: fc1 -> GELU -> fc2
    patch: int = 14  # side of a patch in pixels
    image_size: int | None = None  # fixed-size towers: the side every image is resized to
    tokens_per_image: int | None = None  # fixed-size towers: LM tokens per image
    #: the patch embedding's convolution: (in channels, kernel size), () when the tower has none
    patch_conv: tuple[int, tuple[int, ...]] | tuple[()] = ()

    @property
    def patches_per_image(self) -> int | None:
        """A fixed-size tower's patches per image (None: they grow with the image)."""
        return (self.image_size // self.patch) ** 2 if self.image_size else None


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads off the meta model; independent of the run's settings."""

    name: str
    config_dtype: str  # what model.dtype=auto loads the weights in (from_pretrained's dtype="auto")
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
    image_token_id: int | None = None  # the placeholder the processor repeats once per image token
    config_dtype_from: str = "config.json"  # where config_dtype was read
    hub_config: str = ""  # for a hub id: the config.json read (r1fit's shipped copy, or the hub's)
    #: the layers transformers' activation checkpointing switches, in module order: "t" a decoder
    #: layer, "v" a vision block, "o" another
    checkpoint_order: str = ""
    #: the config's model_type (qwen2_5_vl, gemma3, ...): which engines run it
    model_type: str = ""

    @property
    def places_images(self) -> bool:
        """Whether the model places image tokens by its own position rule with causal attention
        (Qwen-VL's M-RoPE ``get_rope_index``), so the static engine appends a tool turn's image
        to a kept cache; Gemma 3's image tokens attend both ways, and such a turn is prefilled
        whole (r1fit/rollout/static_engine.py)."""
        return self.model_type in M_ROPE_MODEL_TYPES
    #: the input embedding's gradient can go into its .grad in place (a plain nn.Embedding:
    #: r1fit/algorithms/embedding.py)
    embedding_into_grad: bool = False
    #: the model's matrices as the FLOP count reads them (r1fit/memory/flops.py), for the time
    #: model; as built (no adapters, everything trainable)
    shape: Any = field(default=None, compare=False, repr=False)  # flops.ModelShape

    def checkpointed(self, every: int) -> tuple[int, int]:
        """(decoder layers, vision blocks) recomputed in backward when checkpointing is on with
        ``every_n_layers=every``: those whose index in ``checkpoint_order`` is a multiple of it.
        Without a recorded order (a model facts were made up for), every ``every``-th of each."""
        if not self.checkpoint_order:
            depth = self.vision.depth if self.vision is not None else 0
            return -(-self.text.layers // every), -(-depth // every)
        picked = self.checkpoint_order[::every]
        return picked.count("t"), picked.count("v")


@dataclass(frozen=True)
class PromptShape:
    tokens: int  # one prompt, images included
    image_tokens: int
    patches: int  # vision-encoder patches of one prompt's images
    how: str
    images: int = 0  # the prompt's images



def model_facts(path: str, lora_target: str = "all-linear") -> ModelFacts:
    """Shapes and parameter counts of ``model.path`` (a folder, builtin:NAME, or a hub id: the
    config.json r1fit ships for it, else that file alone from the hub or its cache), from a model
    built on the meta device."""
    from r1fit.models.load import config_folder, resolve_model_path

    # builtin:NAME -> its folder (built on first use); a hub id stays one (its weights, for a
    # config naming no dtype, and its processor may be in the Hugging Face cache)
    return _facts(config_folder(path), resolve_model_path(path), path, lora_target)


def prompts_in_rows(rows: int, group: int) -> int:
    """Distinct prompts among ``rows`` consecutive rows of a step whose rows come in groups of
    ``group`` (one more where the rows start inside a group)."""
    return min(rows, math.ceil(rows / group) + (1 if rows % group else 0))


def group_runs(start: int, end: int, group: int) -> list[int]:
    """The rows of each group that rows ``start .. end - 1`` of a step hold (groups of ``group``
    rows from row 0), in order: a chunk of 12 rows from row 12 in groups of 8 holds [4, 8]."""
    return [min(end, (g + 1) * group) - max(start, g * group)
            for g in range(start // group, (end - 1) // group + 1)] if end > start else []


def shares_prompt_cache(f: ModelFacts, cfg: Config) -> bool:
    """The static engine holds each prompt once for its group (rollout.static.share_prompt on,
    a model without sliding-window layers, single-turn rollouts)."""
    return bool(cfg.rollout.static.share_prompt) and not f.text.sliding and not cfg.tools


def run_dtype(cfg: Config, facts: ModelFacts) -> str:
    """The dtype the run holds the weights in: ``model.dtype``, or for 'auto' the checkpoint's."""
    return facts.config_dtype if cfg.model.dtype == "auto" else cfg.model.dtype


@functools.lru_cache(maxsize=16)
def _facts(source: str, checkpoint: str, path: str, lora_target: str) -> ModelFacts:
    """``source``: the folder of the config.json; ``checkpoint``: the folder or hub id
    from_pretrained loads the weights from."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForImageTextToText

    from r1fit.algorithms.embedding import embeds_into_grad
    from r1fit.memory.flops import ModelShape
    from r1fit.models.load import (
        ModelConfigError,
        checkpoint_dtype,
        language_model_lora_regex,
        load_failure,
        vision_tower,
    )

    regex = re.compile(language_model_lora_regex(lora_target))
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelConfigError(f"cannot plan for {path!r}: cannot read {source}/config.json: "
                               f"{' '.join(str(err).split())}") from err
    dtype, dtype_from = checkpoint_dtype(config, checkpoint)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelConfigError(load_failure("cannot plan for", path, err)) from err
    text_cfg = getattr(config, "text_config", config)
    heads = text_cfg.num_attention_heads
    text = TextDims(hidden=text_cfg.hidden_size, intermediate=text_cfg.intermediate_size,
                    layers=text_cfg.num_hidden_layers, heads=heads,
                    kv_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
                    head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
                    vocab=text_cfg.vocab_size)
    layers, blocks = _fsdp_units(model, visual := vision_tower(model))
    order = _checkpoint_order(model, layers, visual)
    kinds = set(getattr(text_cfg, "layer_types", None) or [])
    text = replace(text, **_layer_norms(layers[0] if layers else None, text),
                   rotary_sets=len(kinds or {None}), sliding=bool(kinds - {"full_attention"}))
    params = list(model.parameters())  # unique: a tied head is counted once
    vision_params = list(visual.parameters()) if visual is not None else []
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
    return ModelFacts(
        name=path, model_type=config.model_type,
        config_dtype=str(dtype).removeprefix("torch."), config_dtype_from=dtype_from,
        hub_config="" if source == checkpoint else os.path.join(source, "config.json"),
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
        processor=_processor(checkpoint), image_token_id=getattr(config, "image_token_id", None),
        checkpoint_order=order,
        embedding_into_grad=embed is not None and embeds_into_grad(embed),
        shape=ModelShape.of(model))


def _checkpoint_order(model: Any, layers: list[Any], visual: Any) -> str:
    """Kinds of the model's ``GradientCheckpointingLayer`` modules in module order, the order in
    which transformers' ``every_n_layers`` counts them: "t" decoder layer, "v" vision block,
    "o" other."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    text = {id(m) for m in layers}
    vision = {id(m) for m in visual.modules()} if visual is not None else set()
    return "".join("t" if id(m) in text else "v" if id(m) in vision else "o"
                   for m in model.modules() if isinstance(m, GradientCheckpointingLayer))


def _layer_norms(layer: Any, text: TextDims) -> dict[str, Any]:
    """How many norms of the hidden state a decoder layer has, and whether it norms q and k per
    head, counted on the (meta) layer: norm modules whose weight spans the hidden size, resp. the
    head size."""
    if layer is None:
        return {}
    norms = [m for m in layer.modules()
             if "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None]
    widths = [m.weight.shape[0] for m in norms]
    hidden = [m for m in norms if m.weight.shape[0] == text.hidden]
    return {"hidden_norms": len(hidden) or 2,
            "head_norms": any(w == text.head_dim for w in widths),
            "norm_weight_f32": bool(hidden) and _saves_float32_product(hidden[0])}


def _saves_float32_product(norm: Any) -> bool:
    """Whether ``norm`` (a meta module), run in bfloat16 with its weight trained, saves its
    normalised value in float32: a CPU copy is run on 4 tokens under saved-tensor hooks and the
    per-token bytes it saves compared with a float32 input copy, 1/rms and a bfloat16 product."""
    import copy

    import torch

    width = norm.weight.shape[0]
    try:
        module = copy.deepcopy(norm).to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(0.5)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[0] == 4:  # per-token tensors, not the weight
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.random.fork_rng(devices=[]):  # a run plans at start and after an OOM
            x = torch.randn(4, width, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
    except (RuntimeError, TypeError, ValueError):  # a norm that cannot run alone: the formula's
        return False
    return sum(saved.values()) // 4 > 4 * width + 4 + 2 * width


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
    """The vision tower's shape, read from its config (Qwen-VL and SigLIP names alike) and from
    its first block (the first of its longest ``ModuleList``) for the norm and MLP kinds."""
    vc = getattr(config, "vision_config", None)
    if vc is None or visual is None:
        return None
    # Qwen2-VL calls the block width embed_dim (its hidden_size is the merger's output width)
    hidden = getattr(vc, "embed_dim", None) or vc.hidden_size
    intermediate = (getattr(vc, "intermediate_size", None)
                    or int(hidden * getattr(vc, "mlp_ratio", 4)))
    block = _first_block(visual)
    patch = getattr(vc, "patch_size", 14)
    channels = (getattr(vc, "in_channels", None) or getattr(vc, "in_chans", None)
                or getattr(vc, "num_channels", 3))
    # a tower that takes every image at one size and pools its patches to a fixed number of LM
    # tokens (Gemma 3: SigLIP at image_size, mm_tokens_per_image); Qwen-VL towers have neither
    tokens_per_image = getattr(config, "mm_tokens_per_image", None)
    image_size = getattr(vc, "image_size", None) if tokens_per_image else None
    return VisionDims(
        hidden=hidden, intermediate=intermediate,
        depth=getattr(vc, "depth", None) or getattr(vc, "num_hidden_layers", 0),
        heads=getattr(vc, "num_heads", None) or getattr(vc, "num_attention_heads", 16),
        pixels_per_patch=channels * getattr(vc, "temporal_patch_size", 1) * patch * patch,
        merge=getattr(vc, "spatial_merge_size", 1),
        rms_norm=block is None or any("RMSNorm" in type(m).__name__ for m in block.modules()),
        gated_mlp=block is None or any(n.endswith("gate_proj") for n, _ in block.named_modules()),
        patch=patch, image_size=image_size, tokens_per_image=tokens_per_image,
        patch_conv=_patch_conv(visual))


def _patch_conv(visual: Any) -> tuple[int, tuple[int, ...]] | tuple[()]:
    """(in channels, kernel size) of the tower's first convolution, its patch embedding."""
    from torch import nn

    conv = next((m for m in visual.modules() if isinstance(m, nn.Conv2d | nn.Conv3d)), None)
    return () if conv is None else (int(conv.in_channels), tuple(int(k) for k in conv.kernel_size))


def _first_block(visual: Any) -> Any:
    """The first block of the tower: element 0 of its longest ``ModuleList`` (Qwen-VL's
    ``blocks``, SigLIP's ``encoder.layers``), or None."""
    from torch import nn

    lists = [m for m in visual.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=len)[0] if lists else None


def _processor(checkpoint: str) -> Any:
    """The model's processor when its files are at hand (builtins, full model folders, the HF
    cache); None for a bare config.json."""
    from transformers import AutoProcessor

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "no processor": fall back to estimates
        return None


def prompt_shape(cfg: Config, facts: ModelFacts) -> PromptShape:
    """Tokens of the longest prompt the run will see: system prompt + question + images.

    With the model's processor, prompts are encoded for real (builtin:shapes: its own questions
    and images; other data, whose rows are not read: a blank image at ``data.max_pixels`` and
    ``QUESTION_TOKENS`` question tokens). Without one, the same is estimated from the vision
    config: a fixed-size tower's patches and tokens per image, or one LM token per
    ``merge x merge`` patches of the fitted image (Qwen2.5-VL: 28 x 28 px).
    """
    d = cfg.data
    images = d.max_images if facts.vision is not None else 0
    shapes = d.train == "builtin:shapes"
    if facts.processor is not None:
        try:
            return _encoded_prompt(cfg, facts, images, shapes)
        except Exception as err:  # noqa: BLE001 - e.g. a processor that is not Qwen-like
            log.debug("plan: encoding a prompt failed (%s); estimating instead", err)
    tokens_per_image, patches_per_token = _image_estimate(cfg, facts.vision, shapes)
    system = (math.ceil(len(d.system_prompt) / CHARS_PER_TOKEN) if d.system_prompt else 0)
    text = CHAT_TEMPLATE_TOKENS + system + QUESTION_TOKENS + 2 * images  # + vision start/end
    return PromptShape(tokens=text + images * tokens_per_image,
                       image_tokens=images * tokens_per_image,
                       patches=round(images * tokens_per_image * patches_per_token),
                       how=f"estimated: {QUESTION_TOKENS} question tokens, "
                           f"{CHARS_PER_TOKEN} characters per system-prompt token",
                       images=images)


def _image_estimate(cfg: Config, v: VisionDims | None, shapes: bool) -> tuple[int, float]:
    """(LM tokens, patches per token) of one image estimated from the vision config: a
    fixed-size tower's, or one token per ``merge x merge`` patches of the image fitted to the
    budget (``shapes``: a builtin:shapes image; else one at ``data.max_pixels``)."""
    if v is not None and v.patches_per_image and v.tokens_per_image:  # every image at one size
        return v.tokens_per_image, v.patches_per_image / v.tokens_per_image
    merge, patch = (v.merge, v.patch) if v is not None else (2, 14)
    unit = patch * merge  # one LM token covers a unit x unit square (Qwen2.5-VL: 28 px)
    side = _image_side(cfg, shapes)
    side = max(unit, round(side / unit) * unit)  # the processor rounds sides to whole tokens
    return (side // unit) ** 2, merge * merge


def trajectory_patches(cfg: Config, facts: ModelFacts, prompt: PromptShape) -> int | None:
    """With tools: the vision patches of one trajectory's images, ``data.max_images`` images
    (the row's and the tools' together) at ``data.max_pixels`` each, estimated from the vision
    config, and never fewer than the prompt's own; None without tools (a row's images are its
    prompt's) or without a vision tower."""
    if not cfg.tools or facts.vision is None:
        return None
    tokens, patches_per_token = _image_estimate(cfg, facts.vision, shapes=False)
    return max(prompt.patches, cfg.data.max_images * round(tokens * patches_per_token))


@dataclass(frozen=True)
class ToolTurnShape:
    """A trajectory's turns as the time model takes them (with tools): ``turns`` policy turns
    (a mean over rows where measured: row k+1's turn runs for the fraction ``turns - k`` of
    rows, at most all), each tool turn ``text`` tokens of the template around its results and
    ``images`` images (a mean) of ``image_tokens`` tokens and ``image_patches`` vision patches
    each."""

    turns: float = 1.0
    text: int = 0
    images: float = 0.0
    image_tokens: int = 0
    image_patches: int = 0

    @property
    def tokens(self) -> float:
        """Tokens of one tool turn."""
        return self.text + self.images * self.image_tokens


#: tokens of a tool turn's framing when the model has no processor to encode it: Qwen's
#: <|im_end|>, a user turn of <tool_response> tags, the next assistant turn's opening
TOOL_TURN_TEXT_TOKENS = 16


def tool_turn_shape(cfg: Config, facts: ModelFacts, prompt: PromptShape,
                    turns: float | None = None) -> ToolTurnShape:
    """The turns of one trajectory (:class:`ToolTurnShape`; one without tools): ``turns``, by
    default as many whole policy turns of ``algo.max_new_tokens`` and the tool turns between
    them as the trajectory's budget holds (a fraction of one more where it holds part of it),
    at most ``rollout.max_turns``. Each tool turn: its framing (encoded by the model's
    processor where it has one) and the images the tools may still show, ``data.max_images``
    less the prompt's, one per tool turn at most, at ``data.max_pixels``."""
    if not cfg.tools:
        return ToolTurnShape()
    left = max(cfg.data.max_images - prompt.images, 0) if facts.vision is not None else 0
    text, image_tokens, patches = _tool_turn_tokens(cfg, facts)

    def at(k: float) -> ToolTurnShape:
        images = min(left, k - 1) / (k - 1) if k > 1 else 0.0
        return ToolTurnShape(turns=k, text=text, images=images, image_tokens=image_tokens,
                             image_patches=patches)

    if turns is not None:
        return at(float(turns))
    most, per_turn = cfg.rollout.max_turns, cfg.algo.max_new_tokens
    budget = cfg.rollout.max_trajectory_tokens or most * per_turn
    shape = at(float(most))
    for _ in range(8):  # a tool turn's images depend on the turns they are spread over (converges)
        shape = at(min(float(most), max(1.0, (budget + shape.tokens) / (per_turn + shape.tokens))))
    return shape


def _tool_turn_tokens(cfg: Config, facts: ModelFacts) -> tuple[int, int, int]:
    """(the framing's tokens, one image's tokens, its patches) of a tool turn: encoded by the
    model's processor as a rollout encodes it (r1fit/rollout/turns.py), else estimated."""
    if facts.processor is not None and facts.vision is not None:
        try:
            return _encoded_tool_turn(cfg, facts)
        except Exception as err:  # noqa: BLE001 - a processor that is not Qwen-like
            log.debug("plan: encoding a tool turn failed (%s); estimating instead", err)
    if facts.vision is None:
        return TOOL_TURN_TEXT_TOKENS, 0, 0
    tokens, patches_per_token = _image_estimate(cfg, facts.vision, shapes=False)
    return TOOL_TURN_TEXT_TOKENS, tokens + 2, round(tokens * patches_per_token)  # + start/end


def _encoded_tool_turn(cfg: Config, facts: ModelFacts) -> tuple[int, int, int]:
    from PIL import Image

    from r1fit.data.images import fit_pixel_budget
    from r1fit.tools.api import ToolResult
    from r1fit.tools.conversation import tool_turn_tokens

    d = cfg.data
    side = _image_side(cfg, shapes=False)
    image = fit_pixel_budget(Image.new("RGB", (side, side)), d.min_pixels, d.max_pixels)
    text = tool_turn_tokens(facts.processor, [ToolResult("tool", ("",))])[0]
    ids, _, inputs, _ = tool_turn_tokens(facts.processor, [ToolResult("tool", (image,))])
    return (int(text.shape[0]), int(ids.shape[0]) - int(text.shape[0]),
            _patches(inputs, facts.vision))


def _image_side(cfg: Config, shapes: bool) -> int:
    """Side of the square image fitted to [min_pixels, max_pixels] (r1fit/data/images.py)."""
    d = cfg.data
    area = d.shapes.image_size ** 2 if shapes else d.max_pixels
    area = min(max(area, d.min_pixels), d.max_pixels)
    return max(28, math.isqrt(area))


def _encoded_prompt(cfg: Config, facts: ModelFacts, images: int, shapes: bool) -> PromptShape:
    from PIL import Image

    from r1fit.data.batch import encode_prompts
    from r1fit.data.images import fit_pixel_budget
    from r1fit.data.sample import Sample

    d, processor = cfg.data, facts.processor
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
    image_tokens = (int((best.input_ids == facts.image_token_id).sum())
                    if facts.image_token_id is not None else 0)
    return PromptShape(tokens=best.length + extra, image_tokens=image_tokens,
                       patches=_patches(best.image_inputs, facts.vision), how=how,
                       images=len(best.sample.images))


def _patches(image_inputs: dict[str, Any], vision: VisionDims | None) -> int:
    """Vision-encoder patches of a prompt's processed images: Qwen-VL's ``image_grid_thw`` (one
    row per image: t x h x w patches), else the ``[images, channels, side, side]`` pixel values
    of a fixed-size tower cut into ``vision.patch`` px squares."""
    grid = image_inputs.get("image_grid_thw")
    if grid is not None:
        return int(grid.prod(-1).sum())
    pixels = image_inputs.get("pixel_values")
    if pixels is None or vision is None or pixels.dim() != 4:
        return 0
    return int(pixels.shape[0]) * (int(pixels.shape[2]) // vision.patch) * (int(pixels.shape[3]) // vision.patch)
