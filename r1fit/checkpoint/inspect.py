"""``r1fit inspect PATH``: what a checkpoint, an output folder or a model folder holds, and whether
a run can resume from it.

Every answer is a plain dict (``--json`` prints it as is); :func:`render` turns it into lines of
text, or into rich tables on a terminal. Nothing here writes to the folders it reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from r1fit.checkpoint.files import read_json_object
from r1fit.checkpoint.manager import (
    CHECKPOINT_NAME,
    MANIFEST,
    MODEL_DIR,
    PARTIAL,
    TRAINER_STATE,
    CheckpointError,
    checkpoint_order,
    command_of,
    list_checkpoints,
    missing_for_resume,
    read_best,
    verify,
)
from r1fit.report.blocks import print_blocks
from r1fit.units import format_bytes

# file names that make a folder a Hugging Face model folder (weights, or a peft adapter)
_ADAPTER = "adapter_config.json"
_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def inspect_path(path: Path) -> dict[str, Any]:
    """Describe ``path``: a checkpoint, an output folder (``train.output_dir``) or a plain model
    folder. Raises :class:`CheckpointError` for anything else."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; give a checkpoint folder, a run's output folder "
                              "or a model folder")
    if (checkpoint_order(path) is not None or (path / TRAINER_STATE).is_file()
            or (path / MANIFEST).is_file()):
        return inspect_checkpoint(path)
    if is_model_folder(path) or (_in_checkpoint(path) and (path / "config.json").is_file()):
        return inspect_model(path)
    if list_checkpoints(path) or (path / "latest").is_file() or (path / "metrics.jsonl").is_file():
        return inspect_output_dir(path)
    raise CheckpointError(f"{path} is not a checkpoint, a run's output folder or a Hugging Face "
                          "model folder (no trainer_state.json, checkpoint-* folders, or "
                          "config.json with weights)")


def is_model_folder(path: Path) -> bool:
    if (path / _ADAPTER).is_file():
        return True
    return (path / "config.json").is_file() and any(any(path.glob(g)) for g in _WEIGHTS)


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """Step, phase, files and sizes of one checkpoint, whether it is intact (sizes and sha256
    against its manifest) and whether a run can resume from it exactly."""
    state = _trainer_state(path)
    match = CHECKPOINT_NAME.match(path.name.removesuffix(PARTIAL))
    problem = verify(path)
    missing = missing_for_resume(path) if state else []
    weights_only = state.get("weights_only", bool(missing) if state else None)
    if problem is not None:
        why = problem
    elif not state:
        why = "trainer_state.json is missing or unreadable"
    elif missing:
        why = (f"weights only: it has no {', no '.join(missing)}; "
               "checkpoint.resume_weights_only=true continues from its step with a fresh optimizer")
    else:
        why = None
    files = _files(path)
    return {
        "type": "checkpoint", "path": str(path), "name": path.name,
        "step": state.get("step", int(match.group(2)) if match else None),
        "phase": state.get("phase", ("warmup" if match.group(1) else None) if match else None),
        "kind": state.get("kind"), "saved_at": state.get("saved_at"),
        "world_size": state.get("world_size"),
        "r1fit_version": state.get("r1fit_version"), "weights_only": weights_only,
        "lora": (path / MODEL_DIR / _ADAPTER).is_file(),
        "base_model": read_json_object(path / MODEL_DIR / _ADAPTER).get("base_model_name_or_path"),
        "models": state.get("models", sorted(p.name for p in path.iterdir()
                                             if p.is_dir() and is_model_folder(p))),
        "files": files, "total_bytes": sum(f["bytes"] for f in files),
        "intact": problem is None, "problem": problem,
        "resumable": why is None, "why_not_resumable": why,
    }


