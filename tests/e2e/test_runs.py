"""Whole runs on builtin:tiny through the CLI: GRPO (full and LoRA), SFT, bad rows, failing rewards."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from r1fit.cli import main
from r1fit.config import AlgoConfig
from r1fit.report.metrics import read_metrics

STEP_KEYS = {"step", "loss", "reward_mean", "reward_std", "reward/accuracy", "reward/format",
             "accuracy", "kl", "clip_fraction", "completion_len_mean", "seconds_generate",
             "seconds_score", "seconds_update", "tokens_per_second", "grad_norm",
             "peak_memory_bytes", "bad_rows", "reward_errors", "predicted_seconds_generate",
             "predicted_seconds_score", "predicted_seconds_update", "predicted_calibrated"}
SMALL = ["train.max_steps=3", "train.prompts_per_step=2", "algo.num_generations=4",
         "algo.max_new_tokens=8", "sft.format_warmup_steps=2", "sft.batch_size=4",
         "data.eval_size=4", "eval.every=2", "memory.micro_batch=3", "memory.generation_batch=5",
         "data.shapes.train_size=50", "data.shapes.image_size=56", "data.max_pixels=3136"]


def run_cli(*args: str) -> int:
    return main(list(args))


def step_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]


def test_grpo_three_steps_full_finetuning(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, "algo.beta=0",
                   "report.profile_step=2") == 0
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 2 profiled: the table has the phases as rows of their own, and the operators
    table = (out / "profile-step-2.txt").read_text()
    assert all(f"r1fit/{phase}" in table for phase in ("generate", "score", "update"))
    assert "aten::" in table and not (out / "profile-step-1.txt").exists()
    for row in rows:
        assert STEP_KEYS <= set(row), STEP_KEYS - set(row)
        assert row["kl"] is None  # beta = 0: no reference model, no KL
        assert math.isfinite(row["loss"]) and row["peak_memory_bytes"] > 0
        assert row["completion_len_mean"] <= 8
    assert any(r["grad_norm"] > 0 for r in rows) or all(r["reward_std"] == 0 for r in rows)
    all_rows = read_metrics(out / "metrics.jsonl")
    evals = [r for r in all_rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    # every step once; evaluations ride on their step's line
    assert [r["step"] for r in all_rows if "step" in r] == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    model = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_grpo_lora_with_kl_and_reused_rollouts(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, "model.lora.r=4",
                   "algo.beta=0.05", "algo.num_iterations=2", "train.learning_rate=5e-2") == 0
    rows = step_rows(out)
    assert len(rows) == 3
    # the reference is the policy with adapters off: KL is defined and starts at 0
    assert all(r["kl"] is not None and r["kl"] >= 0 for r in rows)
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_lora_adapters_in_bfloat16_train_in_grpo_and_sft(use_tiny_cache, tmp_path, caplog):
    """model.lora.compute_dtype=model on a bfloat16 model: GRPO (with reused rollouts and KL) and
    SFT run, say what the adapters compute in, and train them (lora_B starts at 0)."""
    from safetensors.torch import load_file

    caplog.set_level("INFO", logger="r1fit")
    lora = ["model.dtype=bfloat16", "model.lora.r=4", "model.lora.compute_dtype=model",
            "train.learning_rate=5e-2"]
    out = tmp_path / "grpo"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, *lora, "algo.beta=0.05",
                   "algo.num_iterations=2", "train.max_steps=2") == 0
    assert all(math.isfinite(r["loss"]) for r in step_rows(out))
    assert "the adapters' products in bfloat16 under torch.autocast" in caplog.text
    sft = tmp_path / "sft"
    assert run_cli("sft", f"train.output_dir={sft}", *lora, "sft.steps=2", "sft.batch_size=4",
                   "data.eval_size=4", "data.shapes.train_size=50", "data.max_pixels=3136",
                   "data.shapes.image_size=56") == 0
    for folder in (out, sft):
        weights = load_file(folder / "final" / "adapter_model.safetensors")
        b = [w for name, w in weights.items() if "lora_B" in name]
        assert b and any(w.abs().sum() > 0 for w in b)
        assert all(w.dtype == torch.float32 for w in weights.values())


def test_full_finetuning_kl_reference_is_the_warmed_up_policy(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, "algo.beta=0.1") == 0
    rows = step_rows(out)
    # step 1 scores the policy before its first update against the reference: a copy of the
    # warmed-up policy, so KL is 0 (the pre-warm-up model would give a large KL)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(r["kl"] >= 0 for r in rows)


def test_sft_three_steps_changes_weights(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert run_cli("sft", f"train.output_dir={out}", "sft.steps=3", "sft.batch_size=4",
                   "data.eval_size=4", "data.shapes.train_size=50", "data.max_pixels=3136",
                   "data.shapes.image_size=56", "sft.eval_every=2") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the final evaluation rides on the last step's line, and sft.eval_every=2 adds step 2's
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 3]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_end"] == rows[-1]["eval/accuracy"]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert all(r["truncated_answers"] == 0 for r in rows)  # sft.max_answer_tokens=1024
    # model FLOPs of each step's forward and backward (r1fit/memory/flops.py), and their MFU
    assert all(r["flops"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    # the time model's step beside the measured one
    assert all(r["seconds_step"] > 0 and r["predicted_seconds_step"] > 0 for r in rows)
    before = AutoModelForImageTextToText.from_pretrained(use_tiny_cache / "models" / "tiny-v1")
    after = AutoModelForImageTextToText.from_pretrained(out / "final")
    changed = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(),
                                                     after.state_dict().values())]
    assert any(changed)


def test_sft_cuts_answers_longer_than_max_answer_tokens_and_counts_them(use_tiny_cache,
                                                                         tmp_path):
    out = tmp_path / "run"
    assert run_cli("sft", f"train.output_dir={out}", "sft.steps=2", "sft.batch_size=4",
                   "sft.max_answer_tokens=3", "data.eval=null", "data.shapes.train_size=50",
                   "data.max_pixels=3136", "data.shapes.image_size=56") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    # every <think>..</think><answer>..</answer> target is longer than 3 tokens: all 4 rows cut
    assert [r["truncated_answers"] for r in rows] == [4, 4]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    # 4 rows x 3 answer tokens: the steps' FLOPs count the rows as they ran (cut)
    full = tmp_path / "full"
    assert run_cli("sft", f"train.output_dir={full}", "sft.steps=2", "sft.batch_size=4",
                   "data.eval=null", "data.shapes.train_size=50", "data.max_pixels=3136",
                   "data.shapes.image_size=56") == 0
    whole = [r for r in read_metrics(full / "metrics.jsonl") if "loss" in r]
    assert all(a["flops"] < b["flops"] for a, b in zip(rows, whole))
    log = (out / "log.txt").read_text()
    assert log.count("answer longer than sft.max_answer_tokens=3 tokens, cut there") == 1


def _jsonl(tmp_path: Path, n_good: int, bad_lines: list[str]) -> Path:
    for colour in ("red", "blue"):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"{colour}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    lines = [json.dumps({"image": f"{c}.png", "problem": "What colour is the image?",
                         "solution": c}) for c in ["red", "blue"] * (n_good // 2)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines + bad_lines) + "\n")
    return path


def test_bad_rows_are_counted_and_reward_errors_do_not_stop_training(use_tiny_cache, tmp_path,
                                                                     monkeypatch):
    bad = ['{"image": "missing.png", "problem": "q", "solution": "a"}',
           '{"image": "broken.png", "problem": "q", "solution": "a"}',
           '{"problem": "q"}', "not json"]
    data = _jsonl(tmp_path, 36, bad)
    plugin = tmp_path / "boom_reward.py"
    plugin.write_text("def boom(completion, solution, **info):\n"
                      "    raise RuntimeError('reward exploded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, f"data.train={data}",
                   "data.eval=null", "data.max_bad_fraction=0.2", "rewards.boom_reward:boom=1.0") == 0
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["bad_rows"] == 4 for r in rows)
    # 2 prompts x 4 completions per step, every call raises: counted, the sample scores 0
    assert [r["reward_errors"] for r in rows] == [8, 16, 24]
    assert all(r["reward/boom_reward:boom"] == 0 for r in rows)
    log = (out / "log.txt").read_text()
    assert log.count("RuntimeError: reward exploded") == 1  # first traceback only
    assert "missing.png" in log and "train.jsonl:" in log


def test_too_many_bad_rows_stop_with_one_line(use_tiny_cache, tmp_path, capsys):
    data = _jsonl(tmp_path, 4, ["not json"] * 3)
    code = run_cli("train", f"train.output_dir={tmp_path / 'run'}", *SMALL, f"data.train={data}",
                   "data.eval=null")
    err = capsys.readouterr().err.strip()
    assert code == 2
    # the data is checked before the model loads: skip warnings, then one error line, no traceback
    lines = err.splitlines()
    assert lines[-1].startswith("r1fit: error:") and "train.jsonl" in lines[-1]
    assert all(line.startswith(("WARNING r1fit.data: skipping", "INFO r1fit.data: data: "))
               for line in lines[:-1])
    assert "Traceback" not in err


def test_config_errors_exit_2_with_one_line(capsys):
    assert run_cli("train", "algo.num_generation=8") == 2
    err = capsys.readouterr().err.strip()
    # every key of the section, in declaration order (the list grows with the algorithms)
    allowed = ", ".join(f.name for f in dataclasses.fields(AlgoConfig))
    assert allowed.startswith("num_generations, num_iterations, beta, ")
    assert err == f"r1fit: error: unknown key 'algo.num_generation'; allowed here: {allowed}"


def test_refuses_to_mix_runs(use_tiny_cache, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_cli("train", f"train.output_dir={out}", *SMALL) == 2
    assert "train.overwrite=true" in capsys.readouterr().err


def test_multi_image_rows_and_lora(use_tiny_cache, tmp_path):
    """Rows with two images of different sizes go through generation and the update."""
    Image.new("RGB", (56, 56), "red").save(tmp_path / "a.png")
    Image.new("RGB", (84, 56), "blue").save(tmp_path / "b.png")
    rows = [json.dumps({"image": ["a.png", "b.png"], "problem": "Which image is red, first or "
                        "second?", "solution": "first"}) for _ in range(8)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, f"data.train={tmp_path / 'pairs.jsonl'}",
                   f"data.eval={tmp_path / 'pairs.jsonl'}", "data.max_images=2",
                   "model.lora.r=4") == 0
    assert [r["step"] for r in step_rows(out)] == [1, 2, 3]


def test_eval_rows_that_fail_to_decode_are_counted_not_scored(use_tiny_cache, tmp_path,
                                                              monkeypatch):
    """An image that passed the load-time check but fails when decoded (e.g. deleted or truncated
    in between) is skipped with a warning, counted, and left out of the averages."""
    import r1fit.data.source as jsonl
    from r1fit.data.errors import BadRowError

    for name in ("red", "gone"):
        Image.new("RGB", (56, 56), "red").save(tmp_path / f"{name}.png")
    rows = [{"image": "red.png", "problem": "Colour?", "solution": "red"}] * 5 + \
        [{"image": "gone.png", "problem": "Colour?", "solution": "red"}]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    real_load = jsonl.load_image

    def load_image(path):
        if Path(path).name == "gone.png":
            raise BadRowError(f"image not found: {path}")
        return real_load(path)

    monkeypatch.setattr(jsonl, "load_image", load_image)
    out = tmp_path / "run"
    code = run_cli("train", f"train.output_dir={out}", *SMALL, f"data.eval={tmp_path / 'eval.jsonl'}",
                   "train.max_steps=1", "data.eval_size=10")
    assert code == 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert len(evals) == 2
    assert all(r["eval/size"] == 5 and r["eval/bad_rows"] == 1 for r in evals)
    assert "eval: skipping" in (out / "log.txt").read_text()


def test_evaluation_peak_stays_below_the_training_peak(use_tiny_cache, tmp_path):
    # Peak bytes of live tensors (the probe), not the process's peak RSS: on a 0.36M-parameter
    # model the two peaks differ by a few MB of tensors, well inside RSS's page noise (an
    # evaluation once peaked 16 KiB of RSS above its step). Tensor bytes carry no such noise.
    # Two steps: the first creates the optimizer states, the second starts with them. No warm-up
    # and no evaluation before GRPO, which would only add profiled windows (slow).
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, "train.max_steps=2",
                   "sft.format_warmup_steps=0", "eval.before_train=false", "eval.every=1",
                   "eval.batch=4", "algo.beta=0", "memory.cpu_peak=tensors") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("eval/peak_memory_bytes" in r for r in rows)
    for row in rows:  # eval runs after the update, gradients freed, under inference mode
        assert 0 < row["eval/peak_memory_bytes"] <= row["peak_memory_bytes"], row["step"]
        assert row["peak_reserved_bytes"] is None  # CPU: no allocator cache to report


def test_auto_chunk_sizes_from_the_budget(use_tiny_cache, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", f"train.output_dir={out}", *SMALL, "memory.micro_batch=auto",
                   "memory.generation_batch=auto", "memory.budget=1GiB") == 0
    log = (out / "log.txt").read_text()
    assert "auto-fit for 1.00 GiB on cpu: memory.micro_batch=" in log
    rows = step_rows(out)
    # a generous budget: every row of a step (2 prompts x 4) in one chunk
    assert {(r["micro_batch"], r["generation_batch"]) for r in rows} == {(8, 8)}
