"""Sources other than JSONL: a JSON list, parquet with embedded image bytes (EasyR1's layout), a
``save_to_disk`` folder with splits, and the one-line errors of each."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.rows import FormatOptions
from r1fit.data.source import RowSource, TableSpec
from r1fit.data.tables import open_table

datasets = pytest.importorskip("datasets", reason="the datasets package reads parquet/Arrow")


def png(color: tuple[int, int, int], size: tuple[int, int] = (30, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def source(*specs: str | TableSpec, **kwargs: object) -> RowSource:
    tables = [s if isinstance(s, TableSpec) else TableSpec(s) for s in specs]
    kwargs = {"max_images": 2, "max_bad_fraction": 0.5, **kwargs}
    return RowSource(tables, options=FormatOptions(), **kwargs)


def easyr1_parquet(path: Path, rows: list[tuple[bytes, str, str]]) -> Path:
    """EasyR1's columns: images (a list of Image), problem with its <image>, answer."""
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                  "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    table = datasets.Dataset.from_dict(
        {"images": [[{"bytes": b, "path": None}] for b, _, _ in rows],
         "problem": [p for _, p, _ in rows], "answer": [a for _, _, a in rows]},
        features=features)
    table.to_parquet(str(path))
    return path


def test_parquet_with_embedded_images_decodes_each_sample(tmp_path, caplog) -> None:
    path = easyr1_parquet(tmp_path / "train.parquet", [
        (png((255, 0, 0)), "<image>Which colour?", "red"),
        (png((0, 0, 255)), "<image>And this one?", "blue"),
        (png((0, 255, 0))[:40], "<image>Broken?", "green"),  # a truncated PNG: a bad row
    ])
    with caplog.at_level(logging.INFO, logger="r1fit.data"):
        src = source(str(path))
    assert (len(src), src.total_rows, src.bad_rows) == (2, 3, 1)
    assert src.first_error.startswith(f"{path} row 3: corrupt image (embedded, 40 bytes): ")
    assert f"data: {path}: columns rows (question 'problem', answer 'answer', 'image' or " \
           "'images' for images); 2 good rows, 2 with images" in caplog.text
    first, second = src.sample(0), src.sample(1)
    assert first.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert second.images[0].getpixel((0, 0)) == (0, 0, 255)
    assert (second.problem, second.solution, second.source) == ("And this one?", "blue",
                                                                f"{path} row 2")
    assert second.turns == (("user", "<image>And this one?"), ("assistant", "blue"))
    # the embedded bytes stay in the table, not in the validated rows
    assert all(r.row.images == () and r.embedded for r in src.rows)


def test_save_to_disk_folder_with_splits(tmp_path) -> None:
    rows = {"problem": ["a?", "b?"], "solution": ["1", "2"]}
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                   "test": datasets.Dataset.from_dict({"problem": ["c?"],
                                                                       "solution": ["3"]})})
    splits.save_to_disk(str(tmp_path / "ds"))
    assert len(open_table(str(tmp_path / "ds"), default_split="train")) == 2
    assert len(open_table(str(tmp_path / "ds"), default_split="test")) == 1
    picked = open_table(f"{tmp_path / 'ds'}@test", default_split="train")
    assert (len(picked), picked.name) == (1, f"{tmp_path / 'ds'}@test[test]")
    with pytest.raises(DataError, match=re.escape("no split 'dev' (has ['train', 'test']); name "
                                                  f"one as {tmp_path / 'ds'}@<split>")):
        open_table(f"{tmp_path / 'ds'}@dev", default_split="train")


def test_json_python_cannot_read_is_a_bad_row_and_suffixes_ignore_case(tmp_path) -> None:
    """Valid JSON past Python's limits (a 5,000-digit number, 100,000 nested lists) is a bad
    row, named, not a traceback; DATA.JSONL and LIST.JSON are the local files they look like,
    not hub ids."""
    good = json.dumps({"problem": "q", "solution": "a"})
    path = tmp_path / "DATA.JSONL"
    path.write_text("\n".join([good, '{"problem": "q", "solution": ' + "9" * 5000 + "}",
                               '{"problem": ' + "[" * 100_000 + "]" * 100_000 + "}", good]))
    src = source(str(path), max_bad_fraction=0.5)
    assert (len(src), src.bad_rows) == (2, 2)
    assert src.skipped == [
        f"{path}:2: bad JSON: Exceeds the limit (4300 digits) for integer string conversion: "
        "value has 5000 digits",
        f"{path}:3: bad JSON: nested too deeply"]
    listed = tmp_path / "LIST.JSON"
    listed.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match=re.escape(f"{listed}: not a JSON file (nested too "
                                                  "deeply)")):
        source(str(listed))


