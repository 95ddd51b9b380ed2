"""Fixtures for the whole suite: `builtin:tiny` built once per session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def realvocab_cache(tiny_cache: Path) -> Path:
    """The session cache with builtin:small-realvocab (Qwen's 151,936-token vocabulary) built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        ensure_builtin("small-realvocab")
    return tiny_cache
