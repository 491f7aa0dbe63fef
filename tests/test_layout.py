"""The package's architecture as rules: one seam to mergekit, no import circle, no hidden reach.

- only `mergekit_ram/_mergekit/` imports mergekit's private modules, patches mergekit's
  objects (`setattr`, `__wrapped__`) or looks modules up in `sys.modules`;
- every mergekit name the package imports is listed in `surface.NAMES`, so the one guard
  checks every name used; mergekit's private planner attributes are touched in `surface` only;
- below the seam no module imports the seam (only the entry points do: `__init__` and the
  `cli/` folder);
- no import circle, lazy imports included, and no chain of imports longer than `FLOORS` modules;
- no module assigns an attribute of a module (or anything else) it imports: a process-wide verdict
  is written by the module that owns it;
- our wrappers' marks and what they wrap (`__wrapped__`) are touched in `surface` only;
- each folder's `__init__.py` says what lives there, naming every module of the folder;
- the formatter is never switched off (`# fmt: skip`, `# fmt: off`), and no module holds more than
  `STATEMENTS` statements (`example_models.py`, the synthetic models' data, aside).

Why statements, not lines. The caps were once 300 lines in the seam and 400 elsewhere, and modules met them by
squeezing: the formatter switched off to pack arguments into fewer lines, help text and comments cut. A line
count rewards exactly that, and says nothing about a module holding two concerns. A statement count (every
`ast.stmt`: an import, an assignment, a `def`, each line of a body) is the same however the code is laid out,
and help text, docstrings and comments cost nothing, so it can only be met by moving code. No size finds two
concerns by itself; the cap is a smell detector, set well above the largest module (which held 222 statements
when the cap was set), so that a module that reaches it is read again for a second job to split off. The formatter rule makes
layout the formatter's alone, so that no rule here is met by hand-packing lines.
"""

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

from mergekit_ram._mergekit import surface

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_ram"
PRIVATE = (
    "mergekit.plan",
    "mergekit.io",
    "mergekit.merge",
    "mergekit.graph",
    "mergekit.architecture.conversion",
    "mergekit.multigpu_executor",
    "mergekit.merge_methods.task_adapter",
    "mergekit.scripts",
)
#: the entry points: the package (its start-up hook) and the `mergekit-ram` command, a folder (`cli/`: its group
#: and one module per command); they alone, above the seam, may import it
ENTRY_POINTS = {"mergekit_ram", "mergekit_ram.cli"}
#: the most modules one chain of imports may pass through (lazy imports included): the longest runs from the
#: start-up hook through a door, the pipeline and the input checks down to `errors` and the one reader of the
#: environment's on/off words below it (`environment`, which took one floor when the four readers became one)
FLOORS = 10
#: the most statements (`ast.stmt`) a module may hold, whatever its layout; see the docstring for why
STATEMENTS = 300
LONG_ALLOWED = {"mergekit_ram.example_models"}
#: a comment that switches the formatter off for a line or a block (ruff honours all three): never in the package
FORMATTER_OFF = re.compile(r"#\s*(fmt:\s*(skip|off)|yapf:\s*disable)\b", re.I)


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


