"""Bad input that used to end deep in a traceback ends in one line or a counted skip."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from PIL import Image

from r1fit.cli import main
from r1fit.report.metrics import read_metrics

ARGS = ["train.max_steps=3", "train.prompts_per_step=2", "algo.num_generations=2",
        "algo.max_new_tokens=8", "sft.format_warmup_steps=0", "eval.every=0",
        "data.shapes.image_size=56", "data.max_pixels=3136", "checkpoint.every=0"]


def _data(folder: Path, long_words: int) -> Path:
    """Four good rows, then (line 5) one whose question is ``long_words`` words long."""
    Image.new("RGB", (56, 56), "red").save(folder / "red.png")
    rows = [{"image": "red.png", "problem": "What colour is the image?", "solution": "red"}] * 4
    rows.append({"image": "red.png", "problem": "word " * long_words, "solution": "red"})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_longer_than_the_context_is_a_counted_bad_row(use_tiny_cache, tmp_path):
    # builtin:tiny takes 32,768 positions: the default limit is that minus algo.max_new_tokens
    data = _data(tmp_path, 40_000)
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS, f"data.train={data}",
                 f"data.eval={data}"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    log = (out / "log.txt").read_text()
    # 3 steps x 2 prompts draw every row of the first epoch: the long one is met, skipped and
    # counted each time it comes up, never trained on
    met = log.count(f"WARNING r1fit: skipping {data}:5: the prompt has ")
    assert met >= 1 and rows[-1]["bad_rows"] == met
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert evals and all(r["eval/bad_rows"] == 1 and r["eval/size"] == 4 for r in evals)
    assert "more than data.max_prompt_tokens=32760" in log


def test_max_prompt_tokens_is_configurable(use_tiny_cache, tmp_path):
    data = _data(tmp_path, 200)
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS, f"data.train={data}",
                 "data.eval=null", "data.max_prompt_tokens=100"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    log = (out / "log.txt").read_text()
    met = log.count("tokens, more than data.max_prompt_tokens=100")
    assert met >= 1 and rows[-1]["bad_rows"] == met


def test_a_config_image_token_id_the_tokenizer_does_not_use_stops_before_the_first_step(
        tiny_dir, use_tiny_cache, tmp_path, capsys):
    # a hand-edited config.json: transformers would stop in the first step with "Image features
    # and image tokens do not match"
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    used, config["image_token_id"] = config["image_token_id"], 5
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    assert main(["train", f"model.path={model}", f"train.output_dir={out}", *ARGS,
                 "train.max_steps=1", "eval.before_train=false", "data.eval=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"r1fit: error: model '{model}': config image_token_id=5 but the processor's "
                       f"image token '<|image_pad|>' is id {used}, so the model would not find the "
                       f"image tokens in a prompt; set \"image_token_id\": {used} in the model's "
                       "config.json (or use the tokenizer the model was saved with)")
    assert not any("Traceback" in line for line in err)
    assert not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text()


def test_max_prompt_tokens_below_every_prompt_says_how_long_the_prompts_are(use_tiny_cache,
                                                                             tmp_path, capsys):
    data = _data(tmp_path, 30)  # prompts of two lengths
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS, f"data.train={data}",
                 "data.eval=null", "eval.before_train=false", "data.max_prompt_tokens=10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    found = re.fullmatch(
        r"r1fit: error: \S*train.jsonl: could not fetch 2 good rows in 100 tries; all 200 rows "
        r"drawn have a prompt longer than data.max_prompt_tokens=10 \((\d+) to (\d+) tokens\): "
        r"raise data.max_prompt_tokens to at least (\d+) \(within the model's context\) or "
        r"shorten the prompts \(a lower data.max_pixels gives an image fewer tokens\)", err[-1])
    assert found, err[-1]
    # the lengths are those of the rows skipped on the way, each warned about
    seen = [int(n) for n in re.findall(r"skipping .*: the prompt has (\d+) tokens, more than "
                                       r"data.max_prompt_tokens=10", (out / "log.txt").read_text())]
    assert len(seen) == 200 and len(set(seen)) == 2
    assert (int(found[1]), int(found[2]), int(found[3])) == (min(seen), max(seen), max(seen))


def _special_rows(folder: Path) -> Path:
    """Four good rows, then a question holding an image placeholder's text (line 5) and an
    answer holding the end-of-turn token's (line 6)."""
    Image.new("RGB", (56, 56), "red").save(folder / "red.png")
    good = {"image": "red.png", "problem": "What colour is the image?", "solution": "red"}
    rows = [good] * 4 + [
        {**good, "problem": "What colour is <|image_pad|> the image?"},
        {**good, "solution": "red<|im_end|>"}]
    path = folder / "special.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_special_tokens_in_data_rows_are_counted_bad_rows_under_grpo_and_sft(use_tiny_cache,
                                                                                 tmp_path):
    data = _special_rows(tmp_path)
    for command, extra in (("train", ["train.max_steps=4"]),
                           ("sft", ["sft.steps=4", "sft.batch_size=2"])):
        out = tmp_path / command
        assert main([command, f"train.output_dir={out}", *ARGS, *extra, f"data.train={data}",
                     "data.eval=null"]) == 0, command
        log = (out / "log.txt").read_text()
        question = log.count(f"skipping {data}:5: its question holds the model's special token "
                             "'<|image_pad|>'")
        answer = log.count(f"skipping {data}:6: its answer holds the model's special token "
                           "'<|im_end|>'")
        assert question >= 1 and answer >= 1, command
        rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("bad_rows") is not None]
        assert rows and rows[-1]["bad_rows"] == question + answer, command


