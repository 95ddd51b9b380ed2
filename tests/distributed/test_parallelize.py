"""parallelize() on one process (activation checkpointing only) and the sharding units it would
use; the sharded path runs under torchrun in tests/e2e/test_distributed.py."""

from __future__ import annotations

import torch

from r1fit.distributed.parallelize import fsdp_modules, gathered, parallelize, shard_units
from r1fit.models.load import load_policy
from r1fit.models.logprobs import CompletionLogProbs
from r1fit.processes import World

LOAD = dict(lora_r=0, lora_alpha=16, lora_dropout=0.0, lora_target="all-linear",
            freeze_vision=False, dtype="float32", gradient_checkpointing=False)


def test_units_are_the_decoder_layers_and_vision_blocks(use_tiny_cache):
    model, _ = load_policy("builtin:tiny", device="cpu", **LOAD)
    units = shard_units(CompletionLogProbs(model))
    inner = model.model
    expected = [*inner.visual.blocks, *inner.language_model.layers]
    assert sorted(map(id, units)) == sorted(map(id, expected))


def checkpointing(model) -> bool:
    """Whether gradient checkpointing is on: ``is_gradient_checkpointing`` in transformers 5.17
    (the GPU image's), ``is_activation_checkpointing`` in later releases, which deprecate the
    first."""
    name = "is_activation_checkpointing"
    return bool(getattr(model, name) if hasattr(model, name) else model.is_gradient_checkpointing)


def test_one_process_gets_checkpointing_and_no_fsdp(use_tiny_cache):
    model, _ = load_policy("builtin:tiny", device="cpu", **LOAD)
    assert not checkpointing(model)
    root = parallelize(CompletionLogProbs(model), activation_checkpointing=True, world=World(),
                       device_type="cpu")
    assert checkpointing(model) and fsdp_modules(root) == []
    before = [p.clone() for p in model.parameters()]
    with gathered(root):  # a no-op without FSDP
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_meta_skeleton_matches_the_loaded_model(use_tiny_cache):
    """What ranks other than 0 build: same names, shapes and dtypes, no storage."""
    real, _ = load_policy("builtin:tiny", device="cpu", **{**LOAD, "lora_r": 4})
    meta, _ = load_policy("builtin:tiny", device="meta", **{**LOAD, "lora_r": 4})
    a = {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}
    b = {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()}
    assert a == b
    assert all(p.is_meta for p in meta.parameters())
    # the folder's generation_config.json too (its eos ids end the rows), not config.json's
    from r1fit.models.load import unwrap

    real_cfg, meta_cfg = unwrap(real).generation_config, unwrap(meta).generation_config
    assert meta_cfg.to_diff_dict() == real_cfg.to_diff_dict()
    assert isinstance(real_cfg.eos_token_id, list) and len(real_cfg.eos_token_id) == 2


def test_the_log_names_the_dtypes_gathered():
    """FSDP2's log line: the policy's dtype, else every stored one (a bf16 model's float32 LoRA
    adapters are gathered in float32)."""
    from r1fit.distributed.parallelize import _dtype_name

    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16), torch.nn.Linear(2, 2))
    assert _dtype_name(None, mixed) == "bfloat16 and float32 as stored"
    assert _dtype_name(torch.bfloat16, mixed) == "bfloat16"
    assert _dtype_name(None, torch.nn.Linear(2, 2)) == "float32 as stored"
