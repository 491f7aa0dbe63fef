"""Start-up registration: the .pth hook, the meta-path finder, failure isolation.

Every check runs in a fresh interpreter (``sys.executable``), because what is
tested is what happens while Python and mergekit start.  Each subprocess prints
one ``RESULT {json}`` line that the test parses.  The subprocesses run in an
empty directory, so ``mergekit_ram`` comes from the installation, not from the
current directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import mergekit_ram

MARK = "__mergekit_ram_prepass__"
# mergekit_ram comes from here (the repo for an editable install) and mergekit
# from purelib; `python -S` runs need both on sys.path by hand.
PACKAGE_PARENT = str(Path(mergekit_ram.__file__).resolve().parent.parent)
PURELIB = sysconfig.get_paths()["purelib"]

# Prepended to every script: a tiny helper to report results.
PRELUDE = textwrap.dedent(
    """
    import json as _json, sys

    def report(**values):
        print("RESULT " + _json.dumps(values, default=str), flush=True)

    def finders():
        return sum(type(f).__module__ == "mergekit_ram._mergekit.finder" for f in sys.meta_path)
    """
)


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("MERGEKIT_RAM_DISABLE", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONIOENCODING="utf-8")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def neutral_cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cwd")


def _run(args, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def py(neutral_cwd):
    """py(code, flags=(), env=None, ok=True) -> (result dict or None, completed process)."""

    def run(code: str, *, flags=(), env=None, ok: bool = True):
        proc = _run([sys.executable, *flags, "-c", PRELUDE + textwrap.dedent(code)], neutral_cwd, env)
        if ok:
            assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):]) if lines else None
        return result, proc

    return run


@pytest.fixture(scope="session")
def workload(tmp_path_factory):
    try:
        from mergekit_ram.example_models import build_workload
    except ImportError as error:  # pragma: no cover - depends on a file being written
        pytest.fail(f"mergekit_ram.example_models.build_workload is not importable: {error!r}")
    out = tmp_path_factory.mktemp("workload")
    return build_workload(
        out, hidden_size=32, num_layers=2, vocab_size=64, densities=(0.05, 0.3), tokenizer=False
    )


def _config(workload, method="ramplus", **parameters) -> dict:
    return {
        "merge_method": method,
        "base_model": str(Path(workload.base).resolve()),
        "models": [{"model": str(Path(p).resolve())} for p in workload.agents.values()],
        "parameters": parameters,
        "dtype": "float32",
    }


def _mergekit_yaml() -> str:
    beside = Path(sys.executable).parent / "mergekit-yaml"
    if beside.exists():
        return str(beside)
    found = shutil.which("mergekit-yaml")
    if found is None:
        pytest.skip("the mergekit-yaml console script is not installed")
    return found


# --------------------------------------------------------------------------- #
# The unmodified mergekit CLI and registry see `ramplus`
# --------------------------------------------------------------------------- #
def test_unmodified_mergekit_yaml_merges_ramplus(workload, tmp_path, neutral_cwd):
    import yaml

    config = tmp_path / "ramplus.yml"
    config.write_text(yaml.safe_dump(_config(workload, r=0.1, alpha=2.0)))
    out = tmp_path / "merged"
    proc = _run([_mergekit_yaml(), str(config), str(out), "--no-copy-tokenizer"], neutral_cwd)
    assert proc.returncode == 0, f"mergekit-yaml failed:\n{proc.stderr[-4000:]}"
    assert (out / "model.safetensors").is_file()
    assert (out / "config.json").is_file()
    assert "RAM+ statistics" in proc.stderr, proc.stderr[-2000:]  # the pre-pass progress bar
    assert "RAM+ statistics" in proc.stderr, proc.stderr[-2000:]  # the table
    for name in workload.agents:
        assert name in proc.stderr

    import torch
    from safetensors.torch import load_file

    merged = load_file(str(out / "model.safetensors"))
    base = load_file(str(Path(workload.base) / "model.safetensors"))
    assert merged and all(torch.isfinite(t).all() for t in merged.values())
    assert any(not torch.equal(merged[k].float(), base[k].float()) for k in merged if k in base)


@pytest.mark.quick
def test_ramplus_registered_without_explicit_import(py):
    result, _ = py(
        """
        import mergekit.merge_methods as m
        method = m.get('ramplus')
        report(
            same=method is sys.modules['mergekit_ram.method'].ramplus,
            pretty=method.spec.pretty_name,
            ram_module=sys.modules['mergekit_ram'].__file__,
            finders=finders(),
        )
        """
    )
    assert result["same"]
    assert "RAM+" in result["pretty"]
    assert result["finders"] == 1


# --------------------------------------------------------------------------- #
# Start-up cost
# --------------------------------------------------------------------------- #
@pytest.mark.quick
def test_startup_is_torch_free_and_mergekit_free(py):
    result, proc = py(
        """
        print('torch' in sys.modules, 'mergekit' in sys.modules)
        report(torch='torch' in sys.modules, mergekit='mergekit' in sys.modules,
               transformers='transformers' in sys.modules, logging='logging' in sys.modules,
               ours='mergekit_ram' in sys.modules, finders=finders(), modules=sorted(sys.modules))
        """
    )
    assert proc.stdout.splitlines()[0] == "False False"
    assert result["ours"] and result["finders"] == 1
    assert not result["transformers"]

    disabled, _ = py("report(modules=sorted(sys.modules))", env=_env(MERGEKIT_RAM_DISABLE="1"))
    extra = set(result["modules"]) - set(disabled["modules"])
    # our two modules, plus whatever standard-library modules importlib.util needs
    # (how many of those an interpreter has already loaded depends on the environment)
    ours = {"mergekit_ram", "mergekit_ram._mergekit", "mergekit_ram._mergekit.finder"}
    foreign = {m for m in extra - ours if m.split(".")[0] not in sys.stdlib_module_names}
    assert not foreign, f"start-up imports more than the hook: {sorted(foreign)}"
    assert "logging" not in extra and "threading" not in extra


# --------------------------------------------------------------------------- #
# Opting out: MERGEKIT_RAM_DISABLE and python -S
# --------------------------------------------------------------------------- #
def test_disable_env_skips_hook_and_explicit_import_still_registers(py):
    result, _ = py(
        """
        r = {'at_startup': 'mergekit_ram' in sys.modules}
        import mergekit.merge_methods as m
        try:
            m.get('ramplus')
            r['error'] = None
        except RuntimeError as error:
            r['error'] = str(error)
        r['linear'] = m.get('linear').spec.name
        r['ties'] = m.get('ties').spec.name
        r['after_mergekit'] = 'mergekit_ram' in sys.modules
        import mergekit_ram
        r['registered'] = m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus
        report(**r)
        """,
        env=_env(MERGEKIT_RAM_DISABLE="1"),
    )
    assert result["at_startup"] is False
    assert result["error"] and "Unimplemented merge method" in result["error"]
    assert result["linear"] == "linear" and result["ties"] == "ties"
    assert result["after_mergekit"] is False
    assert result["registered"] is True


@pytest.mark.parametrize("value, loaded", [("true", False), (" YES ", False), ("0", True), ("", True)])
def test_disable_env_values(py, value, loaded):
    result, _ = py("report(loaded='mergekit_ram' in sys.modules)", env=_env(MERGEKIT_RAM_DISABLE=value))
    assert result["loaded"] is loaded


def test_python_S_skips_pth_and_explicit_import_works(py):
    result, _ = py(
        f"""
        r = {{'site': 'site' in sys.modules, 'at_startup': 'mergekit_ram' in sys.modules}}
        sys.path += [{PACKAGE_PARENT!r}, {PURELIB!r}]
        import mergekit_ram
        import mergekit.merge_methods as m
        r['registered'] = m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus
        report(**r)
        """,
        flags=("-S",),
    )
    assert result == {"site": False, "at_startup": False, "registered": True}


def test_finder_installed_late_after_merge_methods(py):
    """python -S: mergekit.merge_methods is loaded before mergekit_ram installs its finder."""
    result, _ = py(
        f"""
        sys.path += [{PACKAGE_PARENT!r}, {PURELIB!r}]
        import mergekit.merge_methods as m
        r = {{'before': 'ramplus' in [x.spec.name for x in m.registered_methods()]}}
        import mergekit_ram
        r['registered'] = m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus
        r['plan_loaded'] = 'mergekit.plan' in sys.modules
        import mergekit.plan as p
        r['wrapped'] = getattr(p.MergePlanner._plan, '__mergekit_ram_prepass__', False)
        r['count'] = [x.spec.name for x in m.registered_methods()].count('ramplus')
        report(**r)
        """,
        flags=("-S",),
    )
    assert result == {"before": False, "registered": True, "plan_loaded": False, "wrapped": True,
                      "count": 1}


# --------------------------------------------------------------------------- #
# Idempotence and import orders
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def plan_first(py):
    """One interpreter: `import mergekit.plan` first, then repeated installs, then a purge."""
    result, proc = py(
        """
        import mergekit.plan as p
        print(p.MergePlanner._plan)
        import mergekit.merge_methods as m
        from mergekit_ram._mergekit import hooks as hook, surface
        plan = p.MergePlanner._plan
        inner = plan.__wrapped__
        first = dict(
            mark=getattr(plan, '__mergekit_ram_prepass__', False),
            inner_marked=hasattr(inner, '__mergekit_ram_prepass__'),
            inner_name=inner.__module__ + ':' + inner.__qualname__,
            registered=m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus,
            reason=surface.unavailable_reason(),
        )
        print('---- repeat ----', file=sys.stderr, flush=True)
        import importlib
        import mergekit_ram
        for _ in range(5):
            import mergekit_ram
            importlib.reload(mergekit_ram)
        import mergekit_ram._mergekit.finder as startup
        import mergekit_ram._mergekit.hooks as hook; import mergekit_ram._mergekit.surface as surface
        import mergekit.plan as plan
        import mergekit.merge_methods as m
        startup.install(); startup.install()
        startup.register_methods(); startup.register_methods()
        hook.install(); hook.install()
        wrapper = plan.MergePlanner._plan
        inner = wrapper.__wrapped__
        r = dict(
            first=first,
            finders=finders(),
            count=[x.spec.name for x in m.registered_methods()].count('ramplus'),
            same=m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus,
            mark=getattr(wrapper, '__mergekit_ram_prepass__', False),
            inner_marked=hasattr(inner, '__mergekit_ram_prepass__'),
            inner_wrapped=hasattr(inner, '__wrapped__'),
            inner_name=inner.__module__ + ':' + inner.__qualname__,
        )
        print('---- reload ----', file=sys.stderr, flush=True)
        # Second phase: a purge/reload of the plugin's own modules (test
        # harnesses, importlib.reload) must not stack hooks or warn about itself.
        for name in [k for k in sys.modules if k.startswith('mergekit_ram')]:
            del sys.modules[name]
        import mergekit_ram
        import mergekit_ram.method
        importlib.reload(sys.modules['mergekit_ram._mergekit.finder'])
        sys.modules['mergekit_ram._mergekit.finder'].install()
        r['finders_after_reload'] = finders()
        r['count_after_reload'] = [x.spec.name for x in m.registered_methods()].count('ramplus')
        r['mark_after_reload'] = getattr(plan.MergePlanner._plan, '__mergekit_ram_prepass__', False)
        r['wrapper_kept'] = plan.MergePlanner._plan is wrapper
        report(**r)
        """
    )
    startup_err, _, rest = proc.stderr.partition("---- repeat ----")
    repeat_err, _, reload_err = rest.partition("---- reload ----")
    return result, proc.stdout, startup_err, repeat_err, reload_err


def test_planner_wrapped_when_mergekit_plan_imported_first(plan_first):
    result, stdout, stderr, _, _ = plan_first
    first = result["first"]
    assert "mergekit_ram" in stdout  # print(p.MergePlanner._plan) shows our wrapper
    assert first["mark"] is True
    assert first["inner_marked"] is False
    assert first["inner_name"] == "mergekit.plan:MergePlanner._plan"
    assert first["registered"]
    assert first["reason"] is None
    assert "mergekit-ram" not in stderr, stderr  # no warning on the happy path


def test_idempotent_registration_and_wrapping(plan_first):
    result, _, _, stderr, _ = plan_first
    assert result["finders"] == 1
    assert result["count"] == 1 and result["same"]
    assert result["mark"] is True
    assert result["inner_marked"] is False and result["inner_wrapped"] is False
    assert result["inner_name"] == "mergekit.plan:MergePlanner._plan"
    assert "mergekit-ram" not in stderr, stderr


def test_reimport_after_purge_keeps_one_hook(plan_first):
    result = plan_first[0]
    assert result["count_after_reload"] == 1
    assert result["mark_after_reload"] is True and result["wrapper_kept"] is True


def test_reimport_after_purge_is_silent_and_adds_no_finder(plan_first):
    result, after_reload = plan_first[0], plan_first[4]
    assert result["finders_after_reload"] == 1
    assert "already registered" not in after_reload, after_reload


@pytest.mark.parametrize(
    "first",
    ["import mergekit_ram.method", "from mergekit_ram import api", "import mergekit_ram._mergekit.pipeline"],
)
def test_import_orders_end_registered(py, first):
    result, proc = py(
        f"""
        {first}
        import mergekit.merge_methods as m
        report(count=[x.spec.name for x in m.registered_methods()].count('ramplus'),
               same=m.get('ramplus') is sys.modules['mergekit_ram.method'].ramplus)
        """
    )
    assert result == {"count": 1, "same": True}
    assert "mergekit-ram" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- #
# Failure isolation: a broken plugin never breaks mergekit
# --------------------------------------------------------------------------- #
BREAKERS = {
    # mergekit_ram.method cannot be imported at all
    "method-unimportable": "sys.modules['mergekit_ram.method'] = None",
    # a half-broken module whose `ramplus` attribute raises on access
    "method-attribute-raises": textwrap.dedent(
        """
        import types
        class Broken(types.ModuleType):
            @property
            def ramplus(self):
                raise RuntimeError('bogus ramplus')
        sys.modules['mergekit_ram.method'] = Broken('mergekit_ram.method')
        """
    ),
    # the registration hook itself raises
    "register-hook-raises": textwrap.dedent(
        """
        import mergekit_ram._mergekit.finder as startup
        def register_methods():
            raise ZeroDivisionError('simulated registration failure')
        for key, hook in list(startup._HOOKS.items()):
            if hook is startup.register_methods:
                startup._HOOKS[key] = register_methods
        startup.register_methods = register_methods
        """
    ),
}


@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_broken_registration_does_not_break_mergekit(py, breaker):
    result, proc = py(
        BREAKERS[breaker]
        + textwrap.dedent(
            f"""
            assert 'mergekit' not in sys.modules
            import mergekit.merge_methods as m
            r = {{'linear': m.get('linear').spec.name, 'ram': m.get('ram').spec.name}}
            try:
                m.get('ramplus')
                r['error'] = None
            except RuntimeError as error:
                r['error'] = str(error)
            report(**r)
            """
        )
    )
    assert result["linear"] == "linear" and result["ram"] == "ram"
    assert result["error"] and "Unimplemented merge method" in result["error"]
    assert "mergekit-ram" in proc.stderr and "unavailable" in proc.stderr, proc.stderr


def test_incompatible_mergekit_disables_prepass_but_not_mergekit(py, workload, tmp_path):
    config = {k: v for k, v in _config(workload).items() if k != "parameters"}
    result, proc = py(
        f"""
        import mergekit_ram._mergekit.surface as surface
        def check(needed_for):
            raise surface.IncompatibleMergekit('simulated: mergekit changed its planner')
        surface.check = check
        assert 'mergekit.plan' not in sys.modules
        import mergekit.plan as p
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions
        options = MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True)
        def merge(out, method, **parameters):
            config = dict({config!r}, merge_method=method, parameters=parameters)
            run_merge(MergeConfiguration.model_validate(config), out, options=options)
            import os
            return sorted(os.listdir(out))
        r = dict(
            reason=surface.unavailable_reason(),
            wrapped=getattr(p.MergePlanner._plan, '__mergekit_ram_prepass__', False),
            linear=merge({str(tmp_path / 'linear')!r}, 'linear', weight=1.0),
            ram_r0=merge({str(tmp_path / 'ram_r0')!r}, 'ramplus', r=0.0),
        )
        try:
            merge({str(tmp_path / 'ramplus')!r}, 'ramplus', r=0.1)
            r['error'] = None
        except Exception as error:
            r['error'] = type(error).__name__ + ': ' + str(error)
        report(**r)
        """
    )
    assert result["reason"] == "simulated: mergekit changed its planner"
    assert result["wrapped"] is False
    assert "model.safetensors" in result["linear"] and "config.json" in result["linear"]
    assert "model.safetensors" in result["ram_r0"]  # plain RAM needs no pre-pass
    assert result["error"] is not None, "ramplus with r > 0 merged without its global rho"
    assert "simulated: mergekit changed its planner" in result["error"]
    assert "mergekit-ram" in proc.stderr and "pre-pass disabled" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- #
# Name collision
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def collision(py, workload, tmp_path_factory):
    config = {k: v for k, v in _config(workload).items() if k != "parameters"}
    out = str(tmp_path_factory.mktemp("collision") / "merged")
    return py(
        f"""
        import torch
        import mergekit.merge_methods as m
        ram, tl = m.get('ram'), m.get('ramplus_tl')
        r = {{'ram_pretty': ram.spec.pretty_name, 'tl_pretty': tl.spec.pretty_name}}

        @m.merge_method(name='ramplus', pretty_name='someone else')
        def dummy(group: m.TensorGroup) -> torch.Tensor:
            return group.entries[0].tensor

        m.register(dummy)
        print('---- import ----', file=sys.stderr, flush=True)
        import mergekit_ram
        import mergekit_ram.method
        import mergekit.plan
        # The other plugin's `ramplus` must merge as that plugin defines it.
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions
        try:
            run_merge(MergeConfiguration.model_validate({config!r}), {out!r},
                      options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True))
            r['foreign_merge'] = None
        except Exception as error:
            r['foreign_merge'] = type(error).__name__ + ': ' + str(error)
        r.update(
            dummy_kept=m.get('ramplus') is dummy,
            count=[x.spec.name for x in m.registered_methods()].count('ramplus'),
            ram_same=m.get('ram') is ram,
            tl_same=m.get('ramplus_tl') is tl,
            ram_pretty_after=m.get('ram').spec.pretty_name,
            tl_pretty_after=m.get('ramplus_tl').spec.pretty_name,
        )
        report(**r)
        """,
        env=_env(MERGEKIT_RAM_DISABLE="1"),
    )


def test_name_collision_warns_and_keeps_other_method(collision):
    result, proc = collision
    assert result["dummy_kept"] is True and result["count"] == 1
    assert result["ram_same"] and result["tl_same"]
    assert result["ram_pretty_after"] == result["ram_pretty"] == "Reinforced Agent Merging"
    assert result["tl_pretty_after"] == result["tl_pretty"]
    assert "already registered" in proc.stderr and "mergekit-ram" in proc.stderr, proc.stderr


def test_name_collision_warns_once(collision):
    _, proc = collision
    after = proc.stderr.partition("---- import ----")[2]
    assert after.count("already registered") == 1, after


def test_name_collision_merge_is_refused_not_run_under_our_name(collision):
    """With mergekit-ram loaded, `merge_method: ramplus` owned by another package is an error naming
    the owner and the way out, never that package's merge (tests/reliability/test_plugin_isolation.py)."""
    result, proc = collision
    assert result["foreign_merge"] is not None, "the other package's ramplus merged under our name"
    assert "not by mergekit-ram" in result["foreign_merge"] and "MERGEKIT_RAM_DISABLE=1" in result["foreign_merge"]
