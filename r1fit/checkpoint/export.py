"""``r1fit export CHECKPOINT OUT``: a checkpoint's model as a plain Hugging Face folder.

The checkpoint's weights are sharded (``weights/``, torch.distributed.checkpoint, one shard file
per process that saved it); export consolidates them in this one process, whatever the number of
processes that wrote them:

- full fine-tuning: the model is built from the checkpoint's ``model/config.json`` without
  initialising it (meta device), given the saved weights, and saved with ``save_pretrained``
  (weights, config, generation config, processor);
- LoRA: the adapter (it needs its base model, ``base_model_name_or_path`` in
  ``adapter_config.json``); with ``merge_lora`` the adapter is merged into the base model named by
  the run's ``model.path`` and the result saved as a standalone model.

Either way ``AutoModelForImageTextToText.from_pretrained(OUT)`` and
``AutoProcessor.from_pretrained(OUT)`` load it. The checkpoint is verified against its manifest
first, and OUT is written as ``OUT.partial`` then renamed, so OUT is either complete or absent.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r1fit.checkpoint.files import fsync_dir, fsync_tree, read_json_object
from r1fit.checkpoint.manager import (
    MANIFEST,
    MODEL_DIR,
    PARTIAL,
    TRAINER_STATE,
    CheckpointError,
    failure_reason,
    io_failure,
    list_checkpoints,
    verify,
)
from r1fit.checkpoint.sharded import load_model_weights, model_tensors
from r1fit.processes import barrier, world
from r1fit.units import format_bytes

_ADAPTER = "adapter_config.json"


@dataclass
class Exported:
    """What :func:`export` wrote."""

    out: Path
    what: str                # "full" (fine-tuned weights), "adapter" or "merged"
    base_model: str | None   # the base an adapter needs, or the base merged into
    total_bytes: int
    note: str = ""

    def summary(self, checkpoint: Path) -> str:
        size = format_bytes(self.total_bytes, decimal=True)
        if self.what == "adapter":
            return (f"exported the LoRA adapter of {checkpoint} to {self.out} ({size}); it needs "
                    f"its base model {self.base_model} (base_model_name_or_path in "
                    "adapter_config.json) to load; pass --merge-lora for a standalone model")
        what = ("LoRA merged into " + str(self.base_model) if self.what == "merged"
                else "full fine-tuned weights")
        return (f"exported {checkpoint} ({what}) to {self.out} ({size}); load it with "
                f"from_pretrained({str(self.out)!r}){self.note}")


def export(checkpoint: Path, out: Path, *, merge_lora: bool = False) -> Exported:
    """Write the model of ``checkpoint`` into the new folder ``out`` (see the module doc)."""
    model_dir = _checked_model_dir(checkpoint)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise CheckpointError(f"{out} already exists and {what}; export into a new folder")
    partial = out.absolute().with_name(out.absolute().name + PARTIAL)  # `out` may be "."
    lora = (model_dir / _ADAPTER).is_file()
    try:
        if partial.exists():  # left by an interrupted export
            shutil.rmtree(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
        note = ""
        if lora:
            what = "merged" if merge_lora else "adapter"
            base = _export_lora(checkpoint, model_dir, partial, merge=merge_lora)
            if not merge_lora:  # what the adapter itself names (a folder, for builtin: models)
                base = read_json_object(partial / _ADAPTER).get("base_model_name_or_path", base)
        else:
            what, base = "full", None
            _export_full(checkpoint, model_dir, partial)
            if merge_lora:
                note = " (--merge-lora: nothing to merge, the checkpoint holds full weights)"
        fsync_tree(partial)
        if out.exists():  # an empty folder (maybe "."): fill it, the folder itself stays
            for child in partial.iterdir():
                os.rename(child, out / child.name)
            partial.rmdir()
            fsync_dir(out)
        else:
            os.rename(partial, out)
        fsync_dir(partial.parent)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if io_failure(exc):  # a full disk, as safetensors' and tokenizers' own errors too
            raise CheckpointError(f"could not export to {out}: {failure_reason(exc)}") from exc
        raise
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return Exported(out, what, base, total, note)


def _checked_model_dir(checkpoint: Path) -> Path:
    """The ``model/`` folder of an intact checkpoint, or a one-line error saying what is wrong."""
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint folder")
    inside = list_checkpoints(checkpoint)
    if inside:
        raise CheckpointError(f"{checkpoint} is a run's output folder; export one of its "
                              f"checkpoints, e.g. {inside[0]}")
    if not (checkpoint / MANIFEST).is_file():  # a run's final/ or an export: nothing to export
        if (checkpoint / _ADAPTER).is_file():
            raise CheckpointError(
                f"{checkpoint} is a LoRA adapter folder (a LoRA run's final/), not a checkpoint: "
                "from_pretrained loads it as it is; to merge it, export the run's last checkpoint "
                "with --merge-lora, or merge it with peft (docs/using.md)")
        if (checkpoint / "config.json").is_file() and not (checkpoint / TRAINER_STATE).is_file():
            raise CheckpointError(
                f"{checkpoint} is a Hugging Face model folder (a full run's final/ or an export), "
                "not a checkpoint: from_pretrained loads it as it is")
    problem = verify(checkpoint)
    if problem is not None:
        raise CheckpointError(f"{checkpoint}: cannot export: {problem}")
    model_dir = checkpoint / MODEL_DIR
    if not model_dir.is_dir():
        raise CheckpointError(f"{checkpoint}: cannot export: the checkpoint has no {MODEL_DIR}/ "
                              "folder")
    return model_dir


def _run_dtype(checkpoint: Path) -> Any:
    import torch

    dtype = read_json_object(checkpoint / "config.json").get("model", {}).get("dtype", "auto")
    return dtype if dtype == "auto" else getattr(torch, dtype)


def _export_full(checkpoint: Path, model_dir: Path, dest: Path) -> None:
    """Consolidate the full model's shards into ``dest`` (``save_pretrained``)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from r1fit.models.load import checkpoint_dtype

    try:
        config = AutoConfig.from_pretrained(model_dir)
        dtype = _run_dtype(checkpoint)
        if dtype == "auto":  # the dtype the run loaded: model/config.json was saved from it
            dtype = checkpoint_dtype(config, str(model_dir))[0]
        with torch.device("meta"):  # no random initialisation: every weight is loaded below
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty unties the LM head from the embeddings; the config ties
        load_model_weights(checkpoint, "model", model)
        processor = AutoProcessor.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{checkpoint}: cannot consolidate the model: "
                              f"{' '.join(str(exc).split())}") from exc
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.save_pretrained(dest)
    processor.save_pretrained(dest)


