"""The declared floors of mergekit-ram's dependencies as pip constraints: `.ci/floors.py [pyproject.toml]`.

Prints one `name==X` line per entry of `[project] dependencies`, X being its `>=X` floor, for
`pip install -c FILE`: the floor stage (`.ci/other_python PYTHON VENV floors`) installs exactly these,
so the floors that pyproject.toml declares and the ones CI tests cannot drift apart. A dependency
without a `>=` floor is an error (every floor is declared, with its reason in CONTRIBUTING.md's
version table). The `test` extra is not pinned: its tools are not what users install.

Runs on every Python the package supports (3.10 has no tomllib: pip's own copy of tomli then).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")


def floors(pyproject: Path) -> list[str]:
    dependencies = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    pins = []
    for requirement in dependencies:
        match = REQUIREMENT.match(requirement)
        if not match or match.group(4):
            raise SystemExit(f"{pyproject}: cannot read the requirement {requirement!r} (name, >=floor[, <cap])")
        name, specifiers = match.group(1), [s.strip() for s in match.group(3).split(",") if s.strip()]
        floor = [s[2:].strip() for s in specifiers if s.startswith(">=")]
        if len(floor) != 1:
            raise SystemExit(f"{pyproject}: {requirement!r} declares no floor (>=X): every dependency needs one")
        pins.append(f"{name}=={floor[0]}")
    return pins


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(floors(path)))
