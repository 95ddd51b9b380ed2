"""The policy's full weights, one tensor at a time, under their transformers-v5 names.

What an inference engine needs to take the trainer's weights: every parameter whole (FSDP shards
are gathered one parameter at a time, so at most one gathered tensor is alive besides the shards),
and for LoRA the merged weight ``W + scale * B @ A`` computed per layer while the trainable
adapters stay as they are. Tied parameters are given under each of their names (an engine may
keep the LM head apart from the embedding).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from r1fit.models.errors import ModelConfigError

LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.",
              ".lora_magnitude_vector.")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` unsharded: a DTensor is gathered (a collective: every rank must call it in the
    same order); a plain tensor is returned as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _merged_lora_weight(layer: Any, base_weight: torch.Tensor) -> torch.Tensor:
    """``base_weight`` plus the deltas of ``layer``'s active LoRA adapters (a new tensor)."""
    if not isinstance(layer.base_layer, nn.Linear):
        raise ModelConfigError(f"merging LoRA weights supports adapted nn.Linear layers only, not "
                               f"{type(layer.base_layer).__name__}")
    merged = base_weight.detach().clone()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise ModelConfigError("merging DoRA adapters for the rollout engine is not supported")
        a = whole(layer.lora_A[adapter].weight).detach()
        b = whole(layer.lora_B[adapter].weight).detach()
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        merged += delta.to(merged.dtype)
    return merged


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights as a copy loaded from its folder holds them: every parameter
    but LoRA's adapters (a tied one once), whole under FSDP."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return sum(param.numel() * param.element_size() for name, param in hf_model.named_parameters()
               if not any(part in name for part in LORA_PARTS))


def full_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter of ``model`` (a transformers model, or a peft model
    around one) whole and detached, named as the transformers model names them
    (``model.language_model.layers.0...``). LoRA layers give their merged weight."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if any(part in name for part in LORA_PARTS):
            continue
        if ".base_layer." in name:
            owner, leaf = name.rsplit(".base_layer.", 1)
            tensor = whole(param).detach()
            if leaf == "weight":
                tensor = _merged_lora_weight(hf_model.get_submodule(owner), tensor)
            yield f"{owner}.{leaf}", tensor
        else:
            yield name, whole(param).detach()
