"""The built-in crop and zoom: fractions of the image to pixel boxes, worked out by hand."""

from __future__ import annotations

import math

import pytest
from PIL import Image

from r1fit.tools import ToolArgumentError, ToolContext, crop, zoom


def numbered(width: int, height: int) -> Image.Image:
    """An image whose pixel (x, y) is (x, y, 0), so a crop tells where it came from."""
    image = Image.new("RGB", (width, height))
    image.putdata([(x, y, 0) for y in range(height) for x in range(width)])
    return image


CONTEXT = ToolContext((numbered(200, 100), numbered(10, 10)))


def test_crop_takes_the_fraction_box_in_source_pixels():
    out = crop(CONTEXT, 0.5, 0.0, 1.0, 0.5)  # the top-right quarter of 200 x 100
    assert out.size == (100, 50)
    assert out.getpixel((0, 0)) == (100, 0, 0)
    assert out.getpixel((99, 49)) == (199, 49, 0)


def test_crop_covers_every_pixel_the_region_touches():
    # x: 0.101 * 200 = 20.2 -> column 20; 0.2 * 200 = 40 -> up to 40 (one past the last)
    # y: 0.333 * 100 = 33.3 -> row 33; 0.335 * 100 = 33.5 -> up to 34: one row
    out = crop(CONTEXT, 0.101, 0.333, 0.2, 0.335)
    assert out.size == (20, 1)
    assert out.getpixel((0, 0)) == (20, 33, 0)


def test_crop_of_the_second_image():
    assert crop(CONTEXT, 0, 0, 1, 1, image=1).size == (10, 10)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((-0.1, 0, 1, 1), {}, "x1=-0.1 is outside [0, 1]"),
    ((0, 0, 1.5, 1), {}, "x2=1.5 is outside [0, 1]"),
    ((0, 0, 1, 2), {}, "y2=2 is outside [0, 1]"),
    ((0.5, 0, 0.5, 1), {}, "x1 (0.5) must be less than x2 (0.5)"),
    ((0, 0.7, 1, 0.2), {}, "y1 (0.7) must be less than y2 (0.2)"),
    ((0, 0, "1", 1), {}, "x2 must be a number in [0, 1], got '1'"),
    ((0, 0, True, 1), {}, "x2 must be a number in [0, 1], got True"),
    ((0, 0, math.nan, 1), {}, "x2 must be a number in [0, 1], got nan"),
    ((0, 0, 1, 1), {"image": 2}, "image=2 does not exist: the row has 2 image(s), numbered 0..1"),
    ((0, 0, 1, 1), {"image": 0.0}, "image must be an integer index"),
])
def test_crop_refuses_bad_values_naming_them(args, kwargs, message):
    with pytest.raises(ToolArgumentError) as excinfo:
        crop(CONTEXT, *args, **kwargs)
    assert message in str(excinfo.value)


def test_crop_of_a_row_without_images():
    with pytest.raises(ToolArgumentError, match="this row has no image"):
        crop(ToolContext(()), 0, 0, 1, 1)


def test_zoom_is_the_centred_region_of_one_over_factor():
    # factor 4 on 200 x 100: a 50 x 25 region centred on (100, 50) -> x 75..125, y 37.5..62.5
    out = zoom(CONTEXT, 0.5, 0.5, factor=4)
    assert out.size == (50, 25)  # whole pixels: 1/factor of each side, rounded
    assert out.getpixel((0, 0)) == (75, 38, 0)  # the half-pixel start rounds up: rows 38..62
    # an 896 px image at factor 8 is exactly 112 px wherever the centre is (no resampling in a
    # 112 px budget); 0.56 of 896 = 501.76 px: columns 446..557
    big = ToolContext((Image.new("RGB", (896, 896)),))
    assert {zoom(big, x, 0.19, factor=8).size for x in (0.06, 0.31, 0.56, 0.94)} == {(112, 112)}
    assert zoom(big, 0.56, 0.5, factor=3).size == (299, 299)


def test_zoom_near_an_edge_moves_inside_the_image():
    out = zoom(CONTEXT, 1.0, 0.0, factor=2)  # the centre clamps to (0.75, 0.25)
    assert out.size == (100, 50)
    assert out.getpixel((0, 0)) == (100, 0, 0)
    assert zoom(CONTEXT, 0.3, 0.3, factor=1).size == (200, 100)


@pytest.mark.parametrize(("factor", "message"), [
    (0.5, "factor=0.5 is outside [1, 64]"),
    (65, "factor=65 is outside [1, 64]"),
    ("2", "factor must be a number"),
])
def test_zoom_refuses_bad_factors(factor, message):
    with pytest.raises(ToolArgumentError) as excinfo:
        zoom(CONTEXT, 0.5, 0.5, factor=factor)
    assert message in str(excinfo.value)
