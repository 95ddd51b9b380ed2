"""The run report: one self-contained HTML file (``<output_dir>/report.html``) that opens from disk
with no network: inline CSS, inline SVG plots drawn here, one small inline script that sorts the
rollout tables. Alarms first (:mod:`r1fit.report.alarms`), then plots of ``metrics.jsonl`` against
step (a plot whose keys the run never logged is left out), then the rollouts saved every
``report.rollouts_every`` steps (:mod:`r1fit.report.rollouts`), their images by relative path; a
multi-turn row (with tools) turn by turn, the tools' results and images under each call.

``r1fit report RUN_DIR`` writes it; training (GRPO or SFT) rewrites it at its end and every
``report.every`` steps (:class:`LiveReport`). An SFT run's page has its loss, grad norm, speed,
memory and evaluations: the GRPO plots, alarms and rollouts need keys it does not log.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from r1fit.errors import R1fitError, naming
from r1fit.report.alarms import AlarmWatch, check_alarms, grpo_rows
from r1fit.report.metrics import counters, plain, read_json_lines
from r1fit.report.rollouts import read_rollouts, save_rollout
from r1fit.rollout.record import Rollout
from r1fit.units import format_bytes, parse_bytes

log = logging.getLogger("r1fit.report")

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
WIDTH, HEIGHT = 340, 180
LEFT, RIGHT, TOP, BOTTOM = 62, 12, 10, 26  # margins of the plotting area

Points = list[tuple[float, float]]


class NotARun(R1fitError):
    """``r1fit report`` was given a folder without ``metrics.jsonl``."""


def number(value: float) -> str:
    return f"{value:.3g}"


def svg_plot(lines: dict[str, Points], fmt: Callable[[float], str] = number,
             level: float | None = None) -> str:
    """A line plot, one line per name (points sorted by x), with min/mid/max labels on y and the
    first and last x; ``level`` draws a dashed horizontal line (a prediction)."""
    xs = [x for points in lines.values() for x, _ in points]
    ys = [y for points in lines.values() for _, y in points] + ([level] if level is not None else [])
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.05 or abs(y0) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}">',
             f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="#fafafa" stroke="#bbb"/>']
    low, high = min(ys), max(ys)
    for y in [low, (low + high) / 2, high] if high > low else [low]:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                     f'stroke="#e4e4e4"/><text x="{LEFT - 4}" y="{py(y) + 4:.1f}" '
                     f'text-anchor="end">{html.escape(fmt(y))}</text>')
    for x, anchor in ((min(xs), "start"), (max(xs), "end")):
        parts.append(f'<text x="{px(x):.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}">'
                     f'{number(x)}</text>')
    if level is not None:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{py(level):.1f}" '
                     f'y2="{py(level):.1f}" stroke="#555" stroke-dasharray="5 4"/>')
    for colour, points in zip(COLOURS * 4, lines.values()):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                     f'stroke-width="1.6"/>')
        if len(points) <= 30:  # sparse lines (evaluations) show their points
            parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>'
                         for x, y in points)
    return "\n".join(parts + ["</svg>"])


def points(rows: Sequence[dict[str, Any]], key: str, axis: str = "step") -> Points:
    """(step, value) of every row with a finite number under ``key`` (and ``axis``)."""
    def number(value: Any) -> bool:  # JSON's NaN and Infinity literals are floats too
        return isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value)

    return [(float(r[axis]), float(r[key])) for r in rows
            if number(r.get(axis)) and number(r.get(key))]


def planned_peak(run_dir: Path) -> int | None:
    """The planner's peak, when start-up recorded one: ``memory.*_batch=auto`` logs it to log.txt
    (the last one, for a resumed run)."""
    log_file = run_dir / "log.txt"
    if not log_file.is_file():
        return None
    found = re.findall(r"planned peak ([\d.]+ \w+)\)", log_file.read_text(errors="replace"))
    try:
        return parse_bytes(found[-1].replace(" ", "")) if found else None
    except ValueError:
        return None


def figure(title: str, lines: dict[str, Points], note: str = "", *,
           fmt: Callable[[float], str] = number, level: float | None = None) -> str:
    legend = " ".join(f'<span><i style="background:{c}"></i>{html.escape(name)}</span>'
                      for c, name in zip(COLOURS * 4, lines))
    if level is not None:
        legend += ' <span><i class="dash"></i>prediction</span>'
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>\n'
            f'{svg_plot(lines, fmt, level)}\n<div class="legend">{legend}</div>'
            + (f'<div class="note">{html.escape(note)}</div>' if note else "") + "</figure>")


def plots(rows: Sequence[dict[str, Any]], run_dir: Path) -> list[str]:
    """One figure per plot whose keys the run logged."""
    keys = {k for r in rows for k in r}
    components = sorted(k for k in keys if k.startswith("reward/"))
    ends = sorted(k for k in keys if k.startswith("trajectory_end/"))
    specs: list[tuple[str, list[str]]] = [
        ("reward", ["reward_mean", *components]),
        ("accuracy", ["accuracy", "eval/accuracy", "eval/iou"]),
        ("loss", ["loss"]),
        ("kl", ["kl"]),
        ("entropy (nats per token)", ["entropy"]),
        ("completion length (tokens)", ["completion_len_mean"]),
        ("completions clipped at algo.max_new_tokens (fraction)", ["completion_clipped_fraction"]),
        ("zero-variance groups (fraction)", ["zero_variance_groups"]),
        ("turns and tool calls per row", ["turns_mean", "tool_calls_mean", "tool_errors_mean"]),
        ("trajectories by end reason (fraction)", ends),
        ("clip_fraction", ["clip_fraction"]),
        ("grad_norm", ["grad_norm"]),
        ("learning_rate", ["learning_rate"]),
        ("tokens_per_second", ["tokens_per_second"]),
        # predicted_seconds_*: the time model's at start (r1fit/memory/prediction.py)
        ("seconds per step, measured and predicted",
         [f"{p}seconds_{phase}" for p in ("", "predicted_")
          for phase in ("generate", "score", "update", "step")]),
    ]
    out = []
    for title, names in specs:
        lines = {name: p for name in names if (p := points(rows, name))}
        if lines:
            out.append(figure(title, lines))
    memory = points(rows, "peak_memory_bytes")
    if memory:
        planned = planned_peak(run_dir)
        note = (f"planner's prediction: {format_bytes(planned)}" if planned is not None else
                "planner's prediction: not recorded (only memory.*_batch=auto runs record one)")
        out.append(figure("peak memory", {"peak_memory_bytes": memory}, note, fmt=format_bytes,
                          level=planned))
    warmup = {name: p for name in ("warmup/loss",) if (p := points(rows, name, "warmup/step"))}
    if warmup:
        out.append(figure("warm-up (SFT) loss", warmup))
    return out


#: the multi-turn diagnostics (with tools): plot title, and the prefix of its keys, one per
#: turn or per number of tool calls (r1fit/report/step.py)
TURN_PLOTS = [
    ("advantage per policy token, by turn", "turn_advantage/"),
    ("importance ratio to the old policy, by turn (policy tokens)", "turn_ratio/"),
    ("clipped policy tokens (fraction), by turn", "turn_clip_fraction/"),
    ("KL to the reference (k3) per policy token, by turn", "turn_kl/"),
    ("mean reward by tool calls per row", "reward_by_tool_calls/"),
]


def turn_section(rows: Sequence[dict[str, Any]]) -> str:
    """The multi-turn diagnostics of a run with tools (empty for any other run): per step, the
    advantage, ratio, clip fraction and KL of each policy turn's tokens, the reward by number
    of tool calls, and the share of the trajectories' tokens out of the loss."""
    keys = {k for r in rows for k in r}
    if not any(k.startswith(prefix) for k in keys for _, prefix in TURN_PLOTS):
        return ""
    out = []
    for title, prefix in TURN_PLOTS:
        names = sorted((k for k in keys if k.startswith(prefix)),
                       key=lambda k: int(k.rsplit("/", 1)[1]))
        lines = {name: p for name in names if (p := points(rows, name))}
        if lines:
            out.append(figure(title, lines))
    masked = points(rows, "masked_token_fraction")
    if masked:
        out.append(figure("trajectory tokens out of the loss: tool turns (fraction)",
                          {"masked_token_fraction": masked}))
    return ('<h2 id="multi-turn">Multi-turn diagnostics</h2>\n<p>Per step, over the policy\'s '
            'tokens of each turn (1 = the first, before any tool turn): are the turns after a '
            'tool turn trained with the trajectory\'s advantage, clipped, drifting from the '
            'reference? And does calling tools pay?</p>\n<div class="plots">\n'
            + "\n".join(out) + "\n</div>")


