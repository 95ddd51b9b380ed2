"""Model-test fixtures (the built-in model fixtures live in tests/conftest.py)."""

from __future__ import annotations

import pytest
from PIL import Image


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
