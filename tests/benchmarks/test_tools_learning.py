"""The bookkeeping of benchmarks/tools_learning.py on hand-made runs: the arms and what each
starts from, the evaluations read from metrics.jsonl, the verdict and the table; the parent on
faked children."""

from __future__ import annotations

import json

import pytest
from benchkit import BenchmarkError, load_script

tl = load_script("tools_learning")


def test_each_grpo_arm_starts_from_an_sft_arm_run_before_it():
    args = tl.parse_args(["--sft-steps", "7", "--grpo-steps", "3", "--variant", "algo.beta=0",
                          "--set", "data.shapes.zoom_hint=true", "--sft-eval-every", "2"])
    arms = tl.arms(args)
    order = [a.name for a in arms]
    assert order == ["sft-plain", "sft-tools", "grpo-plain", "grpo-tools", "grpo-tools-variant"]
    for arm in arms:
        if arm.start_from:
            assert order.index(arm.start_from) < order.index(arm.name)
            assert arm.command == "train" and "train.max_steps=3" in arm.overrides
        else:
            assert arm.command == "sft" and "sft.steps=7" in arm.overrides
            assert "sft.eval_every=2" in arm.overrides
        assert "data.shapes.zoom_hint=true" in arm.overrides  # --set: every arm
        # the plain arms run without the tool, the others with the config's
        assert ("tools=[]" in arm.overrides) == arm.name.endswith("plain")
    assert arms[2].start_from == "sft-plain" and arms[3].start_from == "sft-tools"
    assert arms[4].overrides[-1] == "algo.beta=0"


def test_the_first_and_last_evaluations_are_read(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.3, "eval/tool_use": 1.0}, {"step": 1, "loss": 0.1},
            {"step": 2, "reward_mean": 0.5, "eval/accuracy": 0.6, "eval/tool_use": 0.9}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, *_, last = tl.evaluations(metrics)
    assert (first["eval/accuracy"], last["eval/accuracy"], last["eval/tool_use"]) == (0.3, 0.6, 0.9)
    metrics.write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    with pytest.raises(BenchmarkError, match="no evaluation row"):
        tl.evaluations(metrics)


@pytest.mark.parametrize("tools, plain, minutes, met", [
    (0.60, 0.40, 12.0, True),    # +20 points
    (0.50, 0.40, 12.0, False),   # +10 points
    (0.60, 0.40, 25.0, False),   # too slow
])
def test_the_verdict_needs_15_points_within_20_minutes(tools, plain, minutes, met):
    arms = {"grpo-tools": tl.Arm("grpo-tools", "train", [], accuracy=tools, minutes=minutes),
            "grpo-plain": tl.Arm("grpo-plain", "train", [], accuracy=plain, minutes=5.0)}
    ok, line = tl.verdict(arms)
    assert ok is met
    assert line.startswith(f"grpo-tools - grpo-plain = {100 * (tools - plain):+.1f} points in "
                           f"{minutes:.1f} min") and line.endswith("met" if met else "missed")


def test_the_parent_runs_every_arm_and_exits_1_on_a_miss(tmp_path, monkeypatch, capsys):
    """Children faked: each writes the metrics an arm would; the table and exit status follow."""
    accuracy = {"sft-plain": 0.33, "sft-tools": 0.34, "grpo-plain": 0.35, "grpo-tools": 0.40,
                "grpo-tools-variant": 0.41}
    commands = []

    def fake_child(command, what, name, **kwargs):
        commands.append(command)
        out = next(a.split("=", 1)[1] for a in command if a.startswith("train.output_dir="))
        arm = what.split()[-1]
        rows = [{"step": 0, "eval/accuracy": 0.3},
                {"step": 1, "eval/accuracy": accuracy[arm],
                 **({} if "plain" in arm else {"eval/tool_use": 1.0})}]
        (tmp_path / "runs" / arm).mkdir(parents=True)
        (tmp_path / "runs" / arm / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
        assert out.endswith(arm)
        return ""

    monkeypatch.setattr(tl, "run_child", fake_child)
    assert tl.run(tl.parse_args(["--output-dir", str(tmp_path / "runs")])) == 1
    out = capsys.readouterr().out
    assert "| grpo-tools | 0.300 | 0.400 | 1.000 |" in out
    assert "| sft-plain | - | 0.330 | - |" in out
    assert "grpo-tools accuracy by step: 0: 0.300, 1: 0.400" in out  # every evaluation
    assert "grpo-tools - grpo-plain = +5.0 points" in out and out.rstrip().endswith("missed")
    grpo_tools = commands[3]
    assert grpo_tools[3] == "train" and f"model.path={tmp_path / 'runs' / 'sft-tools' / 'final'}" \
        in grpo_tools
    saved = json.loads((tmp_path / "runs" / "result.json").read_text())
    assert [a["name"] for a in saved][-1] == "grpo-tools-variant"