def steps_done(rows: Sequence[dict[str, Any]]) -> str:
    """"12 GRPO steps (last step 12)", or an SFT run's "3 SFT steps (last step 3)": SFT rows have a
    step and a loss but no reward (the warm-up's have ``warmup/`` keys)."""
    grpo = grpo_rows(rows)
    done, kind = (grpo, "GRPO") if grpo else ([r for r in rows if "step" in r and "loss" in r],
                                              "SFT")
    if not done:
        return "0 steps"
    return f"{len(done)} {kind} steps (last step {done[-1]['step']})"


def cell(value: Any) -> str:
    """A table cell that sorts by its value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="n" data-v="{value}">{value:.3f}</td>'
    if value is None:
        return '<td class="n" data-v="">-</td>'
    return f'<td><pre>{html.escape(str(value))}</pre></td>'


def rollout_section(step: int, rows: list[dict[str, Any]], folder: Path, out: Path,
                    open_: bool) -> str:
    """A step's saved rollouts: per prompt its images and a sortable table of its completions."""
    names = sorted({k for r in rows for k in r.get("components", {})})
    head = ("<tr><th>row</th><th>completion</th><th>reward</th>"
            + "".join(f"<th>{html.escape(n)}</th>" for n in names) + "<th>advantage</th></tr>")
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(int(r["group"]), []).append(r)
    parts = [f'<details{" open" if open_ else ""}><summary>step {step}: {len(groups)} prompts, '
             f'{len(rows)} completions</summary>']

    def src(name: str) -> str:  # an image's path relative to the page
        return html.escape(Path(os.path.relpath(folder / name, out.parent)).as_posix())

    for group, members in groups.items():
        images = "".join(f'<img src="{src(name)}" alt="prompt image">'
                         for name in members[0].get("images", []))
        body = "".join(
            f'<tr><td class="n" data-v="{r["row"]}">{r["row"]}</td>'
            + (turns_cell(r, src) if "turns" in r else cell(r["completion"])) + cell(r["reward"])
            + "".join(cell(r.get("components", {}).get(n)) for n in names)
            + cell(r["advantage"]) + "</tr>" for r in members)
        parts.append(f'<div class="prompt"><div class="images">{images}</div><div>'
                     f'<p><b>group {group}</b>: {html.escape(members[0]["prompt"])}</p>'
                     f'<table class="sortable"><thead>{head}</thead><tbody>{body}</tbody>'
                     f'</table></div></div>')
    return "\n".join(parts + ["</details>"])


