"""torchrun on CPU (gloo): 2 processes train like 1, and checkpoints move between process counts.

Every run is a real ``torchrun --standalone --nproc-per-node N -m r1fit ...`` (or plain
``python -m r1fit`` for one process) on ``builtin:tiny``. Rollouts are sampled from per-row
streams and rewards are gathered before the group advantages, so 2 processes see the same global
batch as 1; what may differ is float summation order (FSDP's reduce-scatter sums the two ranks'
gradients), hence tolerances here, and bit-exact comparisons where the process count is the same.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r1fit.report.metrics import read_metrics

TINY = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
        "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=3",
        "memory.generation_batch=3", "data.shapes.train_size=50", "data.shapes.image_size=56",
        "data.max_pixels=3136", "rewards.lenreward:length=1.0", "rewards.format=0.5",
        "checkpoint.keep=0"]
GRPO = [*TINY, "train.max_steps=3", "sft.format_warmup_steps=2", "algo.num_iterations=2",
        "algo.beta=0.05", "checkpoint.every=2", "eval.every=0"]
SFT = [*TINY, "sft.steps=3", "checkpoint.every=2", "eval.before_train=false"]
# compared between process counts (timings, memory and the sizes in use are not)
COMPARED = ("loss", "grad_norm", "kl", "clip_fraction", "reward_mean", "reward_std", "accuracy",
            "completion_len_mean", "learning_rate", "eval/accuracy", "warmup/loss",
            "warmup/grad_norm")


def launch(processes: int, command: str, out: Path, plugins: Path, *args: str) -> None:
    """``r1fit <command>`` on ``processes`` CPU processes; fails the test with its stderr."""
    r1fit = ["-m", "r1fit", command, f"train.output_dir={out}", *args]
    cmd = ([sys.executable, *r1fit] if processes == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", *r1fit])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def rows(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def compared(row: dict) -> dict:
    return {k: row[k] for k in COMPARED if k in row}


def assert_close_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        cx, cy = compared(x), compared(y)
        assert cx.keys() == cy.keys()
        for key in cx:
            if cx[key] is None:
                assert cy[key] is None, key
            else:
                assert cy[key] == pytest.approx(cx[key], rel=1e-4, abs=1e-6), (x.get("step"), key)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_close_weights(a: Path, b: Path, *, start: Path | None = None,
                         exact: bool = False) -> None:
    """Bit-identical final weights, or (across process counts) weights whose difference is below
    0.1% of how far training moved them from ``start`` (the initial model): Adam divides by the
    gradient's running RMS, so a float-rounding difference in a near-zero gradient moves a weight
    by up to the learning rate, and element-wise tolerances would say nothing either way. A
    resume with a fresh optimizer lands at several % (Adam's first steps move every weight by
    about the learning rate)."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    if exact:
        for key in wa:
            assert torch.equal(wa[key].view(torch.uint8), wb[key].view(torch.uint8)), key
        return
    w0 = load_file(next(start.glob("models/tiny-v*/model.safetensors")))
    apart = sum(float((wa[k] - wb[k]).pow(2).sum()) for k in wa) ** 0.5
    moved = sum(float((wa[k] - w0[k]).pow(2).sum()) for k in wa) ** 0.5
    assert moved > 0.1 and apart / moved < 1e-3, (apart, moved)


