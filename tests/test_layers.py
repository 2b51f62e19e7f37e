"""The house's shape, checked from the code's own imports: floors in one direction, no circles.

Every ``import`` of a ``stablewatch`` module is read (those under ``TYPE_CHECKING`` and inside
functions too) from the folders that pyproject.toml maps onto the package. The floors, from the
ground up: the package's root (its version) and the wire contract, the agents, the detector, the
pipeline, the CLI on top; the examples stand apart (the agents are all they use, and only the CLI
uses them), and so does the test harness, ``stablewatch.testing`` (it runs agents and detectors,
and only the tests and the benches use it).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent

#: What each room may import from the package (its own modules included).
MAY_IMPORT: dict[str, set[str]] = {
    "stablewatch": {"stablewatch"},
    "stablewatch.v1": {"stablewatch", "stablewatch.v1"},
    "stablewatch.agents": {"stablewatch", "stablewatch.v1", "stablewatch.agents"},
    "stablewatch.detector": {"stablewatch", "stablewatch.v1", "stablewatch.agents", "stablewatch.detector"},
    "stablewatch.pipeline": {
        "stablewatch",
        "stablewatch.v1",
        "stablewatch.agents",
        "stablewatch.detector",
        "stablewatch.pipeline",
    },
    "stablewatch.examples": {"stablewatch", "stablewatch.v1", "stablewatch.agents", "stablewatch.examples"},
    # The test harness beside the floors: it runs the agents and the detector; only tests and benches use it.
    "stablewatch.testing": {
        "stablewatch",
        "stablewatch.v1",
        "stablewatch.agents",
        "stablewatch.detector",
        "stablewatch.testing",
    },
}


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name, from pyproject.toml's package-dir mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules.setdefault(".".join([package, *parts]), path)
    return modules


def _import_graph() -> nx.DiGraph:
    """Module -> module for every import between the package's own modules."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from package import module`` imports the module, not the package's __init__.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_module_imports_in_a_circle() -> None:
    cycles = sorted(nx.simple_cycles(_import_graph()), key=len)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join([*cycle, cycle[0]]) for cycle in cycles)


def test_imports_point_down_the_floors_only() -> None:
    graph = _import_graph()
    assert "stablewatch.cli" in {_room(module) for module in graph}, "the front door, stablewatch.cli, is missing"
    upward = [
        f"{source} -> {target}"
        for source, target in graph.edges
        if _room(source) != "stablewatch.cli" and _room(target) not in MAY_IMPORT.get(_room(source), set())
    ]
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))
