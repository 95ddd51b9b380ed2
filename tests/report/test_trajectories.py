"""Multi-turn rows (with tools) in the report, on hand-built trajectories: the step's turn, call and
end-reason figures (numbers worked out by hand), the saved rollouts' turns and tool images, the
trackers' text of a trajectory and the browser's turn-by-turn rendering; rows of one completion
stay as they were."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from r1fit.algorithms.losses import LossSettings
from r1fit.data.batch import Prompt, pad_rows
from r1fit.data.sample import Sample
from r1fit.report import step as step_module
from r1fit.report.html import build_report
from r1fit.report.rollouts import save_rollout
from r1fit.report.sinks import sample_rows
from r1fit.report.step import TurnFigures, step_metrics
from r1fit.rollout.record import Rollout, Trajectory, Turn
from r1fit.tools import MalformedCall, ToolCall, ToolResult

EOS, POLICY, TOOL = 9, 5, 7  # token ids: end of sequence, any policy token, any tool-turn token
ZOOM = ToolCall("zoom", {"x": 0.6, "y": 0.3, "factor": 4}, "<tool_call>...</tool_call>")
CROP = ToolCall("crop", {"x1": 0.0, "y1": 0.0, "x2": 1.2, "y2": 0.5}, "<tool_call>...</tool_call>")


def trajectory(prompt: Prompt, turns: list[Turn], ended: str) -> Trajectory:
    """A trajectory of ``turns``: each turn's policy tokens (the last an EOS when it ended on
    one), then its tool turn's ``context_tokens``."""
    ids: list[int] = []
    mask: list[float] = []
    for turn in turns:
        ids += [POLICY] * (turn.tokens - 1) + [EOS if turn.ended == "eos" else POLICY]
        ids += [TOOL] * turn.context_tokens
        mask += [1.0] * turn.tokens + [0.0] * turn.context_tokens
    images = [p for turn in turns for r in turn.results for p in r.parts if isinstance(p, Image.Image)]
    return Trajectory(prompt, torch.tensor(ids), torch.tensor(mask), images=images, turns=turns,
                      ended=ended)


def three_trajectories(prompt: Prompt) -> list[Trajectory]:
    """2 turns, 1 call, ended on EOS; 3 turns, 3 calls (a bad crop, a malformed call, a crop
    with two images), 2 errors, ended at max_new_tokens; 2 turns, 1 call answered and the last
    turn's call not run, ended at max_turns."""
    red, blue, green = (Image.new("RGB", (400, 300), c) for c in ("red", "blue", "green"))
    return [
        trajectory(prompt, [
            Turn("Let me zoom. <tool_call>zoom</tool_call>", 5, "tool_call", (ZOOM,),
                 (ToolResult("zoom", (red, "zoomed x4")),), context_tokens=3),
            Turn("<answer>red</answer>", 4, "eos")], "eos"),
        trajectory(prompt, [
            Turn("Crop <tool_call>crop</tool_call>", 4, "tool_call", (CROP,),
                 (ToolResult.failure("crop", "x2=1.2 is outside [0, 1]"),), context_tokens=2),
            Turn("Again <tool_call>{bad</tool_call> <tool_call>crop</tool_call>", 6, "tool_call",
                 (MalformedCall("bad JSON", "{bad"), CROP),
                 (ToolResult.failure("", "bad JSON"), ToolResult("crop", ("two views:", blue, green))),
                 context_tokens=4),
            Turn("I cannot tell whether", 6, "length")], "max_new_tokens"),
        trajectory(prompt, [
            Turn("<tool_call>zoom</tool_call>", 3, "tool_call", (ZOOM,),
                 (ToolResult("zoom", (green,)),), context_tokens=2),
            Turn("Once more <tool_call>zoom</tool_call>", 5, "tool_call", (ZOOM,))], "max_turns"),
    ]


