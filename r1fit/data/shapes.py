"""``builtin:shapes``: a procedural visual QA task that needs no downloads.

Each item is a small image of 1-3 large coloured shapes (circle, square, triangle) on a plain
background, with one question about it:

- ``color``:    "What colour is the circle? Answer with one word."              -> "red"
- ``count``:    "How many shapes are there? Answer with a number."              -> "2"
- ``position``: "Is the red shape on the left or the right? Answer with one word." -> "left"
- ``box``:      "Give the box of the red circle as [x1,y1,x2,y2] in pixels of this 112x112 image."
                -> "[31,40,72,81]" (grounding, VLM-R1's REC; scored by IoU: the row's accuracy
                method is ``iou``)
- ``zoom``:     "A small grey square is hidden in this image. Zoom in: are its stripes horizontal,
                vertical or checkered? Answer with one word." -> "vertical" (a task for tools:
                see below)

A ``zoom`` image is ``ZOOM_SCALE`` (8) times ``image_size`` on a side (896 px for 112) and blank
but for one ``MARK_PX`` (32 px) square mark at a random place on an 8 px grid, filled with black
(white on a black background) and background stripes 2 px wide: horizontal, vertical or a
checkerboard. Every 8 x 8 block of the mark is half ink in all three patterns, and each pattern
is symmetric about the mark's centre, so once the image is shrunk 8 times to the pixel budget
(``data.max_pixels`` = image_size squared) the mark is a 4 px grey square that looks the same
whatever its pattern (within 2 grey levels of 255, measured in tests/data/test_shapes.py): the
policy can see where the mark is but not what it is. A crop around it at the source resolution
(the ``crop``/``zoom`` tools, r1fit/tools/) shows the stripes. The prompt must carry the image
shrunk (``data.max_pixels`` below the zoom image's pixels), else the question needs no tool.

A box is in pixels of the image as drawn (``image_size`` square, origin at the top-left corner,
x to the right, y down), corners on pixel edges: ``x1, y1`` are the first column and row the shape
covers, ``x2, y2`` one past the last (PIL's ``getbbox``). That is the frame of the image the model
sees only when nothing resizes it: ``data.shapes.image_size`` squared must lie within the pixel
budget (``data.min_pixels..max_pixels``, checked by the config) and, for Qwen2/2.5-VL processors,
be a multiple of 28 px (112 is), else the processor rounds it.

Design choices, learned the hard way on this project:

- Shapes are LARGE (radius about 0.3 x the image side when alone; 0.2 for box questions, whose
  answer must depend on where the shape is) with at most a few distractors: a 1.4M-parameter
  random-init vision tower learned nothing when shapes were small among 4 distractors, and learned
  colour questions with big shapes and <= 2 distractors.
- The image alone decides the answer: the asked-about shape is unique (only one circle for colour
  questions, only one red shape for position questions, only one red circle for box questions) and
  shapes never touch, so they can be counted.
- Answers are exactly balanced: item ``i`` asks kind ``kinds[i % K]`` and its answer cycles through that
  kind's answer space, so chance accuracy is ``1 / len(answer_space[kind])``; box questions cycle
  through the shape asked about.
- Determinism: item ``(seed, split, index)`` is drawn from its own RNG stream, so it never depends on
  the dataset size or on other items.
- Train and eval are disjoint by construction: every item has a key (question + every rendered
  parameter, so equal keys mean identical image and question); a stable hash of the key, independent
  of the seed, assigns it to ``eval`` (1 in ``EVAL_BUCKETS``) or ``train``, and an item is redrawn until
  its key lands in its own split. This holds for any seeds and sizes, unlike excluding a fixed eval list.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from PIL import Image, ImageColor, ImageDraw

from r1fit.data.errors import DataError
from r1fit.data.sample import Sample

# Kinds whose answer is a word or a number from a fixed list (answer_space), and all kinds.
QUESTION_KINDS: tuple[str, ...] = ("color", "count", "position")
KINDS: tuple[str, ...] = (*QUESTION_KINDS, "box", "zoom")
SHAPE_NAMES: tuple[str, ...] = ("circle", "square", "triangle")
DEFAULT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
SPLITS: tuple[str, ...] = ("train", "eval")

# Radius of a lone shape as a fraction of the image side ("draw them large", see module docstring).
RADIUS_FRACTION = 0.3
# A lone shape of a box question is smaller, so where it is matters: with 0.3 the best constant
# box already scores a mean IoU of ~0.47, with 0.2 ~0.22 (and a random other row's box ~0.15).
BOX_RADIUS_FRACTION = 0.2
# With several shapes each gets a column; its radius is at most this fraction of the column width,
# which leaves a gap of background between neighbours.
COLUMN_RADIUS_FRACTION = 0.42
# Narrowest column that still holds a recognisable shape (radius ~6 px).
MIN_COLUMN_PX = 14
# A zoom question's image is this many times image_size on a side; its mark is MARK_PX square, on
# a grid of ZOOM_SCALE px, filled with stripes STRIPE_PX wide (see the module docstring).
ZOOM_SCALE = 8
MARK_PX = 32
STRIPE_PX = 2
ZOOM_PATTERNS: tuple[str, ...] = ("horizontal", "vertical", "checkered")
# One in EVAL_BUCKETS scene keys belongs to the eval split.
EVAL_BUCKETS = 5
# Eval accepts ~1/EVAL_BUCKETS of draws; 200 failures in a row only happen when the spec leaves
# almost no freedom (tiny images), which is reported as an error instead of looping forever.
MAX_ATTEMPTS = 200


def answer_space(
    kinds: Iterable[str] | None = None,
    *,
    colors: Sequence[str] = DEFAULT_COLORS,
    max_distractors: int = 1,
) -> dict[str, list[str]]:
    """Possible answers per question kind, in the order items cycle through them.

    ``kinds`` defaults to ``QUESTION_KINDS``; counts run from 1 to ``1 + max_distractors``; a
    ``zoom`` answer is the mark's pattern. A
    ``box`` answer is a box, not one of a list: its entry is the shapes whose box is asked, which
    its items cycle through instead.
    """
    spaces = {
        "color": list(colors),
        "count": [str(n) for n in range(1, max_distractors + 2)],
        "position": ["left", "right"],
        "box": list(SHAPE_NAMES),
        "zoom": list(ZOOM_PATTERNS),
    }
    chosen = QUESTION_KINDS if kinds is None else tuple(kinds)
    unknown = [k for k in chosen if k not in spaces]
    if unknown:
        raise DataError(f"unknown shapes kind(s) {unknown}; choose from {list(KINDS)}")
    return {k: spaces[k] for k in chosen}


def _strings(value: str | Iterable[str]) -> tuple[str, ...]:
    """A tuple of lower-cased strings; a lone string counts as one element, not as characters."""
    items = (value,) if isinstance(value, str) else tuple(value)
    return tuple(str(v).strip().lower() for v in items)


@dataclass(frozen=True)
class ShapesSpec:
    """Parameters of ``builtin:shapes``. Lists are accepted for the tuple fields (e.g. from YAML)."""

    image_size: int = 56
    """Side of the square image in pixels."""
    kinds: tuple[str, ...] = QUESTION_KINDS
    """Question kinds to ask, any of "color", "count", "position", "box", "zoom"; items cycle
    through them."""
    colors: tuple[str, ...] = DEFAULT_COLORS
    """Shape colours (PIL colour names, single words: they are the answers to colour questions)."""
    max_distractors: int = 1
    """Extra shapes besides the asked-about one: 0..max_distractors per image; counts go to 1+this."""
    background: str = "white"
    """Plain background colour; must differ from every shape colour."""
    zoom_hint: bool = False
    """Zoom questions say where the mark is (its centre in fractions of the image, 2 decimals):
    the tool is still needed to read it, but finding it is not (a policy that cannot localise
    can learn to zoom there)."""
    zoom_cells: int = 0
    """0: a zoom mark lies anywhere on the ``ZOOM_SCALE`` px grid; n: its centre is the centre of
    one of n x n equal cells of the image (n^2 places: a coarser place to find or state)."""
    _rgb: dict[str, tuple[int, int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Normalise list fields to tuples and validate; ``DataError`` names the bad field."""
        kinds, colors = _strings(self.kinds), _strings(self.colors)
        background = str(self.background).strip().lower()
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "colors", colors)
        object.__setattr__(self, "background", background)

        for name in ("image_size", "max_distractors", "zoom_cells"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise DataError(f"ShapesSpec.{name} must be an integer, got {value!r}")
        if self.zoom_cells and not 1 <= self.zoom_cells <= ZOOM_SCALE * self.image_size // MARK_PX:
            raise DataError(
                f"ShapesSpec.zoom_cells must be 0 or 1..{ZOOM_SCALE * self.image_size // MARK_PX} "
                f"(cells at least the {MARK_PX} px mark wide), got {self.zoom_cells}")
        if self.max_distractors < 0:
            raise DataError(f"ShapesSpec.max_distractors must be >= 0, got {self.max_distractors}")
        columns = max(2, 1 + self.max_distractors)
        if self.image_size < MIN_COLUMN_PX * columns:
            raise DataError(
                f"ShapesSpec.image_size={self.image_size} is too small for max_distractors="
                f"{self.max_distractors}: need >= {MIN_COLUMN_PX * columns} ({MIN_COLUMN_PX} px per shape)"
            )
        if not kinds or len(set(kinds)) != len(kinds) or not set(kinds) <= set(KINDS):
            raise DataError(f"ShapesSpec.kinds must be distinct values from {list(KINDS)}, got {list(kinds)}")

        rgb: dict[str, tuple[int, int, int]] = {}
        for color in (*colors, background):
            if not color.isalpha():
                raise DataError(f"ShapesSpec colour {color!r} must be a single-word colour name")
            try:
                rgb[color] = ImageColor.getrgb(color)[:3]
            except ValueError as exc:
                raise DataError(f"ShapesSpec colour {color!r} is not a colour name PIL knows") from exc
        if len(colors) < 2 or len({rgb[c] for c in colors}) != len(colors):
            raise DataError(f"ShapesSpec.colors needs >= 2 distinct colours, got {list(colors)}")
        if rgb[background] in {rgb[c] for c in colors}:
            raise DataError(f"ShapesSpec.background={background!r} equals one of the shape colours")
        object.__setattr__(self, "_rgb", rgb)

    def rgb(self, color: str) -> tuple[int, int, int]:
        """RGB triple of one of this spec's colour names (shape colours or background)."""
        return self._rgb[color]

    def answer_space(self) -> dict[str, list[str]]:
        """``answer_space`` for this spec's kinds, colours and distractor count."""
        return answer_space(self.kinds, colors=self.colors, max_distractors=self.max_distractors)


@dataclass(frozen=True)
class Shape:
    """One drawn shape: name, colour, integer centre and radius (pixels)."""

    name: str
    color: str
    cx: int
    cy: int
    r: int


@dataclass(frozen=True)
class ShapesItem:
    """A question with its scene; ``render_item`` turns it into pixels."""

    kind: str
    problem: str
    answer: str
    shapes: tuple[Shape, ...]
    image_size: int
    background: str

    @property
    def key(self) -> str:
        """Canonical text of the question and everything rendered: equal keys = identical items."""
        shapes = sorted((s.name, s.color, s.cx, s.cy, s.r) for s in self.shapes)
        return json.dumps([self.problem, self.answer, self.image_size, self.background, shapes])


def split_of(key: str) -> str:
    """``"eval"`` or ``"train"``: a stable, seed-independent hash partition of item keys."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") % EVAL_BUCKETS == 0 else "train"


def _column_bounds(size: int, columns: int) -> list[int]:
    """Integer x boundaries of ``columns`` equal columns: ``[0, ..., size]``."""
    return [round(k * size / columns) for k in range(columns + 1)]


def _place(rng: random.Random, size: int, left: int, right: int, columns: int,
           lone: float = RADIUS_FRACTION) -> tuple[int, int, int]:
    """Random centre and radius of a shape inside the column ``[left, right)``; a lone shape's
    radius is about ``lone`` x ``size``.

    One pixel of background is kept on each side of the column, so shapes in adjacent columns never
    touch (they stay separate blobs, which makes counting well defined).
    """
    limit = lone * size if columns == 1 else COLUMN_RADIUS_FRACTION * (right - left)
    r_hi = max(3, min(math.floor(limit), (right - left - 3) // 2))
    r = rng.randint(max(3, math.ceil(0.8 * r_hi)), r_hi)
    cx = rng.randint(left + 1 + r, right - 2 - r)
    cy = rng.randint(1 + r, size - 2 - r)
    return cx, cy, r


def _zoom_scene(spec: ShapesSpec, answer: str, rng: random.Random) -> ShapesItem:
    """A ``ZOOM_SCALE`` times larger blank image with one ``MARK_PX`` mark of pattern ``answer``
    at a random place on the ``ZOOM_SCALE`` px grid, or at a cell's centre (``zoom_cells``) (a
    Shape named by its pattern, ``r`` half its side)."""
    size = ZOOM_SCALE * spec.image_size
    half = MARK_PX // 2
    if spec.zoom_cells:  # the centre of one of zoom_cells x zoom_cells cells
        n = spec.zoom_cells
        cx, cy = (round((rng.randint(0, n - 1) + 0.5) * size / n) for _ in range(2))
    else:
        cells = (size - MARK_PX) // ZOOM_SCALE
        cx, cy = (half + ZOOM_SCALE * rng.randint(0, cells) for _ in range(2))
    ink = "white" if spec.rgb(spec.background) == (0, 0, 0) else "black"
    return ShapesItem(
        kind="zoom", answer=answer, image_size=size, background=spec.background,
        shapes=(Shape(name=answer, color=ink, cx=cx, cy=cy, r=half),),
        problem=_zoom_problem(""))


def _zoom_problem(where: str) -> str:
    return (f"A small grey square is hidden in this image{where}. Zoom in: are its stripes "
            "horizontal, vertical or checkered? Answer with one word.")


def _hinted(item: ShapesItem) -> ShapesItem:
    """A zoom item whose question says where its mark is (``ShapesSpec.zoom_hint``)."""
    (mark,) = item.shapes
    where = f", centred at x={mark.cx / item.image_size:.2f}, y={mark.cy / item.image_size:.2f}"
    return replace(item, problem=_zoom_problem(where))


def _draw_scene(spec: ShapesSpec, kind: str, answer: str, rng: random.Random) -> ShapesItem:
    """One random scene whose answer to a ``kind`` question is ``answer``."""
    size = spec.image_size
    if kind == "zoom":
        return _zoom_scene(spec, answer, rng)
    if kind == "count":
        count = int(answer)
        columns = count
        names = [rng.choice(SHAPE_NAMES) for _ in range(count)]
        colors = [rng.choice(spec.colors) for _ in range(count)]
        slots = rng.sample(range(columns), count)
        problem = "How many shapes are there? Answer with a number."
    elif kind == "color":
        count = 1 + rng.randint(0, spec.max_distractors)
        columns = count
        target = rng.choice(SHAPE_NAMES)
        # Distractors are other shape types, so "the circle" names exactly one shape.
        others = [n for n in SHAPE_NAMES if n != target]
        names = [target] + [rng.choice(others) for _ in range(count - 1)]
        colors = [answer] + [rng.choice(spec.colors) for _ in range(count - 1)]
        slots = rng.sample(range(columns), count)
        problem = f"What colour is the {target}? Answer with one word."
    elif kind == "position":
        count = 1 + rng.randint(0, spec.max_distractors)
        # At least two columns so a lone shape still sits clearly in one half.
        columns = max(2, count)
        bounds = _column_bounds(size, columns)
        centres = [(bounds[k] + bounds[k + 1]) / 2 for k in range(columns)]
        half = [k for k in range(columns) if (centres[k] < size / 2) == (answer == "left") and centres[k] != size / 2]
        target_color = rng.choice(spec.colors)
        target_slot = rng.choice(half)
        # Distractors have other colours, so "the red shape" names exactly one shape.
        other_colors = [c for c in spec.colors if c != target_color]
        names = [rng.choice(SHAPE_NAMES) for _ in range(count)]
        colors = [target_color] + [rng.choice(other_colors) for _ in range(count - 1)]
        slots = [target_slot] + rng.sample([k for k in range(columns) if k != target_slot], count - 1)
        problem = f"Is the {target_color} shape on the left or the right? Answer with one word."
    elif kind == "box":
        count = 1 + rng.randint(0, spec.max_distractors)
        columns = count
        target = (rng.choice(spec.colors), answer)  # answer: the asked-about shape's name
        # Distractors differ in colour or shape (or both), so "the red circle" names one shape.
        others = [(c, n) for c in spec.colors for n in SHAPE_NAMES if (c, n) != target]
        pairs = [target] + [rng.choice(others) for _ in range(count - 1)]
        colors, names = [c for c, _ in pairs], [n for _, n in pairs]
        slots = rng.sample(range(columns), count)
        problem = (f"Give the box of the {target[0]} {target[1]} as [x1,y1,x2,y2] in pixels of "
                   f"this {size}x{size} image.")
    else:  # ShapesSpec validation makes this unreachable; keep the error explicit anyway.
        raise DataError(f"unknown shapes kind {kind!r}")

    bounds = _column_bounds(size, columns)
    shapes = []
    lone = BOX_RADIUS_FRACTION if kind == "box" else RADIUS_FRACTION
    for name, color, slot in zip(names, colors, slots):
        cx, cy, r = _place(rng, size, bounds[slot], bounds[slot + 1], columns, lone)
        shapes.append(Shape(name=name, color=color, cx=cx, cy=cy, r=r))
    if kind == "box":  # the answer is where the asked-about shape (the first) was drawn
        answer = "[{},{},{},{}]".format(*shape_box(shapes[0], size))
    return ShapesItem(
        kind=kind, problem=problem, answer=answer, shapes=tuple(shapes),
        image_size=size, background=spec.background,
    )


def make_item(spec: ShapesSpec, *, seed: int, split: str, index: int) -> ShapesItem:
    """Item ``index`` of ``split``: a pure function of ``(spec, seed, split, index)``."""
    if split not in SPLITS:
        raise DataError(f"builtin:shapes split must be one of {list(SPLITS)}, got {split!r}")
    space = spec.answer_space()
    kind = spec.kinds[index % len(spec.kinds)]
    answers = space[kind]
    answer = answers[(index // len(spec.kinds)) % len(answers)]
    for attempt in range(MAX_ATTEMPTS):
        # String seeds go through SHA-512 in `random`, so streams are stable across runs and
        # independent of PYTHONHASHSEED; each (seed, split, index, attempt) gets its own stream.
        rng = random.Random(f"r1fit-shapes:{seed}:{split}:{index}:{attempt}")
        item = _draw_scene(spec, kind, answer, rng)
        if split_of(item.key) == split:  # the hint left out: the same items with and without
            return _hinted(item) if spec.zoom_hint and kind == "zoom" else item
    if kind == "zoom" and spec.zoom_cells:  # n^2 places x the patterns: too few scenes to split
        raise DataError(
            f"builtin:shapes could not draw a {split} zoom item #{index} ({answer}) in "
            f"{MAX_ATTEMPTS} tries: data.shapes.zoom_cells={spec.zoom_cells} gives only "
            f"{len(ZOOM_PATTERNS) * spec.zoom_cells ** 2} scenes to split between train and eval; raise it (4 or more)")
    raise DataError(
        f"builtin:shapes could not draw a {split} item #{index} in {MAX_ATTEMPTS} tries; "
        f"increase ShapesSpec.image_size (now {spec.image_size})"
    )


def _mark_ink(pattern: str, x: int, y: int) -> bool:
    """Whether pixel (x, y) of a zoom mark is ink. Stripes start half a stripe in (rows 1-2,
    5-6, ... of a horizontal mark), so a mark is symmetric about its centre: its pattern does not
    show as a lopsided edge once shrunk."""
    row, col = (y + STRIPE_PX // 2) // STRIPE_PX, (x + STRIPE_PX // 2) // STRIPE_PX
    if pattern == "horizontal":
        return row % 2 == 1
    if pattern == "vertical":
        return col % 2 == 1
    return (row + col) % 2 == 1  # checkered


def _draw_mark(draw: ImageDraw.ImageDraw, s: Shape, fill: tuple[int, int, int] | int) -> None:
    """A zoom mark: the square of side ``2 r`` centred on (cx, cy), its ink pixels ``fill``."""
    side = 2 * s.r
    draw.point([(s.cx - s.r + x, s.cy - s.r + y) for y in range(side) for x in range(side)
                if _mark_ink(s.name, x, y)], fill=fill)


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, fill: tuple[int, int, int] | int) -> None:
    """Draw one shape (no anti-aliasing)."""
    if s.name in ZOOM_PATTERNS:
        _draw_mark(draw, s, fill)
    elif s.name == "circle":
        draw.ellipse([s.cx - s.r, s.cy - s.r, s.cx + s.r, s.cy + s.r], fill=fill)
    elif s.name == "square":
        # A square inscribed-ish in the circle, so the three shapes have similar visual weight.
        h = max(2, round(0.85 * s.r))
        draw.rectangle([s.cx - h, s.cy - h, s.cx + h, s.cy + h], fill=fill)
    else:  # triangle pointing up, inscribed in the circle; its centroid is the centre
        dx = 0.866 * s.r
        draw.polygon([(s.cx, s.cy - s.r), (s.cx - dx, s.cy + s.r / 2), (s.cx + dx, s.cy + s.r / 2)], fill=fill)


def shape_box(shape: Shape, size: int) -> tuple[int, int, int, int]:
    """``(x1, y1, x2, y2)``: the pixels ``shape`` covers when drawn, ``x2``/``y2`` one past the
    last (drawn alone on a mask by the same code as :func:`render_item`, so it is exact)."""
    mask = Image.new("L", (size, size), 0)
    _draw_shape(ImageDraw.Draw(mask), shape, 255)
    box = mask.getbbox()
    assert box is not None, "shapes are drawn inside the image"
    return box


def render_item(item: ShapesItem, spec: ShapesSpec) -> Image.Image:
    """Draw ``item`` as an RGB image (no anti-aliasing: every pixel is exactly a spec colour)."""
    img = Image.new("RGB", (item.image_size, item.image_size), spec.rgb(item.background))
    draw = ImageDraw.Draw(img)
    for s in item.shapes:
        # a zoom mark's ink is black or white, not one of the spec's shape colours
        fill = ImageColor.getrgb(s.color)[:3] if s.name in ZOOM_PATTERNS else spec.rgb(s.color)
        _draw_shape(draw, s, fill)
    return img


class ShapesSource:
    """The first ``size`` items of one split; images are rendered on access."""

    def __init__(self, spec: ShapesSpec, *, split: str, size: int, seed: int) -> None:
        """Draw (not render) all ``size`` items up front so their keys can be checked and listed."""
        if size < 1:
            raise DataError(f"builtin:shapes size must be >= 1, got {size}")
        self.spec = spec
        self.split = split
        self.seed = seed
        self.name = f"builtin:shapes/{split}"
        self.items = [make_item(spec, seed=seed, split=split, index=i) for i in range(size)]
        self.total_rows = size
        self.bad_rows = 0
        self.skipped: list[str] = []  # no row of a built-in task is bad

    def __len__(self) -> int:
        """Number of items."""
        return len(self.items)

    def sample(self, index: int) -> Sample:
        """Render item ``index`` into a ``Sample`` (answer as the solution; a box question's
        accuracy method is ``iou``; a zoom question's focus is its mark)."""
        item = self.items[index]
        return Sample(
            images=[render_item(item, self.spec)],
            problem=item.problem,
            solution=item.answer,
            source=f"{self.name}#{index % len(self.items)}",
            reward_method="iou" if item.kind == "box" else "default",
            focus=mark_focus(item) if item.kind == "zoom" else None,
        )


def mark_focus(item: ShapesItem) -> tuple[float, float, float, float]:
    """A zoom item's mark as ``Sample.focus``: its square (``2 r`` px from ``cx - r``, ``cy -
    r``) in fractions of the image's side."""
    mark, size = item.shapes[0], item.image_size
    return ((mark.cx - mark.r) / size, (mark.cy - mark.r) / size,
            (mark.cx + mark.r) / size, (mark.cy + mark.r) / size)
