"""Reinforced Agent Merging (RAM / RAM+, arXiv 2601.13572) for mergekit.

Importing this package (or just starting Python, through mergekit_ram.pth)
makes `merge_method: ramplus` available to mergekit. The import itself is
light: torch and mergekit load only when used.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "agent_statistics", "merge_state_dicts", "ramplus"]


def __getattr__(name):
    if name in ("merge_state_dicts", "agent_statistics"):
        from mergekit_ram import api

        return getattr(api, name)
    if name == "ramplus":
        from mergekit_ram.method import ramplus

        return ramplus
    raise AttributeError(f"module 'mergekit_ram' has no attribute {name!r}")


def _install():
    try:
        from mergekit_ram._mergekit import finder

        finder.install()
    except Exception as error:  # never break the interpreter or mergekit
        import logging

        logging.getLogger("mergekit_ram").warning("mergekit-ram start-up hook failed: %r", error)


_install()
del _install
