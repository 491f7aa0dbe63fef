"""What the wheel and the sdist in DIST must contain: python .ci/check_dist.py DIST"""

import re
import sys
import tarfile
import zipfile
from pathlib import Path

dist = Path(sys.argv[1])
repo = Path(__file__).resolve().parent.parent
version = re.search(r'^__version__ = "([^"]+)"', (repo / "mergekit_ram" / "__init__.py").read_text(), re.M)[1]
(wheel,) = dist.glob(f"mergekit_ram-{version}-py3-none-any.whl")
(sdist,) = dist.glob(f"mergekit_ram-{version}.tar.gz")
licenses = {name: (repo / name).read_bytes() for name in ("LICENSE", "COPYING")}

with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
    info = f"mergekit_ram-{version}.dist-info"
    for name, text in licenses.items():
        assert archive.read(f"{info}/licenses/{name}") == text, f"{wheel.name}: {name}"
    modules = {p.relative_to(repo).as_posix() for p in (repo / "mergekit_ram").rglob("*.py")}
    wanted = modules | {"mergekit_ram.pth", "mergekit_ram/py.typed", "mergekit_ram/core/_native.c"}
    assert wanted <= names, f"{wheel.name} lacks {sorted(wanted - names)}"
    assert "License-Expression: LGPL-3.0-only" in archive.read(f"{info}/METADATA").decode()

with tarfile.open(sdist) as archive:
    names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    root = f"mergekit_ram-{version}"
    for name, text in licenses.items():
        member = archive.extractfile(f"{root}/{name}")
        assert member is not None and member.read() == text, f"{sdist.name}: {name}"
    wanted = {"README.md", "CHANGELOG.md", "CONTRIBUTING.md", "pyproject.toml", "mergekit_ram/py.typed"}
    assert wanted <= names, f"{sdist.name} lacks {sorted(wanted - names)}"

print(f"{wheel.name} and {sdist.name}: LICENSE, COPYING, py.typed and every module present")