MODULES = _modules()
#: the package and its folders (each `__init__.py`, imported before the folder's modules anyway)
PACKAGES = {name.removesuffix(".__init__") for name in MODULES if (PACKAGE.parent / name.replace(".", "/")).is_dir()}
#: the package's groups from the top down: a module imports its own group's modules and those of groups below it,
#: never one above (the seam's own order inside `_mergekit/` is the floors rule's)
GROUPS = (
    ("the entry points", ("mergekit_ram", "mergekit_ram.cli")),
    ("the seam", ("mergekit_ram._mergekit",)),
    ("the method, the API and the example", ("mergekit_ram.method", "mergekit_ram.api", "mergekit_ram.example_models")),
    ("verify", ("mergekit_ram.verify",)),
    ("reporting", ("mergekit_ram.reporting",)),
    ("checks", ("mergekit_ram.checks",)),
    ("the session", ("mergekit_ram.session",)),
    ("core", ("mergekit_ram.core",)),
    ("the shared leaves", ("mergekit_ram.errors", "mergekit_ram.files", "mergekit_ram.environment")),
)
#: at most this many modules directly in `mergekit_ram/` (its `__init__` aside): the entry points and what every
#: folder shares
TOP_LEVEL = 12
#: verify's folder, and the modules outside it that may import it: the CLI, the doors (which read a record) and the
#: seam's verify mode; no merge code
VERIFY = "mergekit_ram.verify"
VERIFY_IMPORTERS = {
    "mergekit_ram.cli.verify",
    "mergekit_ram._mergekit.door_yaml",
    "mergekit_ram._mergekit.door_pytorch",
    "mergekit_ram._mergekit.recompute",
    "mergekit_ram._mergekit.comparing",
}
#: the seam's modules that import nothing from mergekit, each with why it is the seam's all the same
SEAM_WITHOUT_MERGEKIT = {
    "mergekit_ram._mergekit": "the seam's package: its docstring maps the modules",
    "mergekit_ram._mergekit.tokenizer_order": "mirrors mergekit's union tokenizer's numbering (`hooks` installs it)",
    "mergekit_ram._mergekit.methods": "mergekit's own methods as verify sees them (what each reads and draws), by name",
}


def _in_seam(name: str) -> bool:
    return name.startswith("mergekit_ram._mergekit")


def _is_entry_point(name: str) -> bool:
    """The package's `__init__`, or a module of the `cli/` folder."""
    return name == "mergekit_ram" or any(_in_folder(name, entry) for entry in ENTRY_POINTS - {"mergekit_ram"})


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
    assert {"mergekit_ram._mergekit.surface", "mergekit_ram._mergekit.hooks", "mergekit_ram.core.kernel"} <= MODULES.keys()


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
    cycles = sorted(n for n in graph if n in reachable(n) - PACKAGES)
    assert not cycles, f"modules on an import circle: {cycles}"


def _chains() -> dict[str, tuple[str, ...]]:
    """module -> the longest chain of imports that starts at it (every import, lazy and type-only ones
    included; a package's `__init__`, imported before its modules anyway, is no floor of its modules)."""
    graph = {
        name: {m for module, names in _imports(tree) for m in _ours(module, names)} - {name} - PACKAGES
        for name, tree in MODULES.items()
    }
    longest: dict[str, tuple[str, ...]] = {}

    def chain(name: str, path: tuple[str, ...]) -> tuple[str, ...]:
        if name not in longest:
            assert name not in path, f"import circle: {' -> '.join((*path, name))}"
            below = [chain(dep, (*path, name)) for dep in sorted(graph[name])]
            longest[name] = (name, *max(below, key=len, default=()))
        return longest[name]

    return {name: chain(name, ()) for name in graph}


def _floors(chain: tuple[str, ...]) -> int:
    """The floors a chain of imports passes: its modules, less a folder's `__init__` at its head that hands the work
    to a module of its own folder (the `cli/` group to its commands), which adds no floor, as a package's `__init__`
    below a module adds none (`_chains`)."""
    dispatches = chain[0] in PACKAGES and len(chain) > 1 and chain[1].rpartition(".")[0] == chain[0]
    return len(chain) - dispatches


def test_import_chains_have_at_most_FLOORS_modules():
    """The longest chain of imports, lazy ones included, passes through at most FLOORS modules."""
    worst = max(_chains().values(), key=_floors)
    shown = " -> ".join(m.removeprefix("mergekit_ram.") for m in worst)
    assert _floors(worst) <= FLOORS, f"{_floors(worst)} floors (at most {FLOORS}): {shown}"


def _touches_mergekit(tree: ast.Module) -> bool:
    return any(module == "mergekit" or module.startswith("mergekit.") for module, _ in _imports(tree))


