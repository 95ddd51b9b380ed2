"""Tool demonstrations: the call written for a row's focus (hand-checked numbers), the region it
cuts holding the whole focus, the tool turn holding what the tool returns through the runner, and
when rows are left as they are."""

from __future__ import annotations

import json

import numpy as np
import pytest

from r1fit.data.dataset import load_dataset
from r1fit.data.errors import DataError
from r1fit.data.images import fit_pixel_budget
from r1fit.data.sample import Sample
from r1fit.data.shapes import ShapesSpec
from r1fit.tools import ToolContext, ToolRunner, parse_tool_calls
from r1fit.tools.demonstrations import ToolDemonstrations, demonstration_call, zoom_factor
from r1fit.tools.registry import BUILTIN_TOOLS

MARK = (144 / 896, 184 / 896, 176 / 896, 216 / 896)  # a 32 px mark centred on (160, 200)


def runner(*names: str, max_pixels: int = 112 * 112) -> ToolRunner:
    return ToolRunner(names, timeout=5.0, min_pixels=28 * 28, max_pixels=max_pixels)


def test_the_zoom_shows_the_source_pixels_unless_the_focus_would_not_fit():
    # 896 px shown in 112 x 112: 8 times; the 32 px mark fits a 1/21.9 region, so 8
    assert zoom_factor(MARK, (896, 896), 112 * 112) == 8
    assert zoom_factor(MARK, (896, 896), 113 * 113) == 8  # 7.9: 8 shows it unshrunk
    assert zoom_factor(MARK, (448, 448), 56 * 56) == 8
    # a box 0.2 wide needs a region of 0.21 at least: 4
    assert zoom_factor((0.4, 0.4, 0.6, 0.6), (896, 896), 112 * 112) == 4
    # an image within the budget: the whole image
    assert zoom_factor(MARK, (100, 100), 112 * 112) == 1
    assert zoom_factor((0.0, 0.0, 1.0, 1.0), (4000, 4000), 112 * 112) == 1


def test_the_calls_by_hand():
    zoom = demonstration_call("zoom", MARK, (896, 896), 112 * 112)
    assert zoom == ('<tool_call>\n{"name": "zoom", "arguments": {"x": 0.18, "y": 0.22, '
                    '"factor": 8}}\n</tool_call>')
    # crop: zoom's region around the unrounded centre (0.1786 +- 0.0625), corners rounded outwards
    crop = demonstration_call("crop", MARK, (896, 896), 112 * 112)
    assert json.loads(crop.split("\n")[1])["arguments"] == {"x1": 0.11, "y1": 0.16, "x2": 0.25,
                                                            "y2": 0.29}
    # near an edge the region moves inside the image, as zoom's does
    corner = demonstration_call("crop", (0.98, 0.0, 1.0, 0.02), (896, 896), 112 * 112)
    assert json.loads(corner.split("\n")[1])["arguments"] == {"x1": 0.87, "y1": 0.0, "x2": 1.0,
                                                              "y2": 0.13}
    with pytest.raises(ValueError, match="no demonstration for tool 'rotate'"):
        demonstration_call("rotate", MARK, (896, 896), 112 * 112)


@pytest.mark.parametrize("tool", ["zoom", "crop"])
@pytest.mark.parametrize("image_size", [56, 112])
def test_the_call_cuts_the_whole_mark_and_the_tool_turn_holds_its_fitted_result(tool, image_size):
    budget = image_size * image_size
    data = load_dataset("builtin:shapes", split="train", min_pixels=28 * 28, max_pixels=budget,
                        max_images=2, max_bad_fraction=0.0, seed=1, size=12,
                        shapes=ShapesSpec(image_size=image_size, kinds=["zoom"]),
                        keep_source_images=True)
    demonstrations = ToolDemonstrations.of([tool], runner(tool, max_pixels=budget))
    for sample in data:
        shown = demonstrations.write(sample)
        (call,) = parse_tool_calls(shown.turns[1][1])
        source = sample.source_images[0]
        region = BUILTIN_TOOLS[tool](ToolContext((source,)), **call.arguments)
        ink = np.asarray(source).min(axis=-1) < 128
        assert (np.asarray(region).min(axis=-1) < 128).sum() == ink.sum() > 0  # the whole mark
        assert max(region.size) <= 8 * image_size // 7  # about the budget's side: little shrunk
        fitted = fit_pixel_budget(region, 28 * 28, budget)
        assert shown.images[1].tobytes() == fitted.tobytes() and shown.images[0] is sample.images[0]
        assert shown.turns == (
            ("user", "<image>" + sample.problem), ("assistant", call.text),
            ("tool", "<tool_response>\n<image>\n</tool_response>"),
            ("assistant", f"<answer>{sample.solution}</answer>"))
        assert shown.solution == f"<answer>{sample.solution}</answer>"
        assert shown.source_images == sample.source_images and shown.focus == sample.focus


def test_rows_without_a_focus_and_runs_without_an_image_tool_are_left_alone():
    plain = Sample([], "q", "a", "t")
    assert ToolDemonstrations.of(["zoom"], runner("zoom")).write(plain) is plain
    assert ToolDemonstrations.of(["mypkg.tools:rotate"], runner()) is None
    assert ToolDemonstrations.of(["crop", "zoom"], runner("crop", "zoom")).tool == "zoom"
    assert ToolDemonstrations.of(["crop"], runner("crop")).tool == "crop"


def test_a_tagged_answer_and_the_rows_own_turns_are_kept():
    from PIL import Image

    image = Image.new("RGB", (896, 896), "white")
    turns = (("system", "Be brief."), ("user", "<image>Which stripes?"), ("assistant", "x"))
    sample = Sample([image.resize((112, 112))], "Which stripes?", "<answer>vertical</answer>",
                    "t", turns=turns, source_images=(image,), focus=MARK)
    shown = ToolDemonstrations.of(["zoom"], runner("zoom")).write(sample)
    assert shown.turns[:2] == turns[:2]
    assert shown.turns[-1] == ("assistant", "<answer>vertical</answer>")


def test_a_failing_call_stops_with_the_rows_source():
    from PIL import Image

    image = Image.new("RGB", (896, 896), "white")
    broken = runner("zoom")

    def fail(context, **arguments):
        raise RuntimeError("disk on fire")

    broken.functions["zoom"] = fail
    sample = Sample([image], "q", "a", "builtin:shapes/train#3", source_images=(image,), focus=MARK)
    with pytest.raises(DataError, match=r"builtin:shapes/train#3: the tool demonstration's call .* "
                                        r"failed: error: zoom: raised RuntimeError: disk on fire"):
        ToolDemonstrations.of(["zoom"], broken).write(sample)