def scored_rollout(*, tools: bool, step: int = 4) -> Rollout:
    """Step ``step`` of 2 prompts x 3 generations; this process holds the first prompt's 3 rows
    (the 3 trajectories with ``tools``, else their tokens as plain completions)."""
    prompts = [Prompt(torch.tensor([1, 2]), {}, {}, Sample([Image.new("RGB", (64, 48), c)],
                                                           f"What colour is shape {g}?", "red",
                                                           f"builtin:shapes/train#{g}"))
               for g, c in enumerate(["red", "blue"])]
    trajectories = three_trajectories(prompts[0])
    return Rollout(step=step, prompts=prompts, num_generations=3, share=slice(0, 3),
                   completions=[t.token_ids for t in trajectories],
                   total_tokens=2 * (9 + 16 + 8),  # the policy's tokens, both processes'
                   rewards=torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0]),
                   components={"accuracy": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])},
                   correct=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
                   advantages=torch.tensor([1.0, -1.0, 0.0]),
                   trajectories=trajectories if tools else None)


def test_step_metrics_average_turns_calls_and_end_reasons_over_every_process_rows(monkeypatch):
    # a second process holds rows with the same figures: every sum doubles, its rows' calls
    # gather after this one's
    monkeypatch.setattr(step_module, "all_sum", lambda values: [2 * v for v in values])
    monkeypatch.setattr(step_module, "all_gather_rows", lambda t: torch.cat([t, t]))
    rollout = scored_rollout(tools=True)
    row = step_metrics(rollout, [{"loss": 0.5}], {"seconds_generate": 1.0}, [EOS])
    # this process: 2 + 3 + 2 turns, 1 + 3 + 1 calls, 0 + 2 + 0 errors; doubled, over 6 rows
    assert row["turns_mean"] == pytest.approx(14 / 6)
    assert row["tool_calls_mean"] == pytest.approx(10 / 6)
    assert row["tool_errors_mean"] == pytest.approx(4 / 6)
    assert {k: v for k, v in row.items() if k.startswith("trajectory_end/")} == pytest.approx({
        "trajectory_end/eos": 2 / 6, "trajectory_end/max_new_tokens": 2 / 6,
        "trajectory_end/max_turns": 2 / 6, "trajectory_end/max_trajectory_tokens": 0.0})
    # only the trajectory that ended on EOS ends with one: the others count as clipped
    assert row["completion_clipped_fraction"] == pytest.approx(1 - row["trajectory_end/eos"])
    assert row["completion_len_mean"] == pytest.approx(66 / 6)  # the policy's tokens only
    # 9 + 16 + 8 policy tokens, 3 + 6 + 2 of tool turns (both processes alike): 11 of 44 masked
    assert row["masked_token_fraction"] == pytest.approx(0.25)
    # calls 1, 3, 1 | 1, 3, 1 for rewards 1, 0, 0.5 | 1, 1, 1
    assert {k: v for k, v in row.items() if k.startswith("reward_by_tool_calls/")} == {
        "reward_by_tool_calls/1": pytest.approx(0.875), "reward_by_tool_calls/3": 0.5}

    plain = step_metrics(scored_rollout(tools=False), [{"loss": 0.5}], {"seconds_generate": 1.0},
                         [EOS])
    added = {"turns_mean", "tool_calls_mean", "tool_errors_mean", "trajectory_end/eos",
             "trajectory_end/max_new_tokens", "trajectory_end/max_turns",
             "trajectory_end/max_trajectory_tokens", "masked_token_fraction",
             "reward_by_tool_calls/1", "reward_by_tool_calls/3"}
    assert set(row) - set(plain) == added and set(plain) <= set(row)
    assert {k: row[k] for k in plain} == plain


