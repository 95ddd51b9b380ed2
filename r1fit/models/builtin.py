"""Built-in random-weight VLMs, created offline on first use and cached on disk.

`builtin:tiny`, `builtin:tiny-hd32` and `builtin:small-realvocab` are real
`Qwen2_5_VLForConditionalGeneration` checkpoints with real Qwen2.5-VL processors;
`builtin:tiny-qwen2vl` is a real `Qwen2VLForConditionalGeneration` (LayerNorm vision blocks,
no window attention) with a Qwen2-VL processor;
`builtin:tiny-qwen3vl` is a real `Qwen3VLForConditionalGeneration` (interleaved M-RoPE,
DeepStack, 16 px patches) with a Qwen3-VL processor; `builtin:tiny-gemma3` is a real
`Gemma3ForConditionalGeneration` (SigLIP tower on fixed 64 px images, sliding-window and global
attention layers) with a Gemma 3 processor and tokenizer. Each is written with `save_pretrained` into
`$R1FIT_CACHE/models/<name>-v<BUILDER_VERSION>/`. Callers load them back through the exact
`from_pretrained` path a hub checkpoint takes, so tests exercise the same code as real training.

Building is deterministic (fixed seeds, deterministic BPE training) and safe under concurrency:
the folder is written to a temporary sibling and renamed into place while holding a file lock,
so another process never sees a half-written model.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.resources
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GemmaTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from r1fit.models.errors import ModelConfigError
from r1fit.models.tokenizer import (
    GEMMA3_CHAT_TEMPLATE,
    QWEN2VL_CHAT_TEMPLATE,
    QWEN3VL_CHAT_TEMPLATE,
    build_gemma3_tokenizer,
    build_tokenizer,
)

#: Bump when anything that changes the written files changes; old cache folders are then ignored.
BUILDER_VERSION = 1
#: Name of the marker file proving a cache folder was completely written by this builder.
MARKER_FILE = "r1fit_builtin.json"
#: Prefix that selects a built-in model in a model path.
BUILTIN_PREFIX = "builtin:"

# Image budget for the built-ins: small so CPU tests stay fast (56x56 -> 4 merged image tokens,
# at most 64 merged tokens per image).
DEFAULT_MIN_PIXELS = 28 * 28 * 4
DEFAULT_MAX_PIXELS = 28 * 28 * 64
# The same budget for Qwen3-VL, whose merged token covers 32x32 px: 64 px -> 4 tokens, at most 64.
QWEN3VL_MIN_PIXELS = 32 * 32 * 4
QWEN3VL_MAX_PIXELS = 32 * 32 * 64


@dataclass(frozen=True)
class BuiltinSpec:
    """Shape of one built-in model. `vocab_size=None` means "exactly the tokenizer's size"."""

    name: str
    description: str
    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    tie_word_embeddings: bool
    vocab_size: int | None = None
    #: the architecture: "qwen2_5_vl", "qwen3_vl" or "gemma3" (a key of `FAMILIES`)
    family: str = "qwen2_5_vl"
    #: fixed-size vision towers (Gemma 3's SigLIP): the side every image is resized to, its patch
    #: size, and the image tokens the tower's output is pooled to
    image_size: int | None = None
    patch_size: int | None = None
    image_tokens: int | None = None
    #: window of the sliding-window attention layers (Gemma 3: one global layer after five of them)
    sliding_window: int | None = None
    #: the processor's pixel budget per image when it is not the small default (Qwen2.5-VL only)
    max_pixels: int | None = None


#: builtin:tiny, whose shapes the other tiny architectures share
TINY = BuiltinSpec(
    name="tiny",
    description="~0.36M params, vocab = tokenizer size, tied head; for unit tests",
    seed=1234,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    mrope_section=(2, 3, 3),  # sums to head_dim / 2 = 8 (Qwen: 16, 24, 24 of 64)
    vision_hidden=64,
    vision_depth=2,
    vision_heads=4,
    vision_intermediate=128,
    tie_word_embeddings=True,
)


BUILTINS: dict[str, BuiltinSpec] = {
    "tiny": TINY,
    "tiny-hd32": replace(
        TINY,
        name="tiny-hd32",
        description="tiny with 2 attention heads of 32 dims, the smallest head size vLLM's CPU "
        "attention runs; for rollout.engine=vllm tests",
        num_heads=2,
        num_kv_heads=1,
        mrope_section=(4, 6, 6),  # sums to head_dim / 2 = 16
    ),
    "small-realvocab": BuiltinSpec(
        name="small-realvocab",
        description="hidden 256, 4 layers, Qwen's 151,936-row embedding and untied lm_head; "
        "for memory/speed work where the vocab-sized logits dominate",
        seed=4321,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        mrope_section=(8, 12, 12),  # sums to head_dim / 2 = 32
        vision_hidden=128,
        vision_depth=2,
        vision_heads=4,
        vision_intermediate=256,
        tie_word_embeddings=False,
        vocab_size=151_936,
    ),
    "small": BuiltinSpec(
        name="small",
        description="hidden 256, 4 layers, tiny's vocabulary, tied head, a 4-block 256-wide "
        "vision tower (7.6M params): a tower wide and deep enough to be a candidate for "
        "learning measurements on the image (benchmarks/zoom_skills.py)",
        seed=5678,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        mrope_section=(8, 12, 12),  # sums to head_dim / 2 = 32
        vision_hidden=256,
        vision_depth=4,
        vision_heads=4,
        vision_intermediate=512,
        tie_word_embeddings=True,
    ),
    "bench-1024": BuiltinSpec(
        name="bench-1024",
        description="hidden 1024, 8 layers, Qwen's 151,936-row vocabulary, untied head (0.41B "
        "params), 448 px images = 256 image tokens; real-scale proportions for "
        "benchmarks/throughput.py (slow: not for tests)",
        seed=2468,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        mrope_section=(8, 12, 12),  # sums to head_dim / 2 = 32 (Qwen: 16, 24, 24 of 128)
        vision_hidden=256,
        vision_depth=4,
        vision_heads=4,
        vision_intermediate=1024,
        tie_word_embeddings=False,
        vocab_size=151_936,
        max_pixels=448 * 448,
    ),
    "bench-3b-cut": BuiltinSpec(
        name="bench-3b-cut",
        description="Qwen2.5-VL-3B-Instruct's shapes (hidden 2048, 16 heads, 2 KV heads, MLP "
        "11008, a 1280-wide 16-head vision tower, tied 151,936-row vocabulary) cut to 4 decoder "
        "layers and 4 vision blocks (0.74B params); for benchmarks/plan_accuracy.py at a real "
        "model's widths (slow: not for tests)",
        seed=3579,
        hidden_size=2048,
        num_layers=4,
        num_heads=16,
        num_kv_heads=2,
        intermediate_size=11008,
        mrope_section=(16, 24, 24),  # Qwen2.5-VL-3B's, of head_dim 128
        vision_hidden=1280,
        vision_depth=4,
        vision_heads=16,
        vision_intermediate=3420,
        tie_word_embeddings=True,
        vocab_size=151_936,
    ),
    "tiny-qwen2vl": replace(
        TINY,
        name="tiny-qwen2vl",
        description="Qwen2-VL architecture at tiny's size (LayerNorm vision blocks with a "
        "QuickGELU MLP of 2x their width, full attention in every block, M-RoPE); for "
        "architecture coverage",
        family="qwen2_vl",
    ),
    "tiny-qwen3vl": replace(
        TINY,
        name="tiny-qwen3vl",
        description="Qwen3-VL architecture at tiny's size (interleaved M-RoPE, DeepStack features "
        "from the first vision block, 16 px patches); for architecture coverage",
        family="qwen3_vl",
    ),
    "tiny-gemma3": replace(
        TINY,
        name="tiny-gemma3",
        description="Gemma 3 architecture at tiny's size (SigLIP tower on 64 px images pooled to 4 "
        "tokens, a sliding-window then a global attention layer, bidirectional attention over "
        "image tokens); for architecture coverage",
        mrope_section=(0, 0, 0),  # no M-RoPE: Gemma 3 uses 1-D positions
        family="gemma3",
        image_size=64,
        patch_size=16,
        image_tokens=4,
        sliding_window=32,
    ),
}


@functools.cache
def _shipped_configs() -> dict[str, str]:
    """Lower-cased hub id -> folder of every config.json in r1fit/models/configs/ORG/NAME/."""
    root = importlib.resources.files("r1fit.models") / "configs"
    return {f"{org.name}/{name.name}".lower(): str(name)
            for org in root.iterdir() if org.is_dir()
            for name in org.iterdir() if (name / "config.json").is_file()}


def shipped_config(repo_id: str) -> str | None:
    """The folder of the ``config.json`` r1fit ships (package data) for hub model ``repo_id``,
    e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``, matched regardless of case as the hub does; else None."""
    return _shipped_configs().get(repo_id.lower())


def builtin_names() -> list[str]:
    """Names accepted after `builtin:` (sorted)."""
    return sorted(BUILTINS)


def cache_root() -> Path:
    """The r1fit cache folder: `$R1FIT_CACHE`, else `~/.cache/r1fit`. A `ModelConfigError` when
    it, or a folder above it, is a file (it could never be made)."""
    env = os.environ.get("R1FIT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "r1fit"
    blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = f"R1FIT_CACHE={env}" if env else f"the cache folder {root}"
        raise ModelConfigError(f"{where}: {blocker} is a file, not a folder; point R1FIT_CACHE at "
                               "a folder (r1fit keeps its built-in models and device "
                               "calibrations there)")
    return root


def builtin_dir(name: str) -> Path:
    """Where built-in `name` lives in the cache (whether or not it was built yet)."""
    _spec(name)
    return cache_root() / "models" / f"{name}-v{BUILDER_VERSION}"


def is_built(folder: Path) -> bool:
    """True when `folder` holds a complete build by this `BUILDER_VERSION`."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("builder_version") == BUILDER_VERSION


