"""2-step GRPO (its SFT warm-up included) and 2-step SFT on each data format people bring:
VLM-R1's JSONL (two files, their own image folders and accuracy methods), EasyR1's parquet with
embedded image bytes, and LLaVA's JSON list of multi-turn conversations."""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import r1fit.train.sft
from r1fit.cli import main
from r1fit.data.batch import micro_batches
from r1fit.report.metrics import read_metrics

RUN = ["train.prompts_per_step=2", "algo.num_generations=4", "algo.max_new_tokens=8",
       "sft.batch_size=4", "data.eval_size=4", "memory.micro_batch=4",
       "memory.generation_batch=8", "data.max_pixels=3136", "eval.every=0",
       "checkpoint.every=0", "sft.format_warmup_steps=2", "train.max_steps=2", "algo.beta=0"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (56, 56), COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()


def vlm_r1(tmp: Path) -> list[str]:
    """Two JSONL files in VLM-R1's layout, each with its image folder; rows name their method."""
    args = []
    for name in ("a", "b"):
        folder = tmp / f"imgs_{name}"
        folder.mkdir()
        lines = []
        for i, colour in enumerate(COLOURS):
            (folder / f"{colour}.png").write_bytes(png(colour))
            choice = "ABC"[i]
            lines.append(json.dumps({
                "id": f"{name}{i}", "image": f"{colour}.png",
                "conversations": [{"from": "human", "value": "<image>Colour? A. red B. green "
                                                              "C. blue"},
                                  {"from": "gpt", "value": f"<answer>{choice}</answer>"}],
                "accu_reward_method": "mcq" if name == "a" else "default"}))
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    args += [f"data.train=[{tmp / 'a.jsonl'},{tmp / 'b.jsonl'}]",
             f"data.image_folder=[{tmp / 'imgs_a'},{tmp / 'imgs_b'}]",
             f"data.eval={tmp / 'b.jsonl'}", f"data.eval_image_folder={tmp / 'imgs_b'}"]
    return args


def easyr1(tmp: Path) -> list[str]:
    datasets = pytest.importorskip("datasets", reason="the datasets package reads parquet")
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                  "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    table = datasets.Dataset.from_dict(
        {"images": [[{"bytes": png(c), "path": None}] for c in COLOURS],
         "problem": ["<image>What colour is the square?"] * 3, "answer": list(COLOURS)},
        features=features)
    table.to_parquet(str(tmp / "train.parquet"))
    return [f"data.train={tmp / 'train.parquet'}", f"data.eval={tmp / 'train.parquet'}"]


def llava(tmp: Path) -> list[str]:
    """LLaVA's JSON list: multi-turn conversations, the image in the first turn."""
    rows = []
    for colour in COLOURS:
        (tmp / f"{colour}.png").write_bytes(png(colour))
        rows.append({"id": colour, "image": f"{colour}.png", "conversations": [
            {"from": "human", "value": "<image>\nIs there a square?"},
            {"from": "gpt", "value": "Yes."},
            {"from": "human", "value": "What colour is it?"},
            {"from": "gpt", "value": colour}]})
    (tmp / "llava.json").write_text(json.dumps(rows))
    return [f"data.train={tmp / 'llava.json'}", f"data.eval={tmp / 'llava.json'}"]


FORMATS = {"vlm-r1": vlm_r1, "easyr1": easyr1, "llava": llava}