def test_turn_figures_are_means_over_each_policy_turns_tokens():
    """Rows of 2, 3 and 2 policy turns with advantages 1, -1, 0 and ratios 1.5, 1, 0.5 (eps
    0.2/0.28: row 0 clipped), a KL of e - 2 on row 1's third turn only; whatever sits on the tool
    turns' tokens (inf here) counts nowhere. Two micro-batches: rows 0-1, then row 2."""
    rollout = replace(scored_rollout(tools=True), ref_logp=torch.zeros(3, 22))
    masks = pad_rows([t.policy_mask for t in rollout.trajectories], 22)
    logp = torch.where(masks > 0, -1.0, float("inf"))
    old = logp - torch.tensor([[math.log(1.5)], [0.0], [math.log(0.5)]])
    ref = logp.clone()
    ref[1, 16:] = logp[1, 16:] + 1  # row 1's third turn
    loss = LossSettings(0.2, 0.28)
    figures = TurnFigures.of(rollout, None, loss, max_turns=5)
    for piece, width in ((slice(0, 2), 22), (slice(2, 3), 10)):
        figures.add(piece, logp[piece, :width], old[piece, :width], ref[piece, :width],
                    rollout.advantages[piece], masks[piece, :width])
    # turn 1: 5 + 4 + 3 tokens, turn 2: 4 + 6 + 5, turn 3: 6 (row 1's)
    assert figures.sums == pytest.approx({
        "turn_advantage/1": 1 / 12, "turn_advantage/2": -2 / 15, "turn_advantage/3": -1.0,
        "turn_ratio/1": 13 / 12, "turn_ratio/2": 14.5 / 15, "turn_ratio/3": 1.0,
        "turn_clip_fraction/1": 5 / 12, "turn_clip_fraction/2": 4 / 15, "turn_clip_fraction/3": 0.0,
        "turn_kl/1": 0.0, "turn_kl/2": 0.0, "turn_kl/3": math.e - 2})
    # algo.mask_truncated leaving row 1 out: no third turn; without a reference, no KL
    kept = TurnFigures.of(replace(rollout, ref_logp=None), torch.tensor([True, False, True]),
                          loss, max_turns=5)
    kept.add(slice(0, 3), logp[:, :22], old[:, :22], None, rollout.advantages,
             masks * torch.tensor([[1.0], [0.0], [1.0]]))
    assert kept.sums == pytest.approx({
        "turn_advantage/1": 5 / 8, "turn_advantage/2": 4 / 9, "turn_ratio/1": 9 / 8,
        "turn_ratio/2": 8.5 / 9, "turn_clip_fraction/1": 5 / 8, "turn_clip_fraction/2": 4 / 9})
    plain = TurnFigures.of(scored_rollout(tools=False), None, loss, max_turns=5)
    plain.add(slice(0, 3), logp, old, ref, rollout.advantages, masks)
    assert plain.sums == {}


def test_sample_rows_show_a_trajectory_turn_by_turn_with_its_results():
    rows = sample_rows(scored_rollout(tools=True), processor=None)
    assert [r.completion.splitlines()[-1] for r in rows] == [
        "[ended: eos]", "[ended: max_new_tokens]", "[ended: max_turns]"]
    assert rows[1].completion == (
        "Crop <tool_call>crop</tool_call>\n"
        "-> error: crop: x2=1.2 is outside [0, 1]\n"
        "Again <tool_call>{bad</tool_call> <tool_call>crop</tool_call>\n"
        "-> error: bad JSON\n"
        "-> crop: two views: <image> <image>\n"
        "I cannot tell whether\n"
        "[ended: max_new_tokens]")
    assert rows[0].completion.startswith("Let me zoom. <tool_call>zoom</tool_call>\n"
                                         "-> zoom: <image> zoomed x4\n<answer>red</answer>\n")
    assert [r.reward for r in rows] == [1.0, 0.0, 0.5] and rows[0].image is not None


def test_saved_trajectory_rows_hold_their_turns_and_the_tools_images(tmp_path):
    rollout = scored_rollout(tools=True)
    path = save_rollout(rollout, None, tmp_path)
    saved = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["row"] for r in saved] == [0, 1, 2] and [r["ended"] for r in saved] == [
        "eos", "max_new_tokens", "max_turns"]
    assert saved[1]["completion"] == sample_rows(rollout, None)[1].completion
    assert [len(r["turns"]) for r in saved] == [2, 3, 2]
    assert saved[1]["turns"][1] == {
        "text": "Again <tool_call>{bad</tool_call> <tool_call>crop</tool_call>", "tokens": 6,
        "ended": "tool_call",
        "calls": [{"malformed": "bad JSON"},
                  {"name": "crop", "arguments": {"x1": 0.0, "y1": 0.0, "x2": 1.2, "y2": 0.5}}],
        "results": [{"name": "", "error": True, "parts": [{"text": "error: bad JSON"}]},
                    {"name": "crop", "error": False, "parts": [
                        {"text": "two views:"}, {"image": "step_000004_r0001_t1_0.png"},
                        {"image": "step_000004_r0001_t1_1.png"}]}]}
    assert saved[2]["turns"][1]["results"] == []  # the last turn's call was not run
    assert saved[0]["images"] == ["step_000004_g000_0.png"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "step_000004_g000_0.png", "step_000004_r0000_t0_0.png", "step_000004_r0001_t1_0.png",
        "step_000004_r0001_t1_1.png", "step_000004_r0002_t0_0.png"]
    blue = Image.open(tmp_path / "step_000004_r0001_t1_0.png")
    assert blue.size == (192, 144) and blue.getpixel((0, 0)) == (0, 0, 255)


