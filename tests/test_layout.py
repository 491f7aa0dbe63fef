"""The package's modules import each other without a circle (lazy imports included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_ram"


def _imports() -> dict:
    graph = {}
    for path in PACKAGE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mergekit_ram"):
                if node.module == "mergekit_ram":
                    deps.update(alias.name for alias in node.names)
                else:
                    deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("mergekit_ram."))
        graph[path.stem] = deps - {path.stem}
    return graph


def test_no_import_cycles():
    graph = _imports()
    assert {"hook", "checks", "prepass", "method", "startup"} <= graph.keys()

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = sorted(name for name in graph if name in reachable(name))
    assert not cycles, f"modules on an import circle: {cycles} ({graph})"


def test_only_the_hook_patches_mergekit():
    """setattr on mergekit's classes or modules happens in hook.py alone."""
    for path in PACKAGE.glob("*.py"):
        if path.stem == "hook":
            continue
        text = path.read_text(encoding="utf-8")
        assert "MergePlanner, " not in text and "generate_card =" not in text, path.name
