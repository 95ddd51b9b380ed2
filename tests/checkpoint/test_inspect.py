"""`r1fit inspect` on real checkpoints written by short runs of the CLI on builtin:tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r1fit.cli import main

RUN = ["train.max_steps=2", "sft.format_warmup_steps=0", "checkpoint.every=1",
       "train.prompts_per_step=2", "algo.num_generations=2", "data.shapes.image_size=56",
       "eval.every=0", "data.eval=null", "algo.max_new_tokens=8"]


@pytest.fixture(scope="module")
def runs(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run with two full checkpoints (best by reward: checkpoint-1, latest: checkpoint-2) and a
    run with one weights-only checkpoint. Tests copy them before damaging anything."""
    root = tmp_path_factory.mktemp("inspect")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        # rewards are 0 on random weights, so the first checkpoint stays the best
        assert main(["train", f"train.output_dir={root / 'full'}", *RUN,
                     "checkpoint.keep_best_by=reward_mean"]) == 0
        assert main(["train", f"train.output_dir={root / 'weights'}", *RUN, "train.max_steps=1",
                     "checkpoint.weights_only=true"]) == 0
    return {"full": root / "full", "weights": root / "weights"}


def inspect(capsys, path: Path, *flags: str) -> str:
    capsys.readouterr()
    assert main(["inspect", str(path), *flags]) == 0
    return capsys.readouterr().out


def flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_checkpoint_lists_every_file_and_is_resumable(runs, capsys):
    ckpt = runs["full"] / "checkpoint-2"
    text = inspect(capsys, ckpt)
    assert "step 2, phase grpo, saved by `r1fit train`" in text
    assert "by r1fit 0.1.0" in text and "saved at 20" in text
    assert "1 process(es); resumes on any number" in text
    assert "contents: full" in text
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    for file in files:
        assert str(file.relative_to(ckpt)) in text
    assert text.strip().endswith("resumable: yes")

    report = json.loads(inspect(capsys, ckpt, "--json"))
    assert report["type"] == "checkpoint" and report["step"] == 2 and report["resumable"]
    assert report["weights_only"] is False and report["lora"] is False
    assert {f["path"]: f["bytes"] for f in report["files"]} == {
        str(p.relative_to(ckpt)): p.stat().st_size for p in files}
    assert report["total_bytes"] == sum(p.stat().st_size for p in files)


def test_output_dir_lists_checkpoints_newest_first_with_markers(runs, capsys):
    text = inspect(capsys, runs["full"])
    lines = text.splitlines()
    row2 = next(i for i, line in enumerate(lines) if line.strip().startswith("checkpoint-2"))
    row1 = next(i for i, line in enumerate(lines) if line.strip().startswith("checkpoint-1"))
    assert row2 < row1
    assert "latest" in lines[row2] and "best" not in lines[row2]
    assert "best" in lines[row1] and "latest" not in lines[row1]
    assert "best: checkpoint-1 (reward_mean = 0.0)" in text
    assert "checkpoint.resume=auto continues from: checkpoint-2" in text

    report = json.loads(inspect(capsys, runs["full"], "--json"))
    assert [c["name"] for c in report["checkpoints"]] == ["checkpoint-2", "checkpoint-1"]
    assert [c["resumable"] for c in report["checkpoints"]] == [True, True]
    assert report["latest"] == "checkpoint-2" and report["best"]["checkpoint"] == "checkpoint-1"


def test_an_unreadable_best_file_is_said(runs, capsys, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["full"], out)
    (out / "best").write_text("garbage{")
    text = inspect(capsys, out)
    assert "best: the file 'best' is unreadable (a resume forgets it" in text
    report = json.loads(inspect(capsys, out, "--json"))
    assert report["best"] is None and report["best_unreadable"] is True
    assert not any(c["best"] for c in report["checkpoints"])


def test_corrupt_file_is_named_and_auto_resume_falls_back(runs, capsys, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["full"], out)
    flip_byte(out / "checkpoint-2" / "weights" / "__0_0.distcp")
    text = inspect(capsys, out / "checkpoint-2")
    reason = "weights/__0_0.distcp does not match its sha256 in the manifest (corrupt)"
    assert f"resumable: no — {reason}" in text

    listing = inspect(capsys, out)
    assert reason in next(line for line in listing.splitlines() if "checkpoint-2" in line)
    assert "checkpoint.resume=auto continues from: checkpoint-1" in listing


def test_unreadable_trainer_state_and_manifest_are_said_so(runs, capsys, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["full"], out)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{oops")
    text = inspect(capsys, out / "checkpoint-2")
    # what its name says, not "step None, phase None, saved by unknown (None)"
    assert ("  step 2, phase unknown (from its name: trainer_state.json is missing or "
            "unreadable)\n") in text
    assert "None" not in text
    (out / "checkpoint-1" / "manifest.json").write_text("[1, 2]")
    assert "resumable: no — manifest.json is unreadable (a JSON list, not an object)" in \
        inspect(capsys, out / "checkpoint-1")


def test_partial_folder_is_an_incomplete_save(runs, capsys, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["full"], out)
    (out / "checkpoint-2").rename(out / "checkpoint-3.partial")
    text = inspect(capsys, out / "checkpoint-3.partial")
    assert "resumable: no — incomplete save" in text

    report = json.loads(inspect(capsys, out, "--json"))
    assert [c["name"] for c in report["checkpoints"]] == ["checkpoint-3.partial", "checkpoint-1"]
    assert report["checkpoints"][0]["intact"] is False
    assert report["latest_exists"] is False  # `latest` still names checkpoint-2
    assert report["resume_from"] == "checkpoint-1"
    assert "latest: checkpoint-2 (no such checkpoint)" in inspect(capsys, out)


def test_weights_only_checkpoint_is_not_resumable_exactly(runs, capsys):
    text = inspect(capsys, runs["weights"] / "checkpoint-1")
    assert "contents: weights only" in text
    assert ("resumable: no — weights only: it has no optimizer state, no LR scheduler state, "
            "no RNG states; checkpoint.resume_weights_only=true") in text
    assert "optimizer.safetensors" not in text

    listing = inspect(capsys, runs["weights"])
    assert "ok, weights only" in listing
    assert "needs checkpoint.resume_weights_only=true" in listing


def test_plain_model_folder(runs, capsys):
    text = inspect(capsys, runs["full"] / "final")
    assert text.startswith("Hugging Face model folder (Qwen2_5_VLForConditionalGeneration)")
    assert "model.safetensors" in text
    assert "resumable: no — a plain model folder holds weights only" in text
    assert f"model.path={runs['full'] / 'final'}" in text

    inner = inspect(capsys, runs["full"] / "checkpoint-1" / "model")
    assert f"the model of checkpoint {runs['full'] / 'checkpoint-1'}" in inner
    assert f"its weights are sharded in {runs['full'] / 'checkpoint-1' / 'weights'}" in inner


def test_unknown_paths_are_one_line_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"r1fit: error: {tmp_path / 'nope'}: no such folder\n"
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("r1fit: error: ") and "not a checkpoint" in err and err.count("\n") == 1
