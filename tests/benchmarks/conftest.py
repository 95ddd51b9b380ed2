"""The benchmark scripts import ``benchkit`` from their own folder (they run as
``python benchmarks/<name>.py``); the tests import it, and load the scripts, the same way."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
