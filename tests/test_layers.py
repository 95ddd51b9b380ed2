"""Layers import downwards only: every ``r1fit`` import, at module level or inside a function, goes
to the importing module's own layer or a lower one.

This list is the one place the layer order is written (docs/architecture.md's Layers section points here).
A module belongs to the layer of the longest prefix that names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAYERS: list[tuple[str, ...]] = [
    ("r1fit.errors", "r1fit.units", "r1fit.rng"),  # leaves: no r1fit imports
    ("r1fit.config",),
    ("r1fit.distributed.context",),  # processes and collectives (no-ops in one process)
    ("r1fit.progress",),  # progress bars (rank 0's)
    ("r1fit.algorithms", "r1fit.data", "r1fit.rewards"),  # pure maths, data, rewards
    ("r1fit.models",),  # loading, LoRA, log-probs of a batch
    ("r1fit.rollout",),  # generation and the rollout record
    ("r1fit.distributed",),  # parallelize (FSDP2), loading on ranks
    ("r1fit.report",),  # logs, metrics, summary, printing
    ("r1fit.memory", "r1fit.checkpoint"),  # planner, guard, telemetry; checkpoints
    ("r1fit.train",),  # the run and its loops
    ("r1fit.doctor",),  # r1fit doctor: the machine's facts, a self-check that runs GRPO
    ("r1fit.cli", "r1fit.__main__"),
]

PACKAGE = Path(__file__).resolve().parent.parent / "r1fit"


def layer_of(module: str) -> int:
    if module == "r1fit":  # the package's own __init__ (its version)
        return 0
    best, length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py; add it")
    return best


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every r1fit import in the file, function-level ones included; ``from
    r1fit.x import y`` counts as ``r1fit.x.y`` when ``y`` is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("r1fit")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("r1fit"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                where = package.parent / Path(*sub.split("."))
                is_module = where.with_suffix(".py").is_file() or where.is_dir()
                found.append((node.lineno, sub if is_module else node.module))
    return found


def upward_edges(package: Path = PACKAGE) -> list[str]:
    edges = []
    for path in sorted(package.rglob("*.py")):
        here = module_name(path, package)
        for line, target in imports_of(path, package):
            if layer_of(target) > layer_of(here):
                edges.append(f"{path.relative_to(package.parent)}:{line}: {here} (layer "
                             f"{layer_of(here)}) imports {target} (layer {layer_of(target)})")
    return edges


def test_no_module_imports_a_higher_layer():
    assert upward_edges() == []


def test_an_upward_edge_inside_a_function_is_caught(tmp_path):
    package = tmp_path / "r1fit"
    (package / "memory").mkdir(parents=True)
    (package / "train").mkdir()
    (package / "memory" / "planner.py").write_text(
        "import os\n\n\ndef build():\n    from r1fit.train.run import start_run\n")
    (package / "train" / "run.py").write_text("from r1fit.memory import planner\n")
    assert upward_edges(package) == [
        "r1fit/memory/planner.py:5: r1fit.memory.planner (layer 9) imports r1fit.train.run "
        "(layer 10)"]


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from r1fit.train.run import Run\n", [(2, "r1fit.train.run")]),
    ("import r1fit.cli\n", [(1, "r1fit.cli")]),
    ("from r1fit.data import batch\n", [(1, "r1fit.data.batch")]),
    ("from r1fit.data.batch import collate\n", [(1, "r1fit.data.batch")]),
    ("from . import x\nimport os\n", []),
])
def test_imports_are_found_inside_functions_too(tmp_path, source, expected):
    file = tmp_path / "m.py"
    file.write_text(source)
    assert imports_of(file) == expected


def test_the_longest_prefix_decides():
    assert layer_of("r1fit.distributed.context") < layer_of("r1fit.models.load") \
        < layer_of("r1fit.distributed.parallelize")
