"""benchmarks/time_model.py without its training runs: every configuration of its grid is a
valid config whose plan carries a time prediction; the verdict against the targets."""

from __future__ import annotations

import pytest
from benchkit import load_script

tm = load_script("time_model")


def test_every_configuration_is_a_valid_config():
    from r1fit.config import load_config

    for name, overrides in tm.GRID.items():
        load_config(tm.CONFIGS.get(name), [*tm.COMMON, *overrides])


# the built-ins planned here are cheap to build (bench-1024 and 3b-cut would take seconds each)
@pytest.mark.parametrize("name", sorted(n for n in tm.GRID if n.startswith(("tiny", "small"))))
def test_a_configuration_is_planned_with_its_time(name, use_tiny_cache):
    predicted = tm.predict(tm.GRID[name])
    assert predicted["step"] > 0 and predicted["generate"] > 0 and predicted["update"] > 0
    assert predicted["step"] >= predicted["generate"] + predicted["update"]


def test_a_tools_run_is_predicted_at_the_turns_it_took(use_tiny_cache):
    tools = tm.GRID["tiny-full-g8-tools"]
    assert tm.at_measured_turns(tools, {"step": 1.0}) == (tools, None)  # no turns: no tools
    one, turns = tm.at_measured_turns(tools, {"step": 1.0, "turns": 1.0})
    assert turns == 1.0 and one[-1] == "rollout.max_trajectory_tokens=32"  # one turn of 32
    # 1.25 turns: the longest trajectory, which the update pads to, is two turns and the tool
    # turn between them (the tiny tokenizer's framing and a 56 px zoom: 47 tokens)
    more, turns = tm.at_measured_turns(tools, {"step": 1.0, "turns": 1.25})
    assert turns == 1.25 and more[-1] == "rollout.max_trajectory_tokens=111"
    # the budget's four turns generate more than one turn, a quarter more than that one
    planned, measured, longer = tm.predict(tools), tm.predict(one, turns=1.0), \
        tm.predict(more, turns=1.25)
    assert measured["generate"] < longer["generate"] < planned["generate"]


def test_the_tool_policy_stands_in_for_its_placeholder(monkeypatch, tmp_path):
    monkeypatch.setattr(tm.benchkit, "zoom_policy", lambda: tmp_path / "final")
    overrides = tm.resolved(tm.GRID["zoom-sft-tools-g8-96"])
    assert overrides[0] == f"model.path={tmp_path / 'final'}"
    assert tm.resolved(["model.path=builtin:tiny"]) == ["model.path=builtin:tiny"]


def test_the_verdict(monkeypatch, capsys):
    """Two configurations 5% and 20% off: met (median 12.5%); one 40% off: missed (exit 1)."""
    import r1fit.memory.rates as rates

    monkeypatch.setattr(tm, "GRID", {"a": [], "b": []})
    monkeypatch.setattr(rates, "load_calibration", lambda device, threads=None: object())
    monkeypatch.setattr(tm, "cpu_ticks", lambda: None)  # no /proc: no run is disturbed
    monkeypatch.setattr(tm, "predict", lambda overrides, processes=1, turns=None, config=None: {
        "generate": 0.5, "score": 0.0, "update": 0.5, "step": 1.0, "source": "test"})
    measured = {"a": 1 / 1.05, "b": 1 / 1.2}
    monkeypatch.setattr(tm, "measure", lambda name, overrides, steps: {
        "generate": measured[name] / 2, "score": 0.0, "update": measured[name] / 2,
        "step": measured[name]})
    assert tm.main([]) == 0
    assert "median |error| 12%, worst 20% over 2 undisturbed" in capsys.readouterr().out
    measured["b"] = 1 / 1.4
    assert tm.main([]) == 1
    assert "MISSED" in capsys.readouterr().out


@pytest.mark.parametrize("name,processes", [("fsdp2-small-lora-g8-32-kl", 2),
                                            ("small-lora-g8-64", 1)])
def test_two_process_configurations_run_under_torchrun(monkeypatch, tmp_path, name, processes):
    """The fsdp2- configurations run under torchrun with 2 workers, OMP_NUM_THREADS left to it
    (a thread each), and are planned for 2 processes: their collectives in the step."""
    import json
    from pathlib import Path

    seen = {}

    def child(command, what, script, env=None):
        seen["command"], seen["env"] = command, env
        out = Path(next(c for c in command if c.startswith("train.output_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        row = {"reward_mean": 0.0, "seconds_generate": 1.0, "seconds_score": 0.0,
               "seconds_update": 2.0}
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(row) for _ in range(3)))
        return ""

    monkeypatch.setattr(tm, "run_child", child)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert tm.measure(name, tm.GRID[name], 3)["step"] == 3.0
    assert tm.PROCESSES.get(name, 1) == processes
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert (seen["command"][1:5] == launcher) is (processes == 2)
    assert "OMP_NUM_THREADS" not in seen["env"]


def test_a_two_process_plan_holds_the_collectives(use_tiny_cache):
    from r1fit.config import load_config
    from r1fit.memory.planner import plan_memory

    overrides = tm.GRID["fsdp2-small-lora-g8-32-kl"]
    plan = plan_memory(load_config(None, [*tm.COMMON, *overrides]), device_type="cpu", gpus=2)
    assert plan.time["details"]["collectives_seconds"] > 0
    assert tm.predict(overrides, 2)["step"] == pytest.approx(plan.time["step_seconds"])
