"""``r1fit eval``'s files: ``eval.jsonl`` (one scored row per line), its images, and ``eval.html``,
one self-contained page in the run report's style (:mod:`r1fit.report.html`: its CSS, sortable
tables and multi-turn cells) that opens from disk: the summary, the bad rows, then each row's
images, question, reference answer and answers with their rewards.

A row of ``eval.jsonl``::

    {"index": 3, "id": "val.jsonl:4", "question": "...", "reference": "<answer>B</answer>",
     "reward_method": "mcq", "images": ["images/row_000003_0.png"], "pass": 1.0, "mean": 0.5,
     "answers": [{"text": "...", "accuracy": 1.0, "format": 1.0, "reward": 1.5,
                  "rewards": {"accuracy": 1.0, "format": 1.0}}, ...]}

``pass`` is the row's best answer's accuracy, ``mean`` its answers' mean. With tools an answer
also holds ``turns`` and ``ended`` (the trajectory, as the run report's rollouts hold it) and
``tool_calls``; ``text`` is its last turn, what the rewards scored. Image names are relative to
the folder of ``eval.jsonl``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from r1fit.report.html import CSS, SCRIPT, cell, turns_cell
from r1fit.report.metrics import plain
from r1fit.report.rollouts import save_thumbnail, trajectory_record
from r1fit.rollout.record import Trajectory

IMAGES = "images"  # the folder, beside eval.jsonl, of the rows' and tools' images


def save_row_images(images: Sequence[Image.Image], out: Path, index: int) -> list[str]:
    """Thumbnails of row ``index``'s images under ``out/images``; their names relative to
    ``out``."""
    folder = out / IMAGES
    folder.mkdir(parents=True, exist_ok=True)
    return [f"{IMAGES}/{save_thumbnail(image, folder, f'row_{index:06d}_{k}')}"
            for k, image in enumerate(images)]


def answer_record(text: str, accuracy: float, form: float, reward: float,
                  rewards: dict[str, float], trajectory: Trajectory | None, out: Path,
                  stem: str) -> dict[str, Any]:
    """One answer of a row; with a ``trajectory``, its turns (the tools' images saved under
    ``out/images`` as ``<stem>_tT_K.png``)."""
    record: dict[str, Any] = {"text": text, "accuracy": accuracy, "format": form,
                              "reward": plain(reward),
                              "rewards": {k: plain(v) for k, v in rewards.items()}}
    if trajectory is not None:
        folder = out / IMAGES
        folder.mkdir(parents=True, exist_ok=True)
        turns = trajectory_record(trajectory, folder, stem)
        for turn in turns["turns"]:  # names relative to out, as the rows' images
            for result in turn["results"]:
                for part in result["parts"]:
                    if "image" in part:
                        part["image"] = f"{IMAGES}/{part['image']}"
        record.update(turns, tool_calls=trajectory.tool_calls)
    return record


def write_rows(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """``eval.jsonl``: one row per line."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


#: the summary's figures the page and the terminal show, in order, with their labels
SHOWN = (("accuracy", "accuracy"), ("format", "format"), ("pass_at_k", "pass@{k}"),
         ("mean_at_k", "mean@{k}"), ("reward_mean", "reward (weighted sum)"), ("iou", "IoU (box rows)"),
         ("tool_use", "answers that called a tool"), ("size", "rows scored"), ("bad_rows", "bad rows"))


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of each figure of ``summary`` that is there, numbers to 3 decimals."""
    lines = []
    for key, label in SHOWN:
        if summary.get(key) is None:
            continue
        value = summary[key]
        shown = str(value) if isinstance(value, int) else f"{value:.3f}"
        lines.append((label.format(k=summary["samples"]), shown))
    return lines


PAGE_CSS = """
.prompt p{margin:2px 0 4px}
pre.reference{margin:0 0 6px;padding:2px 4px;background:#f6f6f6;display:inline-block}
"""


def build_page(summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """The page of an evaluation: ``summary`` (summary.json's) and its rows (eval.jsonl's),
    images linked relative to the page's folder."""
    title = f"r1fit eval: {summary['model']}"
    figures = "".join(f"<tr><th>{html.escape(label)}</th><td class=\"n\">{html.escape(value)}</td>"
                      "</tr>" for label, value in summary_lines(summary))
    how = ("greedy answers" if summary["samples"] == 1 else
           f"{summary['samples']} sampled answers per row")
    bad = summary.get("bad", [])
    bad_html = ("<ul>" + "".join(f"<li>{html.escape(message)}</li>" for message in bad)
                + "</ul>") if bad else "<p>none</p>"
    # the rewards' components besides accuracy and format (the same functions as those columns)
    names = sorted({name for row in rows for a in row["answers"] for name in a["rewards"]}
                   - {"accuracy", "format"})
    head = ("<tr><th>answer</th><th>text</th><th>accuracy</th><th>format</th><th>reward</th>"
            + "".join(f"<th>reward/{html.escape(n)}</th>" for n in names) + "</tr>")
    blocks = []
    for row in rows:
        images = "".join(f'<img src="{html.escape(name)}" alt="row image">'
                         for name in row["images"])
        body = "".join(
            f'<tr><td class="n" data-v="{j}">{j}</td>'
            + (turns_cell(a, html.escape) if "turns" in a else cell(a["text"]))
            + cell(a["accuracy"]) + cell(a["format"]) + cell(a["reward"])
            + "".join(cell(a["rewards"].get(n)) for n in names) + "</tr>"
            for j, a in enumerate(row["answers"]))
        # partial credit (fuzzy, iou) is a best score, not a pass
        verdict = "pass" if row["pass"] >= 1 else "fail" if row["pass"] <= 0 else \
            f"best {row['pass']:.3f}"
        blocks.append(
            f'<div class="prompt"><div class="images">{images}</div><div>'
            f'<p><b>row {row["index"]}</b> ({html.escape(row["id"])}, {verdict}, '
            f'mean accuracy {row["mean"]:.3f}): {html.escape(row["question"])}</p>'
            f'<p>reference answer (accuracy method {html.escape(row["reward_method"])}):</p>'
            f'<pre class="reference">{html.escape(row["reference"])}</pre>'
            f'<table class="sortable"><thead>{head}</thead><tbody>{body}</tbody></table>'
            "</div></div>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}{PAGE_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(summary['model'])} ({html.escape(summary['model_kind'])}) scored on
{html.escape(summary['data'])}: {html.escape(how)}, {summary['size']} rows. Accuracy and format
are scored as the run's evaluations score them; reward is the weighted sum of the config's
rewards.</p>
<h2>Summary</h2>
<table>{figures}</table>
<h2>Bad rows</h2>
{bad_html}
<h2>Rows</h2>
<p>Click a column to sort a row's answers.</p>
{chr(10).join(blocks) or "<p>No row was scored.</p>"}
<script>{SCRIPT}</script>
</body></html>
"""


def write_page(summary: dict[str, Any], rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Write ``eval.html`` (the images it links lie beside it)."""
    path.write_text(build_page(summary, rows), encoding="utf-8")
    return path