def inspect_output_dir(path: Path) -> dict[str, Any]:
    """Every checkpoint of a run's output folder, newest first, with its status, and the
    ``latest`` / ``best`` markers."""
    latest_file, best_file = path / "latest", path / "best"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    best = read_best(path)
    rows = []
    for folder in list_checkpoints(path):
        info = inspect_checkpoint(folder)
        rows.append({key: info[key] for key in ("name", "step", "phase", "total_bytes", "intact",
                                                "problem", "weights_only", "resumable",
                                                "why_not_resumable")}
                    | {"latest": folder.name == latest,
                       "best": bool(best) and folder.name == best.get("checkpoint")})
    # what `checkpoint.resume=auto` picks (resume.find_resume_point): the newest intact one
    resume_from = next((r["name"] for r in rows if r["intact"]), None)
    names = {r["name"] for r in rows}
    return {
        "type": "output_dir", "path": str(path), "checkpoints": rows,
        "latest": latest, "latest_exists": latest in names if latest else None,
        "best": best, "best_unreadable": best_file.is_file() and best is None,
        "resume_from": resume_from,
        "final": str(path / "final") if is_model_folder(path / "final") else None,
    }


def inspect_model(path: Path) -> dict[str, Any]:
    """A plain Hugging Face model (or peft adapter) folder: what it is and why a run cannot
    resume from it."""
    lora = (path / _ADAPTER).is_file()
    config = read_json_object(path / (_ADAPTER if lora else "config.json"))
    base = config.get("base_model_name_or_path") if lora else None
    files = _files(path)
    parent = path.parent
    in_checkpoint = _in_checkpoint(path)
    problem = _weights_problem(path)
    if problem:
        start = "nor can a new run start from it: its weights are truncated or corrupt"
    elif lora:
        start = f"it is a LoRA adapter that needs its base model {base}"
    else:
        start = f"a new run can start from these weights with model.path={path}"
    why = ("a plain model folder holds weights only (no trainer_state.json, optimizer, "
           f"scheduler or RNG states); {start}")
    if in_checkpoint and not any(any(path.glob(g)) for g in _WEIGHTS):
        why = (f"these are the model's config and processor; its weights are sharded in "
               f"{parent / 'weights'}: resume from the checkpoint, or `r1fit export {parent} OUT` "
               "for a plain Hugging Face folder")
    return {
        "type": "model", "path": str(path), "lora": lora, "base_model": base,
        "architectures": read_json_object(path / "config.json").get("architectures") if not lora else None,
        "files": files, "total_bytes": sum(f["bytes"] for f in files),
        "in_checkpoint": str(parent) if in_checkpoint else None,
        "intact": problem is None, "problem": problem,
        "resumable": False, "why_not_resumable": why,
    }


# -- rendering ------------------------------------------------------------------------------------


def render(report: dict[str, Any], *, rich: bool = False) -> None:
    """Print ``report``: aligned plain text, or rich tables when ``rich`` (a terminal)."""
    blocks = {"checkpoint": _checkpoint_blocks, "output_dir": _output_dir_blocks,
              "model": _model_blocks}[report["type"]](report)
    print_blocks(blocks, rich=rich)


def _size(n: int) -> str:
    return format_bytes(n, decimal=True)


def _resumable(report: dict[str, Any]) -> str:
    return "resumable: yes" if report["resumable"] else f"resumable: no — {report['why_not_resumable']}"


def _checkpoint_blocks(r: dict[str, Any]) -> list[Any]:
    if r["weights_only"] is None:
        contents = "unknown (no trainer_state.json)"
    elif r["weights_only"]:
        contents = "weights only (no optimizer, scheduler or RNG states)"
    else:
        contents = "full (weights, optimizer, scheduler, RNG and data position)"
    model = f"LoRA adapter on {r['base_model']}" if r["lora"] else "full weights"
    if r["kind"] is None:  # no trainer_state.json to read: what its name says
        saved = [f"  step {r['step'] if r['step'] is not None else 'unknown'}, phase "
                 f"{r['phase'] or 'unknown'} (from its name: trainer_state.json is missing or "
                 "unreadable)"]
    else:
        saved = [f"  step {r['step']}, phase {r['phase']}, saved by {command_of(r['kind'])}",
                 f"  saved at {r['saved_at']} by r1fit {r['r1fit_version']}, "
                 f"{r.get('world_size') or '?'} process(es); resumes on any number"]
    return [
        f"checkpoint {r['path']}",
        *saved,
        f"  contents: {contents}; model: {model}",
        f"  integrity: {'ok (sizes and sha256 match the manifest)' if r['intact'] else r['problem']}",
        "files:",
        (("size", "file"), [(_size(f["bytes"]), f["path"]) for f in r["files"]], {0}),
        f"  {_size(r['total_bytes'])} in {len(r['files'])} files",
        _resumable(r),
    ]


