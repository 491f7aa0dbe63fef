"""Installed versions of distributions, looked up one way: `--version`, the card, `ram_stats.json`, the guard."""

from __future__ import annotations

UNKNOWN = "unknown"


def installed(name: str) -> str:
    """The installed version of distribution `name`; "unknown" when it cannot be told."""
    from importlib import metadata  # looked up at call time: importing it costs start-up time

    try:
        return metadata.version(name)
    except Exception:  # not installed, or its metadata unreadable
        return UNKNOWN
