"""Layers import downwards only: every ``r1fit`` import, at module level or inside a function, goes
to the importing module's own layer or a lower one.

This list is the one place the layer order is written (docs/architecture.md's Layers section points here).
A module belongs to the layer of the one prefix that names it: a package is in one layer, never split
over two. And no import circle, between files or between packages (two sibling folders, or a folder
and a file beside it, that import each other, directly or around a loop), even within a layer: a
module that needs another's code and is needed by it is one module, or the shared part moves down.

Every import counts: at module level, inside a function (a function-level import that dodges a
circle at import time is still a dependency both ways), and under ``if TYPE_CHECKING:`` (an
annotation that names a module's class still ties the two; type against a ``Protocol`` declared
below instead).
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


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the r1fit modules it imports (every import: module level, in a function, under
    ``if TYPE_CHECKING:``)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        here = module_name(path, package)
        graph[here] = {target for _, target in imports_of(path, package) if target != here}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (each group sorted; groups in order of their
    first node)."""
    found: list[list[str]] = []
    for start in sorted(graph):
        reach = _reachable(graph, start)
        if start in reach and not any(start in c for c in found):
            found.append(sorted(m for m in reach if start in _reachable(graph, m)))
    return found


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop."""
    return cycles(import_graph(package))


def _child(module: str, parent: str) -> str | None:
    """The child of package ``parent`` (a subpackage or a module in it) that holds ``module``;
    None when ``module`` is outside ``parent`` or is ``parent`` itself (its ``__init__``)."""
    if not module.startswith(parent + "."):
        return None
    return f"{parent}.{module[len(parent) + 1:].split('.')[0]}"


def package_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Circles between the children of one package: for each package (``r1fit``, ``r1fit.memory``,
    ...), its subpackages and modules as nodes, an edge where any module under one imports any
    module under another. A package's ``__init__`` importing its own children is no edge."""
    graph = import_graph(package)
    packages = sorted(".".join(folder.relative_to(package.parent).parts)
                      for folder in [package, *package.rglob("*")] if folder.is_dir())
    found: list[list[str]] = []
    for parent in packages:
        children: dict[str, set[str]] = {}
        for module, targets in graph.items():
            source = _child(module, parent)
            if source is None:
                continue
            children.setdefault(source, set()).update(
                target for target in map(lambda t: _child(t, parent), targets)
                if target is not None and target != source)
        found += [c for c in cycles(children) if len(c) > 1]
    return found


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


def test_no_circle_between_packages():
    assert package_cycles() == []


def test_a_cycle_through_a_function_or_an_annotation_is_caught(tmp_path):
    package = tmp_path / "r1fit"
    (package / "models").mkdir(parents=True)
    (package / "models" / "prefix.py").write_text(
        "def check():\n    from r1fit.models.logprobs import run\n")
    (package / "models" / "logprobs.py").write_text("from r1fit.models.prefix import Packed\n")
    (package / "models" / "load.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from r1fit.models.weights import x\n")
    (package / "models" / "weights.py").write_text("from r1fit.models.load import unwrap\n")
    (package / "models" / "packing.py").write_text("from r1fit.models.prefix import Packed\n")
    assert import_cycles(package) == [["r1fit.models.load", "r1fit.models.weights"],
                                      ["r1fit.models.logprobs", "r1fit.models.prefix"]]


def test_a_circle_between_packages_is_caught(tmp_path):
    """data.demonstrations -> tools.registry -> data.images: no two modules import each other,
    but the packages do; a subpackage and a module beside it too (memory.planner.facts ->
    memory.guard -> memory.planner.estimate); an ``__init__`` importing its children is none."""
    package = tmp_path / "r1fit"
    for folder in ("data", "tools", "memory/planner"):
        (package / folder).mkdir(parents=True)
    files = {"data/__init__.py": "from r1fit.data.images import fit\n",
             "data/images.py": "", "data/demonstrations.py": "from r1fit.tools.registry import Runner\n",
             "tools/registry.py": "from r1fit.data.images import fit\n",
             "memory/planner/facts.py": "from r1fit.memory.guard import Guard\n",
             "memory/planner/estimate.py": "", "memory/guard.py":
             "def plan():\n    from r1fit.memory.planner.estimate import estimate\n",
             "memory/probe.py": "from r1fit.memory.guard import Guard\n"}
    for name, text in files.items():
        (package / name).write_text(text)
    assert import_cycles(package) == []
    assert package_cycles(package) == [["r1fit.data", "r1fit.tools"],
                                       ["r1fit.memory.guard", "r1fit.memory.planner"]]
    (package / "data" / "demonstrations.py").unlink()
    (package / "memory" / "guard.py").write_text("")
    assert package_cycles(package) == []
