"""builtin:shapes: determinism, disjoint splits, balanced answers, and answers visible in the pixels."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from r1fit.config import ConfigError, load_config
from r1fit.data.errors import DataError
from r1fit.data.images import fit_pixel_budget
from r1fit.data.shapes import (
    MARK_PX,
    RADIUS_FRACTION,
    SHAPE_NAMES,
    ZOOM_PATTERNS,
    ZOOM_SCALE,
    ShapesItem,
    ShapesSource,
    ShapesSpec,
    answer_space,
    make_item,
    render_item,
    split_of,
)
from r1fit.rewards.iou import box_iou, parse_box
from r1fit.tools import ToolContext, zoom

SPECS = [
    ShapesSpec(),
    ShapesSpec(image_size=84, max_distractors=2, colors=["red", "blue", "orange"], background="black"),
    ShapesSpec(image_size=28, max_distractors=0, kinds=["position", "color"]),
    ShapesSpec(image_size=112, max_distractors=2, kinds=["box", "color"]),
    ShapesSpec(image_size=56, max_distractors=1, kinds=["zoom", "count"], background="black"),
]


def _pixels(src: ShapesSource, i: int) -> bytes:
    return src.sample(i).images[0].tobytes()


def test_same_seed_same_items_different_seed_differs() -> None:
    a = ShapesSource(ShapesSpec(), split="train", size=30, seed=3)
    b = ShapesSource(ShapesSpec(), split="train", size=30, seed=3)
    c = ShapesSource(ShapesSpec(), split="train", size=30, seed=4)
    for i in range(30):
        sa, sb = a.sample(i), b.sample(i)
        assert (sa.problem, sa.solution, sa.source) == (sb.problem, sb.solution, sb.source)
        assert _pixels(a, i) == _pixels(b, i)
    assert sum(_pixels(a, i) != _pixels(c, i) for i in range(30)) >= 25


def test_item_depends_only_on_seed_split_index() -> None:
    spec = ShapesSpec()
    small = ShapesSource(spec, split="eval", size=10, seed=0)
    large = ShapesSource(spec, split="eval", size=50, seed=0)
    assert small.items == large.items[:10]
    assert make_item(spec, seed=0, split="eval", index=7) == large.items[7]


@pytest.mark.parametrize("spec", SPECS)
def test_train_and_eval_are_disjoint(spec: ShapesSpec) -> None:
    train = ShapesSource(spec, split="train", size=1500, seed=0).items
    # disjoint across seeds too: the split is a hash of the item key, not of the seed
    evals = ShapesSource(spec, split="eval", size=300, seed=0).items + ShapesSource(
        spec, split="eval", size=300, seed=1
    ).items
    assert all(split_of(it.key) == "train" for it in train)
    assert all(split_of(it.key) == "eval" for it in evals)
    assert not {it.key for it in train} & {it.key for it in evals}
    if spec.image_size >= 56:  # (a 28 px image leaves few distinct scenes, so repeats are expected there)
        assert len({it.key for it in evals}) > 0.9 * len(evals), "eval should not be a handful of repeats"


@pytest.mark.parametrize("spec", SPECS)
def test_answers_balanced_per_kind(spec: ShapesSpec) -> None:
    items = ShapesSource(spec, split="train", size=600, seed=1).items
    space = spec.answer_space()
    kinds = Counter(it.kind for it in items)
    assert set(kinds) == set(spec.kinds) and max(kinds.values()) - min(kinds.values()) <= 1
    for kind, answers in space.items():
        # a box question's answer is a box: its items are balanced over the shape they name
        counts = Counter(it.shapes[0].name if kind == "box" else it.answer
                         for it in items if it.kind == kind)
        assert set(counts) == set(answers)
        assert max(counts.values()) - min(counts.values()) <= 1


def test_answer_space() -> None:
    assert answer_space() == {
        "color": ["red", "green", "blue", "yellow"],
        "count": ["1", "2"],
        "position": ["left", "right"],
    }
    assert answer_space(["count"], max_distractors=2) == {"count": ["1", "2", "3"]}
    assert answer_space(["box"]) == {"box": ["circle", "square", "triangle"]}
    assert ShapesSpec(kinds=["color"], colors=["red", "blue"]).answer_space() == {"color": ["red", "blue"]}
    with pytest.raises(DataError, match="unknown shapes kind"):
        answer_space(["size"])


def _components(mask: np.ndarray) -> int:
    """Number of 4-connected True regions (a plain flood fill: the reference, not the fast way)."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def _check_visible(item: ShapesItem, spec: ShapesSpec) -> None:
    """The answer can be read off the rendered pixels alone."""
    pixels = np.asarray(render_item(item, spec))
    size = item.image_size
    background = np.all(pixels == spec.rgb(spec.background), axis=-1)
    if item.kind == "color":
        name = item.problem.split("the ")[1].split("?")[0]
        named = [s for s in item.shapes if s.name == name]
        assert len(named) == 1, "the asked-about shape must be unique"
        assert tuple(pixels[named[0].cy, named[0].cx]) == spec.rgb(item.answer)
    elif item.kind == "count":
        assert _components(~background) == int(item.answer)
    elif item.kind == "box":
        _check_box(item, spec, pixels)
    elif item.kind == "zoom":
        (mark,) = item.shapes
        assert item.image_size == ZOOM_SCALE * spec.image_size
        assert mark.cx - mark.r >= 0 and mark.cx + mark.r <= item.image_size
        assert (mark.cx - mark.r) % ZOOM_SCALE == 0 and 2 * mark.r == MARK_PX
        assert _read_stripes(pixels, spec) == item.answer
        # nothing else is drawn: the mark's square holds every non-background pixel
        inside = np.zeros_like(background)
        inside[mark.cy - mark.r:mark.cy + mark.r, mark.cx - mark.r:mark.cx + mark.r] = True
        assert (~background <= inside).all()
        return
    else:
        color = item.problem.split("the ")[1].split(" shape")[0]
        xs = np.nonzero(np.all(pixels == spec.rgb(color), axis=-1))[1]
        assert len(xs) > 0 and sum(s.color == color for s in item.shapes) == 1
        assert (xs.max() < size / 2) if item.answer == "left" else (xs.min() >= size / 2)
    # every shape is drawn fully inside the image, on its own
    assert _components(~background) == len(item.shapes)