def test_the_seam_holds_only_what_touches_mergekit():
    """A module of `_mergekit/` imports mergekit (lazy imports count), or says in `SEAM_WITHOUT_MERGEKIT` why it
    is the seam's: what judges or reads files on plain data lives below it, where someone upgrading mergekit need
    not read it."""
    found = {name for name, tree in MODULES.items() if _in_seam(name) and not _touches_mergekit(tree)}
    assert found == set(SEAM_WITHOUT_MERGEKIT), sorted(found ^ set(SEAM_WITHOUT_MERGEKIT))
    assert _touches_mergekit(ast.parse("def f():\n    from mergekit.io import tasks\n"))
    assert not _touches_mergekit(ast.parse("import mergekit_ram.files\n"))


def _statements(tree: ast.AST) -> int:
    """The statements of a module, nested ones included: the same however it is laid out or commented."""
    return sum(isinstance(node, ast.stmt) for node in ast.walk(tree))


def _too_big() -> list[str]:
    """'module: N statements (at most STATEMENTS)' for every module over the cap."""
    return [
        f"{name.removeprefix('mergekit_ram.')}: {count} statements (at most {STATEMENTS})"
        for name, tree in sorted(MODULES.items())
        if (count := _statements(tree)) > STATEMENTS and name not in LONG_ALLOWED
    ]


def test_no_module_is_over_the_size_cap():
    """A module holds at most STATEMENTS statements: one that reaches it is read again for a second job to split off
    (why statements, not lines: the module's docstring)."""
    offenders = _too_big()
    assert not offenders, "modules over the size cap: " + "; ".join(offenders)


def test_the_size_cap_counts_code_not_layout():
    packed = "def f(a, b):\n    return g(a, b, c=1, d=2)  # a comment\n"
    spread = """
        \"\"\"A docstring
        of three lines.\"\"\"


        def f(
            a,
            b,
        ):
            # a comment
            return g(
                a,
                b,
                c=1,
                d=2,
            )
    """
    assert _statements(ast.parse(packed)) == 2
    assert _statements(ast.parse(textwrap.dedent(spread))) == 3  # the docstring: one statement, whatever its length


def _formatter_switched_off(source: str) -> list[int]:
    """The lines of `source` whose comment switches the formatter off (a marker inside a string is no comment)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.start[0] for t in tokens if t.type == tokenize.COMMENT and FORMATTER_OFF.search(t.string)]


def test_the_formatter_is_never_switched_off():
    """`ruff format` lays out every module: a `# fmt: skip` or `# fmt: off` let a module pack lines to meet a cap."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _formatter_switched_off(path.read_text(encoding="utf-8"))
    ]
    assert not found, "the formatter switched off (remove the marker and run `ruff format`): " + ", ".join(found)


def test_the_formatter_rule_reads_comments():
    source = 'x = [1,  2]  # fmt: skip\ny = "# fmt: off"\n# fmt: off\nz = 3  # noqa: E501 # fmt:skip\n'
    assert _formatter_switched_off(source) == [1, 3, 4]


def test_the_floors_rule_reads_lazy_imports_and_starts_at_the_entry_points():
    tree = ast.parse("import json\ndef f():\n    from mergekit_ram import kernel\n")
    assert [(m, n) for m, n in _imports(tree)] == [("json", []), ("mergekit_ram", ["kernel"])]
    chains = _chains()
    assert chains["mergekit_ram"][:3] == ("mergekit_ram", "mergekit_ram._mergekit.finder", "mergekit_ram._mergekit.hooks")
    assert chains["mergekit_ram.cli"][:3] == (
        "mergekit_ram.cli",
        "mergekit_ram.cli.inspect",
        "mergekit_ram._mergekit.inspection",
    )
    # the group dispatches to its commands: its floors are its commands'; the package's start-up hook counts its own
    assert _floors(chains["mergekit_ram.cli"]) == len(chains["mergekit_ram.cli.inspect"])
    assert _floors(chains["mergekit_ram"]) == len(chains["mergekit_ram"])
    assert not any(set(chain[1:]) & PACKAGES for chain in chains.values())