@pytest.fixture(scope="module")
def grpo_runs(tiny_cache, tmp_path_factory):
    """The same GRPO run (warm-up, mu=2, KL to a frozen copy) on 1 and on 2 processes."""
    root = tmp_path_factory.mktemp("grpo")
    plugin = root / "plugins" / "lenreward.py"
    plugin.parent.mkdir()
    plugin.write_text("def length(completion, solution, **info):\n"
                      "    return len(completion) / 10\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        launch(1, "train", root / "one", plugin.parent, *GRPO)
        launch(2, "train", root / "two", plugin.parent, *GRPO)
        yield root, plugin.parent


def test_grpo_on_two_processes_equals_one(grpo_runs, tiny_cache):
    root, _ = grpo_runs
    one, two = rows(root / "one"), rows(root / "two")
    grpo = [r for r in one if "reward_mean" in r]
    assert len(grpo) == 3 and all(r["grad_norm"] > 0 for r in grpo)  # real updates compared
    assert_close_rows(one, two)
    assert_close_weights(root / "one", root / "two", start=tiny_cache)
    state = (root / "two" / "checkpoint-2" / "trainer_state.json").read_text()
    assert '"world_size": 2' in state
    shards = sorted(p.name for p in (root / "two" / "checkpoint-2" / "weights").glob("*.distcp"))
    assert len(shards) == 2  # one shard file per rank


def resume_from(root: Path, source: str, name: str, processes: int, plugins: Path) -> Path:
    """Copy run ``source``, go back to its checkpoint-2 and finish it on ``processes``."""
    out = root / name
    shutil.copytree(root / source, out)
    shutil.rmtree(out / "final")
    launch(processes, "train", out, plugins, *GRPO, f"checkpoint.resume={out / 'checkpoint-2'}")
    return out


@pytest.mark.parametrize("source, processes", [("two", 1), ("one", 2)],
                         ids=["saved-on-2-resumed-on-1", "saved-on-1-resumed-on-2"])
def test_resume_on_another_process_count(grpo_runs, tiny_cache, monkeypatch, source, processes):
    root, plugins = grpo_runs
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    out = resume_from(root, source, f"{source}-then-{processes}", processes, plugins)
    log = (out / "log.txt").read_text()
    assert "resumed grpo at step 2" in log and "RNG states are re-seeded" in log
    # step 3 continues with the saved weights AND optimizer moments: a fresh AdamW would move
    # every weight by about the learning rate, far outside these tolerances
    assert_close_rows(rows(root / source), rows(out))
    assert_close_weights(root / source, out, start=tiny_cache)


def test_resume_on_the_same_process_count_is_bit_exact(grpo_runs, tiny_cache, monkeypatch):
    root, plugins = grpo_runs
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    out = resume_from(root, "two", "two-then-2", 2, plugins)
    assert "re-seeded" not in (out / "log.txt").read_text()
    straight = [{k: v for k, v in r.items() if "seconds" not in k and "per_second" not in k
                 and "memory" not in k and "mfu" not in k} for r in rows(root / "two")]
    again = [{k: v for k, v in r.items() if "seconds" not in k and "per_second" not in k
              and "memory" not in k and "mfu" not in k} for r in rows(out)]
    assert straight == again
    assert_close_weights(root / "two", out, exact=True)


def test_export_consolidates_a_two_process_checkpoint(grpo_runs, tiny_cache, monkeypatch,
                                                      tmp_path):
    from transformers import AutoModelForImageTextToText

    from r1fit.checkpoint.export import export

    root, _ = grpo_runs
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    exported = export(root / "two" / "checkpoint-3", tmp_path / "plain")
    assert exported.what == "full"
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "plain")
    final = AutoModelForImageTextToText.from_pretrained(root / "two" / "final")
    for (name, a), (_, b) in zip(model.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name


def test_sft_on_two_processes_equals_one(tiny_cache, reward_plugin, monkeypatch, tmp_path):
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    launch(1, "sft", tmp_path / "one", reward_plugin, *SFT)
    launch(2, "sft", tmp_path / "two", reward_plugin, *SFT)
    one = rows(tmp_path / "one")
    assert len(one) == 3 and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in one)
    assert_close_rows(one, rows(tmp_path / "two"))
    assert_close_weights(tmp_path / "one", tmp_path / "two", start=tiny_cache)