def _read_stripes(pixels: np.ndarray, spec: ShapesSpec) -> str | None:
    """A simple reader of a zoom mark: the pixels at least half-way from the background colour
    to the ink are ink; within their bounding box, rows all ink or all not (row means varying, column
    means flat) are horizontal stripes, the transpose vertical, neither (both flat) checkered.
    None when there is no ink."""
    grey = pixels.astype(float).mean(axis=-1)
    background = float(np.mean(spec.rgb(spec.background)))
    ink = np.abs(grey - background) >= 127.5
    if not ink.any():
        return None
    ys, xs = np.nonzero(ink)
    ink = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    rows, cols = ink.mean(axis=1).var(), ink.mean(axis=0).var()
    if rows > 0.1 > cols:
        return "horizontal"
    if cols > 0.1 > rows:
        return "vertical"
    return "checkered" if rows < 0.1 and cols < 0.1 else None


def _check_box(item: ShapesItem, spec: ShapesSpec, pixels: np.ndarray) -> None:
    """The answer is the tight box of the one shape the question names, in pixels of the image."""
    color, name = item.problem.split("box of the ")[1].split(" as ")[0].split(" ")
    assert sum((s.color, s.name) == (color, name) for s in item.shapes) == 1
    assert (item.shapes[0].color, item.shapes[0].name) == (color, name)
    box = parse_box(item.answer)
    assert box is not None and item.answer == "[{},{},{},{}]".format(*map(int, box))
    x1, y1, x2, y2 = map(int, box)
    assert 0 <= x1 < x2 <= item.image_size and 0 <= y1 < y2 <= item.image_size
    # the shape's colour fills the box to its four edges, and no pixel of that shape (shapes
    # never touch: whatever of that colour is connected to the box's inside) lies outside it
    inside = np.all(pixels[y1:y2, x1:x2] == spec.rgb(color), axis=-1)
    assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any()
    padded = np.pad(pixels.astype(np.int16), ((1, 1), (1, 1), (0, 0)), constant_values=-1)
    ring = np.all(padded[y1:y2 + 2, x1:x2 + 2] == spec.rgb(color), axis=-1)
    ring[1:-1, 1:-1] = False
    assert not ring.any()


