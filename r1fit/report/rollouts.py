"""Sampled rollouts for the run report's browser: every ``report.rollouts_every`` GRPO steps rank 0
writes its rows of the step to ``<output_dir>/rollouts/step_NNNNNN.jsonl``, one JSON object per
completion (step, row, group, prompt, completion, reward, components, advantage, images), and each
prompt's images once, as small PNGs beside it (``step_NNNNNN_gGGG_K.png``; ``images`` holds
their names, relative to the folder).

A multi-turn row (with tools) adds ``turns`` and ``ended`` (why the trajectory ended); its
``completion`` is :func:`~r1fit.report.sinks.trajectory_text`. Each turn is ``{"text", "tokens",
"ended", "calls", "results"}``: a call is ``{"name", "arguments"}`` or ``{"malformed": reason}``, a
result ``{"name", "error", "parts"}`` whose parts are ``{"text": ...}`` or ``{"image": file}``, the
images the tools returned saved beside the prompts' (``step_NNNNNN_rRRRR_tT_K.png``: row, turn,
K-th image of the turn's results)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from r1fit.errors import naming
from r1fit.report.metrics import counters, plain, read_json_lines
from r1fit.report.sinks import sample_rows
from r1fit.rollout.record import Rollout, Trajectory, Turn
from r1fit.tools import MalformedCall, ToolCall

THUMBNAIL = 192  # pixels of an image's longer side in the report


def rollout_file(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}.jsonl"


def save_rollout(rollout: Rollout, processor: Any, folder: Path) -> Path:
    """Write this process's rows of a scored rollout, and its prompts' images, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"step_{rollout.step:06d}"
    rows = sample_rows(rollout, processor, limit=len(rollout.completions))
    written: dict[int, list[str]] = {}  # group -> its images' file names
    lines = []
    for i, (row, prompt) in enumerate(zip(rows, rollout.rows)):
        index = rollout.first_row + i
        group = index // rollout.num_generations
        if group not in written:
            written[group] = [save_thumbnail(image, folder, f"{stem}_g{group:03d}_{k}")
                              for k, image in enumerate(prompt.sample.images)]
        record = {
            "step": rollout.step, "row": index, "group": group, "prompt": row.prompt,
            "completion": row.completion, "reward": plain(row.reward),
            "components": {k: plain(v) for k, v in row.components.items()},
            "advantage": plain(row.advantage), "images": written[group]}
        if len(prompt.sample.turns) > 2:  # a conversation: the turns before its last question
            record["context"] = [list(turn) for turn in prompt.sample.turns[:-2]]
        if rollout.trajectories is not None:
            record.update(trajectory_record(rollout.trajectories[i], folder,
                                            f"{stem}_r{index:04d}"))
        lines.append(json.dumps(record))
    path = rollout_file(folder, rollout.step)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def save_thumbnail(image: Image.Image, folder: Path, stem: str) -> str:
    """Save a small RGB copy of ``image`` as ``folder/<stem>.png``; return the file's name."""
    small = image.convert("RGB")
    small.thumbnail((THUMBNAIL, THUMBNAIL))
    with naming(folder / f"{stem}.png"):
        small.save(folder / f"{stem}.png")
    return f"{stem}.png"


def trajectory_record(trajectory: Trajectory, folder: Path, stem: str) -> dict[str, Any]:
    """A row's ``turns`` and ``ended``; the tool images saved as ``<stem>_tT_K.png``."""
    return {"turns": [turn_record(turn, folder, f"{stem}_t{t}")
                      for t, turn in enumerate(trajectory.turns)],
            "ended": trajectory.ended}


def turn_record(turn: Turn, folder: Path, stem: str) -> dict[str, Any]:
    """One policy turn: its text, calls and their results, the K-th image its results returned
    saved as ``<stem>_K.png``."""
    images = 0
    results = []
    for result in turn.results:
        parts: list[dict[str, str]] = []
        for part in result.parts:
            if isinstance(part, str):
                parts.append({"text": part})
            else:
                parts.append({"image": save_thumbnail(part, folder, f"{stem}_{images}")})
                images += 1
        results.append({"name": result.name, "error": result.error, "parts": parts})
    return {"text": turn.text, "tokens": turn.tokens, "ended": turn.ended,
            "calls": [call_record(call) for call in turn.calls], "results": results}


def call_record(call: ToolCall | MalformedCall) -> dict[str, Any]:
    if isinstance(call, MalformedCall):
        return {"malformed": call.reason}
    return {"name": call.name, "arguments": call.arguments}


def read_rollouts(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Step -> its saved rows, oldest step first (empty when nothing was saved)."""
    steps = {}
    for path in sorted(folder.glob("step_*.jsonl")):
        # JSON lines, as metrics.jsonl; the page places each row by its step and group
        rows = read_json_lines(path, ("step", "group"), counters("step", "group")).rows
        if rows:
            steps[int(rows[0]["step"])] = rows
    return steps
