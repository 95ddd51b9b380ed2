"""Pixel budget and image loading."""

from __future__ import annotations

import pytest
from PIL import Image

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import MIN_SIDE, fit_pixel_budget, load_image, verify_image

TOKEN = 28 * 28  # pixels per merged Qwen vision token


def test_large_image_is_downscaled_into_budget_keeping_aspect() -> None:
    img = Image.new("RGB", (1000, 500), (200, 10, 10))
    out = fit_pixel_budget(img, min_pixels=TOKEN * 4, max_pixels=TOKEN * 16)
    w, h = out.size
    assert TOKEN * 4 <= w * h <= TOKEN * 16
    # sqrt(12544 / 500000) * (1000, 500) = (158.4, 79.2) -> 158 x 79, aspect 2.0
    assert (w, h) == (158, 79)
    assert abs((w / h) / 2.0 - 1) <= 0.02
    assert out.mode == "RGB"


def test_tiny_image_is_upscaled_to_min_pixels() -> None:
    img = Image.new("RGB", (10, 5), (0, 0, 255))
    out = fit_pixel_budget(img, min_pixels=TOKEN * 4, max_pixels=TOKEN * 16)
    w, h = out.size
    assert TOKEN * 4 <= w * h <= TOKEN * 16
    assert min(w, h) >= MIN_SIDE
    assert abs((w / h) / 2.0 - 1) <= 0.02
    # flat colour survives BICUBIC upsampling unchanged
    assert out.getpixel((w // 2, h // 2)) == (0, 0, 255)


def test_image_inside_budget_is_returned_unchanged() -> None:
    img = Image.new("RGB", (56, 56), (1, 2, 3))
    assert fit_pixel_budget(img, min_pixels=TOKEN, max_pixels=TOKEN * 16) is img


def test_short_side_below_28_is_enlarged_even_inside_budget() -> None:
    # 200 x 20 = 4000 px is inside [784, 12544] but 20 px cannot make a 28 px token row
    out = fit_pixel_budget(Image.new("RGB", (200, 20)), min_pixels=TOKEN, max_pixels=TOKEN * 16)
    w, h = out.size
    assert h >= MIN_SIDE and w * h <= TOKEN * 16
    assert abs((w / h) / 10.0 - 1) <= 0.02  # 280 x 28


def test_extreme_aspect_keeps_max_pixels_and_min_side() -> None:
    out = fit_pixel_budget(Image.new("RGB", (5000, 10)), min_pixels=TOKEN, max_pixels=TOKEN * 4)
    w, h = out.size
    assert min(w, h) >= MIN_SIDE and w * h <= TOKEN * 4


@pytest.mark.parametrize(
    "size", [(1, 1), (3, 700), (640, 480), (481, 479), (4000, 3000), (29, 29), (57, 3000), (333, 1)]
)
@pytest.mark.parametrize("budget", [(TOKEN, TOKEN * 4), (TOKEN * 4, TOKEN * 4 + 100), (TOKEN * 16, TOKEN * 64)])
def test_budget_invariants(size: tuple[int, int], budget: tuple[int, int]) -> None:
    min_pixels, max_pixels = budget
    w, h = fit_pixel_budget(Image.new("RGB", size), min_pixels, max_pixels).size
    assert min(w, h) >= MIN_SIDE
    assert w * h <= max_pixels
    # the lower bound holds whenever the aspect ratio allows it under the cap
    if max(size) / min(size) < 4:
        assert w * h >= min_pixels
        assert abs((w / h) / (size[0] / size[1]) - 1) <= 0.05


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_converts_to_rgb(mode: str) -> None:
    assert fit_pixel_budget(Image.new(mode, (64, 64)), TOKEN, TOKEN * 16).mode == "RGB"


@pytest.mark.parametrize("budget", [(0, TOKEN), (TOKEN * 2, TOKEN), (1, 100)])
def test_bad_budget_is_a_data_error(budget: tuple[int, int]) -> None:
    with pytest.raises(DataError, match="pixels"):
        fit_pixel_budget(Image.new("RGB", (64, 64)), *budget)


def _write_png(path, size=(40, 30), color=(10, 200, 30)) -> bytes:
    Image.new("RGB", size, color).save(path)
    return path.read_bytes()


def test_load_image_decodes_fully(tmp_path) -> None:
    _write_png(tmp_path / "a.png")
    img = load_image(tmp_path / "a.png")
    # decoded while the file was open: still usable after the file handle is closed
    assert img.size == (40, 30)
    assert img.resize((80, 60)).getpixel((0, 0)) == (10, 200, 30)


def test_load_image_missing_file(tmp_path) -> None:
    with pytest.raises(BadRowError, match=r"image not found: .*nope\.png$"):
        load_image(tmp_path / "nope.png")


def test_load_image_truncated_and_garbage(tmp_path) -> None:
    data = _write_png(tmp_path / "a.png")
    (tmp_path / "trunc.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    for name in ("trunc.png", "junk.png"):
        with pytest.raises(BadRowError) as info:
            load_image(tmp_path / name)
        message = str(info.value)
        assert message.startswith(f"cannot decode image {tmp_path / name}: ")
        assert "\n" not in message


def test_verify_image(tmp_path) -> None:
    data = _write_png(tmp_path / "a.png")
    verify_image(tmp_path / "a.png")
    (tmp_path / "trunc.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadRowError, match="corrupt image"):
        verify_image(tmp_path / "trunc.png")
    with pytest.raises(BadRowError, match="image not found"):
        verify_image(tmp_path / "missing.png")
