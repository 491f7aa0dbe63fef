"""The one cache root: the statistics cache folder and the compiled kernel's folder, from the environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import NEEDS_COMPILER

from mergekit_ram.core import cache, cachedir, native

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

PACKAGE = Path(cachedir.__file__).resolve().parent


@pytest.fixture
def env(monkeypatch, tmp_path):
    """No MERGEKIT_RAM_CACHE, XDG_CACHE_HOME in tmp_path, HOME in tmp_path."""
    monkeypatch.delenv("MERGEKIT_RAM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_default_root_follows_xdg_cache_home(env, tmp_path):
    assert cachedir.default() == tmp_path / "xdg" / "mergekit-ram"
    assert cachedir.statistics() == tmp_path / "xdg" / "mergekit-ram"
    assert cachedir.native() == tmp_path / "xdg" / "mergekit-ram" / "native"


@pytest.mark.parametrize("xdg", [None, ""])
def test_default_root_without_xdg_cache_home_is_in_the_home(env, tmp_path, xdg):
    if xdg is None:
        env.delenv("XDG_CACHE_HOME")
    else:
        env.setenv("XDG_CACHE_HOME", xdg)
    assert cachedir.statistics() == tmp_path / "home" / ".cache" / "mergekit-ram"
    assert cachedir.native() == tmp_path / "home" / ".cache" / "mergekit-ram" / "native"


def test_mergekit_ram_cache_moves_both(env, tmp_path):
    env.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "elsewhere"))
    assert cachedir.statistics() == tmp_path / "elsewhere"
    assert cachedir.native() == tmp_path / "elsewhere" / "native"


def test_mergekit_ram_cache_expands_the_home(env, tmp_path):
    env.setenv("MERGEKIT_RAM_CACHE", "~/my-cache")
    assert cachedir.statistics() == tmp_path / "home" / "my-cache"
    assert cachedir.native() == tmp_path / "home" / "my-cache" / "native"


@pytest.mark.parametrize("value", ["off", "OFF", " Off ", "0", "false", "No", "none", "", "  "])
def test_off_values_turn_the_statistics_cache_off_but_not_the_kernels_home(env, tmp_path, value):
    env.setenv("MERGEKIT_RAM_CACHE", value)
    assert cachedir.statistics() is None
    assert cache.directory() is None
    assert cachedir.native() == tmp_path / "xdg" / "mergekit-ram" / "native"


@pytest.mark.parametrize("value", ["offline", "1", "yes", "./off"])
def test_other_values_are_folders(env, value):
    env.setenv("MERGEKIT_RAM_CACHE", value)
    assert cachedir.statistics() == Path(value)


def test_the_statistics_cache_is_the_root(env, tmp_path):
    assert cache.directory() == cachedir.statistics() == tmp_path / "xdg" / "mergekit-ram"
    env.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "c"))
    assert cache.directory() == tmp_path / "c"


@NEEDS_COMPILER
@pytest.mark.parametrize("value", [None, "off", "folder"])
def test_the_kernel_is_built_in_the_kernels_folder(env, tmp_path, value):
    if value == "folder":
        env.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "c"))
    elif value is not None:
        env.setenv("MERGEKIT_RAM_CACHE", value)
    want = {None: tmp_path / "xdg" / "mergekit-ram", "off": tmp_path / "xdg" / "mergekit-ram", "folder": tmp_path / "c"}
    assert native.target().parent == want[value] / "native" == cachedir.native()


PACKAGES = {"mergekit_ram", "mergekit_ram.core"}  # `from PACKAGE import module` names a module


def _package_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mergekit_ram"):
            found |= {f"{node.module}.{a.name}" if node.module in PACKAGES else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mergekit_ram")}
    return found


def test_cachedir_is_a_leaf_below_cache_and_native():
    assert _package_imports("cachedir") == set()
    assert "mergekit_ram.core.cachedir" in _package_imports("cache")
    assert "mergekit_ram.core.cachedir" in _package_imports("native")
    assert "mergekit_ram.core.cache" not in _package_imports("native")  # the kernel side knows nothing of the cache
