"""Image loading and the pixel budget.

Qwen2-VL / Qwen2.5-VL cut images into 14 px patches and merge 2x2 patches into one token, so one token
covers 28x28 pixels and the number of image tokens grows with ``width * height``. Capping the pixel
count here (before the processor) bounds the sequence length, hence memory, of every sample; the lower
bound keeps tiny images from collapsing to a single token. A processor with a fixed-size vision tower
(Gemma 3's SigLIP) then resizes every image to its own size, and the tokens per image are its
config's (``mm_tokens_per_image``): the budget only bounds the image that is decoded and resized.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps

from r1fit.data.errors import BadRowError, DataError
from r1fit.errors import one_line

# One merged Qwen vision token covers 28x28 px; a side shorter than that cannot form a token.
MIN_SIDE = 28


def check_pixel_budget(min_pixels: int, max_pixels: int) -> None:
    """Raise ``DataError`` unless ``MIN_SIDE**2 <= max_pixels`` and ``0 < min_pixels <= max_pixels``."""
    if not isinstance(min_pixels, int) or not isinstance(max_pixels, int):
        raise DataError(f"min_pixels/max_pixels must be integers, got {min_pixels!r}/{max_pixels!r}")
    if max_pixels < MIN_SIDE * MIN_SIDE:
        raise DataError(f"max_pixels={max_pixels} is below one 28x28 vision token ({MIN_SIDE * MIN_SIDE})")
    if not 0 < min_pixels <= max_pixels:
        raise DataError(f"min_pixels={min_pixels} must be > 0 and <= max_pixels={max_pixels}")


def _fitted_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Integer size closest to ``width:height`` with area in [min_pixels, max_pixels], sides >= 28.

    When no integer size satisfies every constraint (an extremely elongated image), the area cap wins
    over the aspect ratio, because the cap is what protects memory.
    """
    area = width * height
    scale = 1.0
    if area > max_pixels:
        scale = math.sqrt(max_pixels / area)
    elif area < min_pixels:
        scale = math.sqrt(min_pixels / area)
    target_w, target_h = width * scale, height * scale
    short = min(target_w, target_h)
    if short < MIN_SIDE:  # enlarge both sides so the short one reaches 28 px, keeping the aspect ratio
        target_w, target_h = target_w * MIN_SIDE / short, target_h * MIN_SIDE / short

    aspect = width / height
    # Fix the short side (two rounding candidates), then pick the long side inside the budget that is
    # nearest to the aspect-true value. Rounding the two sides independently can leave the budget.
    transpose = target_w < target_h
    long_t, short_t = (target_h, target_w) if transpose else (target_w, target_h)
    long_aspect = 1 / aspect if transpose else aspect
    best: tuple[float, int, int] | None = None
    for short_side in {max(MIN_SIDE, math.floor(short_t)), max(MIN_SIDE, math.ceil(short_t))}:
        low = max(MIN_SIDE, math.ceil(min_pixels / short_side))
        high = max_pixels // short_side
        if low > high:
            continue
        long_side = min(max(round(long_t), low), high)
        error = abs(long_side / short_side - long_aspect)
        if best is None or error < best[0]:
            best = (error, long_side, short_side)
    if best is None:  # no feasible size keeps both bounds: honour max_pixels and the 28 px floor
        short_side = max(MIN_SIDE, math.floor(short_t))
        best = (0.0, max(MIN_SIDE, max_pixels // short_side), short_side)
    _, long_side, short_side = best
    return (short_side, long_side) if transpose else (long_side, short_side)


# Pillow's modes of more than 8 bits a channel, which convert("RGB") clips at 255
_WIDE_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")


def as_rgb(img: Image.Image) -> Image.Image:
    """``img`` in RGB mode: itself when it already is, else a converted copy.

    As transformers' ``convert_to_rgb`` does, transparent pixels are laid on white (not on the
    black ``convert("RGB")`` leaves). Greyscale of more than 8 bits is scaled to 8 bits, not
    clipped: 16-bit values (``I;16``) divided by 257; 32-bit integers (``I``) likewise when any
    exceeds 255, else taken as 8-bit; floats (``F``) read as 0..1 when none exceeds 1, else as
    0..255; beyond 16 bits (or 255 for floats) the image's maximum is white.
    """
    if img.mode == "RGB":
        return img
    if img.mode in _WIDE_MODES:
        return _eight_bit(img).convert("RGB")
    if {"A", "a"} & set(img.getbands()) or "transparency" in img.info:
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def _eight_bit(img: Image.Image) -> Image.Image:
    """A greyscale image of more than 8 bits as mode ``L`` (the scaling ``as_rgb`` states)."""
    values = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    top = float(values.max(initial=0.0))
    if img.mode.startswith("I;16"):
        scale = 257.0
    elif img.mode == "F":
        scale = 1 / 255 if top <= 1.0 else max(top, 255.0) / 255
    else:
        scale = 1.0 if top <= 255 else 257.0 if top <= 65535 else top / 255
    return Image.fromarray(np.clip(np.rint(values / scale), 0, 255).astype(np.uint8))


def fit_pixel_budget(img: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """Return ``img`` as RGB with ``min_pixels <= w*h <= max_pixels`` and both sides >= 28 px.

    The image is resized (LANCZOS down, BICUBIC up) only when it is outside the budget or has a side
    shorter than 28 px; the aspect ratio is kept up to integer rounding. Raises ``DataError`` for an
    impossible budget.
    """
    check_pixel_budget(min_pixels, max_pixels)
    rgb = as_rgb(img)
    width, height = rgb.size
    if width < 1 or height < 1:
        raise BadRowError(f"image has an empty size {width}x{height}")
    if min_pixels <= width * height <= max_pixels and min(width, height) >= MIN_SIDE:
        return rgb
    new_w, new_h = _fitted_size(width, height, min_pixels, max_pixels)
    # LANCZOS is the best downsampler; for upsampling it rings visibly on flat colours, BICUBIC does not.
    resample = Image.Resampling.LANCZOS if new_w * new_h < width * height else Image.Resampling.BICUBIC
    return rgb.resize((new_w, new_h), resample=resample)


def verify_image(image: str | os.PathLike[str] | bytes | Image.Image) -> None:
    """Cheap integrity check without decoding pixels: the file exists (or the bytes are there) and
    ``Image.verify()`` passes. An image a dataset already decoded passes as it is.

    Raises ``BadRowError`` with a one-line reason. ``verify()`` checks headers and, for PNG, chunk
    checksums; it cannot see every corruption, so decoding can still fail later (see ``load_image``).
    """
    if not isinstance(image, Image.Image):
        _open(image, "verify", "corrupt image")


def load_image(image: str | os.PathLike[str] | bytes | Image.Image) -> Image.Image:
    """Open and fully decode an image file or encoded bytes (``Image.open`` + ``load()``), raising
    ``BadRowError``; an already decoded image is returned as it is.

    Decoding eagerly surfaces truncated/corrupt files here, with the path in the message, instead of
    deep inside the processor. The image is turned upright by its EXIF orientation, as transformers'
    ``load_image`` and datasets' ``Image`` feature do (a phone photo is stored sideways); it is in
    its file mode, ``fit_pixel_budget`` makes it RGB.
    """
    if isinstance(image, Image.Image):
        return image
    return _open(image, "load", "cannot decode image")


def _open(image: str | os.PathLike[str] | bytes, how: str, failure: str) -> Image.Image:
    """``Image.open`` of a file or of encoded bytes, then its ``verify()`` or ``load()``;
    ``BadRowError`` naming the path (or saying the bytes are embedded)."""
    if isinstance(image, bytes):
        source, name = io.BytesIO(image), f"(embedded, {len(image)} bytes)"
    else:
        source = name = Path(image)
        if not source.is_file():
            raise BadRowError(f"image not found: {source}")
    try:
        with Image.open(source) as img:
            getattr(img, how)()
            if how == "load" and img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
                return ImageOps.exif_transpose(img)
            # the context manager closes the file; loaded pixels stay in memory
            return img
    except Image.DecompressionBombError as exc:  # a sound file, too large to decode safely
        raise BadRowError(f"image too large {name}: {one_line(exc)} (PIL refuses to decode it; "
                          "resize it)") from exc
    # PIL plugins raise many types on corrupt input (OSError, SyntaxError, struct.error, IndexError,
    # ...); any of them means "this file is unusable".
    except Exception as exc:  # noqa: BLE001
        raise BadRowError(f"{failure} {name}: {one_line(exc)}") from exc
