"""``r1fit eval`` through the CLI on builtin:tiny: pass@k and mean@k on hand-worked scores, a
VLM-R1 file's rows scored by their methods, k sampled answers per row seeded by row, bad rows
counted and listed, what --model and --out refuse, and the page in headless Chromium. Most tests
script the answers (generation is replaced, the rest is the real path) so that their scores are
known; the whole runs whose final model and checkpoints ``r1fit eval`` scores are in
tests/e2e/test_eval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from r1fit.cli import main
from r1fit.rollout.generate import row_seeds
from r1fit.train.evaluate import EVAL_SEED_STEP, mean_at_k, pass_at_k

FAST = ["algo.max_new_tokens=8", "data.max_pixels=3136", "memory.generation_batch=4"]


def test_pass_at_k_and_mean_at_k_on_hand_worked_scores():
    scores = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.25, 0.0]]
    # best of each row: 1, 0, 1, 0.5 -> 2.5 / 4; every score: 4.75 / 12
    assert pass_at_k(scores) == 0.625
    assert mean_at_k(scores) == pytest.approx(4.75 / 12)
    assert pass_at_k(scores) >= mean_at_k(scores)
    assert pass_at_k([[1.0], [0.0], [0.5]]) == mean_at_k([[1.0], [0.0], [0.5]]) == 0.5  # k = 1
    assert pass_at_k([]) == mean_at_k([]) == 0.0


def vlm_r1_file(folder: Path, answers: str = "ABC") -> Path:
    """A VLM-R1 JSONL file (conversations, an id, ``accu_reward_method: mcq``), one row per
    letter of ``answers``, each with its own image."""
    lines = []
    for i, letter in enumerate(answers):
        Image.new("RGB", (56, 56), ("red", "green", "blue")[i % 3]).save(folder / f"{i}.png")
        lines.append(json.dumps({
            "id": f"q{i}", "image": f"{i}.png", "accu_reward_method": "mcq",
            "conversations": [{"from": "human", "value": "<image>Colour? A. red B. green C. blue"},
                              {"from": "gpt", "value": f"<answer>{letter}</answer>"}]}))
    path = folder / "val.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def scripted_answers(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """``script(answer)``: the engines' generation replaced by ``answer(sample, seed)`` (seed None
    when greedy) as tokens of the tiny model's tokenizer; returns the calls' seeds."""
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(tiny_dir).tokenizer
    calls: list[list[int] | None] = []

    def script(answer):
        def generate(model, rows, *, seeds, batch_size, settings, ids, device, sharing=None):
            calls.append(None if seeds is None else list(seeds))
            return [torch.tensor(tokenizer(answer(row.sample, None if seeds is None else seeds[i]),
                                           add_special_tokens=False)["input_ids"])
                    for i, row in enumerate(rows)]

        monkeypatch.setattr("r1fit.train.engines.generate_completions", generate)
        return calls

    return script


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]


def test_greedy_answers_to_a_vlm_r1_file_are_scored_by_their_methods(use_tiny_cache, tmp_path,
                                                                     scripted_answers, capsys):
    data = vlm_r1_file(tmp_path)
    calls = scripted_answers(lambda sample, seed: "<think>It is green.</think><answer>B</answer>")
    assert main(["eval", f"data.eval={data}", f"train.output_dir={tmp_path / 'run'}",
                 *FAST]) == 0
    assert calls == [None]  # one greedy batch (eval.batch=64)
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "0.333" in printed
    (folder,) = (tmp_path / "run" / "eval").iterdir()  # the default folder: <model>-<time>
    assert folder.name.startswith("builtin-tiny-")
    summary = json.loads((folder / "summary.json").read_text())
    # one of three mcq rows answered B: accuracy = pass@1 = mean@1 = 1/3, every answer formatted
    assert summary["accuracy"] == summary["pass_at_k"] == summary["mean_at_k"] == 1 / 3
    assert summary["format"] == 1.0 and summary["size"] == 3 and summary["bad_rows"] == 0
    assert summary["samples"] == 1 and summary["model_kind"] == "model.path"
    # the default rewards, accuracy 1.0 and format 0.5: (1/3 + 0.5) on average
    assert summary["rewards"] == {"accuracy": 1 / 3, "format": 1.0}
    assert summary["reward_mean"] == pytest.approx(1 / 3 + 0.5)
    rows = read_rows(folder)
    assert [(r["id"], r["reference"], r["reward_method"], r["pass"]) for r in rows] == [
        (f"{data}:{i + 1}", f"<answer>{letter}</answer>", "mcq", float(letter == "B"))
        for i, letter in enumerate("ABC")]
    assert rows[0]["question"] == "Colour? A. red B. green C. blue"
    assert all((folder / r["images"][0]).is_file() for r in rows)
    assert [a["text"] for a in rows[1]["answers"]] == ["<think>It is green.</think><answer>B</answer>"]
    assert rows[1]["answers"][0]["rewards"] == {"accuracy": 1.0, "format": 1.0}
    assert (folder / "eval.html").is_file() and (folder / "log.txt").is_file()
    assert json.loads((folder / "config.json").read_text())["model"]["lora"]["r"] == 0


def test_sampled_answers_are_seeded_by_row_and_scored_as_pass_and_mean_at_k(
        use_tiny_cache, tmp_path, scripted_answers):
    data = vlm_r1_file(tmp_path, "BBB")
    # an answer is right when its seed is even: row i's j-th answer has seed
    # row_seeds(train.seed, EVAL_SEED_STEP, 4 i + j, 1), whatever the batch it is in
    scripted_answers(lambda sample, seed: f"<think>x</think><answer>{'BA'[seed % 2]}</answer>")
    runs = {}
    for batch in (3, 2):
        out = tmp_path / f"batch{batch}"
        assert main(["eval", f"data.eval={data}", "eval.samples=4", f"eval.batch={batch}",
                     "train.seed=7", *FAST, "--out", str(out)]) == 0
        runs[batch] = out
    right = [[float(seed % 2 == 0) for seed in row_seeds(7, EVAL_SEED_STEP, 4 * i, 4)]
             for i in range(3)]
    summary = json.loads((runs[3] / "summary.json").read_text())
    assert summary["pass_at_k"] == sum(max(r) for r in right) / 3
    assert summary["mean_at_k"] == summary["accuracy"] == sum(map(sum, right)) / 12
    assert summary["pass_at_k"] >= summary["mean_at_k"]
    rows = read_rows(runs[3])
    assert [[a["accuracy"] for a in r["answers"]] for r in rows] == right
    assert [r["pass"] for r in rows] == [max(r) for r in right]
    # the same answers from batches of other sizes
    assert [r["answers"] for r in read_rows(runs[2])] == [r["answers"] for r in rows]


def test_bad_rows_are_counted_and_listed_not_fatal(use_tiny_cache, tmp_path, scripted_answers):
    Image.new("RGB", (56, 56), "red").save(tmp_path / "red.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    rows = [{"image": "red.png", "problem": "Colour?", "solution": "red"}] * 3 + [
        {"image": "broken.png", "problem": "Colour?", "solution": "red"},
        {"image": "red.png", "problem": "Colour?<|im_end|>", "solution": "red"}]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scripted_answers(lambda sample, seed: "<think>x</think><answer>red</answer>")
    out = tmp_path / "out"
    assert main(["eval", f"data.eval={data}", "data.max_bad_fraction=0.5", *FAST,
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["size"] == 3 and summary["accuracy"] == 1.0
    # the corrupt image, found by the reader, and the special token, found when encoding
    assert summary["bad_rows"] == 2
    assert summary["bad"][0].startswith(f"{data}:4: ") and "broken.png" in summary["bad"][0]
    assert summary["bad"][1].startswith(f"{data}:5") and "<|im_end|>" in summary["bad"][1]
    assert [r["index"] for r in read_rows(out)] == [0, 1, 2]
    assert "broken.png" in (out / "eval.html").read_text()


def test_no_row_scored_is_an_error_and_its_out_folder_can_be_used_again(
        use_tiny_cache, tmp_path, capsys, scripted_answers):
    """Every row too long for data.max_prompt_tokens (found while answering): an error, not an
    accuracy of 0.000 over no rows. The folder it left (config.json, log.txt) is an unfinished
    evaluation's, which the same --out takes again once the data is fixed."""
    Image.new("RGB", (56, 56), "red").save(tmp_path / "red.png")
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"image": "red.png", "problem": "Colour?", "solution": "red"})
                    + "\n")
    scripted_answers(lambda sample, seed: "<think>x</think><answer>red</answer>")
    out = tmp_path / "out"
    assert main(["eval", f"data.eval={data}", "data.max_prompt_tokens=5", *FAST,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("r1fit: error: data.eval: no row could be answered and scored: all 1 "
                          f"were bad; first: {data}:1")
    assert {p.name for p in out.iterdir()} <= {"config.json", "log.txt", "images"}
    assert not (out / "summary.json").exists()
    assert main(["eval", f"data.eval={data}", *FAST, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["accuracy"] == 1.0
    assert "held an unfinished evaluation (no summary.json): written over" in \
        (out / "log.txt").read_text()
    # a finished evaluation's folder is not taken
    assert main(["eval", f"data.eval={data}", *FAST, "--out", str(out)]) == 2
    assert "not a new or empty folder" in capsys.readouterr().err


def test_what_model_and_out_refuse_is_one_line(use_tiny_cache, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (["--model", str(run)], "is a run's output folder; pass its final/ or one of its "
                                f"checkpoints, e.g. {run / 'checkpoint-2'}"),
        (["--model", str(run / "checkpoint-2")], "cannot read the checkpoint: no manifest"),
        (["--model", str(tmp_path / "empty")], "not a model folder (config.json), a LoRA adapter "
                                               "folder"),
        (["--out", str(tmp_path / "full")], "not a new or empty folder"),
        (["--out", str(tmp_path / "full" / "x" / "out")],
         f"--out {tmp_path / 'full' / 'x' / 'out'}: cannot write the evaluation's folder: "
         f"{tmp_path / 'full' / 'x'} is a file, not a folder"),
        (["--model", str(tmp_path / "missing")], f"model folder '{tmp_path / 'missing'}' does "
                                                 "not exist"),
        (["--model", str(tmp_path / "full" / "x")], "is a file; expected a model folder"),
        (["data.eval=null"], "data.eval is null")]
    for i, (args, message) in enumerate(cases):
        out = [] if "--out" in args else ["--out", str(tmp_path / f"out{i}")]
        assert main(["eval", *args, *out]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("r1fit: error: ") and message in err and "\n" not in err, err
        if "--model" in args:  # refused before the eval set is read
            assert not (tmp_path / f"out{i}").exists()


def test_the_page_of_an_evaluation_with_tools_opens_in_chromium(use_tiny_cache, tmp_path,
                                                                headless_chromium):
    out = tmp_path / "out"
    # the real tiny model, greedy, through the multi-turn loop (its turns on the page)
    assert main(["eval", "data.eval_size=3", "tools=[zoom]", "data.max_images=2", *FAST, "--out", str(out)]) == 0
    rows = read_rows(out)
    assert len(rows) == 3 and all("turns" in r["answers"][0] for r in rows)
    assert json.loads((out / "summary.json").read_text())["tool_use"] == 0.0
    shot, console = headless_chromium(out / "eval.html")
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # text, tables and images, not blank
    assert console == []


def test_an_adapter_scored_on_another_base_is_said(use_tiny_cache, tiny_dir, tmp_path, caplog):
    """A LoRA adapter names its base (adapter_config.json): model.path that resolves to it is
    quiet (builtin:tiny and its cache folder are one), another model is a warning naming both."""
    from r1fit.train.eval_command import other_base

    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "base_model_name_or_path": str(tiny_dir)}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with caplog.at_level("WARNING", logger="r1fit"):
        assert other_base(str(adapter), "builtin:tiny") is None
        assert other_base(str(adapter), str(tiny_dir)) is None
        assert not caplog.records
        assert other_base(str(adapter), str(other)) == str(tiny_dir)
    assert caplog.records[-1].getMessage() == (
        f"eval: --model {adapter} is a LoRA adapter trained on {tiny_dir}, scored on "
        f"model.path={other}: unless that is the same model, pass model.path={tiny_dir}")