def ensure_builtin(name: str) -> Path:
    """Return the cached folder of built-in `name`, building it first if needed.

    Concurrent callers (e.g. pytest-xdist workers) serialise on a per-model file lock; whoever
    gets it first builds, the others then find the finished folder.
    """
    folder = builtin_dir(name)
    if is_built(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_built(folder):  # another process finished while we waited
                return folder
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
            try:
                build_builtin(name, tmp)
                if folder.exists():  # stale: interrupted by a crash or an older builder
                    shutil.rmtree(folder)
                os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
                os.rename(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def build_builtin(name: str, dest: str | os.PathLike[str]) -> None:
    """Write built-in `name` (model, generation config, processor, tokenizer, marker) into `dest`."""
    spec = _spec(name)
    dest = Path(dest)
    model, processor = create_model(name)
    model.save_pretrained(dest, safe_serialization=True)
    processor.save_pretrained(dest)
    marker = {
        "name": spec.name,
        "family": spec.family,
        "builder_version": BUILDER_VERSION,
        "seed": spec.seed,
        "description": spec.description,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def create_model(name: str) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Create built-in `name` in memory (float32, deterministic weights) with its processor.

    `build_builtin` saves exactly this; tests compare it with what `from_pretrained` loads back.
    """
    spec = _spec(name)
    family = FAMILIES[spec.family]
    tokenizer = family.tokenizer()
    config = family.config(spec, tokenizer)
    # Seed the global RNG that transformers' weight init draws from, so every build of a given
    # BUILDER_VERSION has bit-identical weights.
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(spec.seed)
        model = family.model_class(config).to(torch.float32).eval()
        if family.init_weights is not None:
            family.init_weights(model)
    model.generation_config = family.generation(tokenizer)
    if spec.max_pixels is None:
        return model, family.processor(tokenizer)
    if family.processor is not make_processor:
        raise ValueError(f"builtin:{name}: max_pixels is for the qwen2_5_vl family only")
    return model, make_processor(tokenizer, max_pixels=spec.max_pixels)


def build_from_config(hub_id: str, dest: str | os.PathLike[str], *, device: str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, max_pixels: int = 448 * 448,
                      text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
                      seed: int = 0) -> Path:
    """Write a random-weight model of hub model `hub_id` (Qwen2-VL / Qwen2.5-VL) into `dest`, from
    the config.json r1fit ships (r1fit/models/configs/) with nothing downloaded: its weights drawn
    by transformers' initialisation straight on `device` in `dtype`, the built-in tokenizer with
    the filler tokens that put its specials at Qwen's ids (151643..), so the config's token ids
    hold as they are, a Qwen2.5-VL processor capped at `max_pixels` per image, and Qwen's
    generation config. Memory and speed depend on the shapes only. `text` / `vision`: config keys
    to change (a cut-down model for CPU tests). Returns `dest`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from r1fit.models.tokenizer import QWEN_FIRST_SPECIAL_ID

    folder = shipped_config(hub_id)
    if folder is None:
        raise ModelConfigError(f"r1fit ships no config.json of {hub_id!r} (r1fit/models/configs/)")
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise ModelConfigError(f"{hub_id}: a {config.model_type} model; only Qwen2-VL and "
                               "Qwen2.5-VL use the Qwen-id tokenizer and processor built here")
    for part, changes in ((config.text_config, text), (config.vision_config, vision)):
        for key, value in (changes or {}).items():
            if not hasattr(part, key):
                raise ModelConfigError(f"{hub_id}: its config has no {key!r} to change")
            setattr(part, key, value)
    layers = config.text_config.num_hidden_layers
    if getattr(config.text_config, "layer_types", None):  # one entry per layer, checked on load
        config.text_config.layer_types = config.text_config.layer_types[:layers]
    tokenizer = build_tokenizer(first_special_id=QWEN_FIRST_SPECIAL_ID)
    wanted = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
              "vision_start_token_id": "<|vision_start|>"}
    for key, token in wanted.items():
        if getattr(config, key) != tokenizer.convert_tokens_to_ids(token):
            raise ModelConfigError(f"{hub_id}: config {key}={getattr(config, key)} is not "
                                   f"Qwen's id of {token}")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    model.generation_config = _qwen_generation(tokenizer)
    dest = Path(dest)
    model.save_pretrained(dest)
    make_processor(tokenizer, max_pixels=max_pixels).save_pretrained(dest)
    marker = {"name": hub_id, "builder_version": BUILDER_VERSION, "seed": seed,
              "description": f"random weights of {hub_id}'s config.json"
                             + (f", changed: {text or {}} {vision or {}}" if text or vision else ""),
              "num_parameters": sum(p.numel() for p in model.parameters())}
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    del model
    return dest


def make_processor(
    tokenizer: Qwen2Tokenizer, *, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Qwen2_5_VLProcessor:
    """A Qwen2.5-VL processor around `tokenizer` with a small image budget (in pixels)."""
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=tokenizer,
        # transformers v5 requires a video processor for Qwen2.5-VL even when no video is used.
        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )


def make_qwen2vl_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLProcessor:
    """A Qwen2-VL processor around `tokenizer`: the same image and video preprocessing and chat
    template as the Qwen2.5-VL built-ins (Qwen2-VL's own), in Qwen2-VL's processor class."""
    size = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )


def make_qwen3vl_processor(tokenizer: Qwen2Tokenizer) -> Qwen3VLProcessor:
    """A Qwen3-VL processor around `tokenizer`: Qwen3-VL's preprocessor settings (16 px patches,
    2x2 merge, mean/std 0.5) with the same small pixel budget as the Qwen2.5-VL built-ins, rounded
    to its 32 px tokens."""
    size = {"shortest_edge": QWEN3VL_MIN_PIXELS, "longest_edge": QWEN3VL_MAX_PIXELS}
    half = [0.5, 0.5, 0.5]
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
                                              image_mean=half, image_std=half),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
                                              image_mean=half, image_std=half),
        chat_template=QWEN3VL_CHAT_TEMPLATE,
    )


