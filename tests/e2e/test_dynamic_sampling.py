"""DAPO dynamic sampling in whole runs on builtin:tiny: the groups a step keeps, the metrics it
logs, a step with nothing to learn from, an OOM redo that draws the same prompts, and 2 processes
that train like 1 on kept groups re-split over the ranks.

The reward (``halfreward:reward``) scores every completion of a red or green question 0 (those
groups have zero variance and are dropped) and the others by their length (they almost always
differ), so about half the groups of a batch are informative and steps often draw more batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r1fit.cli import main
from r1fit.report.metrics import read_metrics
from r1fit.report.rollouts import read_rollouts

TINY = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
        "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=3",
        "memory.generation_batch=16", "data.shapes.train_size=50", "data.shapes.image_size=56",
        "data.max_pixels=3136", "sft.format_warmup_steps=2", "eval.every=0",
        "algo.num_iterations=2", "algo.beta=0.05", "checkpoint.every=2", "checkpoint.keep=0",
        "rewards.accuracy=0", "rewards.format=0"]
DYNAMIC = [*TINY, "rewards.halfreward:reward=1.0", "algo.dynamic_sampling=true",
           "algo.max_resample_batches=3", "train.max_steps=5", "report.rollouts_every=1"]
VOLATILE = ("seconds", "tokens_per_second", "peak_", "mfu")
PLUGIN = '''
def reward(completion, solution, **info):
    return 0.0 if solution in ("red", "green") else len(completion) / 10


def zero(completion, solution, **info):
    return 0.0
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "halfreward.py").write_text(PLUGIN)
    return folder


@pytest.fixture
def on_path(plugins, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(plugins))
    return plugins


@pytest.fixture(scope="module")
def dynamic_run(tiny_cache, plugins, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dynamic") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        mp.syspath_prepend(str(plugins))
        assert main(["train", f"train.output_dir={out}", *DYNAMIC]) == 0
    return out


def grpo_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]


def drawn_groups(out: Path) -> dict[int, list[list[float]]]:
    """Step -> the rewards of each group it drew, in draw order (from the saved rollouts: every
    row drawn, report.rollouts_every=1)."""
    steps = {}
    for step, rows in read_rollouts(out / "rollouts").items():
        groups: dict[int, list[float]] = {}
        for row in rows:
            groups.setdefault(row["group"], []).append(row["reward"])
        steps[step] = [groups[g] for g in sorted(groups)]
    return steps


def test_a_step_trains_on_the_first_informative_groups_it_draws(dynamic_run):
    rows, drawn = grpo_rows(dynamic_run), drawn_groups(dynamic_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and sorted(drawn) == [1, 2, 3, 4, 5]
    for r in rows:
        groups = drawn[r["step"]]
        informative = [g for g in groups if len(set(g)) > 1]
        assert len(groups) == 2 * r["sample_batches"]  # every batch: prompts_per_step groups
        # drew until 2 informative groups, or 3 batches
        assert r["sample_batches"] == 3 or len(informative) >= 2
        assert r["sample_batches"] == 1 or len([g for g in groups[:-2] if len(set(g)) > 1]) < 2
        assert r["kept_groups"] == min(2, len(informative))
        assert r["zero_variance_groups"] == pytest.approx(1 - len(informative) / len(groups))
        assert r["reward_mean"] == pytest.approx(sum(map(sum, groups)) / (4 * len(groups)))
        assert (r.get("grad_norm", 0) > 0) == (r["kept_groups"] > 0)
    assert any(r["sample_batches"] > 1 for r in rows)  # the comparison covers redraws
    state = json.loads((dynamic_run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["consumed_prompts"] == 2 * sum(r["sample_batches"] for r in rows[:2])


def test_a_step_with_no_informative_group_skips_its_update(use_tiny_cache, on_path, tmp_path):
    args = [*TINY, "rewards.halfreward:zero=1.0", "algo.dynamic_sampling=true",
            "algo.max_resample_batches=2", "checkpoint.every=0"]
    skipped, untrained = tmp_path / "skipped", tmp_path / "untrained"
    assert main(["train", f"train.output_dir={skipped}", *args, "train.max_steps=2"]) == 0
    assert main(["train", f"train.output_dir={untrained}", *args, "train.max_steps=0"]) == 0
    rows = grpo_rows(skipped)
    assert [(r["sample_batches"], r["kept_groups"], r["zero_variance_groups"]) for r in rows] == \
        [(2, 0, 1.0), (2, 0, 1.0)]
    assert all("loss" not in r and "grad_norm" not in r for r in rows)
    assert rows[0]["learning_rate"] == rows[1]["learning_rate"]  # no scheduler step either
    log = (skipped / "log.txt").read_text()
    assert log.count("groups of the 2 batches drawn have all-equal rewards") == 2
    a = load_file(skipped / "final" / "model.safetensors")
    b = load_file(untrained / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the warm-up's weights, untouched


def test_an_oom_redo_draws_the_same_prompts(dynamic_run, use_tiny_cache, on_path, tmp_path,
                                             monkeypatch):
    """Out of memory while generating a step's second batch: the guard halves
    memory.generation_batch (16 -> 8, still one chunk for a rank's 8 rows, so the completions are
    the same) and redoes the step from its first batch, with the sampler put back: the run draws
    the prompts the uninterrupted run drew, and ends the same."""
    from r1fit.train import engines

    redrawn = next(r["step"] for r in grpo_rows(dynamic_run) if r["sample_batches"] > 1)
    real = engines.generate_rollout  # the generation stage without tools (Rollouts.rollout)
    draws: list[tuple[int, int, list[str]]] = []
    injected = []

    def generate(rollout, generate_fn, **kw):
        if rollout.step == redrawn and rollout.row_offset and not injected:
            injected.append(rollout.step)
            raise torch.OutOfMemoryError("injected: out of memory in the second batch")
        draws.append((rollout.step, rollout.row_offset, [p.sample.source for p in rollout.prompts]))
        return real(rollout, generate_fn, **kw)

    monkeypatch.setattr(engines, "generate_rollout", generate)
    out = tmp_path / "redone"
    assert main(["train", f"train.output_dir={out}", *DYNAMIC]) == 0
    assert injected == [redrawn]
    assert "memory.generation_batch 16 -> 8, redoing the step" in (out / "log.txt").read_text()
    # the failed attempt drew its first batch; the redo drew it again, then went on
    first = next(i for i, d in enumerate(draws) if d[0] == redrawn)
    assert draws[first] == draws[first + 1]
    del draws[first]
    straight, redone = grpo_rows(dynamic_run), grpo_rows(out)
    assert [r["sample_batches"] for r in redone] == [r["sample_batches"] for r in straight]
    assert len(draws) == sum(r["sample_batches"] for r in straight)
    for name in ("checkpoint-2", "checkpoint-4"):
        sampler = [json.loads((run / name / "trainer_state.json").read_text())["sampler"]
                   for run in (dynamic_run, out)]
        assert sampler[0] == sampler[1]
    keep = [k for k in straight[0] if not any(v in k for v in VOLATILE)
            and k not in ("oom_retries", "generation_batch")]
    assert [{k: r[k] for k in keep} for r in redone] == [{k: r[k] for k in keep} for r in straight]
    assert [r["oom_retries"] for r in redone] == [int(r["step"] == redrawn) for r in redone]


def launch(processes: int, out: Path, plugins: Path, *args: str) -> None:
    r1fit = ["-m", "r1fit", "train", f"train.output_dir={out}", *args]
    cmd = ([sys.executable, *r1fit] if processes == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", *r1fit])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_processes_train_on_the_kept_groups_like_one(dynamic_run, use_tiny_cache, plugins,
                                                        tmp_path):
    """Each rank generates one of a batch's two groups (rank 0 the first); the kept groups are
    re-split, the first to rank 0: a step whose first kept group was generated by rank 1 (or its
    second by rank 0) trains rows on another rank than the one that generated them."""
    launch(2, tmp_path / "two", plugins, *DYNAMIC)
    one, two = grpo_rows(dynamic_run), grpo_rows(tmp_path / "two")
    moved = 0
    for groups in drawn_groups(dynamic_run).values():
        kept = [g for g, rewards in enumerate(groups) if len(set(rewards)) > 1][:2]
        moved += any(g % 2 != rank for rank, g in enumerate(kept))
    assert moved  # some step trained a group on the rank that did not generate it
    assert len(one) == len(two) == 5
    # the two ranks' gradients are summed in another order, and Adam turns those float
    # differences into weight differences of up to the learning rate where a gradient is near 0;
    # here that changed a sampled token at step 5 (as it changes some samples of the demo, see
    # the README), so the steps before it are compared
    for a, b in zip(one[:4], two[:4]):
        for key in ("sample_batches", "kept_groups", "zero_variance_groups"):
            assert a[key] == b[key], (a["step"], key)
        for key in ("loss", "grad_norm", "kl", "reward_mean", "reward_std", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
