"""Resume is exact: N steps straight == N/2 steps + crash + resume (bytes, not tolerances).

A crash is simulated in-process by raising right after a checkpoint is written; the resumed run
starts from the files alone (a new model, optimizer and sampler built by the CLI), as it would after
``kill -9``. tests/e2e/test_kill.py does the same with real processes and SIGKILL.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest

from r1fit.checkpoint import files as ckpt_files
from r1fit.checkpoint.manager import CheckpointManager, verify
from r1fit.cli import main
from r1fit.report.metrics import read_metrics

TINY = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
        "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=3",
        "memory.generation_batch=5", "data.shapes.train_size=50", "data.shapes.image_size=56",
        "data.max_pixels=3136", "checkpoint.keep=0", "rewards.lenreward:length=1.0",
        "rewards.format=0.5"]


class Crash(Exception):
    """Stands in for the process dying."""


def crash_after(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make the run die right after it has written checkpoint ``name``."""
    original = CheckpointManager.save

    def save(self, phase, step, objects, **kw):
        path = original(self, phase, step, objects, **kw)
        if path.name == name:
            raise Crash(name)
        return path

    monkeypatch.setattr(CheckpointManager, "save", save)


def run(*args: str) -> int:
    return main(list(args))


def straight_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
                         crash_at: str, args: list[str]) -> tuple[Path, Path]:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(command, f"train.output_dir={straight}", *args) == 0
    with monkeypatch.context() as m:
        crash_after(m, crash_at)
        with pytest.raises(Crash):
            run(command, f"train.output_dir={resumed}", *args)
    assert not (resumed / "final").exists()
    assert run(command, f"train.output_dir={resumed}", *args) == 0  # checkpoint.resume=auto
    return straight, resumed


@pytest.mark.parametrize("extra", [
    pytest.param(["algo.num_iterations=2", "algo.beta=0.05"], id="full-ft-mu2-kl"),
    pytest.param(["model.lora.r=4", "algo.beta=0.05", "train.learning_rate=5e-2"], id="lora-kl"),
    # LoRA's dropout draws from torch's global generator at every update: nothing else may draw
    # from it in one run and not in the other (a probe after the resume moved it once)
    pytest.param(["model.lora.r=4", "model.lora.dropout=0.1", "train.learning_rate=5e-2"],
                 id="lora-dropout"),
    # the static engine generates the rollouts and the evaluations (LoRA merged and restored)
    pytest.param(["rollout.engine=static", "model.lora.r=4", "algo.beta=0.05",
                  "train.learning_rate=5e-2"], id="static-engine-lora-kl"),
    # each prompt's cache held once for its group (rollout.static.share_prompt)
    pytest.param(["rollout.engine=static", "rollout.static.share_prompt=true", "algo.beta=0.05"],
                 id="static-engine-shared-prompts"),
])
def test_grpo_resume_is_bit_exact(use_tiny_cache, reward_plugin, same_run, tmp_path, monkeypatch,
                                  extra):
    args = [*TINY, "train.max_steps=4", "sft.format_warmup_steps=2", "checkpoint.every=2",
            "eval.every=2", *extra]
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, "train", "checkpoint-2", args)
    rows = [r for r in read_metrics(straight / "metrics.jsonl") if "reward_mean" in r]
    assert any(r["grad_norm"] > 0 for r in rows)  # the comparison covers real updates
    same_run(straight, resumed)
    log = (resumed / "log.txt").read_text()
    assert "resumed grpo at step 2" in log
    if "rollout.engine=static" in extra:
        assert "rollout.engine=static: KV cache of" in log
    if "rollout.static.share_prompt=true" in extra:  # a prompt slot per group of the step
        assert re.search(r"KV cache of \d+ prompts x \d+ columns \+ \d+ rows", log)


def test_resume_inside_the_warmup(use_tiny_cache, reward_plugin, same_run, tmp_path, monkeypatch):
    args = [*TINY, "train.max_steps=2", "sft.format_warmup_steps=4", "checkpoint.every=2",
            "eval.every=0", "algo.beta=0.05"]
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, "train",
                                             "checkpoint-warmup-2", args)
    same_run(straight, resumed)
    assert "resumed warmup at step 2" in (resumed / "log.txt").read_text()