@pytest.mark.parametrize("spec", SPECS)
def test_answer_is_visible_in_pixels(spec: ShapesSpec) -> None:
    for split in ("train", "eval"):
        for item in ShapesSource(spec, split=split, size=120, seed=5).items:
            _check_visible(item, spec)


def test_shapes_are_large() -> None:
    spec = ShapesSpec()
    items = ShapesSource(spec, split="train", size=300, seed=0).items
    # (a lone shape of a position question gets half the width, so it is smaller; not checked here)
    lone = [it.shapes[0].r for it in items if len(it.shapes) == 1 and it.kind != "position"]
    pair = [s.r for it in items if len(it.shapes) == 2 for s in it.shapes]
    assert lone and pair
    assert min(lone) >= 0.8 * RADIUS_FRACTION * spec.image_size - 1  # radius ~0.3 x side (13-16 px at 56)
    assert min(pair) >= 0.15 * spec.image_size  # two side by side still span about a third of the side each
    assert all(len(it.shapes) <= 2 for it in items)  # max_distractors=1


def test_box_rows_lone_shapes_and_a_hand_checked_item() -> None:
    spec = ShapesSpec(image_size=112, kinds=["box"], max_distractors=0)
    source = ShapesSource(spec, split="eval", size=30, seed=0)
    sample = source.sample(0)
    assert sample.reward_method == "iou"  # its accuracy (and eval/accuracy) is the IoU
    assert sample.problem.startswith("Give the box of the ")
    assert sample.problem.endswith(" as [x1,y1,x2,y2] in pixels of this 112x112 image.")
    assert sample.images[0].size == (112, 112)
    for item in source.items:
        _check_box(item, spec, np.asarray(render_item(item, spec)))
        if item.shapes[0].name == "circle":  # drawn over [cx - r, cx + r] inclusive
            s = item.shapes[0]
            assert parse_box(item.answer) == (s.cx - s.r, s.cy - s.r, s.cx + s.r + 1,
                                              s.cy + s.r + 1)
    assert {it.shapes[0].name for it in source.items} == set(SHAPE_NAMES)
    # boxes are where the shape happens to be: the best constant box scores little (the reason
    # lone box shapes are smaller than the other kinds')
    boxes = [parse_box(it.answer) for it in ShapesSource(spec, split="train", size=600,
                                                        seed=0).items]
    mean = tuple(float(np.mean([b[k] for b in boxes])) for k in range(4))
    assert np.mean([box_iou(b, mean) for b in boxes]) < 0.3


def test_box_kind_needs_an_image_the_pixel_budget_keeps() -> None:
    cfg = load_config(None, ["data.shapes.kinds=[box]", "data.shapes.image_size=112"])
    assert cfg.data.shapes.kinds == ("box",)
    with pytest.raises(ConfigError, match="data.shapes.image_size: 140 px squared is outside"):
        load_config(None, ["data.shapes.kinds=[box]", "data.shapes.image_size=140"])
    # the other kinds do not care: a resized image still shows the same colours and counts
    load_config(None, ["data.shapes.kinds=[color]", "data.shapes.image_size=140"])


