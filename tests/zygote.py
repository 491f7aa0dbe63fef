"""The suite's console-script processes, forked from a warm interpreter instead of started cold.

Most of a test that runs `mergekit-yaml` (or `mergekit-ram`, `mergekit-multi`, `mergekit-pytorch`, `python -m
mergekit_ram.cli`) in a subprocess to check a message, an exit code or a file went on starting Python and importing
torch, transformers and mergekit: 4-8 s each, hundreds of times. Here an interpreter per command and test process
(a zygote) starts as that command's process does: the site's `.pth` start-up hook, then what the command imports
before it runs, with the argv[0] it has then (the plugin's import-time hooks read it: a console script's process
shows the plugin's warnings as `mergekit-ram: warning:` lines, `python -m mergekit_ram.cli`'s as logging's). A
console script's zygote runs the script's own file up to its `main()` call (its `from ... import main`), so a forked
`mergekit-pytorch` has imported what a real one has (not `mergekit.merge`); `mergekit-ram`'s and `python -m
mergekit_ram.cli`'s also import torch, transformers and mergekit, which `inspect` and `verify` import when they run
(`_WARM`). Each command is then a `fork()` of its zygote that sets its argv, environment, working folder and
standard streams and runs the console script's own file (or `python -m`'s module), ending as the script would
(`sys.exit`, an uncaught exception's traceback and exit 1, a signal). The test sees a real process: its own pid,
exit code and signals, a `CompletedProcess` from `subprocess.run`.

What the libraries read from the environment when imported is read again where it can be: huggingface_hub's
`constants` (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, ..., each test's stand-in Hub) are re-run in a child whose
values differ from the zygote's (`_rehome`). Any other difference (PYTHONHASHSEED, PYTHONPATH, ...) gets zygotes of
its own from the second such command on, and a real start the first time; calls with options this does not model
(a shell, `stdin=`, `preexec_fn`, a thread other than the main one), `Popen` (the kill tests) and tests marked
`real_process` (the start-up hook, one real start per door: `tests/conftest.py`) run the real command.
`MERGEKIT_RAM_TEST_FORK=0` turns it off (a CI stage runs the suite so: `.ci/run`). What still differs from a real
start: a forked `mergekit-ram --version` or `example` has torch and mergekit loaded, which a real one loads later
or not at all (their output is the same: tests/test_zygote.py); the interpreter's teardown of its modules is
skipped (`_leave`); and whether a command forks depends on the commands its test process ran before.
tests/test_zygote.py compares forked and real runs of the same commands.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: the console scripts whose processes are forked, and the modules `python -m` runs the same way
COMMANDS = {"mergekit-yaml", "mergekit-multi", "mergekit-pytorch", "mergekit-ram"}
MODULES = {"mergekit_ram.cli", "mergekit_ram"}
#: read when a command runs, not when a library is imported: a zygote serves any value of these
_RUNTIME = ("MERGEKIT_RAM_", "PYTEST_", "COV_CORE_", "COVERAGE_")
_RUNTIME_NAMES = {"PWD", "OLDPWD", "COLUMNS", "LINES", "PATH", "CC"}
#: read by huggingface_hub when it is imported (its `constants`): a child whose values differ re-reads them (_rehome)
_HUB = ("HF_", "HUGGINGFACE_")
_HUB_NAMES = {"HOME", "XDG_CACHE_HOME", "TRANSFORMERS_OFFLINE"}
#: what a command's zygote imports beyond the console script's own imports: what `mergekit-ram inspect` and `verify`
#: import when they run (6 s a start; a forked `mergekit-ram --version` or `example` has them too, to no effect
#: on what it prints or writes, checked by tests/test_zygote.py), and, for `python -m`, the same
_LIBRARIES = ("torch", "transformers", "safetensors", "mergekit.config", "mergekit.merge", "mergekit.options")
_WARM = {"mergekit-ram": _LIBRARIES, "mergekit_ram.cli": _LIBRARIES}
_KNOWN = {
    "args",
    "capture_output",
    "text",
    "universal_newlines",
    "encoding",
    "errors",
    "input",
    "timeout",
    "check",
    "env",
    "cwd",
    "stdout",
    "stderr",
}

_real_run = subprocess.run
_zygotes: dict[tuple, _Zygote] = {}
_seen: dict[tuple, int] = {}
#: set while a test marked `real_process` runs (conftest.py)
real_only = False
#: set by tests/test_zygote.py: fork from the first command of an environment (its zygote started at once), so that
#: a comparison pays for one real start, not two
eager = False
#: how many of our commands were forked and how many started for real (the summary line of tests/conftest.py)
counts = {"forked": 0, "started": 0}
_preamble = b""


def _signature(env: dict) -> tuple:
    keep = {k: v for k, v in env.items() if not k.startswith(_RUNTIME) or k == "MERGEKIT_RAM_DISABLE"}
    return tuple(sorted((k, v) for k, v in keep.items() if k not in _RUNTIME_NAMES and not _hub_variable(k)))


def _hub_variable(name: str) -> bool:
    return name.startswith(_HUB) or name in _HUB_NAMES or name.upper().endswith("_PROXY")


def _command(argv: list) -> tuple[str, str] | None:
    """("script", name) or ("module", name) when argv runs a command this forks, else None."""
    if not argv:
        return None
    first = Path(str(argv[0]))
    if first.name in COMMANDS and first.parent == Path(sys.executable).parent:
        return "script", first.name
    if str(argv[0]) == sys.executable and len(argv) >= 3 and argv[1] == "-m" and argv[2] in MODULES:
        return "module", str(argv[2])
    return None


def run(*popenargs, **kwargs):
    """`subprocess.run`, the commands of `COMMANDS` forked from a zygote where that is the same as starting them."""
    argv = popenargs[0] if popenargs else kwargs.get("args")
    if not isinstance(argv, (list, tuple)) or _command(list(argv)) is None:
        return _real_run(*popenargs, **kwargs)  # not one of our commands: `python -c`, a script, git, ...
    if (
        real_only
        or os.environ.get("MERGEKIT_RAM_TEST_FORK") == "0"
        or len(popenargs) > 1
        or set(kwargs) - _KNOWN
        or kwargs.get("stdout") not in (None, subprocess.PIPE, subprocess.DEVNULL)
        or kwargs.get("stderr") not in (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT)
        or threading.current_thread() is not threading.main_thread()
    ):
        counts["started"] += 1
        return _real_run(*popenargs, **kwargs)
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    signature = _signature(env)
    _seen[signature] = _seen.get(signature, 0) + 1  # the main thread only (above): no lock
    # a zygote per command: each imports what its command's real start does, with that start's argv[0]
    command = _command(list(argv))
    key = (signature, command)
    zygote = _zygotes.get(key)
    if zygote is None and (_seen[signature] >= 2 or eager):
        zygote = _zygotes[key] = _Zygote(env, command)
    if zygote is None or not zygote.alive():
        counts["started"] += 1
        return _real_run(*popenargs, **kwargs)
    counts["forked"] += 1
    return zygote.run([str(a) for a in argv], env, **{k: v for k, v in kwargs.items() if k not in ("args", "env")})


def stop_all() -> None:
    for zygote in _zygotes.values():  # each ends as an interpreter does (coverage saved): all at once, then waited
        if zygote.process.poll() is None:
            zygote.process.stdin.close()
    for zygote in _zygotes.values():
        zygote.stop()
    _zygotes.clear()


class _Zygote:
    """One warm interpreter for `command` (`_command`'s pair), started with `env`, that forks a child per request and
    reports how it ended."""

    def __init__(self, env: dict, command: tuple[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # numpy's and scipy's OpenBLAS start an idle thread each when imported; one fewer thread to reason about
            # in a fork (a child's os.environ is the test's, and nothing of ours calls OpenBLAS)
            env={**env, "OPENBLAS_NUM_THREADS": "1"},
            cwd="/",
            bufsize=0,
        )
        self.ready = _read(self.process.stdout) == "ready"

    def alive(self) -> bool:
        return self.ready and self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # a second close (stop_all's first) does nothing
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def run(
        self,
        argv,
        env,
        *,
        capture_output=False,
        text=None,
        universal_newlines=None,
        encoding=None,
        errors=None,
        input=None,
        timeout=None,
        check=False,
        cwd=None,
        stdout=None,
        stderr=None,
    ):
        if capture_output:
            stdout = stderr = subprocess.PIPE
        decode = bool(text or universal_newlines or encoding or errors)
        with tempfile.TemporaryDirectory(prefix="mergekit-ram-fork-") as scratch:
            paths = {name: os.path.join(scratch, name) for name in ("in", "out", "err")}
            data = input.encode(encoding or "utf-8", errors or "strict") if isinstance(input, str) else input
            with open(paths["in"], "wb") as f:
                f.write(data or b"")
            request = {
                "argv": argv,
                "env": env,
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                "stdin": paths["in"] if input is not None else os.devnull,
                "stdout": paths["out"] if stdout == subprocess.PIPE else os.devnull,
                "stderr": {subprocess.PIPE: paths["err"], subprocess.STDOUT: "&1"}.get(stderr, os.devnull),
            }
            if stdout is None:  # not captured: the test's own stdout, as a real child would inherit it
                request["stdout"] = paths["out"]
            if stderr is None:
                request["stderr"] = paths["err"]
            _write(self.process.stdin, request)
            pid = _read(self.process.stdout)
            status = _read(self.process.stdout, timeout=timeout)
            if status is None:
                os.kill(pid, signal.SIGKILL)
                _read(self.process.stdout)
                out, err = _contents(paths["out"]), _contents(paths["err"])
                raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
            out, err = _contents(paths["out"]), _contents(paths["err"])
        if stdout is None:
            sys.stdout.write(out.decode(errors="replace"))
            out = None
        elif stdout == subprocess.DEVNULL:
            out = None
        if stderr is None:
            sys.stderr.write(err.decode(errors="replace"))
            err = None
        elif stderr != subprocess.PIPE:
            err = None
        if decode:
            out, err = (None if x is None else _text(x, encoding, errors) for x in (out, err))
        code = os.waitstatus_to_exitcode(status)
        done = subprocess.CompletedProcess(argv, code, out, err)
        if check:
            done.check_returncode()
        return done


def _contents(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _text(data: bytes, encoding, errors) -> str:
    # universal newlines, as subprocess's text mode reads them
    return data.decode(encoding or "utf-8", errors or "strict").replace("\r\n", "\n").replace("\r", "\n")


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read(stream, timeout=None):
    """The next message, or None at end of stream or after `timeout` seconds."""
    if timeout is not None:
        deadline = time.monotonic() + timeout
        while not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                return None
    head = _exactly(stream, 8)
    if head is None:
        return None
    return pickle.loads(_exactly(stream, struct.unpack("<Q", head)[0]) or b"")


def _exactly(stream, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            return None
        data += more
    return data


# ----------------------------------------------------------------------------- the zygote itself


def _serve(kind: str, name: str) -> None:
    import importlib

    del sys.path[0]  # this file's folder (tests/): a command's sys.path[0] is its own (set in _child)

    # what the imports print (a library's warning) every real start prints too: kept, and written by each child
    sys.stderr.flush()
    said = tempfile.TemporaryFile()  # noqa: SIM115 (read back below, the zygote's whole life)
    os.dup2(said.fileno(), 2)
    # the plugin's import-time hooks read argv[0] (`errors.show_warnings_as_lines`: a process whose argv[0] names a
    # mergekit command shows the plugin's warnings as `mergekit-ram: warning:` lines): they run here with the argv[0]
    # the command's process has when they run in it
    if kind == "script":
        script = str(Path(sys.executable).parent / name)
        sys.argv = [script]
        # the script's imports, not its `main()` call (run under another name than __main__)
        with contextlib.suppress(Exception), open(script, "rb") as f:
            exec(compile(f.read(), script, "exec"), {"__name__": "__zygote__", "__file__": script})
    else:
        sys.argv = [_module_file(name)]
    for module in _WARM.get(name, ()):
        with contextlib.suppress(Exception):  # a module a version lacks: the command imports what it needs
            importlib.import_module(module)
    sys.stderr.flush()
    said.seek(0)
    global _preamble
    _preamble = said.read()
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # nothing of the zygote's own reaches the test
    os.dup2(null, 2)
    # a fork copies one thread: with another one running (a library's pool started at import), a child could wait
    # forever on a lock that thread held; then every command starts for real
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    _write(replies, "ready" if threads == 1 else f"{threads} threads")
    while True:
        request = _read(requests)
        if request is None:  # the suite's end: its `atexit` (coverage's save), not the seconds of module teardown
            import atexit

            atexit._run_exitfuncs()
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            replies.close()
            try:
                _child(request)  # ends in SystemExit: an uncaught exception's report is printed there
            except SystemExit as end:
                _leave(end.code)
        _write(replies, pid)
        _, status = os.waitpid(pid, 0)
        _write(replies, status)


def _module_file(name: str) -> str:
    """`sys.argv[0]` of `python -m name` while its code runs: the file runpy runs ("-m" where it finds none)."""
    import runpy

    try:
        return runpy._get_module_details(name)[1].origin  # type: ignore[attr-defined]
    except Exception:  # a package without __main__, ...: runpy fails before it sets argv[0], in the child too
        return "-m"


def _child(request: dict) -> None:
    for fd, path, mode in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT)):
        target = os.open(path, mode, 0o600)
        os.dup2(target, fd)
        os.close(target)
    if request["stderr"] == "&1":
        os.dup2(1, 2)
    else:
        target = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(target, 2)
        os.close(target)
    os.write(2, _preamble)
    sys.stdin = open(0, encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    zygote_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    _rehome(zygote_env, request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = request["argv"]
    kind, name = _command(argv)
    try:
        if kind == "module":  # as `python -m` runs it: sys.argv[0] the module's file, runpy's two frames
            import runpy

            sys.path.insert(0, os.getcwd())
            sys.argv = ["-m", *argv[3:]]
            runpy._run_module_as_main(name, True)
        else:  # the console script's own file, as the interpreter runs it
            import types

            main = types.ModuleType("__main__")
            main.__file__ = argv[0]
            sys.modules["__main__"] = main
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
            sys.argv = list(argv)
            with open(argv[0], "rb") as f:
                code = compile(f.read(), argv[0], "exec")
            exec(code, vars(main))
    except SystemExit:
        raise
    except BaseException as error:  # the interpreter's report of an uncaught exception, without this file's frames
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)  # a hook may read __traceback__
        if isinstance(error, KeyboardInterrupt):  # Python ends by the signal itself after an uncaught Ctrl-C
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
    sys.exit(0)


def _leave(code) -> None:
    """End the child as the interpreter ends a script, but for the teardown of every module (1 s with torch and
    transformers loaded, the most of a forked command's time): other threads joined, `atexit` run (logging's
    flush, coverage's save, temporary folders), the exit status of `SystemExit(code)`, streams flushed."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first: non-daemon threads end
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:  # sys.exit("message"): printed, exit 1
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # as Python says a failed flush at exit
    os._exit(status)


def _rehome(before: dict, now: dict) -> None:
    """huggingface_hub's import-time reading of HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE, ... done again for `now`:
    its `constants` module is re-run, and the copies other modules took of a changed value take the new one: under
    its name (`from ..constants import HF_HUB_CACHE`), or, for a path or URL, under another (transformers'
    `TRANSFORMERS_CACHE`, `HUGGINGFACE_CO_RESOLVE_ENDPOINT`), and transformers' `_is_offline_mode` (before 5)."""
    names = {k for k in {*before, *now} if _hub_variable(k)}
    if all(before.get(k) == now.get(k) for k in names):
        return
    import importlib

    from huggingface_hub import constants

    old = {k: v for k, v in vars(constants).items() if k.isupper()}
    importlib.reload(constants)
    changed = {k: (v, getattr(constants, k)) for k, v in old.items() if getattr(constants, k, v) != v}
    for module in list(sys.modules.values()):
        if module is constants or not getattr(module, "__name__", "").startswith(
            ("huggingface_hub", "transformers", "mergekit")
        ):
            continue
        space = vars(module)
        for name, (was, value) in changed.items():
            if name in space and space[name] is was:
                space[name] = value
        if module.__name__.startswith("transformers"):
            paths = {was: value for was, value in changed.values() if isinstance(was, str) and was}
            for name, held in list(space.items()):
                if name.isupper() and isinstance(held, str) and held in paths:
                    space[name] = paths[held]
    api = getattr(sys.modules.get("huggingface_hub.hf_api"), "api", None)  # `list_repo_files` & co. are its methods
    if api is not None and getattr(api, "endpoint", None) == old.get("ENDPOINT"):
        api.endpoint = constants.ENDPOINT
    hub = sys.modules.get("transformers.utils.hub")
    if hub is not None and hasattr(hub, "HF_MODULES_CACHE"):
        hub.HF_MODULES_CACHE = os.getenv("HF_MODULES_CACHE", os.path.join(constants.HF_HOME, "modules"))
    if hub is not None and hasattr(hub, "_is_offline_mode"):
        hub._is_offline_mode = constants.HF_HUB_OFFLINE


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(*sys.argv[2:4])