def turns_cell(row: dict[str, Any], src: Callable[[str], str]) -> str:
    """A multi-turn row's completion cell: turn by turn, the policy's text, its calls and their
    results (the tools' images shown), then why the trajectory ended."""
    turns = "".join(turn_html(t, turn, src) for t, turn in enumerate(row["turns"], 1))
    return (f'<td class="turns">{turns}<div class="ended">ended: '
            f'{html.escape(str(row.get("ended")))}</div></td>')


def turn_html(number: int, turn: dict[str, Any], src: Callable[[str], str]) -> str:
    calls = "".join(f'<div class="call">{html.escape(call_text(call))}</div>'
                    for call in turn["calls"])
    results = "".join(result_html(result, src) for result in turn["results"])
    return (f'<div class="turn"><b>turn {number}</b> ({html.escape(turn["ended"])}, '
            f'{turn["tokens"]} tokens)<pre>{html.escape(turn["text"])}</pre>{calls}{results}</div>')


def call_text(call: dict[str, Any]) -> str:
    """``call zoom(x=0.5, factor=4)``, or ``malformed call: <reason>``."""
    if "malformed" in call:
        return f"malformed call: {call['malformed']}"
    arguments = ", ".join(f"{k}={json.dumps(v)}" for k, v in call["arguments"].items())
    return f"call {call['name']}({arguments})"


def result_html(result: dict[str, Any], src: Callable[[str], str]) -> str:
    parts = "".join(f'<img src="{src(part["image"])}" alt="tool image">' if "image" in part
                    else f'<pre>{html.escape(part["text"])}</pre>' for part in result["parts"])
    return (f'<div class="result{" error" if result["error"] else ""}">'
            f'&rarr; {html.escape(result["name"] or "(malformed)")}{parts}</div>')


CSS = """
body{font:14px system-ui,sans-serif;margin:20px;color:#222;background:#fff}
h1{font-size:20px}h2{font-size:17px;margin-top:28px}
.alarm{background:#fdecea;border-left:5px solid #d62728;padding:6px 10px;margin:4px 0}
.ok{background:#eaf6ea;border-left:5px solid #2ca02c;padding:6px 10px}
.plots{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0;border:1px solid #ddd;padding:6px;background:#fff}
figcaption{font-weight:600;margin-bottom:4px;max-width:340px}
svg text{font-size:10px;fill:#444}
.legend span{margin-right:10px;font-size:12px}
.legend i{display:inline-block;width:12px;height:3px;margin:0 4px 3px 0}
.legend i.dash{border-top:2px dashed #555;height:0}
.note{font-size:12px;color:#555;max-width:340px}
.prompt{display:flex;gap:12px;margin:10px 0;border-top:1px solid #eee;padding-top:8px}
.images img{max-width:192px;display:block;margin-bottom:4px;border:1px solid #ccc}
table{border-collapse:collapse}th,td{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;user-select:none}
td.n{text-align:right;font-variant-numeric:tabular-nums}
pre{margin:0;white-space:pre-wrap;max-width:560px;font:12px ui-monospace,monospace}
.turn{border-left:3px solid #9ecae1;padding:2px 0 2px 6px;margin-bottom:6px}
.call{font:12px ui-monospace,monospace;color:#555}
.result{margin:3px 0 0 12px;padding-left:6px;border-left:3px solid #c7e9c0}
.result.error{border-left-color:#d62728;color:#a00}
.result img{max-width:192px;display:block;margin:2px 0;border:1px solid #ccc}
.ended{font-size:12px;color:#555}
"""

