"""Model-test fixtures (the built-in model fixtures live in tests/conftest.py); ``model_dirs`` and
``setup`` serve the shared-prefix and packing tests (test_prefix.py, test_packing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from r1fit.models.builtin import ensure_builtin


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


@pytest.fixture(scope="module")
def model_dirs(tiny_cache: Path) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        return {name: ensure_builtin(name) for name in ("tiny", "tiny-qwen3vl", "tiny-qwen2vl",
                                                        "tiny-gemma3")}


@pytest.fixture
def setup(float64_model, completions_for):
    """``make(folder, ...) -> (model, pad id, 2 prompts of different lengths, 2 groups of 3
    random completions)``, in float64."""

    def make(folder: Path, *, lora_r: int, checkpointing: bool, max_pixels: int):
        model, processor, prompts = float64_model(folder, lora_r=lora_r,
                                                  checkpointing=checkpointing,
                                                  max_pixels=max_pixels, indices=(0, 2))
        assert prompts[0].length != prompts[1].length
        lengths = [2 + (3 * i + g) % 6 for g in range(2) for i in range(3)]
        flat = completions_for(len(processor.tokenizer), lengths)
        return model.train(), processor.tokenizer.pad_token_id, prompts, [flat[:3], flat[3:]]

    return make
