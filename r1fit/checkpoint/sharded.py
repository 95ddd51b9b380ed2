"""Model weights and optimizer moments through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of one logical state dict keyed by parameter name, and DCP's
metadata records each tensor's global shape, so a checkpoint written by N processes loads into M
processes (or one, with plain tensors) by reading the pieces each rank needs: the checkpoint does
not depend on the number of processes. A LoRA policy saves its trainable (adapter) weights only;
the frozen base comes from ``model.path``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

WEIGHTS_DIR = "weights"


def adapter_only(module: nn.Module) -> bool:
    """LoRA: only the trainable adapter weights are the run's own."""
    return isinstance(module, PeftModel)


def model_tensors(module: nn.Module, **options: Any) -> dict[str, torch.Tensor]:
    """The weights a checkpoint keeps for ``module`` (sharded DTensors under FSDP; ``options``:
    more ``StateDictOptions``), a tied weight once: the LM head tied to the embeddings is one
    parameter under two names, and would be written twice."""
    state = get_model_state_dict(module, options=StateDictOptions(
        ignore_frozen_params=adapter_only(module), **options))
    unique = {name for name, _ in module.named_parameters()}
    for name, _ in module.named_parameters(remove_duplicate=False):
        if name not in unique:
            state.pop(name, None)
    return state


def save_tensors(folder: Path, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` (nested dicts of tensors) as ``folder/weights``; every rank calls this."""
    with _one_process_is_fine():
        dcp.save(tensors, checkpoint_id=folder / WEIGHTS_DIR)


def load_tensors(folder: Path, tensors: dict[str, Any]) -> None:
    """Fill ``tensors`` (plain or sharded) in place from ``folder/weights``."""
    with _one_process_is_fine():
        dcp.load(tensors, checkpoint_id=folder / WEIGHTS_DIR)


@contextmanager
def _one_process_is_fine() -> Iterator[None]:
    # DCP warns that it "assumes" one process when there is no process group: that is intended
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def saved_keys(folder: Path) -> set[str]:
    """Flattened names (``model.<fqn>``, ``optimizer.<fqn>.exp_avg``...) stored in a checkpoint."""
    return set(FileSystemReader(folder / WEIGHTS_DIR).read_metadata().state_dict_metadata)


def load_model_weights(folder: Path, name: str, module: nn.Module) -> None:
    """Load model ``name`` of the checkpoint in ``folder`` into ``module`` (plain or sharded)."""
    target = model_tensors(module)
    saved = saved_keys(folder)
    missing = sorted(k for k in target if f"{name}.{k}" not in saved)
    if missing:
        raise ValueError(f"the checkpoint has no {name} weight {missing[0]!r} (and "
                         f"{len(missing) - 1} more); was it saved with other model settings "
                         "(model.lora, model.path)?")
    load_tensors(folder, {name: target})
    # not strict: LoRA sets the adapter only, and a tied weight comes under one of its names; the
    # names that must be there were checked above
    set_model_state_dict(module, target, options=StateDictOptions(strict=False))
