"""Kill anywhere: SIGKILL a real ``r1fit train`` process at random moments and in the middle of a
checkpoint save, resume it by rerunning the same command, and check that the finished run is
bit-identical to an uninterrupted one (every metrics row and the final weights)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r1fit.report.metrics import read_metrics

ARGS = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
        "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=3",
        "memory.generation_batch=5", "data.shapes.train_size=50", "data.shapes.image_size=56",
        "data.max_pixels=3136", "rewards.lenreward:length=1.0", "rewards.format=0.5",
        "train.max_steps=6", "sft.format_warmup_steps=2", "checkpoint.every=1",
        "checkpoint.keep=2", "eval.every=3", "algo.beta=0.05", "algo.num_iterations=2"]
# dynamic sampling with a reward that is 0 for every completion of a red or green question (those
# groups have zero variance) and the completion's length otherwise: steps draw 1 to 3 batches
DYNAMIC = ["algo.dynamic_sampling=true", "algo.max_resample_batches=3", "rewards.accuracy=0",
           "rewards.format=0", "rewards.lenreward:length=0", "rewards.halfreward:reward=1.0"]
HALF_REWARD = """
def reward(completion, solution, **info):
    return 0.0 if solution in ("red", "green") else len(completion) / 10
"""


def start(out: Path, plugins: Path, *extra: str) -> subprocess.Popen:
    """Start the run; its stderr goes to a file (a pipe nobody reads could fill and block it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins),
                                                        os.environ.get("PYTHONPATH", "")])}
    err_path = out.parent / f"{out.name}.stderr.{time.monotonic_ns()}"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "r1fit", "train",
                                 f"train.output_dir={out}", *ARGS, *extra], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    proc.err_path = err_path  # type: ignore[attr-defined]
    return proc


def stderr(proc: subprocess.Popen) -> str:
    return proc.err_path.read_text()  # type: ignore[attr-defined]


def finish(out: Path, plugins: Path, *extra: str) -> None:
    """Rerun the command until the run completes (a run killed before its first checkpoint
    starts over by itself, saying so)."""
    proc = start(out, plugins, *extra)
    proc.wait(timeout=600)
    assert proc.returncode == 0, stderr(proc)[-2000:]


