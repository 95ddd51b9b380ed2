"""The built-in tools: ``crop`` and ``zoom`` on the row's image.

Coordinates are FRACTIONS of the image's width and height, in [0, 1], origin at the top-left
corner, x to the right, y down: ``crop(x1=0.5, y1=0, x2=1, y2=0.5)`` is the top-right quarter,
whatever the image's resolution. Fractions, not pixels, because the policy sees the image shrunk to
``data.max_pixels`` while the tool cuts the image at its source resolution; a fraction means the
same place in both.

Each returns the region at the source image's resolution; the runner then fits every image a tool
returns into ``data.min_pixels..max_pixels`` (:func:`r1fit.data.images.fit_pixel_budget`), so a crop
of a large image is shrunk no more than the budget demands and a tiny one is enlarged to 28 px.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from PIL import Image

from r1fit.tools.api import ToolArgumentError, ToolContext

#: the strongest zoom: a region 1/64 of the image's side (a 896 px image: 14 px)
MAX_ZOOM = 64.0


def _fraction(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1], else :class:`ToolArgumentError` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ToolArgumentError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ToolArgumentError(f"{name}={value!r} is outside [0, 1] (coordinates are fractions "
                                "of the image's width and height)")
    return float(value)


def _image(context: ToolContext, index: Any) -> Image.Image:
    """The row's image number ``index`` (0 = the first)."""
    count = len(context.images)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ToolArgumentError(f"image must be an integer index, got {index!r}")
    if count == 0:
        raise ToolArgumentError("this row has no image")
    if not 0 <= index < count:
        raise ToolArgumentError(f"image={index} does not exist: the row has {count} image(s), "
                                f"numbered 0..{count - 1}")
    return context.images[index]


def crop(context: ToolContext, x1: float, y1: float, x2: float, y2: float,
         image: int = 0) -> Image.Image:
    """The region from (x1, y1) to (x2, y2) of the row's image ``image``, in fractions of its
    width and height (0..1, top-left origin), at the image's source resolution.

    The pixel box covers every pixel the region touches: columns floor(x1 * width) to
    ceil(x2 * width), one past the last, and rows likewise; it is at least one pixel wide and high.
    """
    left, top = _fraction("x1", x1), _fraction("y1", y1)
    right, bottom = _fraction("x2", x2), _fraction("y2", y2)
    if left >= right:
        raise ToolArgumentError(f"x1 ({x1!r}) must be less than x2 ({x2!r})")
    if top >= bottom:
        raise ToolArgumentError(f"y1 ({y1!r}) must be less than y2 ({y2!r})")
    source = _image(context, image)
    width, height = source.size
    box = (math.floor(left * width), math.floor(top * height),
           math.ceil(right * width), math.ceil(bottom * height))
    return source.crop(box)


def zoom(context: ToolContext, x: float, y: float, factor: float = 2.0,
         image: int = 0) -> Image.Image:
    """The region centred on (x, y) (fractions, as for ``crop``) whose width and height are
    1/``factor`` of the image's, rounded to whole pixels (a 896 px image at factor 8: exactly
    112 px, so a 112 px budget shows it unresampled), moved inside the image when the centre is
    near an edge; ``factor`` 1 is the whole image, at most ``MAX_ZOOM``."""
    cx, cy = _fraction("x", x), _fraction("y", y)
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor):
        raise ToolArgumentError(f"factor must be a number in [1, {MAX_ZOOM:g}], got {factor!r}")
    if not 1.0 <= float(factor) <= MAX_ZOOM:
        raise ToolArgumentError(f"factor={factor!r} is outside [1, {MAX_ZOOM:g}]")
    source = _image(context, image)
    width, height = source.size
    w, h = (min(side, max(1, round(side / float(factor)))) for side in (width, height))
    # the nearest whole-pixel start (halves up), then inside the image
    left = min(max(math.floor(cx * width - w / 2 + 0.5), 0), width - w)
    top = min(max(math.floor(cy * height - h / 2 + 0.5), 0), height - h)
    return source.crop((left, top, left + w, top + h))