def test_json_list_of_llava_rows(tmp_path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((9, 9, 9)))
    rows = [{"id": "1", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "grey"}]},
        {"id": "2", "conversations": [{"from": "human", "value": "hi"}]}]  # no answer: bad
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(rows))
    src = source(TableSpec(str(path), image_folder=str(tmp_path / "imgs")))
    assert (len(src), src.bad_rows) == (1, 1)
    assert src.first_error == (f"{path} row 2: the last turn of 'conversations' is not the "
                               "assistant's answer")
    assert src.sample(0).images[0].getpixel((0, 0)) == (9, 9, 9)


def test_several_sources_with_their_own_folders_and_methods(tmp_path) -> None:
    """VLM-R1's --data_file_paths a:b --image_folders x:y --reward_method m:n."""
    for name in ("x", "y"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "p.png").write_bytes(png((1, 1, 1) if name == "x" else (2, 2, 2)))
    for name, method in (("a", None), ("b", "numeric")):
        row = {"image": "p.png", "conversations": [{"from": "human", "value": "<image>q"},
                                                   {"from": "gpt", "value": "4"}]}
        if method:
            row["accu_reward_method"] = method
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    src = source(TableSpec(str(tmp_path / "a.jsonl"), str(tmp_path / "x"), "mcq"),
                 TableSpec(str(tmp_path / "b.jsonl"), str(tmp_path / "y"), "mcq"))
    a, b = src.sample(0), src.sample(1)
    assert a.images[0].getpixel((0, 0)) == (1, 1, 1) and b.images[0].getpixel((0, 0)) == (2, 2, 2)
    assert (a.reward_method, b.reward_method) == ("mcq", "numeric")
    assert (a.source, b.source) == (f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:1")


def test_unknown_method_makes_rows_bad(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"problem": "q", "solution": "a",
                                          "accu_reward_method": m}) for m in ("mcq", "psychic")))

    def check(method: str) -> None:
        if method == "psychic":
            raise ValueError("unknown accuracy method 'psychic'")

    src = source(str(path), check_method=check)
    assert (len(src), src.first_error) == (1, f"{path}:2: unknown accuracy method 'psychic'")


def test_errors_name_the_source(tmp_path) -> None:
    (tmp_path / "d.json").write_text('{"problem": "q"}')
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'd.json'}: a .json source must "
                                                  "hold a list of rows, got dict")):
        open_table(str(tmp_path / "d.json"), default_split="train")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'x.parquet'}: file not found")):
        open_table(str(tmp_path / "x.parquet"), default_split="train")
    with pytest.raises(DataError, match="not found .neither a file or folder here nor a hub id"):
        open_table("./no/such/thing", default_split="train")
    with pytest.raises(DataError, match=re.escape("d.jsonl@train: a .jsonl file has no splits")):
        (tmp_path / "d.jsonl").write_text("{}\n")
        open_table(f"{tmp_path / 'd.jsonl'}@train", default_split="train")
    # a file of another kind: named as such (datasets took it for a hub id it could not reach)
    (tmp_path / "rows.txt").write_text("q\ta\n")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'rows.txt'}: a .txt file; r1fit "
                                                  "reads .jsonl, .json, .parquet and .arrow")):
        open_table(str(tmp_path / "rows.txt"), default_split="train")


def test_a_folder_datasets_cannot_read_says_why(tmp_path) -> None:
    """datasets wraps the reason in "An error occurred while generating the dataset": the
    message carries the reason too (here, two files whose columns differ)."""
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text('{"problem": "q", "solution": "a"}\n')
    (tmp_path / "rows" / "b.jsonl").write_text('{"question": "q", "answer": 1}\n')
    with pytest.raises(DataError, match=r"rows: cannot load it with datasets \(.*: .*column") as info:
        open_table(str(tmp_path / "rows"), default_split="train")
    assert "\n" not in str(info.value)


def test_a_folder_of_data_files_loads_like_a_hub_repository(tmp_path) -> None:
    """The same datasets.load_dataset call a hub id takes, on a folder laid out as hub dataset
    repositories are (data/<split>-*.parquet)."""
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split, n in (("train", 3), ("test", 2)):
        datasets.Dataset.from_dict({"problem": [f"q{i}" for i in range(n)],
                                    "answer": [str(i) for i in range(n)]}).to_parquet(
            str(tmp_path / "repo" / "data" / f"{split}-00000-of-00001.parquet"))
    repo = str(tmp_path / "repo")
    assert len(open_table(repo, default_split="train")) == 3
    assert len(open_table(repo, default_split="test")) == 2
    assert open_table(f"{repo}@test", default_split="train").where(1) == f"{repo}@test[test] row 2"