@pytest.mark.parametrize("extra", [[], ["model.lora.r=4", "model.lora.dropout=0.1"]],
                         ids=["full-ft", "lora-dropout"])
def test_sft_resume_mid_epoch_is_bit_exact(use_tiny_cache, same_run, tmp_path, monkeypatch,
                                           extra):
    # 10 training rows, 4 per step: step 3 stops in the middle of the second epoch
    args = [*TINY, "sft.steps=6", "data.shapes.train_size=10", "checkpoint.every=3",
            "eval.every=0", *extra]
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, "sft", "checkpoint-3", args)
    state = json.loads((straight / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["position"] == 2
    same_run(straight, resumed)
    # the summary's seconds span the whole run: the part before checkpoint-3, then the resumed
    before = json.loads((resumed / "checkpoint-3" / "trainer_state.json").read_text())["seconds"]
    summary = json.loads((resumed / "summary.json").read_text())
    assert before > 0 and summary["seconds_since_resume"] > 0
    assert summary["seconds"] == pytest.approx(before + summary["seconds_since_resume"], abs=0.2)
    assert "seconds_since_resume" not in json.loads((straight / "summary.json").read_text())


def test_weights_only_checkpoint_is_never_a_silent_restart(use_tiny_cache, reward_plugin,
                                                           tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [*TINY, "train.max_steps=4", "sft.format_warmup_steps=0", "checkpoint.every=2",
            "eval.every=0", "algo.beta=0", "checkpoint.weights_only=true"]
    with monkeypatch.context() as m:
        crash_after(m, "checkpoint-2")
        with pytest.raises(Crash):
            run("train", f"train.output_dir={out}", *args)
    capsys.readouterr()
    assert run("train", f"train.output_dir={out}", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("r1fit: error:") and "checkpoint-2 cannot be resumed exactly" in err
    assert "optimizer state" in err and "RNG states" in err and "resume_weights_only" in err
    assert run("train", f"train.output_dir={out}", *args,
               "checkpoint.resume_weights_only=true") == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert steps == [1, 2, 3, 4]  # continued from step 2, not from 0
    assert "weights only: fresh optimizer" in (out / "log.txt").read_text()


def test_plain_model_folder_is_not_resumable(use_tiny_cache, tmp_path, capsys):
    first = tmp_path / "first"
    assert run("sft", f"train.output_dir={first}", *TINY, "sft.steps=1", "eval.every=0",
               "data.eval=null") == 0
    code = run("sft", f"train.output_dir={tmp_path / 'second'}", *TINY, "sft.steps=2",
               "data.eval=null", f"checkpoint.resume={first / 'final'}")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "not an r1fit checkpoint" in err


def test_skips_corrupt_and_partial_checkpoints_with_a_reason(use_tiny_cache, tmp_path, caplog):
    out = tmp_path / "run"
    args = [*TINY, "sft.steps=4", "checkpoint.every=1", "eval.every=0", "data.eval=null"]
    assert run("sft", f"train.output_dir={out}", *args) == 0
    # newest is corrupt, one more is an interrupted save: resume from checkpoint-3
    weights = out / "checkpoint-4" / "weights" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-5.partial")
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=5") == 0
    log = (out / "log.txt").read_text()
    assert "checkpoint-5.partial: incomplete save" in log
    assert "checkpoint-4: weights/__0_0.distcp does not match its sha256" in log
    assert "resumed sft at step 3" in log
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5]


def test_auto_dtype_resumes_a_run_saved_with_the_dtype_it_resolves_to(use_tiny_cache, tmp_path):
    """A run saved with model.dtype=float32 (the default before 'auto') resumes under 'auto' on
    the float32 built-in model; bfloat16 there is a real change and is refused."""
    out = tmp_path / "run"
    args = [*TINY, "checkpoint.every=1", "eval.every=0", "data.eval=null"]
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=1", "model.dtype=float32") == 0
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=2") == 0  # model.dtype=auto
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=3",
               "model.dtype=bfloat16") == 2


def edit_saved_config(run_dir: Path, edit, name: str = "config.json") -> None:
    """``edit(data)`` each checkpoint's JSON file ``name`` in place, its manifest entry kept
    true."""
    for point in run_dir.glob("checkpoint-*"):
        data = json.loads((point / name).read_text())
        edit(data)
        (point / name).write_text(json.dumps(data))
        manifest = json.loads((point / "manifest.json").read_text())
        manifest["files"][name] = {"bytes": (point / name).stat().st_size,
                                   "sha256": ckpt_files.sha256_file(point / name)}
        (point / "manifest.json").write_text(json.dumps(manifest))


def test_the_engine_is_compared_as_it_resolves(use_tiny_cache, reward_plugin, tmp_path, capsys):
    """rollout.engine=auto (Hugging Face generate on CPU) resumes as rollout.engine=hf; a
    checkpoint that generated with another engine than the one resolved here (auto on a
    machine with vLLM or CUDA, resumed on this CPU) is refused naming both, or continued with a
    warning when config changes are allowed."""
    out = tmp_path / "run"
    args = [*TINY, "sft.format_warmup_steps=0", "checkpoint.every=1", "eval.every=0"]
    assert run("train", f"train.output_dir={out}", *args, "train.max_steps=1") == 0
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["resolved"] == {"rollout.engine": "hf"}
    capsys.readouterr()
    assert run("train", f"train.output_dir={out}", *args, "train.max_steps=2",
               "rollout.engine=hf") == 0
    assert "rollout.engine changed" not in capsys.readouterr().err

    def elsewhere(state):  # as if step 2 had been generated by vLLM
        state["resolved"]["rollout.engine"] = "vllm"

    edit_saved_config(out, elsewhere, "trainer_state.json")
    assert run("train", f"train.output_dir={out}", *args, "train.max_steps=3") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "checkpoint-2 generated its rollouts with the vllm engine; here rollout.engine=auto "
        "resolves to hf (on cpu (CUDA graphs and vLLM need a CUDA device)): set "
        "rollout.engine=vllm to continue as it ran, or checkpoint.allow_config_change=true to "
        "continue on hf")
    assert run("train", f"train.output_dir={out}", *args, "train.max_steps=3",
               "checkpoint.allow_config_change=true") == 0
    assert "(the run will not be identical to an uninterrupted one)" in capsys.readouterr().err


def test_a_checkpoint_saved_before_a_config_key_existed_resumes(use_tiny_cache, tmp_path,
                                                                 capsys):
    """A run saved by an r1fit without ``preset``, ``rollout.min_new_tokens`` and
    ``train.deterministic`` ran as their defaults do: resuming it under a newer r1fit is no
    config change; a new key set otherwise is one, and refused."""
    out = tmp_path / "run"
    args = [*TINY, "checkpoint.every=1", "eval.every=0", "data.eval=null"]
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=1") == 0
    def older(cfg):  # as the r1fit before these keys wrote it
        del cfg["preset"], cfg["rollout"]["min_new_tokens"], cfg["train"]["deterministic"]

    edit_saved_config(out, older)
    capsys.readouterr()
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=2") == 0
    err = capsys.readouterr().err
    assert "resuming with sft.steps changed" in err  # changes are still seen
    assert not any(f"resuming with {key}" in err
                   for key in ("preset", "rollout.min_new_tokens", "train.deterministic"))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]
    edit_saved_config(out, lambda cfg: cfg["rollout"].pop("min_new_tokens", None))
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=3",
               "rollout.min_new_tokens=4") == 2
    assert "rollout.min_new_tokens: None -> 4" in capsys.readouterr().err


