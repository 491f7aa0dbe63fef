"""Reinforced Agent Merging (RAM / RAM+, arXiv 2601.13572) for mergekit.

Importing this package (or just starting Python, through mergekit_ram.pth)
makes `merge_method: ramplus` available to mergekit. The import itself is
light: torch and mergekit load only when used.

Its modules, by concern (each folder's `__init__` says more; tests/test_layout.py
holds the rules): `method` (the `ramplus` method), `api` (`merge_state_dicts`,
`agent_statistics`), `example_models` (the synthetic RL-like models), `cli/` (the
`mergekit-ram` command), `_mergekit/` (the seam, the only code that knows
mergekit's insides), `verify/` (a finished merge checked), `reporting/` (what a
merge tells), `checks/` (what a merge checks first), `session` (one merge's
state), `core/` (the method on plain tensors), and the shared leaves `errors`,
`files` and `environment` (the variables read, and the words of the on/off ones).
"""

__version__ = "0.1.0"

__all__ = ["AgentStats", "RamError", "__version__", "agent_statistics", "merge_state_dicts", "ramplus"]
#: name -> the module that defines it, imported on first use (torch and mergekit load only then)
_LAZY = {
    "merge_state_dicts": "mergekit_ram.api",
    "agent_statistics": "mergekit_ram.api",
    "ramplus": "mergekit_ram.method",
    "AgentStats": "mergekit_ram.core.statistics",
    "RamError": "mergekit_ram.errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mergekit_ram' has no attribute {name!r}")


def __dir__():
    """The public API (`__all__`) for `dir()`, tab completion and `help()`, without importing it."""
    return sorted(set(__all__) | set(globals()))


def _install():
    try:
        from mergekit_ram._mergekit import finder

        finder.install()
    except Exception as error:  # never break the interpreter or mergekit
        import logging

        logging.getLogger("mergekit_ram").warning("mergekit-ram start-up hook failed: %r", error)


_install()
del _install
