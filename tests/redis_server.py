"""Find or start the redis-server the Redis tests run against.

``SESSIONACTORS_REDIS_URL`` names a running server (CI starts one and sets it).
Otherwise a private ``redis-server`` is started on a free loopback port, with
persistence off, for as long as the context manager is open. Without a
``redis-server`` binary the tests are skipped, unless
``SESSIONACTORS_REQUIRE_REDIS=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

__all__ = ["REQUIRE_ENV", "URL_ENV", "ping", "private_redis_server", "redis_server"]

URL_ENV = "SESSIONACTORS_REDIS_URL"
REQUIRE_ENV = "SESSIONACTORS_REQUIRE_REDIS"

_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 makes redis mandatory)", pytrace=False)
    pytest.skip(reason)


def ping(host: str, port: int, *, timeout: float = 1.0) -> bool:
    """Whether a redis server answers PING at ``host:port`` (or asks for a password)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable("redis-server is not installed (apt-get install redis-server)")
    return binary


@contextlib.contextmanager
def private_redis_server(
    port: int | None = None, *, options: Sequence[str] = (), directory: str | None = None
) -> Iterator[str]:
    """Start a throwaway redis-server (on ``port``, or a free one); yield its URL, then stop it.

    ``options`` are more command-line options (they override the defaults, e.g.
    ``["--appendonly", "yes"]``); ``directory`` keeps its files (to restart it on them).
    """
    binary = _binary()
    with contextlib.ExitStack() as stack:
        tmp = directory or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="sessionactors-redis-")
        )
        log_path = Path(tmp) / "redis.log"
        for _attempt in range(1 if port else 3):  # another process may take a free port first
            chosen = port or _free_port()
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    [
                        binary,
                        "--bind", "127.0.0.1",
                        "--port", str(chosen),
                        "--save", "",
                        "--appendonly", "no",
                        "--daemonize", "no",
                        "--dir", tmp,
                        *options,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )  # fmt: skip
            try:
                deadline = time.monotonic() + _START_TIMEOUT
                while process.poll() is None and time.monotonic() < deadline:
                    if ping("127.0.0.1", chosen):
                        yield f"redis://127.0.0.1:{chosen}/0"
                        return
                    time.sleep(0.02)
            finally:
                _stop(process)
        tail = log_path.read_text(errors="replace")[-2000:]
        pytest.fail(f"could not start {binary}; its log ends with:\n{tail}", pytrace=False)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yield the URL of a usable redis server; skip (or fail) if there is none."""
    url = os.environ.get(URL_ENV)
    if url:
        parts = urlsplit(url)
        if parts.scheme == "redis" and not ping(parts.hostname or "127.0.0.1", parts.port or 6379):
            pytest.fail(f"{URL_ENV}={url} does not answer PING; start redis-server there")
        yield url
        return
    with private_redis_server() as url:
        yield url