def test_refusals(use_tiny_cache, reward_plugin, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TINY, "sft.steps=2", "checkpoint.every=1", "eval.every=0", "data.eval=null"]
    assert run("sft", f"train.output_dir={out}", *args) == 0
    capsys.readouterr()

    def error(*extra: str) -> str:
        assert run("sft", f"train.output_dir={out}", *args, *extra) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert "already holds a run" in error("checkpoint.resume=never")
    changed = error("sft.learning_rate=0.5")
    assert "saved with another config (sft.learning_rate: 0.01 -> 0.5)" in changed
    assert "was saved by `r1fit sft`, not `r1fit train`" in (
        run("train", f"train.output_dir={out}", *args) == 2
        and capsys.readouterr().err.strip().splitlines()[-1])
    for ckpt in out.glob("checkpoint-*"):
        (ckpt / "manifest.json").unlink()
    assert "holds a run with no complete checkpoint" in error()
    # told otherwise: start over
    assert run("sft", f"train.output_dir={out}", *args, "train.overwrite=true") == 0
    # memory keys may change; the warning says which ones change the numbers
    capsys.readouterr()
    assert run("sft", f"train.output_dir={out}", *args, "sft.steps=3", "memory.share_prefix=true",
               "memory.gradient_checkpointing=false") == 0
    err = capsys.readouterr().err
    differ = " (the run will not be identical to an uninterrupted one)"
    changes = [line.split("resuming with ", 1)[1] for line in err.splitlines()
               if "resuming with memory." in line]
    assert sorted(changes) == ["memory.gradient_checkpointing changed: True -> False",
                               f"memory.share_prefix changed: 'auto' -> True{differ}"], changes