def test_problem_text_format() -> None:
    items = ShapesSource(ShapesSpec(), split="eval", size=6, seed=0).items
    texts = {it.kind: it.problem for it in items}
    assert texts["color"].startswith("What colour is the ") and texts["color"].endswith("Answer with one word.")
    assert texts["count"] == "How many shapes are there? Answer with a number."
    assert texts["position"].endswith("on the left or the right? Answer with one word.")
    sample = ShapesSource(ShapesSpec(), split="eval", size=6, seed=0).sample(4)
    assert sample.source == "builtin:shapes/eval#4" and len(sample.images) == 1
    assert sample.images[0].size == (56, 56) and sample.images[0].mode == "RGB"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kinds": ["color", "size"]}, "ShapesSpec.kinds"),
        ({"kinds": []}, "ShapesSpec.kinds"),
        ({"colors": ["red"]}, "ShapesSpec.colors"),
        ({"colors": ["grey", "gray"]}, "ShapesSpec.colors"),
        ({"colors": ["red", "#00ff00"]}, "single-word colour name"),
        ({"colors": ["red", "notacolour"]}, "not a colour name"),
        ({"background": "red"}, "ShapesSpec.background"),
        ({"max_distractors": -1}, "ShapesSpec.max_distractors"),
        ({"max_distractors": 4}, "ShapesSpec.image_size=56 is too small"),
        ({"image_size": 20}, "ShapesSpec.image_size=20 is too small"),
        ({"image_size": 56.0}, "ShapesSpec.image_size must be an integer"),
    ],
)
def test_spec_validation_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        ShapesSpec(**kwargs)


def test_bad_split_is_rejected() -> None:
    with pytest.raises(DataError, match="split must be one of"):
        make_item(ShapesSpec(), seed=0, split="test", index=0)


def test_a_zoom_mark_is_unreadable_shrunk_and_readable_in_a_crop() -> None:
    """The zoom kind's point, on the pixels: shrunk to the demo's pixel budget (112 x 112 from
    896 x 896, as PromptDataset does), the three patterns of one mark differ by at most 2 grey
    levels anywhere, and the reader gives all three one answer; a crop by the zoom tool at the source
    resolution shows them, and the reader reads every one."""
    spec = ShapesSpec(image_size=112, kinds=["zoom"], max_distractors=0)
    for item in ShapesSource(spec, split="train", size=6, seed=3).items:
        (mark,) = item.shapes
        shrunk, read, read_shrunk = [], [], []
        for pattern in ZOOM_PATTERNS:
            variant = dataclasses.replace(item, shapes=(dataclasses.replace(mark, name=pattern),))
            image = render_item(variant, spec)
            assert image.size == (896, 896)
            small = np.asarray(fit_pixel_budget(image, 28 * 28, 112 * 112)).astype(int)
            assert small.shape == (112, 112, 3)
            shrunk.append(small)
            read_shrunk.append(_read_stripes(small.astype(np.uint8), spec))
            crop = zoom(ToolContext((image,)), mark.cx / 896, mark.cy / 896, factor=8)
            assert crop.size == (112, 112)  # within the budget: shown as it is
            read.append(_read_stripes(np.asarray(crop), spec))
        assert read == list(ZOOM_PATTERNS)
        assert len(set(read_shrunk)) == 1  # one answer for all three: it cannot tell them apart
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert np.abs(shrunk[a] - shrunk[b]).max() <= 2
        # and the shrunk mark still shows where it is: a grey 4 x 4 square on white
        x, y = (mark.cx - mark.r) // ZOOM_SCALE, (mark.cy - mark.r) // ZOOM_SCALE
        block = shrunk[0][y:y + 4, x:x + 4, 0]
        assert block.max() < 160 and shrunk[0][:, :, 0].min() == block.min()


def test_a_zoom_rows_focus_is_its_mark_and_its_demonstration_reads_it() -> None:
    """Sample.focus of a zoom row is the mark's square (every ink pixel of the image inside it),
    and the zoom its tool demonstration calls shows the stripes readable at the demo's pixel
    budget; other kinds have no focus."""
    from r1fit.tools import ToolRunner
    from r1fit.tools.demonstrations import ToolDemonstrations

    spec = ShapesSpec(image_size=112, kinds=["zoom", "color"], max_distractors=0)
    source = ShapesSource(spec, split="train", size=24, seed=5)
    runner = ToolRunner(["zoom"], timeout=5.0, min_pixels=28 * 28, max_pixels=112 * 112)
    demonstrations = ToolDemonstrations.of(["zoom"], runner)
    for index, item in enumerate(source.items):
        sample = source.sample(index)
        if item.kind != "zoom":
            assert sample.focus is None
            continue
        x1, y1, x2, y2 = (round(f * 896) for f in sample.focus)
        assert (x2 - x1, y2 - y1) == (MARK_PX, MARK_PX)
        ink = np.asarray(sample.images[0]).min(axis=-1) < 128
        assert ink.sum() == ink[y1:y2, x1:x2].sum() > 0
        shrunk = fit_pixel_budget(sample.images[0], 28 * 28, 112 * 112)
        shown = demonstrations.write(dataclasses.replace(sample, images=[shrunk],
                                                         source_images=tuple(sample.images)))
        # the zoom's region: 1/8 of 896 px, whole pixels, so the 112 px budget leaves it as it is
        assert shown.images[1].size == (112, 112)
        assert _read_stripes(np.asarray(shown.images[1]), spec) == item.answer


