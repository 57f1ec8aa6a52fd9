"""``python -m sessionactors ARGS`` run to its end in a process forked from one that has
imported the package already, rather than in a new interpreter.

The command runs as in a process of its own (it is one: its own exit status, standard
streams, environment and working directory; the package's ``__main__`` run as ``-m``
runs it), without the 0.4-1.2 s that each new interpreter spends importing the package
and a Redis client: the command-line tests run hundreds of commands. The tests that
start the command line in other ways (servers, workers, signals, another user) still
start a new interpreter each time.

A forking process serves one command at a time; a command asked for while every one is
busy (from another thread) starts another.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

# The forking process: it imports what the command line imports (the Redis client if it
# is installed), then for each request (a JSON line) forks a child that runs the
# command with its files as its standard streams; it answers with the child's pid, then
# with its exit status. It starts no thread (a fork copies only the thread that calls it).
_FORKER = r"""
import json, os, random, runpy, sys, threading, traceback
import sessionactors, sessionactors._cli
try:
    import sessionactors.stores._redis
except ImportError:
    pass
assert threading.active_count() == 1, threading.enumerate()
requests = os.fdopen(int(sys.argv[1]), "r")
answers = os.fdopen(int(sys.argv[2]), "w")
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            requests.close()
            answers.close()
            for fd, (path, flags) in enumerate(
                [(request["stdin"], os.O_RDONLY), (request["stdout"], os.O_WRONLY),
                 (request["stderr"], os.O_WRONLY)]
            ):
                opened = os.open(path, flags)
                os.dup2(opened, fd)
                os.close(opened)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            random.seed()
            sys.argv = ["-m", *request["args"]]
            code = 0
            try:
                runpy.run_module("sessionactors", run_name="__main__", alter_sys=True)
            except SystemExit as exc:  # (as the interpreter ends on it)
                if exc.code is None:
                    code = 0
                elif isinstance(exc.code, int):
                    code = exc.code
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os._exit(code)
    answers.write(json.dumps({"pid": pid}) + "\n")
    answers.flush()
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    answers.flush()
"""


class _Forker:
    """A forking process, and the pipes that ask it for commands."""

    def __init__(self) -> None:
        requests, self._requests_w = os.pipe()
        self._answers_r, answers = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _FORKER, str(requests), str(answers)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(requests, answers),
        )
        os.close(requests)
        os.close(answers)
        self._requests: IO[str] = os.fdopen(self._requests_w, "w")
        self._answers: IO[str] = os.fdopen(self._answers_r, "r")

    def run(
        self,
        args: Sequence[str],
        stdin: str | None,
        env: dict[str, str],
        cwd: str,
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory(prefix="sa-cli-") as tmp:
            streams = {name: Path(tmp, name) for name in ("stdin", "stdout", "stderr")}
            streams["stdin"].write_text(stdin or "", encoding="utf-8")
            streams["stdout"].touch()
            streams["stderr"].touch()
            request = {
                "args": list(args),
                "env": env,
                "cwd": cwd,
                **{name: str(path) for name, path in streams.items()},
            }
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
            pid = json.loads(self._answers.readline())["pid"]
            killed: list[bool] = []
            timer = threading.Timer(timeout, _kill, (pid, killed))
            timer.start()
            try:
                status = json.loads(self._answers.readline())["status"]
            finally:
                timer.cancel()
            command = [sys.executable, "-m", "sessionactors", *args]
            stdout = streams["stdout"].read_text(encoding="utf-8")
            stderr = streams["stderr"].read_text(encoding="utf-8")
            if killed:
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
            return subprocess.CompletedProcess(command, status, stdout, stderr)

    def close(self) -> None:
        self._requests.close()  # (its end of input: it exits)
        try:
            self.process.wait(10)
        finally:
            self._answers.close()


def _kill(pid: int, killed: list[bool]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
        killed.append(True)


_idle: list[_Forker] = []
_lock = threading.Lock()


@contextlib.contextmanager
def _forker() -> Iterator[_Forker]:
    with _lock:
        forker = _idle.pop() if _idle else None
    if forker is None:
        forker = _Forker()
    try:
        yield forker
    except BaseException:  # (a request cut short leaves its answers unread: not used again)
        forker.process.kill()
        forker.close()
        raise
    with _lock:
        _idle.append(forker)


@atexit.register
def _close_all() -> None:
    with _lock:
        forkers = list(_idle)
        _idle.clear()
    for forker in forkers:
        with contextlib.suppress(Exception):
            forker.close()


def run(
    args: Sequence[str],
    *,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python -m sessionactors ARGS`` with ``stdin`` its input, ``env`` its whole
    environment (this process's by default) and ``cwd`` its directory (this process's by
    default), to its end (killed after ``timeout`` seconds: ``subprocess.TimeoutExpired``),
    as ``subprocess.run(..., capture_output=True, text=True)`` runs it."""
    environment = dict(os.environ if env is None else env)
    directory = os.fspath(cwd) if cwd is not None else os.getcwd()
    with _forker() as forker:
        return forker.run(args, stdin, environment, directory, timeout)