def test_disk_full_while_saving_keeps_the_previous_checkpoint(use_tiny_cache, tmp_path,
                                                              monkeypatch, capsys):
    out = tmp_path / "run"
    real_save_state = ckpt_files.save_state
    calls = {"n": 0}

    def failing_save_state(folder, name, state):
        if "checkpoint-2" in str(folder):
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / f"{name}.json"))
        calls["n"] += 1
        return real_save_state(folder, name, state)

    monkeypatch.setattr("r1fit.checkpoint.manager.save_state", failing_save_state)
    code = run("sft", f"train.output_dir={out}", *TINY, "sft.steps=3", "checkpoint.every=1",
               "eval.every=0", "data.eval=null")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith(f"r1fit: error: could not save checkpoint-2 in {out}: No space left "
                          "on device")
    assert "checkpoint-1 is intact" in err
    assert verify(out / "checkpoint-1") is None
    assert not list(out.glob("*.partial")) and not (out / "checkpoint-2").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-1"


def test_a_resume_point_past_a_lowered_step_count_says_no_step_is_left(use_tiny_cache, tmp_path,
                                                                      reward_plugin):
    """train.max_steps lowered below a finished run's last checkpoint (a change the config check
    accepts): the run trains nothing, and now says so instead of only the changed key."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", *TINY, "sft.format_warmup_steps=0", "eval.every=0",
            "data.eval=null", "checkpoint.every=2"]
    assert run("train", *args, "train.max_steps=4") == 0
    assert run("train", *args, "train.max_steps=2") == 0
    assert "WARNING r1fit: checkpoint-4 is at step 4, past train.max_steps=2: no step left to " \
           "train; final/ and the summary are written from it" in (out / "log.txt").read_text()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_run_resumed_where_it_stopped_early_trains_no_further(use_tiny_cache, reward_plugin,
                                                                 same_run, tmp_path,
                                                                 monkeypatch) -> None:
    """Killed right after the checkpoint of its early stop (before final/), or run again once
    finished, a run stops there: before, the restored counters were tested only after a step,
    so each rerun trained one more step and wrote final/ over."""
    args = [*TINY, "train.max_steps=8", "sft.format_warmup_steps=2", "checkpoint.every=1",
            "eval.every=1", "eval.before_train=false", "train.early_stop_patience=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run("train", f"train.output_dir={straight}", *args) == 0
    stop = re.search(r"early stop at step (\d+):", (straight / "log.txt").read_text())
    assert stop is not None  # eval accuracy cannot improve at every step of a tiny run
    stopped = int(stop.group(1))
    assert stopped < 8
    with monkeypatch.context() as m:
        crash_after(m, f"checkpoint-{stopped}")
        with pytest.raises(Crash):
            run("train", f"train.output_dir={resumed}", *args)
    assert run("train", f"train.output_dir={resumed}", *args) == 0
    same_run(straight, resumed)
    assert f"early stop at step {stopped} (resumed there)" in (resumed / "log.txt").read_text()
    rows = read_metrics(straight / "metrics.jsonl")
    assert run("train", f"train.output_dir={straight}", *args) == 0  # finished: run again
    assert read_metrics(straight / "metrics.jsonl") == rows
    assert max(r["step"] for r in rows if "reward_mean" in r) == stopped


def crash_before_saving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the run die when it is about to write its first checkpoint."""

    def save(self, phase, step, objects, **kw):
        raise Crash(f"before {phase} {step}")

    monkeypatch.setattr(CheckpointManager, "save", save)


