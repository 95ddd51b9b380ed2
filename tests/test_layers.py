"""Layers import downwards only: every ``r1fit`` import, at module level or inside a function, goes
to the importing module's own layer or a lower one.

This list is the one place the layer order is written (docs/architecture.md's Layers section points here).
A module belongs to the layer of the one prefix that names it: a package is in one layer, never split
over two. And no import cycle, even within a layer or through a function-level import: a module that
needs another's code and is needed by it is one module, or the shared part moves down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAYERS: list[tuple[str, ...]] = [
    ("r1fit.errors", "r1fit.units", "r1fit.rng", "r1fit.plugins"),  # leaves: no r1fit imports
    ("r1fit.config",),
    ("r1fit.processes",),  # processes and collectives (no-ops in one process)
    ("r1fit.progress",),  # progress bars (rank 0's)
    ("r1fit.algorithms", "r1fit.data", "r1fit.rewards"),  # maths, data, rewards
    ("r1fit.tools",),  # tools: their calls, runner, tool turns, SFT demonstrations
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
    found = [index for index, prefixes in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    if not found:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py; add it")
    assert len(found) == 1, f"{module} is named by several layers: {found}"
    return found[0]


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
        "r1fit/memory/planner.py:5: r1fit.memory.planner (layer 10) imports r1fit.train.run "
        "(layer 11)"]


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


def test_a_package_is_in_one_layer():
    prefixes = [p for layer in LAYERS for p in layer]
    assert [(p, q) for p in prefixes for q in prefixes if q.startswith(p + ".")] == []
    assert layer_of("r1fit.processes") < layer_of("r1fit.models.load") \
        < layer_of("r1fit.distributed.parallelize")


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (function-level
    imports included; imports under ``if TYPE_CHECKING:`` are annotations only, left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if _type_checking(node):
                node.body = []  # type: ignore[attr-defined]
        here = module_name(path, package)
        runtime = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)}
        graph[here] = {t for line, t in imports_of(path, package) if line in runtime and t != here}
    cycles: list[list[str]] = []
    for start in sorted(graph):
        reach = _reachable(graph, start)
        if start in reach and not any(start in c for c in cycles):
            cycles.append(sorted(m for m in reach if start in _reachable(graph, m)))
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    reach, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reach:
                reach.add(target)
                todo.append(target)
    return reach


def test_no_import_cycles():
    assert import_cycles() == []


def test_a_cycle_through_a_function_is_caught(tmp_path):
    package = tmp_path / "r1fit"
    (package / "models").mkdir(parents=True)
    (package / "models" / "prefix.py").write_text(
        "def check():\n    from r1fit.models.logprobs import run\n")
    (package / "models" / "logprobs.py").write_text("from r1fit.models.prefix import Packed\n")
    (package / "models" / "load.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from r1fit.models.logprobs import x\n")
    assert import_cycles(package) == [["r1fit.models.logprobs", "r1fit.models.prefix"]]
