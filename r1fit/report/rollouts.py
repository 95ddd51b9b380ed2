"""Sampled rollouts for the run report's browser: every ``report.rollouts_every`` GRPO steps rank 0
writes its rows of the step to ``<output_dir>/rollouts/step_NNNNNN.jsonl``, one JSON object per
completion (step, row, group, prompt, completion, reward, components, advantage, images), and each
prompt's images once, as small PNGs beside it (``step_NNNNNN_gGGG_K.png``; ``images`` holds
their names, relative to the folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from r1fit.report.metrics import plain, read_metrics
from r1fit.report.sinks import sample_rows
from r1fit.rollout.record import Rollout

THUMBNAIL = 192  # pixels of an image's longer side in the report


def rollout_file(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}.jsonl"


def save_rollout(rollout: Rollout, processor: Any, folder: Path) -> Path:
    """Write this process's rows of a scored rollout, and its prompts' images, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = sample_rows(rollout, processor, limit=len(rollout.completions))
    written: dict[int, list[str]] = {}  # group -> its images' file names
    lines = []
    for i, (row, prompt) in enumerate(zip(rows, rollout.rows)):
        index = rollout.first_row + i
        group = index // rollout.num_generations
        if group not in written:
            written[group] = []
            for k, image in enumerate(prompt.sample.images):
                name = f"step_{rollout.step:06d}_g{group:03d}_{k}.png"
                small = image.convert("RGB")
                small.thumbnail((THUMBNAIL, THUMBNAIL))
                small.save(folder / name)
                written[group].append(name)
        lines.append(json.dumps({
            "step": rollout.step, "row": index, "group": group, "prompt": row.prompt,
            "completion": row.completion, "reward": plain(row.reward),
            "components": {k: plain(v) for k, v in row.components.items()},
            "advantage": plain(row.advantage), "images": written[group]}))
    path = rollout_file(folder, rollout.step)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_rollouts(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Step -> its saved rows, oldest step first (empty when nothing was saved)."""
    steps = {}
    for path in sorted(folder.glob("step_*.jsonl")):
        rows = read_metrics(path)  # JSON lines, as metrics.jsonl
        if rows:
            steps[int(rows[0]["step"])] = rows
    return steps