def test_rows_of_one_completion_are_saved_as_before(tmp_path):
    processor = SimpleNamespace(tokenizer=SimpleNamespace(
        batch_decode=lambda rows, skip_special_tokens: [f"<answer>{len(r)}</answer>" for r in rows]))
    path = save_rollout(scored_rollout(tools=False), processor, tmp_path)
    assert path.read_text().splitlines()[1] == (
        '{"step": 4, "row": 1, "group": 0, "prompt": "What colour is shape 0?", '
        '"completion": "<answer>22</answer>", "reward": 0.0, "components": {"accuracy": 0.0}, '
        '"advantage": -1.0, "images": ["step_000004_g000_0.png"]}')
    assert [p.name for p in tmp_path.glob("*.png")] == ["step_000004_g000_0.png"]


def test_browser_shows_a_trajectory_turn_by_turn_with_the_tools_images(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 4, "reward_mean": 0.5, "turns_mean": 7 / 3, "tool_calls_mean": 5 / 3,
         "tool_errors_mean": 2 / 3, "trajectory_end/eos": 1 / 3,
         "trajectory_end/max_new_tokens": 1 / 3, "trajectory_end/max_turns": 1 / 3,
         "trajectory_end/max_trajectory_tokens": 0.0}) + "\n")
    save_rollout(scored_rollout(tools=True), None, run / "rollouts")
    page = build_report(run)
    assert {"turns and tool calls per row", "trajectories by end reason (fraction)"} <= set(
        re.findall(r"<figcaption>(.*?)</figcaption>", page))
    assert page.count('<div class="turn">') == 7 and page.count('<tr><td class="n" data-v=') == 3
    assert "<b>turn 2</b> (eos, 4 tokens)<pre>&lt;answer&gt;red&lt;/answer&gt;</pre>" in page
    assert '<div class="call">call zoom(x=0.6, y=0.3, factor=4)</div>' in page
    assert '<div class="call">malformed call: bad JSON</div>' in page
    assert page.count('<div class="result error">') == 2
    assert ('&rarr; crop<pre>two views:</pre><img src="rollouts/step_000004_r0001_t1_0.png" '
            'alt="tool image"><img src="rollouts/step_000004_r0001_t1_1.png" alt="tool image">'
            ) in page
    assert [page.count(f'<div class="ended">ended: {e}</div>')
            for e in ("eos", "max_new_tokens", "max_turns")] == [1, 1, 1]
    assert page.count('<img src="rollouts/step_000004_g000_0.png" alt="prompt image">') == 1


def test_a_conversations_earlier_turns_are_saved_as_its_context(tmp_path):
    """A LLaVA-style row of several turns: its prompt is the last question, and the turns before
    it (which the model saw) were missing from the saved rollout."""
    from dataclasses import replace

    processor = SimpleNamespace(tokenizer=SimpleNamespace(
        batch_decode=lambda rows, skip_special_tokens: ["<answer>x</answer>" for _ in rows]))
    rollout = scored_rollout(tools=False)
    turns = (("user", "<image>What is it?"), ("assistant", "A circle."),
             ("user", "What colour?"), ("assistant", "red"))
    first = rollout.prompts[0]
    rollout.prompts[0] = replace(first, sample=replace(first.sample, turns=turns))
    lines = save_rollout(rollout, processor, tmp_path).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows[0]["context"] == [["user", "<image>What is it?"], ["assistant", "A circle."]]
    two = replace(first.sample, turns=(("user", "<image>What colour?"), ("assistant", "red")))
    rollout = scored_rollout(tools=False)  # its rows are read once
    rollout.prompts[0] = replace(first, sample=two)
    assert "context" not in json.loads(save_rollout(rollout, processor, tmp_path)
                                       .read_text().splitlines()[0])