def test_grpo_with_a_tool_on_two_processes_equals_one(tiny_cache, reward_plugin, tool_plugins,
                                                      monkeypatch, tmp_path):
    """Each rank runs its rows' trajectories (the scripted first-turn call, installed in each
    child by ``sitecustomize``, runs zoom): the turns, calls, rewards and the tools' counts summed
    over the ranks are those of one process."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    monkeypatch.setenv("PYTHONPATH", str(reward_plugin))  # launch() puts the tools' folder first
    args = [*GRPO, "data.shapes.kinds=[zoom]", "tools=[zoom]", "data.max_images=2",
            "rollout.max_turns=3", "algo.max_new_tokens=80", "rewards.toolreward:calls=1.0",
            "sft.format_warmup_steps=0", "checkpoint.every=0", "train.max_steps=1",
            "eval.before_train=false"]
    # one step: a second would sample 80-token turns from weights that differ in float rounding
    # (the two ranks' gradients summed in another order), which may change a token
    launch(1, "train", tmp_path / "one", tool_plugins, *args)
    launch(2, "train", tmp_path / "two", tool_plugins, *args)
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert_close_rows(one, two)
    (a,), (b,) = ([r for r in run if "reward_mean" in r] for run in (one, two))
    assert a["tool_calls_mean"] > 0 and a["grad_norm"] > 0
    for key in ("turns_mean", "tool_calls_mean", "tool_errors_mean", "tools/zoom/calls",
                "reward/toolreward:calls", "trajectory_end/eos", "eval/tool_use"):
        assert a[key] == b[key], key


def test_lora_on_two_processes_equals_one(tiny_cache, reward_plugin, monkeypatch, tmp_path):
    """LoRA: adapter-only shards, the KL reference is the policy with adapters off."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    args = [*GRPO, "model.lora.r=4", "checkpoint.every=0"]
    launch(1, "train", tmp_path / "one", reward_plugin, *args)
    launch(2, "train", tmp_path / "two", reward_plugin, *args)
    one = rows(tmp_path / "one")
    assert all(r["grad_norm"] > 0 and r["kl"] is not None for r in one if "reward_mean" in r)
    assert_close_rows(one, rows(tmp_path / "two"))
    a = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    # B starts at 0, so its norm is how far training moved it
    moved = sum(float(a[k].pow(2).sum()) for k in a if "lora_B" in k) ** 0.5
    apart = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    assert moved > 0 and apart / moved < 1e-3, (apart, moved)


def test_lora_adapters_in_bfloat16_on_two_processes(tiny_cache, reward_plugin, monkeypatch,
                                                    tmp_path):
    """model.lora.compute_dtype=model under FSDP2 (gloo): the sharded float32 adapters, gathered
    and multiplied in bfloat16 under autocast, train; a step's loss is finite on both ranks."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    out = tmp_path / "two"
    launch(2, "train", out, reward_plugin, *GRPO, "model.dtype=bfloat16", "model.lora.r=4",
           "model.lora.compute_dtype=model", "train.max_steps=2", "checkpoint.every=0")
    steps = [r for r in rows(out) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    weights = load_file(out / "final" / "adapter_model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any(float(w.abs().sum()) > 0 for k, w in weights.items() if "lora_B" in k)


def test_sigterm_to_torchrun_saves_once_and_resumes(tiny_cache, reward_plugin, monkeypatch,
                                                    tmp_path):
    """Pre-emption: torchrun passes SIGTERM to both ranks, which may get it during different
    steps; they agree on the step to stop after, save one checkpoint together and exit."""
    import signal
    import time

    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    out = tmp_path / "run"
    args = [*GRPO, "train.max_steps=500", "checkpoint.every=1000"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_plugin),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", "-m", "r1fit", "train",
                             f"train.output_dir={out}", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # wait for 2 GRPO steps
        lines = (out / "metrics.jsonl").read_text().splitlines() \
            if (out / "metrics.jsonl").is_file() else []
        if sum('"reward_mean"' in line for line in lines) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    saved = sorted(p.name for p in out.glob("checkpoint-[0-9]*"))
    assert len(saved) == 1, (saved, err[-2000:])
    assert err.count(f"stopped by a signal after step {saved[0].split('-')[1]}") == 2  # both ranks
    step = int(saved[0].split("-")[1])
    launch(2, "train", out, reward_plugin, *args, f"train.max_steps={step + 1}")
    grpo = [r["step"] for r in rows(out) if "reward_mean" in r]
    assert grpo == list(range(1, step + 2))
