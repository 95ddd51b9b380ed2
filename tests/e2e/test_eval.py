"""``r1fit eval`` on what whole runs leave (the demo's config, shortened): the final model of a
full fine-tuning run, and the last checkpoint and the adapter of a LoRA run evaluated on a VLM-R1
file. Greedy on the same rows, its figures are the run's own last evaluation, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from r1fit.cli import main
from r1fit.config import resolve_config
from r1fit.report.metrics import read_metrics
from r1fit.train.eval_command import model_source, start_session

# the demo, shortened: a format warm-up long enough that every answer is formatted (so the
# figures compared are not all 0), 2 GRPO steps, 12 held-out rows evaluated at the end only
RUN = ["train.max_steps=2", "train.prompts_per_step=2", "algo.num_generations=4",
       "sft.format_warmup_steps=30", "data.eval_size=12", "eval.every=0",
       "eval.before_train=false", "memory.micro_batch=4", "memory.generation_batch=8",
       "data.shapes.train_size=50", "data.max_pixels=3136", "checkpoint.every=2"]


def last_eval(out: Path) -> dict:
    return [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r][-1]


def evaluated(tmp_path: Path, name: str, *args: str) -> dict:
    folder = tmp_path / name
    assert main(["eval", *args, "--out", str(folder)]) == 0
    return json.loads((folder / "summary.json").read_text())


def assert_same_figures(summary: dict, run_eval: dict) -> None:
    assert summary["accuracy"] == summary["pass_at_k"] == summary["mean_at_k"]
    assert (summary["accuracy"], summary["format"], summary["size"], summary["bad_rows"]) == (
        run_eval["eval/accuracy"], run_eval["eval/format"], run_eval["eval/size"],
        run_eval["eval/bad_rows"])


def lora_weights(args: list[str], model: Path) -> dict[str, torch.Tensor]:
    """The LoRA weights of the model ``r1fit eval ARGS --model MODEL`` scores."""
    cfg = resolve_config(None, args)[0]
    source = model_source(cfg, str(model))
    session = start_session(cfg.with_values(source.values), source)
    return {name: p for name, p in session.model.named_parameters() if ".lora_" in name}


def vlm_r1_colours(folder: Path, n: int = 9) -> Path:
    """A VLM-R1 JSONL file of colour questions about 56 px circles (``default`` method)."""
    lines = []
    for i in range(n):
        colour = ("red", "green", "blue")[i % 3]
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).ellipse((8 + i, 8, 40 + i, 40), fill=colour)
        image.save(folder / f"{i}.png")
        lines.append(json.dumps({
            "id": f"c{i}", "image": f"{i}.png", "accu_reward_method": "default",
            "conversations": [{"from": "human", "value": "<image>What colour is the circle?"},
                              {"from": "gpt", "value": f"<answer>{colour}</answer>"}]}))
    path = folder / "colours.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_final_model_a_lora_checkpoint_and_its_adapter_score_their_runs_last_evaluation(
        use_tiny_cache, tmp_path):
    # a full fine-tuning run (the demo's, shortened): its final model
    full = tmp_path / "full"
    assert main(["train", f"train.output_dir={full}", *RUN]) == 0
    run_eval = last_eval(full)
    assert run_eval["eval/format"] > 0  # the warm-up taught the format: a comparison of substance
    summary = evaluated(tmp_path, "final", *RUN, "--model", str(full / "final"))
    assert summary["model_kind"] == "a model folder"
    assert_same_figures(summary, run_eval)

    # LoRA GRPO on that model (which knows the format: LoRA on the random-weight tiny model
    # learns it far slower), evaluated on a VLM-R1 file: its last checkpoint, then its adapter
    data = tmp_path / "data"
    data.mkdir()
    args = [*RUN, "preset=demo", f"model.path={full / 'final'}", "sft.format_warmup_steps=0",
            "model.lora.r=8", "train.learning_rate=5e-2", f"data.eval={vlm_r1_colours(data)}"]
    lora = tmp_path / "lora"
    assert main(["train", f"train.output_dir={lora}", *args]) == 0
    run_eval = last_eval(lora)
    assert run_eval["eval/size"] == 9 and run_eval["eval/format"] > 0
    checkpoint = evaluated(tmp_path, "checkpoint", *args, "--model", str(lora / "checkpoint-2"))
    assert checkpoint["model_kind"] == "a run's checkpoint"
    assert_same_figures(checkpoint, run_eval)
    adapter = evaluated(tmp_path, "adapter", *args, "--model", str(lora / "final"))
    assert adapter["model_kind"] == "a LoRA adapter"
    assert_same_figures(adapter, run_eval)
    # the answers themselves are the same, row by row
    rows = {name: [json.loads(line)["answers"] for line in
                   (tmp_path / name / "eval.jsonl").read_text().splitlines()]
            for name in ("checkpoint", "adapter")}
    assert rows["checkpoint"] == rows["adapter"]
    # two GRPO steps did not change a greedy answer here: the trained adapter is what both
    # loaded (lora_B starts at 0)
    from_checkpoint = lora_weights(args, lora / "checkpoint-2")
    from_adapter = lora_weights(args, lora / "final")
    assert from_checkpoint.keys() == from_adapter.keys() and len(from_adapter) > 0
    assert all(torch.equal(from_checkpoint[k], from_adapter[k]) for k in from_adapter)
    assert any(w.abs().sum() > 0 for k, w in from_adapter.items() if ".lora_B." in k)
