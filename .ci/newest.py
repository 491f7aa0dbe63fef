"""The newest-dependencies stage got the newest releases: python .ci/newest.py (in that venv)

For torch, transformers and mergekit: the newest release that pip itself would install for this
interpreter under its configuration, alone with its own dependencies (a dry run: `pip install
--dry-run --report`, which honours pip's constraint files, find-links and extra indexes; `pip index
versions` ignores constraints) within the range mergekit-ram declares must be the one installed.
pip's resolver takes the newest first but backtracks quietly when something else holds a package
back; this makes that a failure, naming the versions, instead of a pass on older ones. Where the
index lists a newer release that pip cannot install here, it says why, the machine's situation and
not a failure: a cap in pip's configuration, or a dependency of that release the indexes lack.
Prints the versions.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

NAMES = ("torch", "transformers", "mergekit")


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=check)


def dry_run(requirement: str) -> subprocess.CompletedProcess[str]:
    """`pip install REQUIREMENT` with its dependencies, into nothing, as pip would resolve it here."""
    return pip("install", "--dry-run", "--quiet", "--ignore-installed", "--report", "-", requirement, check=False)


def would_install(name: str, specifier: str) -> Version:
    """The version `pip install NAME<spec>` picks here, alone with its dependencies, under pip's configuration."""
    done = dry_run(f"{name}{specifier}")
    if done.returncode:
        sys.exit(f"pip cannot install {name}{specifier} here:\n{done.stderr}")
    installs = json.loads(done.stdout)["install"]
    (item,) = (item for item in installs if canonicalize_name(item["metadata"]["name"]) == name)
    return Version(item["metadata"]["version"])


def why_not(name: str, version: Version) -> str:
    """Why pip installs no NAME==VERSION here: a cap in its configuration, or pip's own last error line."""
    if found := caps(name):
        return f"capped by pip's configuration: {', '.join(found)}"
    done = dry_run(f"{name}=={version}")
    errors = [line.removeprefix("ERROR: ") for line in done.stderr.splitlines() if line.startswith("ERROR: ")]
    return f"which pip cannot install here: {errors[-1] if errors else 'pip gave no reason'}"


def listed(name: str) -> list[Version]:
    """Every final release the indexes list (constraints not applied)."""
    out = pip("index", "versions", name).stdout
    found = re.search(r"^Available versions:(.*)$", out, re.M)
    assert found, f"pip index versions {name}: no 'Available versions:' line in\n{out}"
    versions = []
    for text in found[1].split(","):
        with contextlib.suppress(InvalidVersion):
            versions.append(Version(text.strip()))
    return versions


def caps(name: str) -> list[str]:
    """The lines of pip's constraint files (its configuration and PIP_CONSTRAINT) that name NAME."""
    files = os.environ.get("PIP_CONSTRAINT", "").split()
    for value in re.findall(r"^[\w:.-]*constraint='(.*)'$", pip("config", "list").stdout, re.M):
        files += value.split()
    found = []
    for file in files:
        with contextlib.suppress(OSError):
            for line in Path(file).read_text().splitlines():
                text = line.split("#", 1)[0].strip()
                if text and Requirement(text).name.lower() == name:
                    found.append(f"{text} ({file})")
    return found


declared = {
    req.name.lower(): req.specifier
    for req in map(Requirement, metadata.requires("mergekit-ram") or [])
    if req.marker is None
}
problems = []
for name in NAMES:
    specifier = declared[name]
    newest = would_install(name, str(specifier))
    installed = Version(metadata.version(name))
    line = f"{name} {installed} (newest pip installs here within '{specifier}': {newest})"
    offered = [v for v in listed(name) if specifier.contains(v)]
    if offered and Version(max(offered).public) > Version(newest.public):
        line += f"; the index lists {max(offered)}, {why_not(name, max(offered))}"
    print(line)
    if Version(installed.public) != Version(newest.public):  # a +cpu build counts as its release
        problems.append(line)
if problems:
    sys.exit("older than the newest allowed (another requirement held it back):\n  " + "\n  ".join(problems))
