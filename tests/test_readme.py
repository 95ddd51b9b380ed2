"""The README stays true to the code it documents."""

from __future__ import annotations

from pathlib import Path

from r1fit.config import config_reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_current():
    assert config_reference_markdown() in README.read_text(), \
        "README's config reference is stale: paste the output of `r1fit config --reference`"
