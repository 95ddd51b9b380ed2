"""Every example config loads, and opens with the command that runs it (STYLE.md)."""

from pathlib import Path

import pytest

from r1fit.config import load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_example_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid_and_says_how_to_run_it(path):
    cfg = load_config(path)
    assert cfg.model.path
    first = path.read_text().splitlines()[0]
    assert first.startswith("# r1fit ") and path.name in first