def _output_dir_blocks(r: dict[str, Any]) -> list[Any]:
    rows = []
    for c in r["checkpoints"]:
        marks = ", ".join(m for m in ("latest", "best") if c[m])
        if c["resumable"]:
            status = "ok"
        elif c["intact"]:
            status = "ok, weights only" if c["weights_only"] else f"ok, {c['why_not_resumable']}"
        else:
            status = c["problem"]
        rows.append((c["name"], c["step"], _size(c["total_bytes"]), marks, status))
    blocks: list[Any] = [f"output folder {r['path']}"]
    if rows:
        blocks.append((("checkpoint", "step", "size", "mark", "status"), rows, {1, 2}))
    else:
        blocks.append("  no checkpoints")
    if r["latest"] and not r["latest_exists"]:
        blocks.append(f"latest: {r['latest']} (no such checkpoint)")
    if r["best"]:
        b = r["best"]
        blocks.append(f"best: {b.get('checkpoint')} ({b.get('metric')} = {b.get('value')})")
    elif r.get("best_unreadable"):
        blocks.append("best: the file 'best' is unreadable (a resume forgets it and keeps the "
                      "best anew)")
    resume = r["resume_from"]
    if resume is None:
        blocks.append("checkpoint.resume=auto: no intact checkpoint to continue from")
    elif any(c["name"] == resume and c["weights_only"] for c in r["checkpoints"]):
        blocks.append(f"checkpoint.resume=auto continues from: {resume} (weights only: needs "
                      "checkpoint.resume_weights_only=true)")
    else:
        blocks.append(f"checkpoint.resume=auto continues from: {resume}")
    if r["final"]:
        blocks.append(f"final model: {r['final']}")
    return blocks


def _model_blocks(r: dict[str, Any]) -> list[Any]:
    what = (f"LoRA adapter folder (base model: {r['base_model']})" if r["lora"] else
            f"Hugging Face model folder ({', '.join(r['architectures'] or ['unknown architecture'])})")
    blocks: list[Any] = [f"{what} {r['path']}"]
    if r["in_checkpoint"]:
        blocks.append(f"  the model of checkpoint {r['in_checkpoint']} (inspect that for its "
                      "training state)")
    if r["problem"]:
        blocks.append(f"  integrity: {r['problem']}")
    blocks += ["files:", (("size", "file"), [(_size(f["bytes"]), f["path"]) for f in r["files"]],
                          {0}),
               f"  {_size(r['total_bytes'])} in {len(r['files'])} files", _resumable(r)]
    return blocks


# -- helpers --------------------------------------------------------------------------------------


def _files(path: Path) -> list[dict[str, Any]]:
    return [{"path": str(p.relative_to(path)), "bytes": p.stat().st_size}
            for p in sorted(path.rglob("*")) if p.is_file()]


def _weights_problem(path: Path) -> str | None:
    """Which ``*.safetensors`` files of a model folder safetensors cannot open (truncated or
    corrupt), and why; None when all open. Reads their headers only."""
    from r1fit.models.load import safetensors_problem

    problems = [f"{f.name} is truncated or corrupt ({why})" for f in sorted(path.glob("*.safetensors"))
                if (why := safetensors_problem(f))]
    return "; ".join(problems) + "; download or export it again" if problems else None


def _in_checkpoint(path: Path) -> bool:
    parent = path.parent
    return checkpoint_order(parent) is not None or (parent / TRAINER_STATE).is_file()


def _trainer_state(path: Path) -> dict[str, Any]:
    return read_json_object(path / TRAINER_STATE)