def test_an_unreachable_hub_id_is_one_line(tmp_path) -> None:
    """Hubs are unreachable here: offline mode makes datasets say so at once."""
    code = ("from r1fit.data.tables import open_table\n"
            "try:\n    open_table('someone/some-dataset@train', default_split='train')\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.stdout.startswith("DataError someone/some-dataset@train: cannot load it with "
                                  "datasets ("), done.stdout + done.stderr[-2000:]
    assert done.stdout.count("\n") == 1


def test_a_jsonl_row_that_names_a_key_twice_is_bad(tmp_path) -> None:
    """Python's json keeps the last of two values of a key: which answer was meant is unknown,
    so the row is bad, named and counted (its neighbours are read)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "q", "solution": "1"}\n{"problem": "q", "solution": "1", '
                    '"solution": "2"}\n')
    table = open_table(str(path), default_split="train")
    assert table.row(0) == {"problem": "q", "solution": "1"}
    with pytest.raises(BadRowError, match="key 'solution' given twice"):
        table.row(1)


def test_a_json_list_row_that_names_a_key_twice_is_bad_and_its_neighbours_are_read(
        tmp_path) -> None:
    """In a .json list (LLaVA's layout) as in JSONL: a row naming a key twice, at its top or in
    a turn of its conversation, is a bad row, named; the file's other rows are read."""
    path = tmp_path / "d.json"
    path.write_text('[{"problem": "q", "solution": "1"},\n'
                    ' {"problem": "q", "solution": "1", "solution": "2"},\n'
                    ' {"conversations": [{"from": "human", "value": "a", "value": "b"}]},\n'
                    ' {"problem": "r", "solution": "3"}]')
    table = open_table(str(path), default_split="train")
    assert len(table) == 4
    assert table.row(0) == {"problem": "q", "solution": "1"}
    with pytest.raises(BadRowError, match="key 'solution' given twice"):
        table.row(1)
    with pytest.raises(BadRowError, match="key 'value' given twice"):
        table.row(2)
    assert table.row(3) == {"problem": "r", "solution": "3"}
    src = source(str(path))
    assert (len(src), src.bad_rows) == (2, 2)
    assert src.first_error == f"{path} row 2: key 'solution' given twice"


def test_eval_sources_take_their_training_sources_methods(tmp_path, caplog) -> None:
    """data.reward_method=[mcq,default] is per data.train source: an eval source that is also a
    training source is scored by that source's method (before: 'default' for every eval row,
    unsaid, so 'The answer is B' scored 0 in eval and 1 in training); another source takes
    'default', said; data.eval_reward_method sets them outright."""
    from r1fit.config import load_config
    from r1fit.data.build import build_datasets

    (tmp_path / "p.png").write_bytes(png((1, 1, 1)))
    for name in ("a", "b", "c"):
        rows = [{"image": "p.png", "problem": f"{name} {i}?", "solution": "B"} for i in range(4)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = (str(tmp_path / f"{n}.jsonl") for n in "abc")

    def methods(*overrides: str) -> list[str]:
        cfg = load_config(None, [f"data.train=[{a},{b}]", "data.reward_method=[mcq,numeric]",
                                 "data.eval_size=8", *overrides])
        _, evals = build_datasets(cfg)
        return [evals[i].reward_method for i in range(len(evals))]

    assert methods(f"data.eval=[{b},{a}]") == ["numeric"] * 4 + ["mcq"] * 4
    with caplog.at_level(logging.INFO, logger="r1fit"):
        assert methods(f"data.eval=[{a},{c}]") == ["mcq"] * 4 + ["default"] * 4
    assert f"data.eval: {c} is no data.train source, so its rows that name no method are " \
        "scored by 'default'" in caplog.text
    assert methods(f"data.eval=[{a},{c}]", "data.eval_reward_method=yes_no") == ["yes_no"] * 8
    assert methods(f"data.eval=[{a},{c}]", "data.eval_reward_method=[numeric,mcq]") == \
        ["numeric"] * 4 + ["mcq"] * 4
    with pytest.raises(DataError, match="data.eval_reward_method: "):
        methods(f"data.eval={c}", "data.eval_reward_method=nope")
