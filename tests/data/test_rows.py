"""Rows of each format people bring, in r1fit's one shape (turns + images + accuracy method)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from r1fit.data.errors import BadRowError
from r1fit.data.rows import (
    FormatOptions,
    Row,
    RowFormat,
    detect_format,
    focus_fractions,
    parse_row,
)

FOLDER = Path("/data/imgs")


DETECT = FormatOptions()


def parse(raw: dict, options: FormatOptions = DETECT, *, max_images: int = 4,
          method: str = "default", folder: Path | None = FOLDER) -> Row:
    return parse_row(raw, detect_format(raw, options), folder=folder, reward_method=method,
                     max_images=max_images)


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    return out.getvalue()


def test_r1fit_columns() -> None:
    raw = {"image": "a.png", "problem": "colour?", "solution": "red", "id": 3}
    fmt = detect_format(raw, FormatOptions())
    assert fmt == RowFormat("columns", "problem", "solution", None, None, "accu_reward_method")
    row = parse(raw)
    assert row.turns == (("user", "<image>colour?"), ("assistant", "red"))
    assert row.images == (FOLDER / "a.png",)
    assert (row.problem, row.solution, row.reward_method) == ("colour?", "red", "default")


def test_easyr1_columns_with_embedded_bytes_and_placeholder() -> None:
    data = png_bytes()
    raw = {"images": [{"bytes": data, "path": None}], "problem": "<image>Find x.", "answer": 12}
    fmt = detect_format(raw, FormatOptions())
    assert (fmt.problem_key, fmt.answer_key, fmt.image_key) == ("problem", "answer", None)
    row = parse(raw)
    assert row.turns == (("user", "<image>Find x."), ("assistant", "12"))  # numbers become text
    assert row.images == (data,)
    assert row.problem == "Find x."


def test_vlm_r1_conversations_with_its_reward_method() -> None:
    raw = {"id": 1, "image": "coco/1.jpg",
           "conversations": [{"from": "human", "value": "<image>Is it a cat?"},
                             {"from": "gpt", "value": "yes"}],
           "accu_reward_method": "yes_no"}
    row = parse(raw, method="mcq")  # the row's own method wins over the source's
    assert row.turns == (("user", "<image>Is it a cat?"), ("assistant", "yes"))
    assert row.images == (FOLDER / "coco/1.jpg",)
    assert row.reward_method == "yes_no"
    del raw["accu_reward_method"]
    assert parse(raw, method="mcq").reward_method == "mcq"


def test_llava_multi_turn_and_role_content_parts() -> None:
    llava = {"image": "x.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "A dog."},
        {"from": "human", "value": "What colour?"}, {"from": "gpt", "value": "Brown."}]}
    row = parse(llava)
    assert [r for r, _ in row.turns] == ["user", "assistant", "user", "assistant"]
    assert (row.problem, row.solution) == ("What colour?", "Brown.")
    messages = {"images": ["p.png", "q.png"], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "left, "},
                                     {"type": "image"}, {"type": "text", "text": "right: same?"}]},
        {"role": "assistant", "content": "no"}]}
    row = parse(messages)
    assert row.turns == (("system", "Be brief."), ("user", "<image>left, <image>right: same?"),
                         ("assistant", "no"))
    assert row.images == (FOLDER / "p.png", FOLDER / "q.png")


def test_minicpm_named_placeholders_follow_the_text() -> None:
    raw = {"image": {"<image_00>": "a.png", "<image_01>": "b.png"}, "conversations": [
        {"role": "user", "content": "<image_01> then <image_00>: which is larger?"},
        {"role": "assistant", "content": "the first"}]}
    row = parse(raw)
    assert row.turns[0] == ("user", "<image> then <image>: which is larger?")
    assert row.images == (FOLDER / "b.png", FOLDER / "a.png")  # in the order the text uses them


def test_images_without_placeholders_go_before_the_first_question() -> None:
    raw = {"image": ["a.png", "b.png"], "conversations": [
        {"from": "system", "value": "sys"}, {"from": "human", "value": "same?"},
        {"from": "gpt", "value": "no"}]}
    assert parse(raw).turns[1] == ("user", "<image><image>same?")


def test_absolute_paths_and_pil_images_pass_through() -> None:
    image = Image.new("RGB", (8, 8))
    row = parse({"images": [image, "/abs/b.png"], "problem": "q", "answer": "a"}, folder=None)
    assert row.images == (image, Path("/abs/b.png"))


def test_explicit_keys_and_format_override_detection() -> None:
    options = FormatOptions(kind="columns", problem_key="question", answer_key="gt",
                            image_key="img")
    raw = {"question": "q?", "gt": "a", "img": "x.png", "conversations": []}
    row = parse(raw, options)
    assert row.turns == (("user", "<image>q?"), ("assistant", "a"))


def test_each_row_is_asked_for_its_image_column() -> None:
    """data.image_key null: a row's images are its 'image', else its 'images', whatever the
    first row had (a text-only first row once made every later row text-only); a configured key
    is the only one read."""
    fmt = detect_format({"problem": "no picture", "solution": "a"}, DETECT)
    assert fmt.image_key is None

    def images(raw: dict, row_format: RowFormat = fmt) -> tuple:
        return parse_row(raw, row_format, folder=FOLDER, reward_method="default",
                         max_images=4).images

    assert images({"problem": "q", "solution": "a", "image": "a.png"}) == (FOLDER / "a.png",)
    assert images({"problem": "q", "solution": "a", "images": ["b.png", "c.png"]}) == (
        FOLDER / "b.png", FOLDER / "c.png")
    assert images({"problem": "q", "solution": "a", "image": None, "images": ["b.png"]}) == (
        FOLDER / "b.png",)
    assert images({"problem": "q", "solution": "a", "image": [], "images": None}) == ()
    with pytest.raises(BadRowError, match="has both 'image' and 'images'; set data.image_key"):
        images({"problem": "q", "solution": "a", "image": "a.png", "images": ["b.png"]})
    configured = detect_format({"problem": "q", "solution": "a"}, FormatOptions(image_key="img"))
    assert images({"problem": "q", "solution": "a", "image": "a.png", "img": "d.png"},
                  configured) == (FOLDER / "d.png",)
    assert images({"problem": "q", "solution": "a", "image": "a.png"}, configured) == ()
    assert fmt.describe() == ("columns rows (question 'problem', answer 'solution', 'image' or "
                              "'images' for images)")
    assert configured.describe().endswith("images 'img')")


@pytest.mark.parametrize("raw, reason", [
    ({"problem": "q"}, "missing 'solution'"),
    ({"problem": "q", "solution": " "}, "'solution' is empty"),
    ({"problem": "q", "solution": "<think>x</think><answer> </answer>"},
     "'solution' has an empty <answer></answer>"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value":
                        "<answer></answer>"}]}, "'conversations' has an empty <answer></answer>"),
    ({"problem": "q", "solution": "<think>x</think>\n "}, "'solution' has no answer after its "
                                                          "</think>"),
    ({"problem": "q", "solution": True}, "'solution' must be a string, got bool"),
    ({"problem": "q", "solution": "a", "image": ["a.png"] * 5}, "has 5 images, more than "
                                                                 "data.max_images=4"),
    ({"problem": "<image><image>q", "solution": "a", "image": "a.png"},
     "has 2 '<image>' placeholders for 1 images"),
    ({"problem": "q", "solution": "a", "image": 7}, "'image'[0] must be a path, image bytes or a "
                                                    "{bytes, path} record"),
    ({"problem": "q", "solution": "a", "image": {"bytes": "iVBORw0KGgo=", "path": None}},
     "'image'[0]'s 'bytes' must be encoded image bytes, got str"),
    ({"problem": "q\ud800?", "solution": "a"},
     "'problem' has a lone surrogate '\\ud800' at character 1 (not valid Unicode)"),
    ({"problem": "q", "solution": "a", "image": "a\udfff.png"},
     "'image'[0] has a lone surrogate '\\udfff' at character 1"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\ud800"}]},
     "'conversations'[1] has a lone surrogate"),
    ({"conversations": [{"from": "human", "value": "q"}]},
     "the last turn of 'conversations' is not the assistant's answer"),
    ({"conversations": [{"from": "gpt", "value": "a"}]}, "'conversations' has no user turn"),
    ({"conversations": [{"from": "alien", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "'conversations'[0] has speaker 'alien'; expected one of"),
    ({"conversations": "hello"}, "'conversations' must be a non-empty list of turns"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "<image>"}],
      "image": "a.png"}, "has an image in an assistant turn"),
    ({"problem": "q", "solution": "a", "accu_reward_method": None},
     "'accu_reward_method' must be a method name, got None"),
    ({"image": {"<image_00>": "a.png"}, "conversations": [
        {"from": "human", "value": "no placeholder"}, {"from": "gpt", "value": "a"}]},
     "the text's placeholders ['<image_00>'] do not name each image once"),
    # named and plain placeholders in one row: a processor's traceback before (2 image pads, 1
    # image); a name the mapping lacks
    ({"image": {"<image_00>": "a.png"}, "conversations": [
        {"role": "user", "content": "<image_00> and <image> which?"},
        {"role": "assistant", "content": "red"}]},
     "mixes named placeholders ['<image_00>'] with 1 plain '<image>'"),
    ({"image": {"<image_00>": "a.png"}, "conversations": [
        {"from": "human", "value": "<image_00> or <image_01>?"}, {"from": "gpt", "value": "a"}]},
     "the text names ['<image_01>'], which the row's image mapping ['<image_00>'] does not "
     "hold"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": [0.1, 0.2, 0.3]},
     "'focus' must be a box [x1, y1, x2, y2] of 4 numbers, got [0.1, 0.2, 0.3]"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": [0, 0, True, 1]},
     "'focus' must be a box [x1, y1, x2, y2] of 4 numbers"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": [0, 0, float("nan"), 1]},
     "'focus' must be a box [x1, y1, x2, y2] of 4 numbers"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": "near the top"},
     "'focus' must be a box [x1, y1, x2, y2], got 'near the top'"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": [0.5, 0.1, 0.4, 0.2]},
     "'focus' [0.5, 0.1, 0.4, 0.2] is not a box (need 0 <= x1 < x2 and 0 <= y1 < y2)"),
    ({"problem": "q", "solution": "a", "image": "a.png", "focus": [-1, 0, 4, 4]},
     "'focus' [-1, 0, 4, 4] is not a box"),
    ({"problem": "q", "solution": "a", "focus": [0.1, 0.1, 0.2, 0.2]},
     "has a 'focus' box but no image"),
    # JSON's NaN and Infinity (Python's json reads them), a parquet column's null as a float
    ({"problem": "q", "solution": float("nan")}, "'solution' is nan (not a finite number)"),
    ({"problem": float("inf"), "solution": "a"}, "'problem' is inf (not a finite number)"),
])
def test_bad_rows_say_what_is_wrong(raw: dict, reason: str) -> None:
    # the format is the source's, detected on its first row: these rows are later ones
    fmt = (RowFormat("conversations", None, None, "conversations", "image", "accu_reward_method")
           if "conversations" in raw else
           RowFormat("columns", "problem", "solution", None, "image", "accu_reward_method"))
    with pytest.raises(BadRowError) as info:
        parse_row(raw, fmt, folder=FOLDER, reward_method="default", max_images=4)
    assert str(info.value).startswith(reason)


def test_a_focus_box_is_read_as_written_and_turned_into_fractions() -> None:
    """data.focus_key: a box as a list or a JSON string; focus_fractions keeps a box of numbers
    <= 1 (fractions) and divides any other by the image's size (pixels), refusing one that
    reaches outside the image."""
    row = parse({"problem": "q", "solution": "a", "image": "a.png", "focus": [10, 5, 30, 25]})
    assert row.focus == (10.0, 5.0, 30.0, 25.0)
    assert focus_fractions(row.focus, (40, 50)) == (0.25, 0.1, 0.75, 0.5)
    row = parse({"problem": "q", "solution": "a", "image": "a.png", "box": "[0.1, 0.2, 0.5, 1]"},
                FormatOptions(focus_key="box"))
    assert focus_fractions(row.focus, (40, 50)) == (0.1, 0.2, 0.5, 1.0)
    assert parse({"problem": "q", "solution": "a", "image": "a.png"}).focus is None
    with pytest.raises(BadRowError, match=r"focus box \[10.0, 5.0, 41.0, 25.0\] \(pixels\) "
                                          r"reaches outside the 40 x 50 image"):
        focus_fractions((10.0, 5.0, 41.0, 25.0), (40, 50))


def test_relative_path_without_a_folder_names_the_fix() -> None:
    with pytest.raises(BadRowError, match="relative path .* set data.image_folder"):
        parse({"problem": "q", "solution": "a", "image": "a.png"}, folder=None)


def test_undetectable_first_row_is_a_bad_row() -> None:
    with pytest.raises(BadRowError, match=r"cannot tell the row format \(keys: \['q', 'x'\]\)"):
        detect_format({"q": 1, "x": 2}, FormatOptions())
