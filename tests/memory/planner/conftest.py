"""Model shapes made up by hand for the planner's unit tests (no model is built): the language
model of tests/memory/test_planner.py's hand-built model, and a one-block vision tower."""

from __future__ import annotations

import pytest

from r1fit.memory.planner.facts import TextDims, VisionDims


@pytest.fixture
def text() -> TextDims:
    """Hidden 32, 4 heads of 8, 2 KV heads (kv_dim 16), 2 layers, vocab 100."""
    return TextDims(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8,
                    vocab=100)


@pytest.fixture
def vision() -> VisionDims:
    """Width 16, 2 heads of 8, Qwen's 1,176 pixel values per patch."""
    return VisionDims(hidden=16, intermediate=32, depth=1, heads=2, pixels_per_patch=1176,
                      merge=2, rms_norm=True, gated_mlp=True)
