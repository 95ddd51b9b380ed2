"""benchmarks/plan_accuracy.py's failures: a bad configuration and a failed ``r1fit train`` are one
line and exit status 2 (no training runs)."""

from __future__ import annotations

import pytest
from benchkit import BenchmarkError, load_script

pa = load_script("plan_accuracy")


def test_a_bad_configuration_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(pa, "GRID", {"bad-key": ["algo.no_such_key=1"]})
    assert pa.main(["--only", "bad-key"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan_accuracy: error: unknown key 'algo.no_such_key'")
    assert err.count("\n") == 1


def test_a_failed_run_names_the_configuration_and_r1fits_own_line():
    """The child is ``python -m r1fit train`` (8 s: it imports r1fit); its ``r1fit: error:`` line
    comes back, not a traceback."""
    with pytest.raises(BenchmarkError) as info:
        pa.measure("bad-key", ["algo.no_such_key=1"])
    assert str(info.value).startswith("bad-key: r1fit train: unknown key 'algo.no_such_key'; "
                                      "allowed here: num_generations")
    assert "\n" not in str(info.value)


def test_the_grid_covers_every_built_in_architecture():
    """Each family of r1fit/models/builtin.py FAMILIES has a built-in in the grid, so a new
    architecture's plan is checked against the probe too."""
    from r1fit.models.builtin import BUILTINS, FAMILIES

    planned = {override.split(":", 1)[1] for overrides in pa.GRID.values() for override in overrides
               if override.startswith("model.path=builtin:")}
    assert {BUILTINS[name].family for name in planned} == set(FAMILIES)