def test_a_zoom_hint_says_where_the_mark_is_and_changes_nothing_else() -> None:
    """data.shapes.zoom_hint: the question gives the mark's centre (2 decimals); the items are
    the same marks, and a zoom at the stated place reads the stripes."""
    import re

    plain = ShapesSpec(image_size=112, kinds=["zoom"], max_distractors=0)
    hinted = dataclasses.replace(plain, zoom_hint=True)
    for a, b in zip(ShapesSource(plain, split="train", size=6, seed=3).items,
                    ShapesSource(hinted, split="train", size=6, seed=3).items, strict=True):
        assert (a.shapes, a.answer) == (b.shapes, b.answer)
        assert "centred at" not in a.problem
        (mark,) = b.shapes
        x, y = (float(v) for v in re.search(r"centred at x=(\d\.\d\d), y=(\d\.\d\d)",
                                             b.problem).groups())
        assert abs(x - mark.cx / 896) <= 0.005 and abs(y - mark.cy / 896) <= 0.005
        crop = zoom(ToolContext((render_item(b, hinted),)), x, y, factor=8)
        assert _read_stripes(np.asarray(crop), hinted) == b.answer


def test_zoom_cells_put_the_mark_at_a_cells_centre() -> None:
    """data.shapes.zoom_cells=8: every mark's centre is the centre of one of 8 x 8 cells of the
    896 px image (56 + 112 k px), every cell is drawn (train and eval together: a place's 3
    scenes can all fall in one split), the hint states one of 8 places per axis,
    and a zoom at the stated place reads the stripes; bad values are one-line errors."""
    import re

    spec = ShapesSpec(image_size=112, kinds=["zoom"], max_distractors=0, zoom_cells=8,
                      zoom_hint=True)
    items = [*ShapesSource(spec, split="train", size=400, seed=0).items,
             *ShapesSource(spec, split="eval", size=200, seed=0).items]
    centres = {(item.shapes[0].cx, item.shapes[0].cy) for item in items}
    assert centres == {(56 + 112 * i, 56 + 112 * j) for i in range(8) for j in range(8)}
    stated = {re.search(r"x=(\d\.\d\d)", item.problem).group(1) for item in items}
    assert stated == {"0.06", "0.19", "0.31", "0.44", "0.56", "0.69", "0.81", "0.94"}
    for item in items[:6]:
        x, y = (float(v) for v in re.search(r"x=(\d\.\d\d), y=(\d\.\d\d)", item.problem).groups())
        crop = zoom(ToolContext((render_item(item, spec),)), x, y, factor=8)
        assert _read_stripes(np.asarray(crop), spec) == item.answer
    for bad in (-1, 29):  # 29 cells of 896 px are narrower than the 32 px mark
        with pytest.raises(DataError, match="zoom_cells must be 0 or 1..28"):
            dataclasses.replace(spec, zoom_cells=bad)
    with pytest.raises(DataError, match=r"data.shapes.zoom_cells=1 gives only 3 scenes to split "
                                        r"between train and eval; raise it \(4 or more\)"):
        ShapesSource(dataclasses.replace(spec, zoom_cells=1), split="train", size=6, seed=0)
    cfg = load_config(None, ["data.shapes.zoom_cells=4", "data.shapes.kinds=[zoom]"])
    assert cfg.data.shapes.zoom_cells == 4