def _imported_names(tree: ast.Module) -> set[str]:
    """The names an import statement binds in `tree` (modules, and objects taken from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _assigned_attributes_of_imports(tree: ast.Module) -> list[str]:
    imported = _imported_names(tree)
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets.extend(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
    found = []
    while targets:  # the names bound (`x.y = `, `a, x.y = `), not objects mutated (`x.y[0] = `)
        target = targets.pop(0)
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in imported:
            found.append(f"{target.value.id}.{target.attr} (line {target.lineno})")
    return found


def test_no_module_assigns_what_it_imports():
    """`mod.x = ...` rebinds another module's global behind its back: the owner writes its own state
    (a verdict through a function of its own, `setattr` patching through `surface.wrap`)."""
    for name, tree in MODULES.items():
        assert not _assigned_attributes_of_imports(tree), f"{name} assigns {_assigned_attributes_of_imports(tree)}"


def test_the_assignment_rule_sees_what_it_forbids():
    tree = ast.parse(
        "from mergekit_ram import method\nimport mergekit.plan as p\nimport sys\n"
        "method.x = 1\np.y += 1\nz, sys.w = 2, 3\nsys.path[:] = []\nz.q = 4\n"
    )
    assert _assigned_attributes_of_imports(tree) == ["method.x (line 4)", "p.y (line 5)", "sys.w (line 6)"]


def test_only_surface_marks_or_unwraps_wrappers():
    for name, tree in MODULES.items():
        if name == "mergekit_ram._mergekit.surface":
            continue
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert "__wrapped__" not in attributes, name
        assert not {s for s in strings if s.startswith("__mergekit_ram_") and s.endswith("__")} - {
            "__mergekit_ram_finder__"
        }, name


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
        if _in_seam(name) or _is_entry_point(name):
            continue
        reached = {m for module, names in _imports(tree) for m in _ours(module, names)}
        assert not {m for m in reached if _in_seam(m)}, f"{name} imports the seam"


def test_no_module_global_holds_merge_state():
    """Per-merge state lives in `session.MergeSession`: no module rebinds a global at run time."""
    for name, tree in MODULES.items():
        rebinds = [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
        allowed = {  # process-wide, set once: install verdicts, the compiled kernel and its thread pool
            "mergekit_ram._mergekit.loading": {"_status"},
            "mergekit_ram._mergekit.surface": {"_prepass_unavailable"},
            "mergekit_ram.method": {"_why_unavailable"},  # who to ask for the verdict above (the seam hands it)
            "mergekit_ram.core.native": {"_lib", "_pool", "_failed"},
        }
        names = {g for n in rebinds for g in n.names}
        assert names <= allowed.get(name, set()), f"{name} rebinds globals {names}"


#: the modules that build a `MergeSession`: each door chooses its sessions' flags in one place
DOORS = {"mergekit_ram._mergekit.door_yaml", "mergekit_ram._mergekit.door_pytorch"}


def _builds_sessions(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == "MergeSession" or getattr(node.func, "attr", None) == "MergeSession")
        for node in ast.walk(tree)
    )


def test_only_the_doors_build_a_merge_session():
    """A session's flags (mode, fast loading, inside run_merge, its record) are chosen by its door's `session()`,
    once per door: no mode, hook or pipeline step builds one itself."""
    builders = {name for name, tree in MODULES.items() if _builds_sessions(tree)}
    assert builders == DOORS, f"modules that build a MergeSession: {sorted(builders)}"


def test_each_door_has_what_the_modes_need():
    """Every member of the `Door` protocol is on both doors, so a mode written once runs through either."""
    from typing import get_type_hints

    from mergekit_ram._mergekit import door, door_pytorch, door_yaml

    members = {name for name in vars(door.Door) if not name.startswith("_")} | set(get_type_hints(door.Door))
    for cls in (door_yaml.YamlDoor, door_pytorch.PytorchDoor):
        built = cls.__new__(cls)
        cls.__init__(built, None, None)  # type: ignore[misc]  # no config: only the attributes are read
        missing = sorted(name for name in members if not hasattr(built, name))
        assert not missing, f"{cls.__name__} lacks {missing}"
    assert set(door.DOORS) == {door_yaml.ENTRY_POINT, door_pytorch.ENTRY_POINT}


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (lazy ones included), packages' `__init__` left out."""
    return {
        name: {m for module, names in _imports(tree) for m in _ours(module, names)} - {name} - PACKAGES
        for name, tree in MODULES.items()
    }


