"""The benchmarks' code as rules, on the AST (as tests/test_layout.py reads the package): a benchmark uses another's
code through an import by name (what they share lives in benchmarks/staging.py and benchmarks/paired.py), never
loads a file under a name of its own choosing, never changes another module's globals, and never calls another
class's method with its own `self`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MODULES = {str(p.relative_to(BENCH)): ast.parse(p.read_text(), str(p)) for p in sorted(BENCH.rglob("*.py"))}
#: the ways to run a file as a module under a name the caller invents (two copies of one module, each with its globals)
BY_PATH = {"spec_from_file_location", "module_from_spec", "exec_module", "SourceFileLoader", "run_path", "load_source"}
#: methods that change a dict, list or set in place
MUTATORS = {"update", "append", "extend", "insert", "setdefault", "pop", "popitem", "clear", "remove", "discard", "add"}
#: the benchmarks' own modules, as their scripts import them (each folder first on sys.path, then benchmarks/)
OURS = {p.stem for p in BENCH.rglob("*.py")}


def _loads_by_path(tree: ast.Module) -> list[str]:
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return sorted(names & BY_PATH)


def _foreign(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to another benchmark module: its imports anywhere, and module-level names assigned a call's
    result, which may be a module; names imported from one with `from`)."""
    modules, attributes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name in OURS}
        elif isinstance(node, ast.ImportFrom) and node.module in OURS:
            attributes |= {a.asname or a.name for a in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            modules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return modules, attributes


def _writes_to_other_modules(tree: ast.Module) -> list[str]:
    """`mod.x = ...`, `mod.x[k] = ...`, `mod.x.update(...)`, and `x[k] = ...`, `x.update(...)` on a name imported
    with `from` (rebinding such a name, `x = ...`, is the module's own business)."""
    modules, attributes = _foreign(tree)

    def owner(expr: ast.expr, mutated: bool) -> str | None:
        if isinstance(expr, ast.Subscript):
            expr, mutated = expr.value, True
        if isinstance(expr, ast.Name) and expr.id in attributes and mutated:
            return expr.id
        if isinstance(expr, ast.Attribute):
            root = expr
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in modules or root.id in attributes):
                return ast.unparse(expr)
        return None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        mutated = False
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets, mutated = [node.func.value], True
        while targets:
            target = targets.pop(0)
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
                continue
            name = owner(target, mutated)
            if name is not None:
                found.append(f"{name} (line {node.lineno})")
    return found


def _borrowed_self(tree: ast.Module) -> list[str]:
    """`Other.method(self, ...)` in a class that does not derive from `Other`: a method run on an object it was not
    written for."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = {ast.unparse(b) for b in cls.bases}
        for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
            if not (call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "self"):
                continue
            if isinstance(call.func, ast.Attribute):
                owner = ast.unparse(call.func.value)
                if owner != "self" and not owner.startswith("super(") and owner not in bases:
                    found.append(f"{ast.unparse(call.func)}(self, ...) (line {call.lineno})")
    return found


def test_benchmarks_import_each_other_by_name():
    """A module loaded from its file under an invented name is a second copy of it, with globals of its own."""
    offenders = {name: _loads_by_path(tree) for name, tree in MODULES.items() if _loads_by_path(tree)}
    assert not offenders, offenders


def test_no_benchmark_changes_another_modules_globals():
    offenders = {name: _writes_to_other_modules(tree) for name, tree in MODULES.items()}
    assert not {k: v for k, v in offenders.items() if v}


def test_no_benchmark_lends_its_self_to_another_class():
    offenders = {name: _borrowed_self(tree) for name, tree in MODULES.items()}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_rules_see_what_they_forbid():
    tree = ast.parse(
        "import importlib.util\nimport run as R\nimport sys\nfrom staging import MERGES\nQ = load('run')\n"
        "spec = importlib.util.spec_from_file_location('q', 'q.py')\n"
        "R.VERSIONS = {}\nQ.VERSIONS.update({})\nMERGES['x'] = 1\nR.CONFIGS['a'].append(1)\nsys.path[:0] = ['.']\n"
        "local = {}\nlocal.update(a=1)\nMERGES = {}\nimport os\nos.environ['X'] = '1'\n"
        "class P(R.Base):\n    def f(self):\n        Q.Pipeline.merge_config(self, 1)\n"
        "        R.Base.f(self)\n        super().f()\n        self.g(self)\n"
    )
    assert _loads_by_path(tree) == ["spec_from_file_location"]
    assert set(_writes_to_other_modules(tree)) == {
        "R.VERSIONS (line 7)",
        "Q.VERSIONS (line 8)",
        "MERGES (line 9)",
        "R.CONFIGS (line 10)",
    }
    assert _borrowed_self(tree) == ["Q.Pipeline.merge_config(self, ...) (line 19)"]
