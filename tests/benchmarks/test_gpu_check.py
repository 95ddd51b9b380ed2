"""benchmarks/gpu_check.py: its verdicts on made-up numbers (a missed target is a non-zero exit),
and the ``--cpu-smoke`` run (its stages on builtin:tiny on CPU): every stage ends ok, with numbers
in the table and the JSON (fsdp: torchrun with one process on gloo, killed and resumed, and a plain
run). Four stages are left out of the smoke here, whose code runs elsewhere:
trl (benchmarks/vs_trl.py, which tests/benchmarks/test_vs_trl.py runs on CPU against TRL),
plan7b (the plan stage's runs on another model folder, which only a GPU builds), and resume and
detcost (r1fit doctor's kill_and_resume and run_train, run for real by tests/doctor; their wiring
is tested here on fakes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchkit import load_script

gc = load_script("gpu_check")


def test_a_plan_may_be_10_percent_high_and_5_percent_low():
    assert gc.plan_verdict(110, 100) == pytest.approx((0.10, True))
    assert gc.plan_verdict(95, 100) == pytest.approx((-0.05, True))
    assert gc.plan_verdict(111, 100)[1] is False  # too pessimistic: wastes the card
    assert gc.plan_verdict(94, 100)[1] is False  # too low: an OOM on the GPU


def test_the_time_verdict_is_the_predicted_step_within_25_percent_of_the_measured():
    row = {"seconds_generate": 3.0, "seconds_score": 0.1, "seconds_update": 0.9,
           "predicted_seconds_generate": 3.5, "predicted_seconds_score": 0.1,
           "predicted_seconds_update": 1.4, "predicted_calibrated": 1.0}
    timing = gc.time_verdict(row)  # 5.0 s predicted against 4.0 s measured
    assert timing["error"] == pytest.approx(0.25) and timing["met"] and timing["calibrated"]
    assert gc.time_line(timing) == ("predicted/measured generate 3.50/3.00 s, update 1.40/0.90 s, "
                                    "step 5.00/4.00 s: +25%")
    over = gc.time_verdict({**row, "predicted_seconds_update": 1.5, "predicted_calibrated": 0.0})
    assert not over["met"] and gc.time_line(over).endswith("(uncalibrated rates)")
    assert gc.time_verdict({"seconds_generate": 1.0}) is None  # a run that logged no prediction


def test_the_calibration_line_names_the_rates_the_model_leans_on():
    rates = {"matmul": {"bfloat16": [[4096, 7.0e14], [8192, 8.0e14]]}, "copy_bytes_per_s": 3.0e12,
             "layer_step_s": [[1, 6e-4], [64, 7e-4]], "micro_batch_s": 0.012, "seconds": 41.2}
    assert gc.calibration_line(rates) == ("bf16 matmul 800 TFLOP/s, copy 3,000 GB/s, layer step "
                                          "0.60 ms, micro-batch 12.0 ms; 41 s")


def test_the_gpu_squeeze_budget_holds_micro_batch_4_and_not_g_by_the_plan(tmp_path):
    """The oom and autofit stages' budget on a GPU, planned on CPU from the real 3B config (a
    folder with the cut model's tokenizer and processor and the shipped config.json): the
    context plus the midpoint of the allocated peaks, so the allocator cap (budget - context)
    lies between micro_batch 4's plan and micro_batch G's."""
    import argparse
    import shutil

    from r1fit.memory.planner.estimate import CUDA_CONTEXT_BYTES
    from r1fit.models.builtin import shipped_config

    args = argparse.Namespace(cpu_smoke=True, models=str(tmp_path))
    gc.build(args, "3b", cut=True)
    real = tmp_path / "Qwen2.5-VL-3B-Instruct"
    shutil.copytree(tmp_path / "Qwen2.5-VL-3B-Instruct-cut", real)
    shutil.copy(Path(shipped_config(gc.HUB["3b"])) / "config.json", real / "config.json")
    args.cpu_smoke = False
    budget, plan = gc.squeeze_budget(args)
    g = gc.GPU.squeeze[0]
    fits, full = plan[f"planned_allocated_mb{gc.SQUEEZE_FITS}"], plan[f"planned_allocated_mb{g}"]
    assert int(budget) == plan["budget"] == CUDA_CONTEXT_BYTES + (fits + full) // 2
    assert fits < int(budget) - CUDA_CONTEXT_BYTES < full
    assert full > 9 * 2**30  # the real 3B shapes were planned, not the cut model's


def _rows(*retries_and_sizes):
    return [{"step": i + 1, "oom_retries": r, "micro_batch": m}
            for i, (r, m) in enumerate(retries_and_sizes)]


def test_the_oom_verdict_needs_a_retry_a_smaller_micro_batch_and_every_step():
    ok, text = gc.oom_verdict(_rows((2, 16), (0, 16)), steps=2, first_micro_batch=64)
    assert ok and text == "oom_retries 2, micro_batch 64 -> 16, steps [1, 2] of 2"
    assert not gc.oom_verdict(_rows((0, 64), (0, 64)), 2, 64)[0]  # the card held it: no OOM met
    assert not gc.oom_verdict(_rows((1, 32)), 2, 64)[0]  # a step lost
    assert not gc.oom_verdict([], 2, 64)[0]


def test_a_missed_target_exits_1_a_failed_stage_2():
    ok = {"status": "ok", "met": True, "rows": []}
    missed = {"status": "ok", "met": False, "rows": []}
    failed = {"status": "timeout", "error": "stage resume: no result in 150 s"}
    assert gc.exit_status({"plan": ok, "trl": {"status": "ok", "met": None}}) == 0
    assert gc.exit_status({"plan": missed, "trl": ok}) == 1
    assert gc.exit_status({"plan": ok, "resume": failed}) == 2
    assert gc.exit_status({"plan": missed, "resume": failed}) == 1
    # a stage the budget left no time to start is listed, not a failure
    skipped = {"status": "skipped", "error": "out of time (480 s budget spent)"}
    assert gc.exit_status({"plan": ok, "trl": skipped}) == 0
    assert gc.exit_status({"plan": missed, "trl": skipped}) == 1
    rows = [{"met": None}, {"met": True}, {"met": False}]
    assert gc.stage_status(rows) is False and gc.stage_status(rows[:2]) is True
    assert gc.stage_status(rows[:1]) is None


def test_a_missed_plan_in_a_stage_makes_the_check_exit_1(monkeypatch, tmp_path):
    """The parent's path from a stage's rows to its exit status, with the child faked."""
    result = {"rows": [{"item": "plan 3b-full-g8", "value": "+12.0%", "target": "-5%..+10%",
                        "met": False}], "data": {}}
    monkeypatch.setattr(gc, "run_child", lambda *a, **k: "gpu_check: result: "
                        + json.dumps(result))
    assert gc.main(["--cpu-smoke", "--only", "plan", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"]["plan"]["met"] is False and report["exit_status"] == 1
    assert "MISSED   +12.0% (target -5%..+10%)" in (tmp_path / "gpu_check.log").read_text()


def test_a_resume_proves_something_only_from_the_checkpoint_the_kill_came_after():
    line = "resumed grpo at step 1 from /x/killed/checkpoint-1"
    assert gc.resume_problem([line], 1) is None
    assert gc.resume_problem([line.replace("step 1", "step 3")], 1) == (
        "the rerun resumed at step 3, not 1: the kill came late")
    assert "did not resume" in gc.resume_problem([], 1)


def test_the_fsdp_stage_reads_the_backend_and_times_steps_after_the_first(tmp_path):
    log = ("2026-11-28 00:06:44,506 INFO r1fit: 1 processes (this is rank 0), nccl backend\n"
           "2026-11-28 00:06:45,000 INFO r1fit.distributed: FSDP2: 36 units and the root\n")
    assert gc.process_group(gc.RunOutput(tmp_path, [], log, 1.0)) == "nccl"
    assert gc.process_group(gc.RunOutput(tmp_path, [], "INFO r1fit: grpo run\n", 1.0)) is None
    rows = [{"seconds_generate": 9.0, "seconds_score": 1.0, "seconds_update": 9.0},
            {"seconds_generate": 2.0, "seconds_score": 0.5, "seconds_update": 1.0},
            {"seconds_generate": 4.0, "seconds_score": 0.5, "seconds_update": 3.0}]
    sharded = gc.step_times(rows)  # step 1 (warm-up) left out
    assert sharded == {"seconds_generate": 3.0, "seconds_score": 0.5, "seconds_update": 2.0,
                       "step": 5.5}
    assert gc.step_times(rows[:1])["step"] == 19.0  # one step: that one
    plain = {"seconds_generate": 2.0, "seconds_score": 0.5, "seconds_update": 0.25, "step": 2.75}
    assert gc.time_ratio_line(sharded, plain) == (
        "2.00x: 5.50 s vs 2.75 s a step after the first (generate 1.50x, update 8.00x)")


def test_the_fsdp_stage_keeps_what_ended_when_a_later_run_fails_or_has_no_time(tmp_path,
                                                                              monkeypatch):
    """The stage's rows come as its runs end: a kill-and-resume that fails leaves the backend and
    the plan rows, and the plain run is left out, not cut, where the time left cannot hold it."""
    import argparse

    log = "INFO r1fit: 1 processes (this is rank 0), gloo backend\nFSDP2: 2 units\n"
    straight = gc.RunOutput(tmp_path, [{"step": 1, "peak_memory_bytes": 100}], log, 50.0)

    def torchrun(values, out, what, **kwargs):
        if "killed" in what:
            raise gc.BenchmarkError(f"{what}: stopped at the stage's deadline")
        return straight

    monkeypatch.setattr(gc, "train_torchrun", torchrun)
    monkeypatch.setattr(gc, "train", lambda *a, **k: pytest.fail("no time for the plain run"))
    monkeypatch.setattr(gc, "plan_of", lambda *a, **k: {"allocated": 110})
    args = argparse.Namespace(cpu_smoke=True, models=str(tmp_path), deadline=None)
    monkeypatch.setattr(gc, "seconds_left", lambda args: 60.0)  # < 1.3 x the run's 50 s
    result = gc.stage_fsdp(args, tmp_path)
    rows = {r.item: r for r in result.rows}
    assert rows["fsdp process group (torchrun, 1 process)"].met is True
    assert rows["fsdp peak (torchrun) vs plan for one process"].value.endswith("+10.0%")
    resume = rows["fsdp kill and resume (torchrun, deterministic=true)"]
    assert resume.met is False and "stopped at the stage's deadline" in resume.value
    assert rows["fsdp plain run (no torchrun)"].value.startswith("not run: ")
    assert rows["fsdp plain run (no torchrun)"].met is None


def test_the_torchrun_launch_is_one_process_in_a_group_of_its_own():
    argv, env = gc.launch("train", ["train.max_steps=3"], torchrun=True)
    assert argv[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                         "--no-python", argv[0]]
    assert argv[8:] == ["-c", gc.LAUNCHER, "train", "train.max_steps=3"]
    assert env["R1FIT_ONE_PROCESS_GROUP"] == "1"
    plain, plain_env = gc.launch("train", ["train.max_steps=3"])
    assert plain == argv[7:] and "R1FIT_ONE_PROCESS_GROUP" not in plain_env


def test_descendants_finds_a_grandchild(tmp_path):
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; "
                              "time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while len(found := gc.descendants(child.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 1
    finally:
        for pid in [*gc.descendants(child.pid), child.pid]:
            os.kill(pid, 9)
        child.wait()


#: the smoke's stages here; resume and detcost run r1fit doctor's kill_and_resume and run_train,
#: which tests/doctor runs for real: their wiring is tested below on fakes (56 s saved)
SMOKED = [name for name in gc.STAGES if name not in ("trl", "plan7b", "resume", "detcost")]


def test_the_resume_and_detcost_stages_wire_the_doctors_runs(monkeypatch, tmp_path):
    """stage_resume: the straight run, then kill_and_resume on the same config (deterministic
    on, no overwrite, a checkpoint each step, kill after checkpoint 1), its seconds kept for
    stage_detcost, which reruns the same config with deterministic off."""
    import argparse

    import r1fit.doctor.selfcheck as selfcheck

    calls = []

    def run_train(values, out, **_):
        calls.append(("run", list(values), out))
        return out

    def kill_and_resume(values, out, *, straight, kill_after):
        calls.append(("kill", list(values), out, straight, kill_after))
        return selfcheck.Verdict("kill and resume", True, "identical", {"differences": []})

    monkeypatch.setattr(selfcheck, "run_train", run_train)
    monkeypatch.setattr(selfcheck, "kill_and_resume", kill_and_resume)
    args = argparse.Namespace(cpu_smoke=True, models=str(tmp_path / "models"))
    (tmp_path / "resume").mkdir()
    got = gc.stage_resume(args, tmp_path / "resume")
    (_, values, out), kill = calls[0], calls[1]
    assert out == tmp_path / "resume" / "straight" and kill[2:] == (tmp_path / "resume", out, 1)
    assert kill[1] == values and "train.deterministic=true" in values
    assert "train.overwrite=true" not in values and "checkpoint.every=1" in values
    assert f"train.max_steps={gc.RESUME_STEPS}" in values
    assert [(r.item, r.met) for r in got.rows] == [("resume deterministic=true", True)]
    cost = gc.stage_detcost(args, tmp_path / "detcost")
    assert calls[2][1] == [v.replace("deterministic=true", "deterministic=false") for v in values]
    assert cost.data["deterministic_seconds"] == got.data["straight_seconds"]
    assert "cost of train.deterministic=true" in cost.rows[0].item
    with pytest.raises(gc.BenchmarkError, match="run resume first"):
        gc.stage_detcost(args, tmp_path / "elsewhere" / "detcost")


@pytest.mark.slow
def test_the_smoke_runs_every_stage_with_numbers(tmp_path, capsys):
    # the compiled speed case (torch.compile: ~25 s on CPU) is tested in tests/rollout
    status = gc.main(["--cpu-smoke", "--out", str(tmp_path), "--only", *SMOKED,
                      "--speed-cases", "3b-lora", "3b-full", "step", "adapters", "vision"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    # every target the smoke holds is met: OOM recovery, auto-fit (the
    # planner's is for real sizes: shown, no verdict)
    assert status == 0 and report["exit_status"] == 0, gc.table(report["stages"])
    stages = report["stages"]
    assert list(stages) == SMOKED
    assert all(s["status"] == "ok" for s in stages.values()), {
        k: s.get("error") for k, s in stages.items()}
    for name in ("3b-lora-g8", "3b-full-g8"):
        run = stages["plan"]["data"][name]
        assert run["measured_bytes"] > 0 and run["plan"]["allocated"] > 0
        assert run["error"] == run["plan"]["allocated"] / run["measured_bytes"] - 1
        assert run["completion_len_mean"] == [8.0, 8.0]  # forced to algo.max_new_tokens
        assert run["speed"]["seconds_update"] > 0 and run["speed"]["mfu"] > 0
        assert any("share_prefill=auto: on (logits equal" in x for x in run["numerics"])
        # the time model's prediction beside the measured step (no verdict off a GPU)
        assert run["time"]["measured"]["update"] > 0 and run["time"]["predicted"]["update"] > 0
    assert stages["oom"]["met"] and stages["oom"]["data"]["kind"] == "simulated"
    memtrace = stages["memtrace"]["data"]  # the plan's phases; the history needs CUDA
    assert memtrace["plan_peak_phase"] in memtrace["plan_phases"] and "breakdown" not in memtrace
    assert stages["autofit"]["met"]
    sft = stages["sft"]["data"]  # r1fit sft's steps, measured, beside its plan's update phase
    assert sft["steps"] == [1, 2] and sft["measured_bytes"] > 0
    assert sft["error"] == sft["plan_update_allocated"] / sft["measured_bytes"] - 1
    assert [v["name"] for v in stages["numerics"]["data"]["verdicts"]] == ["shared prompt",
                                                                           "shared prefill"]
    speed = stages["speed"]["data"]  # both engines timed on the same rows, forced lengths
    for name in ("3b-lora", "3b-full"):
        assert speed[name]["hf"]["tokens_per_second"] > 0
        assert speed[name]["static"]["tokens_per_second"] > 0
        assert speed[name]["static"]["graphs"] is False  # CPU: eager
        profile = speed[name]["static"]["profile"]  # where a decode step's time goes
        assert profile["steps"] == gc.DECODE_PROFILE_STEPS[1] and profile["ms_per_step"] > 0
        assert profile["kinds_ms_per_step"]["matmul"] > 0
    # the second turn after a text tool turn: the kept cache gives the whole prefill's tokens
    turn = speed["3b-lora"]["turn"]
    assert turn["same_tokens"] is True and turn["appended"] > 0
    assert turn["kept_seconds"] > 0 and turn["whole_seconds"] > 0
    # the shared-prompt layout against the plain one, on the same rows: the same tokens
    shared = speed["3b-lora"]["shared"]
    assert shared["active"] and shared["same_tokens"] and shared["shared_ms_per_step"] > 0
    # the multi-GPU paths in one torchrun process (gloo here): FSDP2 on, kill and resume exact
    fsdp = stages["fsdp"]["data"]
    assert stages["fsdp"]["met"] and fsdp["backend"] == "gloo" and fsdp["resume_differences"] == []
    assert fsdp["resumed"][0].startswith(f"resumed grpo at step {gc.KILL_AFTER} ")
    assert fsdp["sharding"][0].startswith("FSDP2: ") and "over 1 process on cpu" in fsdp["sharding"][0]
    assert fsdp["peak_bytes"] > 0 and fsdp["plan"]["allocated"] > 0
    assert fsdp["step_seconds"]["torchrun"]["step"] > 0 and fsdp["step_seconds"]["plain"]["step"] > 0
    assert speed["3b-lora-step"]["seconds_generate"] > 0
    timing = speed["3b-lora-step"]["time"]  # the time model's step beside the measured one
    assert timing["predicted"]["generate"] > 0 and timing["measured"]["update"] > 0
    assert speed["3b-lora-step"]["engine_lines"][0] == "rollout.engine=static"
    # share_prefix=auto's decision, with its numbers, and the vision tower's two attentions
    assert speed["3b-lora-step"]["share_prefix_lines"][0].startswith(
        "memory.share_prefix=auto: on")
    # a micro-batch with the adapters in float32 and in bfloat16 under autocast, both timed
    adapters = speed["adapters"]
    assert all(s > 0 for k in ("float32", "model") for s in adapters["seconds"][k])
    assert adapters["cosine"] > 0.99 and adapters["difference"] < 0.1
    vision = speed["vision"]
    assert vision["calls"]["r1fit_flash_layout_sdpa"] == 32 < vision["calls"]["sdpa"]
    assert vision["difference"] < 1e-5
    for stage in SMOKED:
        assert stage in printed
    assert "==== r1fit" not in printed and (tmp_path / "gpu_check.log").stat().st_size > 0


def test_a_stage_child_gets_its_deadline_and_its_parts_keep_a_margin(monkeypatch):
    """The parent passes a stage's cap on as a deadline; the speed stage's step and vision case
    take their timeouts from it, less the margin the stage keeps to write its rows."""
    args = gc.parse_args(["--out", "x"])
    monkeypatch.setattr(gc.time, "time", lambda: 1000.0)
    command = gc.child_command(args, "speed", Path("w"), cap=420)
    assert command[command.index("--deadline") + 1] == "1420.0"
    assert "--deadline" not in gc.child_command(args, "speed", Path("w"))
    child = gc.parse_args(["--out", "x", "--deadline", "1420"])
    assert gc.seconds_left(child) == 420 - gc.STAGE_MARGIN
    assert gc.seconds_left(args) is None


def test_a_speed_case_without_the_time_for_it_is_not_run(monkeypatch):
    """A speed case with under half its cap left of the stage says so and starts nothing."""
    monkeypatch.setattr(gc.time, "time", lambda: 1000.0)
    args = gc.parse_args(["--out", "x", "--deadline", str(1000.0 + gc.STAGE_MARGIN + 40)])
    monkeypatch.setattr(gc, "run_child", lambda *a, **k: pytest.fail("a child was started"))
    result = gc.StageResult()
    gc.speed_adapters(args, result)
    assert [(r.item, r.value) for r in result.rows] == [("speed adapters",
                                                         "not run: 40 s left of the stage")]
    assert "adapters" not in result.data


def test_a_plan_takes_the_sharing_its_run_chose(use_tiny_cache, tmp_path):
    """memory.share_prefix=auto: planned as the larger path before a run, and as the run's own
    decision (its log.txt) after it, as r1fit doctor --check plans."""
    values = ["model.path=builtin:tiny", "memory.share_prefix=auto", "algo.num_generations=4",
              "train.prompts_per_step=2", "memory.micro_batch=4", "data.max_pixels=3136",
              "data.shapes.image_size=56", "data.eval=null"]  # as the stages' runs
    plans = {on: gc.plan_of([*values, f"memory.share_prefix={on}"], gpu=False)["allocated"]
             for on in ("true", "false")}
    assert plans["true"] != plans["false"]
    assert gc.plan_of(values, gpu=False)["allocated"] == max(plans.values())
    assert gc.plan_of(values, gpu=False, run_dir=tmp_path)["allocated"] == max(plans.values())
    for on, word in (("true", "on"), ("false", "off")):
        (tmp_path / "log.txt").write_text(f"INFO r1fit.forward: memory.share_prefix=auto: {word} "
                                          "(...)\n")
        assert gc.plan_of(values, gpu=False, run_dir=tmp_path)["allocated"] == plans[on]


def test_a_process_a_stage_left_in_a_session_of_its_own_is_ended():
    """A child started in its own session (as decode_speed and torchrun's worker are) with the
    check's mark outlives a kill of its stage's group: end_leftovers finds it by the mark."""
    import subprocess
    import sys

    mark = f"test-{os.getpid()}"
    env = {**os.environ, gc.MARK: mark}
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)  # not the check's: left alone
    try:
        for _ in range(100):  # its environ is readable once it has started
            if Path(f"/proc/{left.pid}/environ").read_bytes():
                break
        assert gc.end_leftovers(mark) == [left.pid]
        assert left.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        other.kill()
        left.kill()
        other.wait()
        left.wait()


@pytest.mark.parametrize("cases,timed_hf", [
    (["3b-lora-compiled"], {"3b-lora-compiled": True}),  # the default: HF in the same process
    (["3b-lora", "3b-lora-compiled"], {"3b-lora": True, "3b-lora-compiled": False}),
])
def test_hf_s_baseline_is_timed_once(monkeypatch, tmp_path, cases, timed_hf):
    """HF generate is timed in the graphs-only case where it runs (first), else in the compiled
    case; the graphs-only case alone carries the second turn and the shared-prompt layout."""
    commands = {}

    def case(args, result, name, command, cap, work):
        commands[name] = command
        return None

    monkeypatch.setattr(gc, "decode_case", case)
    args = gc.parse_args(["--out", str(tmp_path), "--speed-cases", *cases])
    gc.stage_speed(args, tmp_path)
    assert set(commands) == set(timed_hf)
    for name, timed in timed_hf.items():
        hf = [c for c in commands[name] if c.startswith("--hf-tokens=")]
        assert (hf != ["--hf-tokens=0"]) is timed and len(hf) == 1, (name, hf)
        assert ("--share-prompt" in commands[name]) is (name == "3b-lora")
    assert gc.SPEED_DEFAULT == ("3b-lora-compiled", "step")


def test_a_judged_decode_case_without_an_hf_baseline_misses_its_target():
    """A judged case without HF's numbers (HF generate not timed) misses its speed-up target,
    not left out; a compile that fell back is said on the rows."""
    r = {"static": {"roofline_fraction": 0.55}, "speedup_tokens_per_second": None,
         "compile": True}
    result = gc.StageResult()
    gc.decode_verdicts(result, "3b-lora-compiled", r, gpu=True, lora=True, compiled=True)
    assert [(x.value, x.met) for x in result.rows] == [
        ("no HF baseline (HF generate was not timed: see the log)", False),
        ("55% of the copy bandwidth's", True)]
    fell_back = gc.StageResult()
    gc.decode_verdicts(fell_back, "3b-lora-compiled", {**r, "speedup_tokens_per_second": 12.0,
                                                        "compile": False},
                       gpu=True, lora=True, compiled=True)
    assert [x.met for x in fell_back.rows] == [True, True]
    assert all("ran uncompiled" in x.target for x in fell_back.rows)
    aside = gc.StageResult()  # the graphs-only case: reported, not judged
    gc.decode_verdicts(aside, "3b-lora", {**r, "speedup_tokens_per_second": 8.0}, gpu=True,
                       lora=True, compiled=False)
    assert [x.met for x in aside.rows] == [None, None]
    nan = gc.StageResult()
    gc.decode_verdicts(nan, "3b-full", {**r, "static": {"roofline_fraction": float("nan")}},
                       gpu=True, lora=False, compiled=True)
    assert [x.met for x in nan.rows] == [False]


def test_a_decode_case_killed_at_its_cap_keeps_its_main_timings(monkeypatch, tmp_path):
    """decode_speed writes its main numbers to --partial before its extras: a case the stage
    must kill at its cap keeps them, with a row saying it was cut short."""
    import sys

    script = ("import json, sys, time; p = sys.argv[sys.argv.index('--partial') + 1]; "
              "open(p, 'w').write(json.dumps({'static': {'tokens_per_second': 7.0}})); "
              "time.sleep(60)")
    args = gc.parse_args(["--out", "x"])  # a GPU's run, no stage deadline
    result = gc.StageResult()
    got = gc.decode_case(args, result, "3b-lora", [sys.executable, "-c", script], cap=3,
                         work=tmp_path)
    assert got == {"static": {"tokens_per_second": 7.0}}
    assert [(x.item, x.met) for x in result.rows] == [("speed 3b-lora", False)]
    assert "cut short" in result.rows[0].value and "no result in 3 s" in result.rows[0].value
    # with under its floor left of the stage it starts nothing
    monkeypatch.setattr(gc.time, "time", lambda: 1000.0)
    late = gc.parse_args(["--out", "x", "--deadline", str(1000.0 + gc.STAGE_MARGIN + 30)])
    monkeypatch.setattr(gc, "run_child", lambda *a, **k: pytest.fail("a child was started"))
    rows = gc.StageResult()
    assert gc.decode_case(late, rows, "3b-lora", ["x"], cap=150, work=tmp_path) is None
    assert [(x.value, x.met) for x in rows.rows] == [("not run: 30 s left of the stage", False)]