# click a column header to sort its table by it (again: the other way)
SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var col = Array.prototype.indexOf.call(th.parentNode.children, th);
    var down = th.dataset.down !== "1"; th.dataset.down = down ? "1" : "0";
    var key = function (tr) { var c = tr.children[col];
      return c.dataset.v !== undefined ? parseFloat(c.dataset.v) : c.textContent; };
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) { var x = key(a), y = key(b);
      if (typeof x === "number" && isNaN(x)) { return 1; }
      if (typeof y === "number" && isNaN(y)) { return -1; }
      return (x < y ? -1 : x > y ? 1 : 0) * (down ? -1 : 1); });
    rows.forEach(function (tr) { body.appendChild(tr); });
  });
});
"""


def skipped_note(skipped: list[str]) -> str:
    """What the page says of the lines of metrics.jsonl that could not be read (none: nothing)."""
    if not skipped:
        return ""
    lines = "line" if len(skipped) == 1 else "lines"
    return f" ({len(skipped)} unreadable {lines} skipped: {'; '.join(skipped)})"


def build_report(run_dir: Path, out: Path | None = None) -> str:
    """The report page of the run in ``run_dir``, with links relative to ``out`` (default
    ``run_dir/report.html``)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise NotARun(f"{run_dir} has no metrics.jsonl: not a run's output folder")
    out = Path(out) if out is not None else run_dir / "report.html"
    # a run killed mid-write: its whole lines, warned; a row with a step that is no number too
    rows, skipped = read_json_lines(metrics, check=counters("step"))
    alarms = check_alarms(rows)
    alarm_html = ("".join(f'<div class="alarm"><b>{html.escape(name)}</b>: '
                          f'{html.escape(message)}</div>' for name, message in alarms.items())
                  or '<div class="ok">no alarm</div>')
    folder = run_dir / "rollouts"
    saved = read_rollouts(folder) if folder.is_dir() else {}
    browser = ("\n".join(rollout_section(step, srows, folder, out, open_=i == len(saved) - 1)
                         for i, (step, srows) in enumerate(saved.items()))
               or "<p>No rollouts saved (report.rollouts_every=0, no GRPO step yet, or an SFT "
                  "run).</p>")
    summary_file = run_dir / "summary.json"
    summary = (f"<pre>{html.escape(summary_file.read_text())}</pre>"
               if summary_file.is_file() else "<p>No summary.json (the run has not finished).</p>")
    title = f"r1fit run report: {run_dir.resolve().name}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(str(run_dir.resolve()))}: {html.escape(steps_done(rows))}, {len(rows)} metrics
rows{html.escape(skipped_note(skipped))}.</p>
<h2>Alarms</h2>
{alarm_html}
<h2>Metrics</h2>
<div class="plots">
{chr(10).join(plots(rows, run_dir))}
</div>
{turn_section(rows)}
<h2>Rollouts</h2>
<p>Saved every report.rollouts_every steps (rank 0's rows). Click a column to sort.</p>
{browser}
<h2>Summary</h2>
{summary}
<script>{SCRIPT}</script>
</body></html>
"""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report page (atomically: a browser reloading it never sees half a page)."""
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    if out.is_dir():  # a folder to write it into, as cp takes one
        out = out / "report.html"
    page = build_report(run_dir, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        with naming(partial):
            partial.write_text(page, encoding="utf-8")
        partial.replace(out)
    except BaseException:
        partial.unlink(missing_ok=True)  # no half page left behind (a full disk)
        raise
    return out


class LiveReport:
    """What training feeds the report (rank 0 only; a no-op elsewhere): the rollouts due for
    saving, the alarms after each step, the page every ``report.every`` steps and at the end."""

    def __init__(self, report_cfg: Any, out: Path, *, main: bool) -> None:
        self.cfg, self.out, self.main = report_cfg, out, main
        self.watch = AlarmWatch(out / "metrics.jsonl") if main else None

    def save_rollout(self, rollout: Rollout, processor: Any) -> None:
        every = self.cfg.rollouts_every
        if self.main and every and rollout.step % every == 0:
            save_rollout(rollout, processor, self.out / "rollouts")

    def after_step(self, row: dict[str, Any]) -> None:
        if self.watch is None:
            return
        self.watch.add({k: plain(v) for k, v in row.items()})
        if self.cfg.every and row["step"] % self.cfg.every == 0:
            write_report(self.out)

    def finish(self) -> None:
        if self.main:
            log.info("run report: %s", write_report(self.out))