def test_a_run_killed_before_its_first_checkpoint_starts_over_with_the_same_command(
        use_tiny_cache, reward_plugin, same_run, tmp_path, monkeypatch, capsys) -> None:
    """Nothing to resume and nothing to lose: the same command starts over, said (a requeued job
    killed in its first steps needed a hand before); another config's run is still refused, and
    so is a finished run that saved no checkpoint (checkpoint.every=0), named as such."""
    args = [*TINY, "train.max_steps=3", "sft.format_warmup_steps=0", "checkpoint.every=2",
            "eval.every=0"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run("train", f"train.output_dir={straight}", *args) == 0
    with monkeypatch.context() as m:
        crash_before_saving(m)
        with pytest.raises(Crash):
            run("train", f"train.output_dir={killed}", *args)
    assert read_metrics(killed / "metrics.jsonl")  # its first rows were written
    assert run("train", f"train.output_dir={killed}", *args, "algo.beta=0.3") == 2
    assert "holds a run with no complete checkpoint (it was stopped before its first " \
        "checkpoint)" in capsys.readouterr().err
    (killed / "checkpoint-2.partial").mkdir()  # killed while writing its first one
    assert run("train", f"train.output_dir={killed}", *args) == 0
    same_run(straight, killed)
    assert "starting over: this command's run stopped before its first checkpoint" in \
        (killed / "log.txt").read_text()

    capsys.readouterr()
    once = [*args, "checkpoint.every=0"]
    assert run("train", f"train.output_dir={tmp_path / 'once'}", *once) == 0
    assert run("train", f"train.output_dir={tmp_path / 'once'}", *once) == 2
    assert "holds a finished run that saved no checkpoint (checkpoint.every=0): its final/ is " \
        "the result" in capsys.readouterr().err


def test_a_run_started_from_a_checkpoint_path_resumes_with_the_same_command(
        use_tiny_cache, reward_plugin, same_run, tmp_path, monkeypatch, capsys) -> None:
    """``checkpoint.resume=PATH`` into a new folder, killed after that folder's own checkpoint:
    the same command continues from it (before: refused, advising train.overwrite=true, which
    deletes it). Another config's run in the folder is still refused, naming resume=auto."""
    args = [*TINY, "train.max_steps=4", "sft.format_warmup_steps=0", "checkpoint.every=1",
            "eval.every=0"]
    source = tmp_path / "source"
    assert run("train", f"train.output_dir={source}", *args, "train.max_steps=1") == 0
    start = [*args, f"checkpoint.resume={source / 'checkpoint-1'}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run("train", f"train.output_dir={straight}", *start) == 0
    with monkeypatch.context() as m:
        crash_after(m, "checkpoint-3")
        with pytest.raises(Crash):
            run("train", f"train.output_dir={resumed}", *start)
    capsys.readouterr()
    assert run("train", f"train.output_dir={resumed}", *start, "eval.every=2") == 2
    assert "holds a run (checkpoint.resume=auto continues it, from checkpoint-3); to resume " \
        f"from {source / 'checkpoint-1'}, choose an empty" in capsys.readouterr().err
    assert run("train", f"train.output_dir={resumed}", *start) == 0
    same_run(straight, resumed)
    log = (resumed / "log.txt").read_text()
    assert "holds this command's run" in log and "resumed grpo at step 3" in log
