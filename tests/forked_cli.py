"""``python -m sessionactors ARGS`` run to its end in a process forked from one that has
imported the package already, rather than in a new interpreter.

The command runs as in a process of its own (it is one: its own exit status, standard
streams, environment and working directory; the package's ``__main__`` run as ``-m``
runs it), without the 0.4-1.2 s that each new interpreter spends importing the package
and a Redis client: the command-line tests run hundreds of commands. The tests that
start the command line in other ways (servers, workers, signals, another user) still
start a new interpreter each time.

A forking process serves one command at a time; a command asked for while every one is
busy (from another thread) starts another. A command whose environment changes what an
interpreter reads as it starts (``PYTHON*``, ``LC_*``, ``LANG``, ``TZ``) runs in a new
interpreter, as the forked one would keep its forker's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

# The forking process: it imports what the command line imports (the Redis client if it
# is installed; the command line's own modules are imported by each command, so that
# what they note as they load is the command's), then for each request (a JSON line)
# forks a child that runs the command with its files as its standard streams, and ends
# as an interpreter ends (its SystemExit and the exit handlers; an exception's traceback
# and Ctrl-C through the interpreter's own end). It answers with its exit status, killing
# it past its timeout (it owns the child: no other process is hit). It starts no thread
# (a fork copies only the thread that calls it).
_FORKER = r"""
import atexit, json, os, random, runpy, select, sys, threading
import sessionactors, sessionactors.stores
try:
    sessionactors.stores.RedisStore
except (AttributeError, ImportError):
    pass
assert threading.active_count() == 1, threading.enumerate()
requests = os.fdopen(int(sys.argv[1]), "r")
answers = os.fdopen(int(sys.argv[2]), "w")


def command(request):
    requests.close()
    answers.close()
    streams = [(request["stdin"], os.O_RDONLY), (request["stdout"], os.O_WRONLY),
               (request["stderr"], os.O_WRONLY)]
    for fd, (path, flags) in enumerate(streams):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    sys.argv = ["-m", *request["args"]]
    try:
        runpy.run_module("sessionactors", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # (as the interpreter ends on it, without its slow teardown)
        code = exc.code
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        command(request)
    ended = os.pidfd_open(pid)
    timed_out = not select.select([ended], [], [], request["timeout"])[0]
    if timed_out:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(ended)
    answers.write(
        json.dumps({"status": os.waitstatus_to_exitcode(status), "timed_out": timed_out}) + "\n"
    )
    answers.flush()
"""

#: What the interpreter reads of its environment as it starts (a forked command keeps
#: its forker's): a command whose environment sets these otherwise starts an interpreter.
_STARTUP: Final = re.compile(r"PYTHON.*|LC_.*|LANG|LANGUAGE|TZ")


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if _STARTUP.fullmatch(key)}


class _Forker:
    """A forking process, and the pipes that ask it for commands."""

    def __init__(self) -> None:
        self.startup = _startup(os.environ)
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
                "timeout": timeout,
                **{name: str(path) for name, path in streams.items()},
            }
            try:
                self._requests.write(json.dumps(request) + "\n")
                self._requests.flush()
            except BrokenPipeError:
                raise self._ended() from None
            answer = self._answer()
            command = [sys.executable, "-m", "sessionactors", *args]
            stdout = streams["stdout"].read_text(encoding="utf-8")
            stderr = streams["stderr"].read_text(encoding="utf-8")
            if answer["timed_out"]:
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
            return subprocess.CompletedProcess(command, answer["status"], stdout, stderr)

    def _answer(self) -> dict[str, Any]:
        line = self._answers.readline()
        if not line:
            raise self._ended()
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _ended(self) -> RuntimeError:
        return RuntimeError(
            f"the forking process of tests/forked_cli.py ended (status "
            f"{self.process.wait(10)}): see its traceback above, if any"
        )

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # (ended already)
            self._requests.close()  # (its end of input: it exits)
        try:
            self.process.wait(10)
        finally:
            self._answers.close()


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
        if _startup(environment) != forker.startup:  # (see _STARTUP)
            return subprocess.run(
                [sys.executable, "-m", "sessionactors", *args],
                input=stdin or "",
                env=environment,
                cwd=directory,
                timeout=timeout,
                capture_output=True,
                text=True,
                check=False,
            )
        return forker.run(args, stdin, environment, directory, timeout)
