"""Start-up: registration without a wrapper script, since mergekit 0.1.5 has no plugin discovery.

`mergekit_ram.pth` imports `mergekit_ram` at interpreter start-up, which adds
this meta-path finder (no torch, no mergekit import). It runs a small hook right
after mergekit's own modules finish loading: register `ramplus` once
`mergekit.merge_methods` exists, install the statistics pre-pass once
`mergekit.plan` exists, extend the model card and `run_merge` once
`mergekit.merge` exists (`hooks.install`), wrap `mergekit-pytorch`'s planner once
`mergekit.scripts.merge_raw_pytorch` exists. A failing hook logs a warning and
never raises into mergekit. `MERGEKIT_RAM_DISABLE=1` makes the .pth do nothing.
"""

import _thread
import importlib.util
import sys

_lock = _thread.RLock()
_busy: set[str] = set()  # modules whose spec this finder is looking up
_executing: set[str] = set()  # modules whose code runs in one of our loaders right now
_warned: set[str] = set()


def _log():
    import logging  # not at start-up: logging alone costs milliseconds

    return logging.getLogger("mergekit_ram")


def register_methods():
    """Register `ramplus` with mergekit (idempotent; skips a name collision)."""
    if "mergekit_ram.method" in _executing:
        return  # still being defined (it imports mergekit.merge_methods): its own load hook registers it
    from mergekit.merge_methods import register, registered_methods

    from mergekit_ram.method import is_ours, origin, ramplus

    taken = {m.spec.name: m for m in registered_methods()}
    owner = taken.get(ramplus.spec.name)
    if owner is None:
        register(ramplus)
    elif not is_ours(owner) and ramplus.spec.name not in _warned:
        _warned.add(ramplus.spec.name)
        _log().warning(
            "mergekit-ram: a merge method named %r is already registered (by %s); "
            "mergekit-ram's RAM+ was not registered",
            ramplus.spec.name,
            origin(owner),
        )


def install_prepass():
    """Wrap mergekit's planner so `ramplus` gets whole-model statistics."""
    from mergekit_ram._mergekit import hooks

    hooks.install()


def install_card():
    """Wrap `run_merge` and add the RAM+ section to the model card mergekit writes."""
    from mergekit_ram._mergekit import hooks

    hooks.install_merge()


def install_flat():
    """Wrap `mergekit-pytorch`'s planner so `ramplus` gets whole-model statistics there too."""
    from mergekit_ram._mergekit import hooks

    hooks.install_flat()


_HOOKS = {
    "mergekit.merge_methods": register_methods,
    "mergekit_ram.method": register_methods,
    "mergekit.plan": install_prepass,
    "mergekit.merge": install_card,
    "mergekit.scripts.merge_raw_pytorch": install_flat,
}


def _run(hook):
    try:
        with _lock:
            hook()
    except Exception as error:  # a broken plugin must not break mergekit
        _log().warning("mergekit-ram: %s failed, RAM+ is unavailable: %r", hook.__name__, error)


class _Loader:
    """Delegates to the real loader, then runs the hook on the finished module."""

    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        module.__loader__ = self._loader
        _executing.add(module.__name__)
        try:
            self._loader.exec_module(module)
        finally:
            _executing.discard(module.__name__)
        _run(self._hook)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """A meta-path finder that only wraps the loaders of the modules in _HOOKS."""

    __mergekit_ram_finder__ = True

    def find_spec(self, name, path=None, target=None):
        hook = _HOOKS.get(name)
        if hook is None or name in _busy:
            return None
        _busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except Exception:
            return None
        finally:
            _busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        # duck-typed: subclassing importlib.abc.Loader would import it at every interpreter start
        spec.loader = _Loader(spec.loader, hook)  # type: ignore[assignment]
        return spec


_FINDER = _Finder()


def install():
    """Add the finder once; run hooks for modules that are already loaded."""
    if _FINDER not in sys.meta_path:
        # a reloaded copy of this module leaves its old finder behind: replace it
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__mergekit_ram_finder__", False)]
        sys.meta_path.insert(0, _FINDER)
    for name, hook in _HOOKS.items():
        if name in sys.modules and name != "mergekit_ram.method":
            _run(hook)