@pytest.mark.parametrize("name", FORMATS)
def test_grpo_and_sft_on_each_format(name, use_tiny_cache, tmp_path, capsys):
    data = FORMATS[name](tmp_path)
    out = tmp_path / "grpo"
    assert main(["train", f"train.output_dir={out}", *RUN, *data]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["bad_rows"] == 0 for r in steps)
    warmup = [r for r in rows if "warmup/loss" in r]
    assert len(warmup) == 2 and all(math.isfinite(r["warmup/loss"]) for r in warmup)
    assert all(r["warmup/flops"] > 0 and 0 < r["warmup/mfu"] < 1 for r in warmup)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["eval/size"] for r in evals] == [3, 3]

    out = tmp_path / "sft"
    assert main(["sft", f"train.output_dir={out}", *RUN, *data, "sft.steps=2"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)


def test_packed_sft_on_multi_turn_rows_trains_as_rows_do(use_tiny_cache, tmp_path, caplog,
                                                          monkeypatch):
    """SFT with memory.micro_batch_tokens (rows packed into one row each micro-batch, assistant
    turns scored only) trains the model as micro-batches of rows do: the same losses each step
    and final weights within rounding; so does the head that recomputes its chunks."""
    data = llava(tmp_path)
    common = [*RUN, *data, "sft.steps=3", "sft.batch_size=3", "sft.learning_rate=1e-2",
              "data.eval=null"]

    def sft(name: str, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
        out = tmp_path / name
        assert main(["sft", f"train.output_dir={out}", *common, *extra]) == 0
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        return rows, load_file(out / "final" / "model.safetensors")

    rows, w_rows = sft("rows", "memory.micro_batch=2")
    # the LM head's gradient made in its forward (memory.fused_loss, the default) or recomputed
    # in backward: the same losses and gradient norms, on masked multi-turn rows
    recomputed, w_recomputed = sft("recomputed", "memory.micro_batch=2", "memory.fused_loss=false")
    for a, b in zip(rows, recomputed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for key in w_rows:
        torch.testing.assert_close(w_recomputed[key], w_rows[key], rtol=1e-4, atol=1e-3)
    cuts = []

    def recording(*args, **kwargs):
        pieces = list(micro_batches(*args, **kwargs))
        cuts.append([len(p) for _, p, _ in pieces])
        return iter(pieces)

    monkeypatch.setattr(r1fit.train.sft, "micro_batches", recording)
    with caplog.at_level(logging.INFO, logger="r1fit.forward"):
        # a row (an image prompt and both turns) is ~79 tokens: 170 packs two rows, then one
        packed, w_packed = sft("packed", "memory.micro_batch_tokens=170")
    assert "packed micro-batches checked equal" in caplog.text
    assert cuts == [[2, 1]] * 3
    assert len(rows) == len(packed) == 3
    for a, b in zip(rows, packed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["flops"] == a["flops"] > 0  # packing removes padding, not model FLOPs
    assert w_rows.keys() == w_packed.keys()
    moved = 0
    for key in w_rows:
        # AdamW's step of a near-zero gradient is noise-sized: atol well under the lr (1e-2)
        torch.testing.assert_close(w_packed[key], w_rows[key], rtol=1e-4, atol=1e-3)
        moved += int(not torch.equal(w_rows[key], w_packed[key]))
    assert moved  # two computations, not one path twice


def test_sft_cuts_multi_turn_answers_with_their_masks(use_tiny_cache, tmp_path, monkeypatch,
                                                      capsys):
    """sft.max_answer_tokens cuts a multi-turn row's conversation after its prompt, mask and
    all: the rows train on the first tokens of their first assistant turn; a batch left with
    no scored token stops the run in one line."""
    data = llava(tmp_path)
    common = [*RUN, *data, "sft.steps=2", "sft.batch_size=3", "data.eval=null"]
    out = tmp_path / "cut"
    assert main(["sft", f"train.output_dir={out}", *common, "sft.max_answer_tokens=2"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["truncated_answers"] for r in rows] == [3, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    # a template whose kept tokens are all unscored: every mask cut to zeros
    real = r1fit.train.sft.cut_answers

    def unscored(targets, masks, limit):
        targets, masks, cut = real(targets, masks, limit)
        return targets, [torch.zeros_like(m) for m in masks], cut

    monkeypatch.setattr(r1fit.train.sft, "cut_answers", unscored)
    capsys.readouterr()
    assert main(["sft", f"train.output_dir={tmp_path / 'none'}", *common,
                 "sft.max_answer_tokens=2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("r1fit: error: SFT step 1: no answer token to learn in the batch "
                   "(sft.max_answer_tokens=2 cuts every scored assistant turn); raise "
                   "sft.max_answer_tokens")
