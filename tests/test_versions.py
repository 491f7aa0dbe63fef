"""`mergekit_ram.reporting.versions`: one lookup of installed versions for `--version`, the card, ram_stats.json, the guard."""

from importlib import metadata

import pytest

from mergekit_ram.reporting import versions

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_installed_versions_are_the_metadata():
    for name in ("mergekit", "mergekit-ram", "torch"):
        assert versions.installed(name) == metadata.version(name)


def test_a_missing_distribution_is_unknown():
    assert versions.installed("no-such-distribution-mergekit-ram") == versions.UNKNOWN == "unknown"


def test_unreadable_metadata_is_unknown(monkeypatch):
    def broken(name):
        raise OSError("metadata unreadable")

    monkeypatch.setattr(metadata, "version", broken)
    assert versions.installed("mergekit") == "unknown"
