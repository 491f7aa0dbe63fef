"""The newest-dependencies stage got the newest releases: python .ci/newest.py (in that venv)

For torch, transformers and mergekit: the newest final release the package index offers this
interpreter (`pip index versions`) within the range mergekit-ram declares must be the one
installed. pip's resolver takes the newest first but backtracks quietly when something else
holds a package back; this makes that a failure, naming the versions, instead of a pass on
older ones. Prints the versions.
"""

import contextlib
import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

NAMES = ("torch", "transformers", "mergekit")


def available(name: str) -> list[Version]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = re.search(r"^Available versions:(.*)$", out, re.M)
    assert found, f"pip index versions {name}: no 'Available versions:' line in\n{out}"
    versions = []
    for text in found[1].split(","):
        with contextlib.suppress(InvalidVersion):
            versions.append(Version(text.strip()))
    return versions


declared = {
    req.name.lower(): req.specifier
    for req in map(Requirement, metadata.requires("mergekit-ram") or [])
    if req.marker is None
}
problems = []
for name in NAMES:
    specifier = declared[name]
    offered = [v for v in available(name) if specifier.contains(v)]  # final releases only
    assert offered, f"the index offers no {name} within {specifier}"
    newest = max(offered)
    installed = Version(metadata.version(name))
    line = f"{name} {installed} (newest offered within '{specifier}': {newest})"
    print(line)
    if Version(installed.public) != Version(newest.public):  # a +cpu build counts as its release
        problems.append(line)
if problems:
    sys.exit("older than the newest allowed (another requirement held it back):\n  " + "\n  ".join(problems))
