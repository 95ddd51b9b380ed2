"""Built-in random-weight Qwen2.5-VL models, created offline on first use and cached on disk.

`builtin:tiny` and `builtin:small-realvocab` are real `Qwen2_5_VLForConditionalGeneration`
checkpoints with real Qwen2-VL processors, written with `save_pretrained` into
`$R1FIT_CACHE/models/<name>-v<BUILDER_VERSION>/`. Callers load them back through the exact
`from_pretrained` path a hub checkpoint takes, so tests exercise the same code as real training.

Building is deterministic (fixed seeds, deterministic BPE training) and safe under concurrency:
the folder is written to a temporary sibling and renamed into place while holding a file lock,
so another process never sees a half-written model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from r1fit.models.errors import ModelConfigError
from r1fit.models.tokenizer import QWEN2VL_CHAT_TEMPLATE, build_tokenizer

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


BUILTINS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(
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
    ),
    "tiny-hd32": BuiltinSpec(
        name="tiny-hd32",
        description="tiny with 2 attention heads of 32 dims, the smallest head size vLLM's CPU "
        "attention runs; for rollout.engine=vllm tests",
        seed=1234,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        mrope_section=(4, 6, 6),  # sums to head_dim / 2 = 16
        vision_hidden=64,
        vision_depth=2,
        vision_heads=4,
        vision_intermediate=128,
        tie_word_embeddings=True,
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
}


def builtin_names() -> list[str]:
    """Names accepted after `builtin:` (sorted)."""
    return sorted(BUILTINS)


def cache_root() -> Path:
    """The r1fit cache folder: `$R1FIT_CACHE`, else `~/.cache/r1fit`."""
    env = os.environ.get("R1FIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "r1fit"


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
    model, tokenizer = create_model(name)
    model.save_pretrained(dest, safe_serialization=True)
    make_processor(tokenizer).save_pretrained(dest)
    marker = {
        "name": spec.name,
        "builder_version": BUILDER_VERSION,
        "seed": spec.seed,
        "description": spec.description,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def create_model(name: str) -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer]:
    """Create built-in `name` in memory (float32, deterministic weights) with its tokenizer.

    `build_builtin` saves exactly this; tests compare it with what `from_pretrained` loads back.
    """
    spec = _spec(name)
    tokenizer = build_tokenizer()
    config = _make_config(spec, tokenizer)
    # Seed the global RNG that transformers' weight init draws from, so every build of a given
    # BUILDER_VERSION has bit-identical weights.
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(spec.seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    ids = _token_ids(tokenizer)
    # Mirrors Qwen2.5-VL-Instruct's generation_config.json: stop on <|im_end|> or <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=ids["endoftext"],
        eos_token_id=[ids["im_end"], ids["endoftext"]],
        pad_token_id=ids["endoftext"],
    )
    return model, tokenizer


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


def _spec(name: str) -> BuiltinSpec:
    try:
        return BUILTINS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown built-in model {BUILTIN_PREFIX}{name!r}; available: "
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


def _make_config(spec: BuiltinSpec, tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    ids = _token_ids(tokenizer)
    vocab_size = spec.vocab_size if spec.vocab_size is not None else len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ModelConfigError(f"built-in {spec.name}: vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": list(spec.mrope_section),
        },
        # As in Qwen's config.json: bos is <|endoftext|> although the tokenizer adds no bos.
        "bos_token_id": ids["endoftext"],
        "eos_token_id": ids["im_end"],
        "pad_token_id": ids["endoftext"],
    }
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
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )
