"""Shared fixtures: build `builtin:tiny` once per test session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from r1fit.models.builtin import ensure_builtin


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root (for R1FIT_CACHE) holding a freshly built builtin:tiny."""
    root = tmp_path_factory.mktemp("r1fit_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(root))
        ensure_builtin("tiny")
    return root


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    """The built tiny model folder."""
    folder = next((tiny_cache / "models").glob("tiny-v*"))
    assert (folder / "config.json").is_file()
    return folder


@pytest.fixture
def use_tiny_cache(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point R1FIT_CACHE at the session cache for one test, so `builtin:tiny` needs no rebuild."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    return tiny_cache


@pytest.fixture
def image56() -> Image.Image:
    """A 56x56 RGB test image with some structure (not constant)."""
    img = Image.new("RGB", (56, 56), (255, 0, 0))
    for x in range(28):
        for y in range(28):
            img.putpixel((x, y), (0, 0, 255))
    return img


def image_prompt(processor, text: str = "How many circles are there?") -> str:
    """Render one user turn holding an image and `text`, with the assistant generation prompt."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
