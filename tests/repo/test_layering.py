"""The import graph between ladder's packages follows the layers: no upward edge, no cycle.

Every import counts, the lazy ones inside functions too (ARCHITECTURE.md): the source is parsed, not
imported, so an import that only runs on a GPU machine is seen as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "model", "parallel", "engine", "compile", "server", "loadtest", "doctor", "deploy", "ladder")
# What each package may import besides itself.
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    # Layer 2 shards the model from outside it; the engine drives a sharded model as any other.
    "parallel": {"model", "kernels"},
    "engine": {"model", "kernels", "parallel"},
    "compile": {"model", "kernels", "engine"},
    "server": {"engine", "model"},
    "loadtest": set(),  # HTTP only: it measures any OpenAI-compatible server
    # Layer 5 measures the layers below it: steps and loads through the engine, a server through loadtest's
    # client; never the server's code (it reads a server over HTTP) nor the compile pipeline's.
    "doctor": {"kernels", "model", "engine", "loadtest"},
    # Ray Serve replicas each run the server's app over their own engine; the ingress reuses the server's
    # error shapes. Nothing below imports deploy: it sits beside the command line, on top of the server.
    "deploy": {"server", "engine", "model"},
    "ladder": {"kernels", "model", "parallel", "engine", "compile", "server", "loadtest", "doctor", "deploy"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & set(PACKAGES)
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files (relative to the root) that import it."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imported_packages(path) - {package}:
                graph[package].setdefault(target, []).append(str(path.relative_to(ROOT)))
    return graph


def test_every_import_between_packages_follows_the_layers():
    graph = package_graph()
    against = {f"{package} -> {target}: {files}" for package, targets in graph.items()
               for target, files in targets.items() if target not in ALLOWED[package]}
    assert not against


def test_the_allowed_edges_have_no_cycle():
    # Depth-first search over ALLOWED: the rule itself must be a layering.
    state: dict[str, str] = {}

    def visit(package: str) -> None:
        assert state.get(package) != "open", f"cycle through {package}"
        if state.get(package) == "done":
            return
        state[package] = "open"
        for target in ALLOWED[package]:
            visit(target)
        state[package] = "done"

    for package in PACKAGES:
        visit(package)