def _export_lora(checkpoint: Path, model_dir: Path, dest: Path, *, merge: bool) -> str:
    """The adapter of ``checkpoint`` on the run's base model (``model.path``): saved as an adapter,
    or merged into the base (``merge``). Returns the base model's name."""
    from peft import LoraConfig, get_peft_model
    from safetensors import SafetensorError
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from r1fit.models.load import ModelConfigError, bad_weights_message, resolve_model_path

    base = read_json_object(checkpoint / "config.json").get("model", {}).get("path")
    if not base:
        raise CheckpointError(f"{checkpoint}/config.json names no model.path; cannot find the base "
                              "model of the LoRA adapter")
    try:
        folder = resolve_model_path(base)
        # the training dtype, so the merged weights are what the adapter was trained against
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=_run_dtype(checkpoint))
        with warnings.catch_warnings():
            # peft probes the deprecated `is_gradient_checkpointing` property; not our call site
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(model_dir)))
        load_model_weights(checkpoint, "model", peft_model)
        processor = AutoProcessor.from_pretrained(str(model_dir))
    except SafetensorError as exc:  # the base model's weights file is truncated or corrupt
        raise CheckpointError(f"{checkpoint}: cannot rebuild the LoRA model on its base model: "
                              f"{bad_weights_message(folder, base, exc)}") from exc
    except (ModelConfigError, OSError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        message = " ".join(str(exc).split())
        raise CheckpointError(f"{checkpoint}: cannot rebuild the LoRA model on its base model "
                              f"{base!r}: {message}") from exc
    if merge:
        peft_model.merge_and_unload().save_pretrained(dest)
    else:
        peft_model.save_pretrained(dest)
    processor.save_pretrained(dest)
    return base


def save_hf_folder(model: Any, processor: Any, folder: Path) -> None:
    """A live model as a plain Hugging Face folder (the adapter only, for LoRA) that
    from_pretrained loads: a run's ``final/``. Sharded weights are gathered to rank 0 (to host
    memory) and written there."""
    w = world()
    state = None
    if w.distributed:
        state = model_tensors(model, full_state_dict=True, cpu_offload=True)
    if w.main:
        # whole or not at all, as an export: a full disk left final/ with its configs only
        partial = folder.with_name(folder.name + PARTIAL)
        try:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            model.save_pretrained(partial, state_dict=state)
            processor.save_pretrained(partial)
            fsync_tree(partial)
            if folder.exists():  # a finished run's, written again
                shutil.rmtree(folder)
            os.rename(partial, folder)
            fsync_dir(folder.parent)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if not io_failure(exc):
                raise
            raise CheckpointError(f"could not write {folder}: {failure_reason(exc)}. The "
                                  "checkpoints are intact: free the space and rerun the same "
                                  "command to write it") from exc
    barrier()
