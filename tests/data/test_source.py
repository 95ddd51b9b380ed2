"""Row sources (a JSONL file here): good rows, every kind of bad row, counts, warnings and the
bad-fraction error."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from PIL import Image

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.rows import FormatOptions
from r1fit.data.source import MAX_ROW_WARNINGS, RowSource, TableSpec


def _png(path: Path, size: tuple[int, int] = (40, 30), color: tuple[int, int, int] = (255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def JsonlSource(path: Path, **kwargs: object) -> RowSource:  # noqa: N802 - reads as a class
    """One JSONL file as a row source, formats detected."""
    return RowSource([TableSpec(str(path))], options=FormatOptions(), **kwargs)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """A JSONL with good rows on lines 1-5 and one bad row of each kind on lines 7-15 (line 6 blank).

    Returns the path and {line: expected reason fragment} for the bad lines.
    """
    data = tmp_path / "data"
    red = _png(data / "imgs" / "red.png")
    _png(data / "imgs" / "blue.png", color=(0, 0, 255))
    elsewhere = _png(tmp_path / "elsewhere" / "abs.png", color=(0, 255, 0))
    good = _png(data / "imgs" / "trunc_src.png", size=(64, 64))
    (data / "imgs" / "trunc.png").write_bytes(good.read_bytes()[:60])

    def row(**kw: object) -> str:
        return json.dumps(kw)

    lines = [
        row(image="imgs/red.png", problem="colour?", solution="red"),                         # 1 relative
        row(image=str(elsewhere), problem="colour?", solution="green"),                       # 2 absolute
        row(image=["imgs/red.png", "imgs/blue.png"], problem="two?", solution="2", id=7),     # 3 list + extra key
        row(problem="What is 2+2?", solution="4"),                                            # 4 text-only
        row(image=str(red.relative_to(data)), problem="again", solution="red"),               # 5 shared image
        "   ",                                                                                # 6 blank: ignored
        '{"image": "imgs/red.png", "problem": "oops"',                                        # 7 bad JSON
        json.dumps(["not", "an", "object"]),                                                  # 8 not an object
        row(image="imgs/red.png", solution="red"),                                            # 9 no problem
        row(image="imgs/red.png", problem="q", solution="  "),                                # 10 empty solution
        row(image="imgs/red.png", problem="q", solution=[3]),                                 # 11 non-string
        row(image="imgs/missing.png", problem="q", solution="a"),                             # 12 missing image
        row(image="imgs/trunc.png", problem="q", solution="a"),                               # 13 corrupt image
        row(image=["imgs/red.png"] * 3, problem="q", solution="a"),                           # 14 too many images
        row(image=[1, 2], problem="q", solution="a"),                                         # 15 bad image field
    ]
    reasons = {
        7: "bad JSON",
        8: "not a JSON object",
        9: "missing 'problem'",
        10: "'solution' is empty",
        11: "'solution' must be a string, got list",
        12: "image not found: ",
        13: "corrupt image ",
        14: "has 3 images, more than data.max_images=2",
        15: "'image'[0] must be a path, image bytes or a {bytes, path} record",
    }
    return _write_lines(data / "train.jsonl", lines), reasons


def test_good_and_bad_rows_counted_and_warned(mixed, caplog, tmp_path, monkeypatch) -> None:
    path, reasons = mixed
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative image paths must not depend on the cwd
    with caplog.at_level(logging.WARNING, logger="r1fit.data"):
        src = JsonlSource(path, max_images=2, max_bad_fraction=0.7)
    assert (src.total_rows, src.bad_rows, len(src)) == (14, 9, 5)
    assert [src.tables[0].where(r.index) for r in src.rows] == [f"{path}:{i}" for i in range(1, 6)]

    warnings = [r.getMessage() for r in caplog.records if r.name == "r1fit.data"]
    assert len(warnings) == 9
    for message, (line, reason) in zip(warnings, sorted(reasons.items())):
        assert message.startswith(f"skipping {path}:{line}: {reason}"), message
    assert src.first_error is not None and src.first_error.startswith(f"{path}:7: bad JSON")


def test_samples_decode_relative_absolute_list_and_text_only(mixed) -> None:
    path, _ = mixed
    src = JsonlSource(path, max_images=2, max_bad_fraction=0.7)
    first, absolute, pair, text_only, shared = (src.sample(i) for i in range(5))
    assert first.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert (first.problem, first.solution, first.source) == ("colour?", "red", f"{path}:1")
    assert absolute.images[0].getpixel((0, 0)) == (0, 255, 0)
    assert [im.getpixel((0, 0)) for im in pair.images] == [(255, 0, 0), (0, 0, 255)]
    assert text_only.images == [] and text_only.solution == "4"
    assert shared.source == f"{path}:5"


def test_too_many_bad_rows_raises_one_line_error(mixed) -> None:
    path, _ = mixed
    with pytest.raises(DataError) as info:
        JsonlSource(path, max_images=2, max_bad_fraction=0.1)
    expected = f"{path}: 9 of 14 rows are bad (max_bad_fraction=0.1); first: {path}:7: bad JSON"
    assert str(info.value).startswith(expected)
    assert "\n" not in str(info.value)


def test_bad_fraction_at_the_limit_is_accepted(tmp_path) -> None:
    _png(tmp_path / "a.png")
    lines = [json.dumps({"image": "a.png", "problem": "q", "solution": "a"})] * 9 + ["{bad"]
    src = JsonlSource(_write_lines(tmp_path / "d.jsonl", lines), max_images=1, max_bad_fraction=0.1)
    assert (src.total_rows, src.bad_rows, len(src)) == (10, 1, 9)  # 1/10 is not > 0.1


def test_missing_and_empty_files(tmp_path) -> None:
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'none.jsonl'}: file not found")):
        JsonlSource(tmp_path / "none.jsonl", max_images=1, max_bad_fraction=0.1)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    for name in ("empty.jsonl", "blank.jsonl"):
        with pytest.raises(DataError, match=re.escape(f"{tmp_path / name}: no rows (empty file)")):
            JsonlSource(tmp_path / name, max_images=1, max_bad_fraction=0.1)
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(DataError, match="not a file"):
        JsonlSource(tmp_path / "folder.jsonl", max_images=1, max_bad_fraction=0.1)


def test_all_rows_bad_is_an_error_even_when_allowed(tmp_path) -> None:
    path = _write_lines(tmp_path / "d.jsonl", ["[]", "{}"])
    with pytest.raises(DataError, match="2 of 2 rows are bad"):
        JsonlSource(path, max_images=1, max_bad_fraction=1.0)


def test_decode_failure_after_load_names_file_and_line(tmp_path) -> None:
    img = _png(tmp_path / "a.png")
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"image": "a.png", "problem": "q", "solution": "a"})])
    src = JsonlSource(path, max_images=1, max_bad_fraction=0.0)
    img.write_bytes(img.read_bytes()[:50])  # the file goes bad between validation and use
    with pytest.raises(BadRowError, match=re.escape(f"{path}:1: cannot decode image {img}")):
        src.sample(0)


def test_a_focus_box_reaches_the_sample_in_fractions_of_the_first_image(tmp_path, caplog
                                                                        ) -> None:
    """data.focus_key rows: pixels of the stored image or fractions become Sample.focus in
    fractions; a pixel box outside the image is dropped when the row is decoded (the row still
    trains, as training ignores its focus), with one warning naming file:line however often the
    row is drawn."""
    _png(tmp_path / "a.png", size=(40, 30))
    rows = [{"image": "a.png", "problem": "q", "solution": "a", "focus": [4, 3, 20, 15]},
            {"image": "a.png", "problem": "q", "solution": "a", "focus": [0.1, 0.1, 0.5, 0.5]},
            {"image": "a.png", "problem": "q", "solution": "a"},
            {"image": "a.png", "problem": "q", "solution": "a", "focus": [4, 3, 50, 15]}]
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    src = JsonlSource(path, max_images=1, max_bad_fraction=0.0)
    assert src.sample(0).focus == (0.1, 0.1, 0.5, 0.5)
    assert src.sample(1).focus == (0.1, 0.1, 0.5, 0.5)
    assert src.sample(2).focus is None
    with caplog.at_level(logging.WARNING, logger="r1fit.data"):
        drawn = [src.sample(3) for _ in range(3)]
    assert [(s.focus, s.problem, len(s.images)) for s in drawn] == [(None, "q", 1)] * 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{path}:4: focus box [4.0, 3.0, 50.0, 15.0] (pixels) reaches outside the 40 x 30 image; "
        "its focus is ignored"]


def test_images_are_found_in_rows_after_a_text_only_first_row(tmp_path, caplog) -> None:
    """The image column is each row's: a source opening with a text-only row keeps the images
    of the rows after it, under either name, and its log line counts the rows with images."""
    _png(tmp_path / "a.png")
    rows = [{"problem": "2+2?", "solution": "4"},
            {"image": "a.png", "problem": "colour?", "solution": "red"},
            {"images": ["a.png", "a.png"], "problem": "two?", "solution": "2"}]
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with caplog.at_level(logging.INFO, logger="r1fit.data"):
        src = JsonlSource(path, max_images=2, max_bad_fraction=0.0)
    assert [len(src.sample(i).images) for i in range(3)] == [0, 1, 2]
    assert caplog.records[-1].getMessage() == (
        f"data: {path}: columns rows (question 'problem', answer 'solution', 'image' or 'images' "
        f"for images); 3 good rows, 2 with images (under {tmp_path})")


def test_warnings_are_capped_but_counts_exact(tmp_path, caplog) -> None:
    lines = [json.dumps({"problem": "q", "solution": "a"})] + ["{bad"] * (MAX_ROW_WARNINGS + 5)
    path = _write_lines(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="r1fit.data"):
        src = JsonlSource(path, max_images=1, max_bad_fraction=1.0)
    assert src.bad_rows == MAX_ROW_WARNINGS + 5
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("skipping ") for m in messages) == MAX_ROW_WARNINGS
    assert messages[-1] == f"skipped 5 more bad rows in {path} (only the first {MAX_ROW_WARNINGS} are listed)"


def test_size_stops_after_n_good_rows_and_bom_is_tolerated(tmp_path) -> None:
    row = json.dumps({"problem": "q", "solution": "a"})
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (row + "\n").encode() * 3 + b"{bad\n")
    src = JsonlSource(path, max_images=0, max_bad_fraction=0.0, size=2)
    assert (len(src), src.total_rows, src.bad_rows) == (2, 2, 0)


def test_invalid_utf8_line_is_a_bad_row(tmp_path, caplog) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps({"problem": "q", "solution": "a"}).encode() + b"\n\xff\xfe\n")
    with caplog.at_level(logging.WARNING, logger="r1fit.data"):
        src = JsonlSource(path, max_images=0, max_bad_fraction=0.5)
    assert src.bad_rows == 1
    assert caplog.records[0].getMessage().startswith(f"skipping {path}:2: not valid UTF-8")
