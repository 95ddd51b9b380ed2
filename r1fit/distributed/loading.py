"""Models on every process: loaded (by rank 0 alone when there are several), wrapped for log-probs
and parallelized."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from r1fit.config import ModelConfig
from r1fit.distributed.parallelize import materialize, parallelize
from r1fit.models.load import adapter_autocast_dtype, load_frozen, load_policy
from r1fit.models.logprobs import CompletionLogProbs
from r1fit.processes import world


def load_on_ranks(build: Callable[[Any], tuple[Any, Any]], device: torch.device, *,
                  activation_checkpointing: bool, checkpoint_every: int = 1
                  ) -> tuple[Any, Any, Any]:
    """``build(device) -> (model, processor or None)`` on every process, then
    :func:`parallelize`; returns (model, processor, root to call for log-probs).

    One process: ``build`` onto the device. Several: rank 0 alone reads the weights (to host
    memory), every rank builds the model on the meta device, shards it, and receives its shards
    from rank 0 (:func:`materialize`)."""
    w = world()
    source = build("cpu")[0] if w.distributed and w.main else None
    model, processor = build("meta" if w.distributed else device)
    root = parallelize(CompletionLogProbs(model), activation_checkpointing=activation_checkpointing,
                       world=w, device_type=device.type, checkpoint_every=checkpoint_every)
    if w.distributed:
        materialize(root, model, source, device)
    return model, processor, root


def load_policy_on_ranks(m: ModelConfig, device: torch.device, *,
                         activation_checkpointing: bool, checkpoint_every: int = 1
                         ) -> tuple[Any, Any, Any]:
    """The trainable policy of ``model.*`` (LoRA or full), its processor and its log-prob root
    (whose adapters compute as ``model.lora.compute_dtype`` says)."""
    model, processor, root = load_on_ranks(
        lambda where: load_policy(m.path, device=where, lora_r=m.lora.r, lora_alpha=m.lora.alpha,
                                  lora_dropout=m.lora.dropout, lora_target=m.lora.target,
                                  freeze_vision=m.freeze_vision, dtype=m.dtype,
                                  gradient_checkpointing=False,
                                  attn_implementation=m.attn_implementation),
        device, activation_checkpointing=activation_checkpointing,
        checkpoint_every=checkpoint_every)
    root.adapter_dtype = adapter_autocast_dtype(model, m.lora.compute_dtype)
    return model, processor, root


def load_frozen_copy(m: ModelConfig, device: torch.device,
                     policy_model: Any | None) -> tuple[Any, Any]:
    """A frozen model from ``model.path``, holding a copy of ``policy_model``'s current weights when
    given (the KL reference after the warm-up), sharded like the policy: (model, module to call
    for log-probs)."""
    frozen, _, root = load_on_ranks(
        lambda where: (load_frozen(m.path, dtype=m.dtype, device=where,
                                   attn_implementation=m.attn_implementation), None),
        device, activation_checkpointing=False)
    if policy_model is not None:
        # the same names and shards as the policy's: a local copy, no communication
        set_model_state_dict(frozen, get_model_state_dict(policy_model))
    return frozen, root