def _in_folder(name: str, folder: str) -> bool:
    return name == folder or name.startswith(folder + ".")


def test_only_verify_and_its_callers_import_verifys_folder():
    """verify's modules are imported by verify's folder, the CLI, the doors and the seam's verify mode: no merge
    code (the kernel, the statistics, the checks, the card, the merge hooks and pipeline) reaches them."""
    importers = {
        name for name, deps in _graph().items() if not _in_folder(name, VERIFY) and any(_in_folder(d, VERIFY) for d in deps)
    }
    assert importers <= VERIFY_IMPORTERS, f"merge code imports verify's folder: {sorted(importers - VERIFY_IMPORTERS)}"


def test_every_folder_says_what_lives_there():
    """Each folder's `__init__.py` opens with a docstring (what lives there, what it may import) and, but for the
    entry points', imports nothing."""
    for name in PACKAGES:
        tree = MODULES[name]
        assert ast.get_docstring(tree), f"{name}/__init__.py has no docstring"
        assert name in ENTRY_POINTS or not _imports(tree), f"{name}/__init__.py imports {_imports(tree)}"


def _unnamed(package: str) -> list[str]:
    """The modules (and sub-folders) directly in `package`'s folder that its `__init__` docstring does not name, in
    backquotes: `name`, `name.py` or `name/`."""
    folder = PACKAGE.parent / package.replace(".", "/")
    names = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    names |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    said = ast.get_docstring(MODULES[package]) or ""
    return sorted(n for n in names if not re.search(rf"`{re.escape(n)}(\.py|/)?`", said))


def test_every_folder_names_each_of_its_modules():
    """A folder's docstring is its map: a module it leaves out is found only by listing the folder."""
    unnamed = {package: missing for package in sorted(PACKAGES) if (missing := _unnamed(package))}
    assert not unnamed, f"modules their folder's __init__ docstring does not name: {unnamed}"


def _group(name: str) -> int:
    """The index in GROUPS of the group `name` belongs to (a folder's modules belong to the folder's group)."""
    for index, (_, members) in enumerate(GROUPS):
        if name in members or any(name.startswith(m + ".") for m in members if m in PACKAGES - {"mergekit_ram"}):
            return index
    raise AssertionError(f"{name} is in no group of tests/test_layout.py's GROUPS: add it where its imports place it")


def test_imports_run_down_the_groups():
    """Every package module is in one group, and no import goes up: the seam above the method, verify above the card,
    the card above the checks, the checks above the session and the core, all above `errors` and `files`."""
    upward = [
        f"{name} ({GROUPS[_group(name)][0]}) imports {dep} ({GROUPS[_group(dep)][0]})"
        for name, deps in _graph().items()
        for dep in deps
        if _group(dep) < _group(name)
    ]
    assert not upward, "imports that run up the groups: " + "; ".join(upward)


def test_the_top_level_holds_only_entry_points_and_what_folders_share():
    top = sorted(name for name in MODULES if name.count(".") == 1 and name not in PACKAGES)
    assert len(top) <= TOP_LEVEL, f"{len(top)} modules directly in mergekit_ram/ (at most {TOP_LEVEL}): {top}"


def test_the_group_rule_places_each_module_where_its_folder_is():
    placed = {
        "mergekit_ram": "the entry points",
        "mergekit_ram.cli.verify": "the entry points",
        "mergekit_ram._mergekit.hooks": "the seam",
        "mergekit_ram.verify.hub": "verify",
        "mergekit_ram.reporting.card": "reporting",
        "mergekit_ram.core.kernel": "core",
        "mergekit_ram.files": "the shared leaves",
    }
    assert {m: GROUPS[_group(m)][0] for m in placed} == placed
    with pytest.raises(AssertionError, match="in no group"):
        _group("mergekit_ram.somewhere_new")