def _spec(name: str) -> BuiltinSpec:
    try:
        return BUILTINS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown built-in model {BUILTIN_PREFIX}{name}; available: "
            + ", ".join(BUILTIN_PREFIX + n for n in builtin_names())
        ) from None


def _token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    tokens = {
        "endoftext": "<|endoftext|>",
        "im_end": "<|im_end|>",
        "image": "<|image_pad|>",
        "video": "<|video_pad|>",
        "vision_start": "<|vision_start|>",
        "vision_end": "<|vision_end|>",
    }
    return {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in tokens.items()}


def _qwen_generation(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Mirrors Qwen-VL-Instruct's generation_config.json: stop on <|im_end|> or <|endoftext|>."""
    ids = _token_ids(tokenizer)
    return GenerationConfig(bos_token_id=ids["endoftext"], eos_token_id=[ids["im_end"], ids["endoftext"]],
                            pad_token_id=ids["endoftext"])


def _text_config(spec: BuiltinSpec, tokenizer: Qwen2Tokenizer, rope: dict[str, Any]) -> dict[str, Any]:
    """The language model's config keys shared by the Qwen families."""
    ids = _token_ids(tokenizer)
    vocab_size = spec.vocab_size if spec.vocab_size is not None else len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ModelConfigError(f"built-in {spec.name}: vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "mrope_section": list(spec.mrope_section), **rope},
        # As in Qwen's config.json: bos is <|endoftext|> although the tokenizer adds no bos.
        "bos_token_id": ids["endoftext"],
        "eos_token_id": ids["im_end"],
        "pad_token_id": ids["endoftext"],
    }


def _token_config(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    ids = _token_ids(tokenizer)
    return {"image_token_id": ids["image"], "video_token_id": ids["video"],
            "vision_start_token_id": ids["vision_start"], "vision_end_token_id": ids["vision_end"]}


def _qwen2_5_vl_config(spec: BuiltinSpec, tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    vision_config = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_heads": spec.vision_heads,
        "out_hidden_size": spec.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        # Window attention over 112 px (= 4x4 merged tokens) as in Qwen2.5-VL, with the last
        # block attending globally, like Qwen's fullatt_block_indexes (7, 15, 23, 31) of 32.
        "window_size": 112,
        "fullatt_block_indexes": [spec.vision_depth - 1],
        "tokens_per_second": 2,
    }
    return Qwen2_5_VLConfig(
        text_config=_text_config(spec, tokenizer, {"rope_theta": 1_000_000.0}),
        vision_config=vision_config,
        tie_word_embeddings=spec.tie_word_embeddings,
        **_token_config(tokenizer),
    )


def _qwen2_vl_config(spec: BuiltinSpec, tokenizer: Qwen2Tokenizer) -> Qwen2VLConfig:
    # Qwen2-VL-2B-Instruct's vision config: blocks embed_dim wide with an MLP of mlp_ratio x that,
    # every block attending over the whole image (no windows), the merger out to hidden_size
    if spec.vision_intermediate % spec.vision_hidden:
        raise ModelConfigError(f"built-in {spec.name}: Qwen2-VL's vision MLP is a whole multiple "
                               f"of its width ({spec.vision_intermediate} / {spec.vision_hidden})")
    vision_config = {
        "depth": spec.vision_depth,
        "embed_dim": spec.vision_hidden,
        "mlp_ratio": spec.vision_intermediate // spec.vision_hidden,
        "num_heads": spec.vision_heads,
        "hidden_size": spec.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return Qwen2VLConfig(
        text_config=_text_config(spec, tokenizer, {"rope_theta": 1_000_000.0}),
        vision_config=vision_config,
        tie_word_embeddings=spec.tie_word_embeddings,
        **_token_config(tokenizer),
    )


def _qwen3_vl_config(spec: BuiltinSpec, tokenizer: Qwen2Tokenizer) -> Qwen3VLConfig:
    # Qwen3-VL-4B-Instruct: rope_theta 5e6, interleaved M-RoPE, head_dim set explicitly,
    # DeepStack features taken from vision blocks (5, 11, 17) of 24 into the first LM layers.
    text_config = _text_config(spec, tokenizer, {"rope_theta": 5_000_000.0, "mrope_interleaved": True})
    text_config["head_dim"] = spec.hidden_size // spec.num_heads
    vision_config = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_heads": spec.vision_heads,
        "out_hidden_size": spec.hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        # learned position embeddings on an 8x8 grid (Qwen3-VL: 48x48), interpolated per image
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=spec.tie_word_embeddings,
        **_token_config(tokenizer),
    )


def _gemma3_ids(tokenizer: GemmaTokenizer) -> dict[str, int]:
    tokens = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "end_of_turn": "<end_of_turn>",
              "boi": tokenizer.boi_token, "eoi": tokenizer.eoi_token, "image": tokenizer.image_token}
    return {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in tokens.items()}


def _gemma3_config(spec: BuiltinSpec, tokenizer: GemmaTokenizer) -> Gemma3Config:
    """gemma-3-4b-it's config at tiny size: head_dim and query_pre_attn_scalar set explicitly (256
    there), global rope theta 1e6 and local 1e4, the sliding-window layer pattern kept (five
    sliding layers then a global one there; here one then one), eos = <eos> and <end_of_turn>, no
    softcaps; a SigLIP tower whose output is average-pooled to `image_tokens` per image."""
    ids = _gemma3_ids(tokenizer)
    head_dim = spec.hidden_size // spec.num_heads
    text_config = {
        "vocab_size": spec.vocab_size if spec.vocab_size is not None else len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": spec.sliding_window,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(spec.num_layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": ids["bos"],
        "eos_token_id": [ids["eos"], ids["end_of_turn"]],
        "pad_token_id": ids["pad"],
    }
    vision_config = {
        "model_type": "siglip_vision_model",
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_hidden_layers": spec.vision_depth,
        "num_attention_heads": spec.vision_heads,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    }
    return Gemma3Config(text_config=text_config, vision_config=vision_config,
                        mm_tokens_per_image=spec.image_tokens, boi_token_index=ids["boi"],
                        eoi_token_index=ids["eoi"], image_token_index=ids["image"],
                        tie_word_embeddings=spec.tie_word_embeddings)


def make_gemma3_processor(tokenizer: GemmaTokenizer) -> Gemma3Processor:
    """A Gemma 3 processor around `tokenizer`: gemma-3's preprocessor settings (every image resized
    to the tower's square side, mean/std 0.5, no pan-and-scan) at tiny-gemma3's 64 px and 4 tokens
    per image."""
    spec = BUILTINS["tiny-gemma3"]
    half = [0.5, 0.5, 0.5]
    image_processor = Gemma3ImageProcessor(size={"height": spec.image_size, "width": spec.image_size},
                                           image_mean=half, image_std=half, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=spec.image_tokens)


def _gemma3_generation(tokenizer: GemmaTokenizer) -> GenerationConfig:
    """Mirrors gemma-3-4b-it's generation_config.json: stop on <eos> or <end_of_turn>, sample with
    top_k 64 and top_p 0.95 (r1fit overrides both), a hybrid sliding/global cache."""
    ids = _gemma3_ids(tokenizer)
    return GenerationConfig(bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["end_of_turn"]],
                            pad_token_id=ids["pad"], do_sample=True, top_k=64, top_p=0.95,
                            cache_implementation="hybrid")


