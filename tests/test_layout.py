"""The package's architecture as rules: one seam to mergekit, no import circle, no hidden reach.

- only `mergekit_ram/_mergekit/` imports mergekit's private modules, patches mergekit's
  objects (`setattr`, `__wrapped__`) or looks modules up in `sys.modules`;
- every mergekit name the package imports is listed in `surface.NAMES`, so the one guard
  checks every name used; mergekit's private planner attributes are touched in `surface` only;
- below the seam no module imports the seam (only the entry points `__init__` and `cli` do);
- no import circle, lazy imports included.
"""

import ast
from pathlib import Path

from mergekit_ram._mergekit import surface

PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_ram"
PRIVATE = (
    "mergekit.plan",
    "mergekit.io",
    "mergekit.merge",
    "mergekit.graph",
    "mergekit.architecture.conversion",
    "mergekit.multigpu_executor",
    "mergekit.merge_methods.task_adapter",
)
ENTRY_POINTS = {"mergekit_ram", "mergekit_ram.cli"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


MODULES = _modules()


def _in_seam(name: str) -> bool:
    return name.startswith("mergekit_ram._mergekit")


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, [names]) for every import, lazy ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _ours(module: str, names: list[str]) -> set[str]:
    """The package modules an import statement reaches."""
    if module == "mergekit_ram":
        return {f"mergekit_ram.{n}" for n in names if f"mergekit_ram.{n}" in MODULES} or {"mergekit_ram"}
    if not module.startswith("mergekit_ram"):
        return set()
    subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
    return subs | {module}


def test_layout_is_what_the_rules_read():
    assert {"mergekit_ram._mergekit.surface", "mergekit_ram._mergekit.hooks", "mergekit_ram.kernel"} <= MODULES.keys()


def test_no_import_cycles():
    graph = {
        name: {m for module, names in _imports(tree) for m in _ours(module, names)} - {name}
        for name, tree in MODULES.items()
    }

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    # a package's __init__ is imported before its submodules: that arrow is no circle
    cycles = sorted(n for n in graph if n in reachable(n) - {"mergekit_ram", "mergekit_ram._mergekit"})
    assert not cycles, f"modules on an import circle: {cycles}"


def test_only_the_seam_imports_mergekits_private_modules():
    offenders = [
        (name, module)
        for name, tree in MODULES.items()
        if not _in_seam(name)
        for module, _ in _imports(tree)
        if any(module == p or module.startswith(p + ".") for p in PRIVATE)
    ]
    assert not offenders, offenders


def test_every_mergekit_name_used_is_guarded():
    listed = {(n.module, n.attribute.split(".")[0]) for n in surface.NAMES}
    unguarded = [
        (name, f"{module}.{imported}")
        for name, tree in MODULES.items()
        for module, names in _imports(tree)
        if module == "mergekit" or module.startswith("mergekit.")
        for imported in names
        if (module, imported) not in listed
    ]
    assert not unguarded, f"mergekit names not in surface.NAMES: {unguarded}"


def test_only_the_seam_patches_or_reaches_around():
    for name, tree in MODULES.items():
        if _in_seam(name):
            continue
        calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        sys_modules = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "modules" and getattr(n.value, "id", None) == "sys"
        ]
        assert "setattr" not in calls, name
        assert not sys_modules, name
        assert not {"__wrapped__", "_tensors"} & attributes, name


def test_private_planner_attributes_only_in_surface():
    for name, tree in MODULES.items():
        if name == "mergekit_ram._mergekit.surface":
            continue
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "_tensors" not in attributes, name


def test_below_the_seam_never_imports_it():
    for name, tree in MODULES.items():
        if _in_seam(name) or name in ENTRY_POINTS:
            continue
        reached = {m for module, names in _imports(tree) for m in _ours(module, names)}
        assert not {m for m in reached if _in_seam(m)}, f"{name} imports the seam"


def test_no_module_global_holds_merge_state():
    """Per-merge state lives in `session.MergeSession`: no module rebinds a global at run time."""
    for name, tree in MODULES.items():
        rebinds = [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
        allowed = {  # process-wide, set once: an install verdict, the compiled kernel and its thread pool
            "mergekit_ram._mergekit.loading": {"_status"},
            "mergekit_ram.native": {"_lib", "_pool", "_failed"},
        }
        names = {g for n in rebinds for g in n.names}
        assert names <= allowed.get(name, set()), f"{name} rebinds globals {names}"