def kill_when(proc: subprocess.Popen, ready, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``proc`` as soon as ``ready()`` is true and wait for it to end; False if it
    finished first."""
    while proc.poll() is None:
        if ready():
            proc.send_signal(sig)
            proc.wait()
            return True
        time.sleep(0.001)
    return False


def run_straight(out: Path, plugins: Path, *extra: str) -> float:
    """Run to the end uninterrupted; returns the seconds from the model being loaded to the end."""
    proc = start(out, plugins, *extra)
    while not loaded(proc):
        assert proc.poll() is None, stderr(proc)[-2000:]
        time.sleep(0.01)
    began = time.perf_counter()
    proc.wait(timeout=600)
    assert proc.returncode == 0, stderr(proc)[-2000:]
    return time.perf_counter() - began


def kill_at_random_rows(out: Path, plugins: Path, straight: Path, training: float,
                        *extra: str) -> None:
    """Three attempts, each killed at a random point of its own run (R1FIT_KILL_SEED picks them),
    then finish. A point is "once metrics.jsonl has k rows, plus a random fraction of a row's
    time" (``training`` seconds over the ``straight`` run's rows): measured in rows, not seconds,
    so a machine faster or slower than during the straight run still kills inside the training
    (a time-based moment once outlived a run that ran faster than the straight one had)."""
    rng = random.Random(int(os.environ.get("R1FIT_KILL_SEED", "0")))
    rows = len((straight / "metrics.jsonl").read_text().splitlines())  # warm-up, eval, steps
    per_row = training / rows
    # each attempt resumes with less left to do, so the points move towards the end
    for attempt, (low, high) in enumerate([(1, rows - 4), (2, rows - 2), (3, rows - 1)]):
        k, seconds = rng.randint(low, high), rng.uniform(0.0, 0.5) * per_row
        proc = start(out, plugins, *extra)
        killed = kill_when(proc, after_rows(proc, out, k, seconds))
        saved = sorted(p.name for p in out.glob("checkpoint-*"))
        print(f"kill at row {k} + {seconds:.2f} s (of {rows} rows, {training:.1f} s in all): "
              f"killed={killed}, on disk: {saved}")
        assert killed or proc.returncode == 0, stderr(proc)[-2000:]
        assert killed or attempt > 0  # the first kill lands inside the training
    finish(out, plugins, *extra)


def test_sigkill_at_random_moments_and_during_saves(use_tiny_cache, reward_plugin, same_run,
                                                    tmp_path):
    straight = tmp_path / "straight"
    training = run_straight(straight, reward_plugin)

    # 1. during a save: the moment a checkpoint-*.partial folder appears (twice in a row)
    during_save = tmp_path / "during_save"
    for _ in range(2):
        proc = start(during_save, reward_plugin)
        assert kill_when(proc, lambda: any(during_save.glob("checkpoint-*.partial")))
    finish(during_save, reward_plugin)
    same_run(straight, during_save)

    # 2. a polite stop (SIGTERM, as a cluster pre-emption sends): save after the step, exit 143
    stopped = tmp_path / "sigterm"
    proc = start(stopped, reward_plugin)
    assert kill_when(proc, lambda: (stopped / "checkpoint-2").is_dir(), signal.SIGTERM)
    assert proc.returncode == 143, stderr(proc)[-2000:]
    assert re.search(r"stopped by a signal after step \d+, \S+checkpoint-\d+ saved; rerun the "
                     "same command to resume", stderr(proc))
    finish(stopped, reward_plugin)
    same_run(straight, stopped)

    # 3. at random moments of the training (after start-up: model loaded)
    anywhere = tmp_path / "anywhere"
    kill_at_random_rows(anywhere, reward_plugin, straight, training)
    same_run(straight, anywhere)


def test_sigkill_and_resume_with_dynamic_sampling(use_tiny_cache, reward_plugin, same_run,
                                                  tmp_path):
    """The prompt batches a step draws vary (the sampler's position is saved with them), and so do
    the kept groups: killed at random moments and resumed, the run equals an uninterrupted one."""
    (reward_plugin / "halfreward.py").write_text(HALF_REWARD)
    straight = tmp_path / "straight"
    training = run_straight(straight, reward_plugin, *DYNAMIC)
    steps = [r for r in read_metrics(straight / "metrics.jsonl") if "reward_mean" in r]
    assert any(r["sample_batches"] > 1 for r in steps[2:])  # the resumed steps redraw too
    assert any(0 < r["kept_groups"] for r in steps)
    killed = tmp_path / "killed"
    kill_at_random_rows(killed, reward_plugin, straight, training, *DYNAMIC)
    same_run(straight, killed)


@pytest.mark.vllm
def test_sigkill_and_resume_with_the_vllm_engine(hd32_dir, use_tiny_cache, vllm_installed,
                                                  reward_plugin, same_run, tmp_path):
    """The engine holds nothing a checkpoint must keep: its weights come from the policy before
    each rollout and each row's sampling from its seed, so a run killed in the middle and resumed
    equals an uninterrupted one, bit for bit."""
    engine = ["model.path=builtin:tiny-hd32", "rollout.engine=vllm",
              "rollout.vllm.kv_cache_memory=67108864", "data.max_prompt_tokens=256"]
    straight = tmp_path / "straight"
    proc = start(straight, reward_plugin, *engine)
    proc.wait(timeout=600)
    assert proc.returncode == 0, stderr(proc)[-2000:]
    rows = len((straight / "metrics.jsonl").read_text().splitlines())
    k = random.Random(int(os.environ.get("R1FIT_KILL_SEED", "0"))).randint(3, rows - 2)
    killed_run = tmp_path / "killed"
    proc = start(killed_run, reward_plugin, *engine)
    assert kill_when(proc, after_rows(proc, killed_run, k, 0.0))
    print(f"killed after row {k} of {rows}; on disk: "
          f"{sorted(p.name for p in killed_run.glob('checkpoint-*'))}")
    finish(killed_run, reward_plugin, *engine)
    same_run(straight, killed_run)


def loaded(proc: subprocess.Popen) -> bool:
    """The run has loaded its model (it logs "<kind> run: model ...") and starts training."""
    return proc.err_path.exists() and " run: model " in stderr(proc)  # type: ignore[attr-defined]


def after_rows(proc: subprocess.Popen, out: Path, rows: int, seconds: float):
    """A ``ready`` test: true ``seconds`` after the run (model loaded) has ``rows`` rows in its
    metrics.jsonl (a resumed run starts with the rows of its checkpoint)."""
    deadline: list[float] = []
    metrics = out / "metrics.jsonl"

    def ready() -> bool:
        if not deadline and loaded(proc) and metrics.is_file() \
                and len(metrics.read_text().splitlines()) >= rows:
            deadline.append(time.perf_counter() + seconds)
        return bool(deadline) and time.perf_counter() >= deadline[0]

    return ready


def test_sigkill_while_a_tool_call_runs(use_tiny_cache, reward_plugin, tool_plugins, same_run,
                                        tmp_path, monkeypatch):
    """GRPO with a tool, killed while a call runs in the middle of a step (the zoom has started:
    it touches a file, then takes 0.5 s) and resumed, equals an uninterrupted run: a step's
    trajectories, tool results included, come back from its seeds. The policy writes the call in
    its first turn (``toolpolicy``, installed in the child by ``sitecustomize``)."""
    tools = ["data.shapes.kinds=[zoom]", "tools=[slowtool:zoom]", "data.max_images=2",
             "rollout.max_turns=3", "algo.max_new_tokens=80", "rewards.toolreward:calls=1.0",
             "train.max_steps=3", "sft.format_warmup_steps=0", "eval.before_train=false"]
    monkeypatch.setenv("PYTHONPATH", str(reward_plugin))  # start() puts the tools' folder first
    straight = tmp_path / "straight"
    run_straight(straight, tool_plugins, *tools)
    rows = read_metrics(straight / "metrics.jsonl")
    assert rows[-1]["tools/zoom/calls"] > 0 and rows[-1]["tool_calls_mean"] > 0
    killed = tmp_path / "killed"
    marker = tmp_path / "calling"
    monkeypatch.setenv("R1FIT_TEST_TOOL_MARKER", str(marker))
    proc = start(killed, tool_plugins, *tools)
    assert kill_when(proc, call_after_rows(killed / "metrics.jsonl", len(rows) - 1, marker))
    assert any(killed.glob("checkpoint-*")), "killed before any checkpoint"
    monkeypatch.delenv("R1FIT_TEST_TOOL_MARKER")
    finish(killed, tool_plugins, *tools)
    same_run(straight, killed)


def call_after_rows(metrics: Path, rows: int, marker: Path):
    """A ``ready`` test: true once a tool call starts (``marker`` touched) after ``metrics`` has
    ``rows`` rows."""
    counted: list[bool] = []

    def ready() -> bool:
        if not counted:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
                marker.unlink(missing_ok=True)
                counted.append(True)
            return False
        return marker.exists()

    return ready
