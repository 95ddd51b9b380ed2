"""The benchmark scripts import ``benchkit`` from their own folder (they run as
``python benchmarks/<name>.py``); the tests import it, and load the scripts, the same way. Also
``refused``: a script's refusal of bad arguments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture
def refused(capsys):
    """``refused(parse, argv)``: what argparse printed when ``parse(argv)`` refused the arguments
    (exit status 2, the usage and one error line)."""
    def refuse(parse, argv):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err
    return refuse
