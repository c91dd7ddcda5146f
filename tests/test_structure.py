"""Package structure: no import cycle between rlhf subpackages, layers point one way."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rlhf"

# Lower layers never import higher ones (data and algorithms <- models <- workers <- trainer).
LAYERS = {
    "rlhf.data": 0,
    "rlhf.algorithms": 0,
    "rlhf.envvars": 0,
    "rlhf.config": 1,
    "rlhf.models": 2,
    "rlhf.workers": 3,
    "rlhf.rewards": 3,
    "rlhf.envs": 3,
    "rlhf.trainer": 4,
}


def _unit(module: str) -> str:
    """``rlhf.x.y`` -> ``rlhf.x`` (a subpackage or a top-level module)."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> files that import it (every import, also inside functions)."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PKG.rglob("*.py"):
        src = _unit(_module_name(path))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.startswith("rlhf.") and _unit(name) != src:
                    graph[src][_unit(name)].add(str(path.relative_to(PKG.parent)))
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in graph.get(u, {}):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        stack.pop()
        state[u] = 2
        return None

    for u in list(graph):
        if u not in state and (cycle := visit(u)):
            return cycle
    return None


def test_find_cycle_detects_a_cycle():
    # The checker itself must be able to fail.
    graph = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": {"x"}}, "b": {}}) is None


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle: "
        + " -> ".join(cycle)
        + "; edges: "
        + "; ".join(f"{a} -> {b} in {sorted(graph[a][b])}" for a, b in zip(cycle, cycle[1:], strict=False))
    )


def test_layers_point_one_way():
    bad = [
        f"{src} imports {dst} ({', '.join(sorted(files))})"
        for src, deps in import_graph().items()
        for dst, files in deps.items()
        if src in LAYERS and dst in LAYERS and LAYERS[dst] > LAYERS[src]
    ]
    assert not bad, "a lower layer imports a higher one: " + "; ".join(bad)
