"""Building the fused CPU loops of `_native.c`: the compiler, its flags, where the library lives, and the checks
that make loading it safe. Imports no torch, so `mergekit-ram --version` can say what `native` would do.

Loading a shared library runs its code, so it is built into and loaded from a folder owned by the user and writable
by no one else (as is the folder above it), and only a regular file owned by the user and writable by no one else is
loaded.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from mergekit_ram.core import cachedir
from mergekit_ram.errors import UnsafeLocation

SOURCE = Path(__file__).with_name("_native.c")


class _Unbuilt(RuntimeError):
    """The kernel cannot be built: `cause` ("no C compiler found", "the build failed") and the message."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


def _why(error: BaseException) -> str:
    """One line: why the kernel cannot be built or loaded, the cause first, then the message's last line."""
    text = str(error).strip()
    detail = text.splitlines()[-1] if text else repr(error)
    cause = getattr(error, "cause", None) or (
        "the folder is unsafe"
        if isinstance(error, UnsafeLocation)
        else "the folder is unusable"
        if isinstance(error, OSError)
        else "it does not load"
    )
    return f"{cause} ({detail})"


def _check_folders(target: Path, *, present_only: bool = False) -> None:
    """UnsafeLocation unless the cache folder, the kernel folder and the library are private (with `present_only`,
    those that exist)."""
    for path, what in (
        (target.parent.parent, "cache folder"),
        (target.parent, "kernel folder"),
        (target, "compiled kernel"),
    ):
        if not present_only or os.path.lexists(path):
            _check_private(path, what, follow=what == "cache folder")


def target() -> Path:
    """Where the library for this source, compiler and CPU lives (built or not)."""
    return _recipe()[2]


def find_compiler() -> str | None:
    """The C compiler a build would use: `$CC`, else `cc` or `gcc` on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _recipe() -> tuple[str, list[str], Path]:
    compiler = find_compiler()
    if not compiler:
        raise _Unbuilt("no C compiler found", "$CC unset, no cc or gcc on PATH")
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC", "-std=gnu11"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        # AVX-512 where the CPU has it (gcc and clang default to 256 bits): the merge and count loops 1.5x as
        # fast, the same bits (no reassociation: the lanes are fixed in the source)
        flags.insert(2, "-mprefer-vector-width=512")
    try:
        asked = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    except OSError as error:
        raise _Unbuilt("no C compiler found", f"{compiler}: {error.strerror or error}") from error
    if asked.returncode != 0:
        raise _Unbuilt("no C compiler found", f"`{compiler} --version` exited with {asked.returncode}")
    version = asked.stdout
    digest = hashlib.sha256(
        "\n".join([SOURCE.read_text(), compiler, version, " ".join(flags), platform.machine(), _cpu()]).encode()
    ).hexdigest()[:16]
    return compiler, flags, cachedir.native() / f"ramkernel-{digest}.so"


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    """Compile into `target` unless a safe one is there; True when it was compiled now."""
    folder = target.parent
    if not folder.parent.exists():
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not folder.exists():
        folder.mkdir(mode=0o700, exist_ok=True)
    _check_private(folder.parent, "cache folder", follow=True)
    _check_private(folder, "kernel folder")
    if os.path.lexists(target):
        _check_private(target, "compiled kernel")
        return False
    fd, tmp = tempfile.mkstemp(prefix=".ramkernel-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise _Unbuilt("the build failed", f"{compiler} {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _check_private(target, "compiled kernel")
    return True


def _check_private(path: Path, what: str, *, follow: bool = False) -> None:
    """UnsafeLocation unless `path` is owned by this user and writable by no one else
    (and, unless `follow`, not a symbolic link)."""
    st = os.stat(path) if follow else os.lstat(path)
    uid = os.geteuid()
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symbolic link"
    elif st.st_uid != uid:
        problem = f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"others can write to it (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w {path}` fixes that)"
    elif what == "compiled kernel" and not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif what != "compiled kernel" and not stat.S_ISDIR(st.st_mode):
        problem = "it is not a folder"
    if problem:
        raise UnsafeLocation(f"refusing the {what} {path}: {problem}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()
