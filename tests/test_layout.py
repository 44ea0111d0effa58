"""The house rules of DESIGN.md's layout, read from the sources with `ast` (nothing is imported): no import cycle
anywhere in jitllmd/, `TYPE_CHECKING` and function-local imports included, and the layers import only downwards."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jitllmd"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent)
        if rel.parts[1] == "gen":
            continue  # generated from proto/, never edited
        name = ".".join(rel.with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jitllmd modules `name` imports anywhere in its source: `from .x import y` counts as x.y where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_walk_sees_imports_of_every_kind():
    """The walk itself: relative, absolute, TYPE_CHECKING and function-local imports all count."""
    graph = _graph()
    assert "jitllmd.engine.loader" in graph["jitllmd.engine.engine"]  # from .loader import ...
    assert "jitllmd.engine.memory.placement" in graph["jitllmd.engine.memory.relocation"]  # from .placement import ...
    assert "jitllmd.engine.loader" in graph["jitllmd.engine.cluster.worker"]  # inside a function
    assert "jitllmd.engine.memory.placement" in graph["jitllmd.engine.runner"]  # from .memory.placement import ...
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_jitllmd():
    assert _cycle(_graph()) is None


def test_layers_import_downwards_only():
    """engine/ never imports serve/, commands/ or client.py; serve/ and client.py never import each other or
    commands/; a per-model engine knows nothing of relocation or the cluster's other models (Catalog wires them)."""
    graph = _graph()
    bad = []
    for name, deps in graph.items():
        for dep in deps:
            if name.startswith("jitllmd.engine.") and dep.startswith(("jitllmd.serve", "jitllmd.commands", "jitllmd.client")):
                bad.append((name, dep))
            if name.startswith("jitllmd.serve") and dep.startswith(("jitllmd.commands", "jitllmd.client")):
                bad.append((name, dep))
            if name == "jitllmd.client" and dep.startswith(("jitllmd.serve", "jitllmd.commands")):
                bad.append((name, dep))
    per_model = ("jitllmd.engine.engine", "jitllmd.engine.loader", "jitllmd.engine.memory.jobs", "jitllmd.engine.runner")
    bad += [(name, "jitllmd.engine.memory.relocation") for name in per_model if "jitllmd.engine.memory.relocation" in graph[name]]
    bad += [(name, "jitllmd.engine.catalog") for name in graph if "jitllmd.engine.catalog" in graph[name] and name.startswith("jitllmd.engine.")]
    assert bad == []
