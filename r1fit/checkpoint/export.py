"""``r1fit export CHECKPOINT OUT``: a checkpoint's model as a plain Hugging Face folder.

- full fine-tuning: the checkpoint's ``model/`` files, copied as they are (weights, config,
  generation config, processor);
- LoRA: the adapter folder as it is (it needs its base model, ``base_model_name_or_path`` in
  ``adapter_config.json``); with ``merge_lora`` the adapter is merged into the base model named by
  the run's ``model.path`` and the result saved as a standalone model.

Either way ``AutoModelForImageTextToText.from_pretrained(OUT)`` and
``AutoProcessor.from_pretrained(OUT)`` load it. The checkpoint is verified against its manifest
first, and OUT is written as ``OUT.partial`` then renamed, so OUT is either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from r1fit.checkpoint.files import fsync_dir, fsync_tree
from r1fit.checkpoint.inspect import human
from r1fit.checkpoint.manager import (
    MODEL_DIR,
    PARTIAL,
    CheckpointError,
    list_checkpoints,
    verify,
)

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
        size = human(self.total_bytes)
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
        raise CheckpointError(f"{out} already exists and is not empty; export into a new folder")
    partial = out.absolute().with_name(out.absolute().name + PARTIAL)  # `out` may be "."
    lora = (model_dir / _ADAPTER).is_file()
    try:
        if partial.exists():  # left by an interrupted export
            shutil.rmtree(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
        note = ""
        if lora and merge_lora:
            what, base = "merged", _merge(checkpoint, model_dir, partial)
        else:
            shutil.copytree(model_dir, partial)
            what = "adapter" if lora else "full"
            base = _json(model_dir / _ADAPTER).get("base_model_name_or_path") if lora else None
            if merge_lora:
                note = " (--merge-lora: nothing to merge, the checkpoint holds full weights)"
        fsync_tree(partial)
        if out.exists():  # an empty folder: replace it
            out.rmdir()
        os.rename(partial, out)
        fsync_dir(partial.parent)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"could not export to {out}: {exc.strerror or exc} "
                              f"({getattr(exc, 'filename', '') or out})") from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
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
    problem = verify(checkpoint)
    if problem is not None:
        raise CheckpointError(f"{checkpoint}: cannot export: {problem}")
    model_dir = checkpoint / MODEL_DIR
    if not model_dir.is_dir():
        raise CheckpointError(f"{checkpoint}: cannot export: the checkpoint has no {MODEL_DIR}/ "
                              "folder")
    return model_dir


def _merge(checkpoint: Path, model_dir: Path, dest: Path) -> str:
    """Merge the adapter in ``model_dir`` into the run's base model; save model and processor to
    ``dest``. Returns the base model's name (the run's ``model.path``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from r1fit.models.load import ModelConfigError, resolve_model_path

    model_cfg = _json(checkpoint / "config.json").get("model", {})
    base = model_cfg.get("path")
    if not base:
        raise CheckpointError(f"{checkpoint}/config.json names no model.path; cannot find the base "
                              "model to merge the adapter into")
    dtype = model_cfg.get("dtype", "auto")
    try:
        folder = resolve_model_path(base)
        # the training dtype, so the merged weights are what the adapter was trained against
        model = AutoModelForImageTextToText.from_pretrained(
            folder, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        with warnings.catch_warnings():
            # peft probes the deprecated `is_gradient_checkpointing` property; not our call site
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            merged = PeftModel.from_pretrained(model, str(model_dir)).merge_and_unload()
        processor = AutoProcessor.from_pretrained(str(model_dir))
    except (ModelConfigError, OSError, ValueError, KeyError, AttributeError) as exc:
        message = " ".join(str(exc).split())
        raise CheckpointError(f"{checkpoint}: cannot merge the LoRA adapter into its base model "
                              f"{base!r}: {message}") from exc
    merged.save_pretrained(dest)
    processor.save_pretrained(dest)
    return base


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
