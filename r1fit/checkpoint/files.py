"""Durable files: fsync, atomic replace, checksums, and state dicts as safetensors + JSON.

A state dict (an optimizer's, a scheduler's, RNG states) is split into its tensors, written to
``<name>.safetensors``, and everything else, written to ``<name>.json`` with each tensor replaced by a
``{"__tensor__": key}`` reference. Nothing is pickled, so loading a checkpoint cannot run code, and
the files are readable by any safetensors/JSON tool.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees either the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written .tmp left behind (a full disk)
        raise
    fsync_dir(path.parent)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` when it is missing or unreadable (inspect and export
    report what they find, they do not fail on a damaged folder)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _split(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().to("cpu").contiguous()
        return {_TENSOR: key}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"state dict keys must be strings to be saved as JSON, got {bad[0]!r}")
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_split(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_split(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot save a {type(value).__name__} in a checkpoint state dict")


def _join(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(_join(v, tensors) for v in value[_TUPLE])
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def save_state(folder: Path, name: str, state: Any) -> list[str]:
    """Write ``state`` as ``<name>.json`` (+ ``<name>.safetensors`` if it holds tensors); returns the
    file names written."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, tensors)
    written = [f"{name}.json"]
    (folder / f"{name}.json").write_text(json.dumps(skeleton, indent=1), encoding="utf-8")
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
        written.append(f"{name}.safetensors")
    return written


def load_state(folder: Path, name: str) -> Any:
    """The state saved by ``save_state`` (tensors on the CPU)."""
    skeleton = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    tensor_file = folder / f"{name}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
    return _join(skeleton, tensors)
