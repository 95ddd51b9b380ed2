"""The README stays the front door: short, true to the code, and pointing into the manual."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/ (the front door is <= 300)"


def test_readme_links_resolve():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_readme_says_what_a_newcomer_needs():
    text = README.read_text()
    for fact in ('pip install -e ".[dev]" && pytest', "R1FIT_CACHE", ".arrow", "r1fit plan",
                 "r1fit doctor", "configs/qwen2.5-vl-3b-lora.yaml", "docs/training.md#defaults"):
        assert fact in text, f"README.md no longer says {fact!r}"
