"""What the benchmark scripts share: argument checks, and loading a script as a module (tests).

The scripts run standalone (``python benchmarks/<name>.py``), which puts this folder first on
``sys.path``, so they import this file as ``benchkit``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parent


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (for tests of its pure parts)."""
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