def _gemma3_init(model: PreTrainedModel) -> None:
    # transformers initialises the image projection to zeros (a real checkpoint has it trained),
    # which would hide every image from a random-weight model: draw it like the other weights
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    torch.nn.init.normal_(projector, std=model.config.initializer_range)


@dataclass(frozen=True)
class Family:
    """How a built-in of one architecture is made: its tokenizer, config, model class, processor
    and generation config (each a function of the tokenizer, whose ids the others use)."""

    tokenizer: Callable[[], PreTrainedTokenizerBase]
    config: Callable[[BuiltinSpec, Any], PretrainedConfig]
    model_class: type[PreTrainedModel]
    processor: Callable[[Any], ProcessorMixin]
    generation: Callable[[Any], GenerationConfig]
    #: redraws weights the model class initialises to a constant the real checkpoint has trained
    #: (under the spec's seed)
    init_weights: Callable[[PreTrainedModel], None] | None = None


FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family(build_tokenizer, _qwen2_5_vl_config, Qwen2_5_VLForConditionalGeneration,
                         make_processor, _qwen_generation),
    "qwen2_vl": Family(build_tokenizer, _qwen2_vl_config, Qwen2VLForConditionalGeneration,
                       make_qwen2vl_processor, _qwen_generation),
    "qwen3_vl": Family(build_tokenizer, _qwen3_vl_config, Qwen3VLForConditionalGeneration,
                       make_qwen3vl_processor, _qwen_generation),
    "gemma3": Family(build_gemma3_tokenizer, _gemma3_config, Gemma3ForConditionalGeneration,
                     make_gemma3_processor, _gemma3_generation, init_weights=_gemma3_init),
}
