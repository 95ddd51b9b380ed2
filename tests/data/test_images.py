"""Pixel budget and image loading."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import MIN_SIDE, as_rgb, fit_pixel_budget, load_image, verify_image

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


def _grey(image: Image.Image) -> list[int]:
    """The first row of ``as_rgb(image)``, one number a pixel (its three channels agree)."""
    pixels = np.asarray(as_rgb(image))
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    return pixels[0, :, 0].tolist()


def test_wide_greyscale_is_scaled_to_8_bits_not_clipped() -> None:
    """convert("RGB") clips 16-bit values at 255: a 16-bit scan came out white but for black."""
    sixteen = Image.new("I;16", (4, 1))
    for x, value in enumerate((0, 257, 32768, 65535)):
        sixteen.putpixel((x, 0), value)
    out = io.BytesIO()
    sixteen.save(out, format="PNG")  # and as a file holds it
    assert _grey(load_image(out.getvalue())) == [0, 1, 128, 255]  # 32768 / 257 = 127.5
    assert _grey(Image.fromarray(np.array([[0, 7, 255]], dtype=np.int32))) == [0, 7, 255]
    assert _grey(Image.fromarray(np.array([[0, 514, 65535]], dtype=np.int32))) == [0, 2, 255]
    assert _grey(Image.fromarray(np.array([[-5, 1200, 2000]], dtype=np.int32) * 100)) == [
        0, 153, 255]  # beyond 16 bits: the maximum (200,000) is white; 120,000 * 255 / 200,000
    floats = np.array([[0.0, 0.25, 1.0, np.nan]], dtype=np.float32)
    assert _grey(Image.fromarray(floats)) == [0, 64, 255, 0]  # 0..1: 0.25 * 255 = 63.75
    assert _grey(Image.fromarray(floats * 100)) == [0, 25, 100, 0]  # 0..255 as it is


def test_transparency_is_laid_on_white() -> None:
    """As transformers' convert_to_rgb: a transparent pixel is white, a half-covered one between
    (convert("RGB") leaves whatever colour the transparent pixel holds, mostly black)."""
    rgba = Image.new("RGBA", (3, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 255))
    rgba.putpixel((2, 0), (200, 0, 0, 128))
    assert np.asarray(as_rgb(rgba))[0].tolist() == [[255, 255, 255], [0, 0, 0], [227, 127, 127]]
    assert _grey(Image.new("LA", (2, 1), (0, 0))) == [255, 255]
    palette = Image.new("P", (2, 1), 0)
    palette.putpixel((1, 0), 1)
    palette.putpalette([0, 0, 0, 9, 9, 9])
    palette.info["transparency"] = 0  # colour 0 is transparent
    assert _grey(palette) == [255, 9]
    assert as_rgb(rgb := Image.new("RGB", (2, 2))) is rgb  # RGB is not copied


def test_exif_orientation_turns_the_image_upright() -> None:
    """A phone photo stored landscape with orientation 6 (turn 90 degrees clockwise) is portrait,
    as transformers' load_image and datasets' Image feature show it."""
    stored = Image.new("RGB", (40, 20), (0, 0, 0))
    stored.paste((255, 255, 255), (0, 0, 10, 10))  # top left as stored
    exif = stored.getexif()
    exif[0x0112] = 6
    out = io.BytesIO()
    stored.save(out, format="PNG", exif=exif)
    upright = load_image(out.getvalue())
    assert upright.size == (20, 40)
    assert upright.getpixel((19, 0)) == (255, 255, 255)  # now top right
    assert upright.getpixel((0, 0)) == (0, 0, 0)
    plain = io.BytesIO()
    stored.save(plain, format="PNG")
    assert load_image(plain.getvalue()).size == (40, 20)


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


def test_an_image_over_pils_pixel_limit_is_too_large_not_corrupt(tmp_path, monkeypatch) -> None:
    """PIL refuses to decode an image over twice its MAX_IMAGE_PIXELS (a decompression bomb
    guard): a sound file, named as too large, not as corrupt."""
    _write_png(tmp_path / "a.png")
    with Image.open(tmp_path / "a.png") as img:
        pixels = img.width * img.height
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pixels // 3)
    for check in (load_image, verify_image):
        with pytest.raises(BadRowError, match=rf"^image too large {tmp_path / 'a.png'}: .*PIL "
                                              "refuses to decode it; resize it"):
            check(tmp_path / "a.png")


def test_verify_image(tmp_path) -> None:
    data = _write_png(tmp_path / "a.png")
    verify_image(tmp_path / "a.png")
    (tmp_path / "trunc.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadRowError, match="corrupt image"):
        verify_image(tmp_path / "trunc.png")
    with pytest.raises(BadRowError, match="image not found"):
        verify_image(tmp_path / "missing.png")