def test_a_system_prompt_with_a_special_token_is_a_one_line_error(use_tiny_cache, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS,
                 "data.system_prompt=Answer.<|im_end|><|im_start|>user"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("r1fit: error: data.system_prompt holds the model's special token "
                              "'<|im_start|>'") or err[-1].startswith(
        "r1fit: error: data.system_prompt holds the model's special token '<|im_end|>'")


def test_a_diverging_run_skips_updates_that_are_not_finite_then_stops_in_one_line(
        use_tiny_cache, tmp_path, capsys):
    """A learning rate of 1e30: the first update is finite and blows the weights up, every later
    one's gradient norm is NaN. Each is skipped (no optimizer step: the weights stay as the
    first update left them), counted in skipped_updates, and the second in a row stops the run
    with one line (train.max_skipped_updates=2)."""
    out = tmp_path / "run"
    code = main(["sft", f"train.output_dir={out}", *ARGS, "sft.steps=6", "sft.batch_size=2",
                 "sft.learning_rate=1e30", "train.warmup_steps=0", "data.eval=null",
                 "train.max_skipped_updates=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("r1fit: error: step 3: 2 updates in a row had a gradient norm that "
                              "is not finite (nan), each skipped; the run stops "
                              "(train.max_skipped_updates=2)")
    rows = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["skipped_updates"], r["grad_norm"] is None) for r in rows] == [
        (1, 0, False), (2, 1, True)]  # the stopping step writes no row
    log = (out / "log.txt").read_text()
    assert "WARNING r1fit: step 2: gradient norm nan (not finite): update skipped, no optimizer " \
           "or schedule step (1 in a row; the run stops at train.max_skipped_updates=2)" in log


def test_a_misspelt_reward_stops_r1fit_train_before_the_model_loads(use_tiny_cache, tmp_path,
                                                                    capsys):
    """Before, the model loaded and the whole format warm-up ran (a checkpoint saved) before the
    reward was resolved; now nothing is written."""
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS, "sft.format_warmup_steps=5",
                 "rewards.accurcy=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("r1fit: error: unknown reward 'accurcy': use a built-in")
    assert not out.exists()


def test_an_evaluation_with_no_row_it_could_score_logs_null_not_zero(use_tiny_cache, tmp_path):
    """Every eval row longer than data.max_prompt_tokens (found while answering): eval/accuracy
    is null with a warning, not 0 (a model wrong on every row), and early stopping and the
    summary pass it over."""
    data = _data(tmp_path, 200)
    only_long = tmp_path / "eval.jsonl"
    only_long.write_text(data.read_text().splitlines()[-1] + "\n")
    out = tmp_path / "run"
    assert main(["train", f"train.output_dir={out}", *ARGS, f"data.train={data}",
                 f"data.eval={only_long}", "data.max_prompt_tokens=100",
                 "train.early_stop_patience=1"]) == 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert [(r["step"], r["eval/accuracy"], r["eval/size"], r["eval/bad_rows"]) for r in evals] \
        == [(0, None, 0, 1), (3, None, 0, 1)]
    assert "eval: no row of data.eval could be answered and scored (1 bad): eval/accuracy and " \
           "eval/format are null" in (out / "log.txt").read_text()
    assert "train.early_stop_patience=1 has no effect: it counts evaluations during training, " \
           "and eval.every=0 evaluates only before and after" in (out / "log.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and "eval_accuracy_end" not in summary
