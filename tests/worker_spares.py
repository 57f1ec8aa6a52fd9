"""Worker processes (``tests/cluster_worker.py``) started ahead, for the tests that run
workers in processes: ``open_worker_process(args)`` gives one running with ``args`` (its
command line), taken from the spares if there is one; ``start_spares()``, called by a test
that took some once its workers are gone, starts spares for the next test."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import trio

WORKER = Path(__file__).with_name("cluster_worker.py")


class SpareProcess:
    """A started ``cluster_worker.py --spare`` with the part of trio.Process's interface
    the tests use: ``pid``, ``returncode``, ``stdin``, ``stdout``, ``send_signal()``,
    ``kill()``, ``wait()``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdin is not None
        assert popen.stdout is not None
        self._popen = popen
        self.pid = popen.pid
        self.stdin = trio.lowlevel.FdStream(os.dup(popen.stdin.fileno()))
        self.stdout = trio.lowlevel.FdStream(os.dup(popen.stdout.fileno()))
        popen.stdin.close()
        popen.stdout.close()

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def send_signal(self, signum: int) -> None:
        self._popen.send_signal(signum)

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        while (code := self._popen.poll()) is None:
            await trio.sleep(0.01)
        return code


#: Worker processes started ahead (interpreter started, modules imported), waiting for
#: their arguments: a test's workers start without waiting for their imports. Each test
#: that started workers starts as many again as it took (up to ``_SPARE_COUNT``) for the
#: next when it ends, not while it runs (they would take the CPU from its workers).
_SPARES: list[subprocess.Popen[bytes]] = []
_SPARE_COUNT = 4


def _spare() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--spare"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


def start_spares() -> None:
    while len(_SPARES) < _SPARE_COUNT:
        _SPARES.append(_spare())


@atexit.register
def _end_spares() -> None:
    for popen in _SPARES:  # (the end of its input ends a spare)
        assert popen.stdin is not None
        assert popen.stdout is not None
        popen.stdin.close()
        popen.wait(10)
        popen.stdout.close()
    _SPARES.clear()


async def open_worker_process(args: list[str]) -> SpareProcess:
    """A worker process running with ``args`` (cluster_worker.py's command line)."""
    process = SpareProcess(_SPARES.pop(0) if _SPARES else _spare())
    await process.stdin.send_all(json.dumps(args).encode() + b"\n")
    return process
