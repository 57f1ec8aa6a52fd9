"""Find or start the redis-server the Redis tests run against.

``SESSIONACTORS_REDIS_URL`` names a running server (CI starts one and sets it),
``SESSIONACTORS_REDIS_CLUSTER_URL`` a three-master Redis Cluster
(``redis+cluster://``) and ``SESSIONACTORS_REDIS_SENTINEL_URL`` a master behind a
Sentinel (``redis+sentinel://``). Each may hold several URLs separated by spaces, one
for each test process (pytest-xdist's ``gw0``, ``gw1``, ...): a process takes the one
at its number (modulo their count), so that the processes do not wait on one
another's writes to one server. Otherwise private ones are started on free
loopback ports, for as long as the context manager is open. Every server they
start is durable (``appendonly yes``, ``appendfsync always``, in a temporary
directory), as ``RedisStore`` requires by default. Without a ``redis-server``
binary the tests are skipped, unless ``SESSIONACTORS_REQUIRE_REDIS=1``, which
turns the skip into a failure.
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
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlencode, urlsplit

import pytest

__all__ = [
    "CLUSTER_URL_ENV",
    "DURABLE",
    "REQUIRE_ENV",
    "SENTINEL_URL_ENV",
    "URL_ENV",
    "Replicated",
    "free_port",
    "ping",
    "private_redis_cluster",
    "private_redis_replicated",
    "private_redis_sentinel",
    "private_redis_server",
    "redis_cluster",
    "redis_sentinel",
    "redis_server",
]

URL_ENV = "SESSIONACTORS_REDIS_URL"
CLUSTER_URL_ENV = "SESSIONACTORS_REDIS_CLUSTER_URL"
SENTINEL_URL_ENV = "SESSIONACTORS_REDIS_SENTINEL_URL"
REQUIRE_ENV = "SESSIONACTORS_REQUIRE_REDIS"
#: What makes a server keep every acknowledged write (RedisStore's default demand).
DURABLE = ("--appendonly", "yes", "--appendfsync", "always", "--save", "")
#: A master serves a replica that joins it at once, not after the default 5 s wait for
#: more replicas to share one transfer (the helpers below that start replicas use it on
#: every server: after a failover a replica is the master).
SYNC_AT_ONCE = ("--repl-diskless-sync-delay", "0")

_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_MAX_CLUSTER_PORT = 55535  # a cluster node's bus port is its port + 10000


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 makes redis mandatory)", pytrace=False)
    pytest.skip(reason)


def _command(port: int, *args: str, timeout: float = 1.0) -> bytes:
    """One command to the server at 127.0.0.1:``port``; its raw reply (b"" if unreachable)."""
    request = f"*{len(args)}\r\n".encode()
    for arg in args:
        request += f"${len(arg.encode())}\r\n{arg}\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(request)
            return sock.recv(65536)
    except OSError:
        return b""


def ping(host: str, port: int, *, timeout: float = 1.0) -> bool:
    """Whether a redis server answers PING at ``host:port`` (or asks for a password)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def free_port(highest: int = 65535) -> int:
    """A loopback TCP port free at the time of asking, at most ``highest``."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port <= highest:
            return port


def _stop(process: subprocess.Popen[bytes]) -> None:
    # A server that is writing its first append-only file (a replica just in sync) refuses
    # a SIGTERM ("Writing initial AOF, can't exit") and goes on: ask again until it stops.
    deadline = time.monotonic() + _STOP_TIMEOUT
    while process.poll() is None and time.monotonic() < deadline:
        process.terminate()  # (a second SIGTERM, unlike a second SIGINT, is no hard exit)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(0.1)
    if process.poll() is None:
        process.kill()
        process.wait()


def _binary(name: str = "redis-server") -> str:
    binary = shutil.which(name)
    if binary is None:
        _unavailable(f"{name} is not installed (apt-get install redis-server)")
    return binary


def _wait_until(ready: object, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while process.poll() is None and time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.02)
    tail = log.read_text(errors="replace")[-2000:]
    pytest.fail(f"{what} did not start; its log ends with:\n{tail}", pytrace=False)


@contextlib.contextmanager
def _server(
    stack: contextlib.ExitStack, tmp: Path, port: int, args: Sequence[str], what: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``redis-server`` with ``args`` on ``port`` in its own directory under ``tmp``;
    yield its process."""
    folder = tmp / str(port)
    folder.mkdir(exist_ok=True)  # (a restart on the same port finds its files again)
    log_path = folder / "redis.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [_binary(), *args, "--bind", "127.0.0.1", "--port", str(port),
             "--daemonize", "no", "--dir", str(folder)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    stack.callback(_stop, process)
    _wait_until(lambda: ping("127.0.0.1", port), process, log_path, what)
    yield process


@contextlib.contextmanager
def private_redis_server(
    port: int | None = None, *, config: Sequence[str] = (), directory: str | None = None
) -> Iterator[str]:
    """Start a throwaway durable redis-server (on ``port``, or a free one), with the extra
    command-line ``config`` (``("--appendonly", "no")`` makes it volatile); yield its URL,
    then stop it. ``directory`` keeps its files (to restart it on them, on the same port)."""
    _binary()
    with contextlib.ExitStack() as files:
        tmp = directory or files.enter_context(
            tempfile.TemporaryDirectory(prefix="sessionactors-redis-")
        )
        for attempt in range(1 if port else 3):  # another process may take a free port first
            chosen = port or free_port()
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(
                        _server(stack, Path(tmp), chosen, [*DURABLE, *config], "redis-server")
                    )
                except pytest.fail.Exception:
                    if port or attempt == 2:
                        raise
                    continue
                yield f"redis://127.0.0.1:{chosen}/0"
                return


@contextlib.contextmanager
def private_redis_cluster(
    masters: int = 3, *, replicas: int = 0, tls: tuple[Path, Path] | None = None
) -> Iterator[str]:
    """Start a throwaway durable Redis Cluster of ``masters`` masters, each with
    ``replicas`` durable replicas (in sync before it is yielded), on 127.0.0.1; yield
    its ``redis+cluster://`` URL (one node), then stop it. With ``tls``
    (a certificate and its key, the certificate its own CA), every node also takes TLS
    on a port of its own, its bus runs over TLS, and the URL is the ``rediss+cluster://``
    one that checks the nodes' certificate against that CA."""
    redis_cli = _binary("redis-cli")
    with (
        tempfile.TemporaryDirectory(prefix="sessionactors-cluster-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        ports = [free_port(_MAX_CLUSTER_PORT) for _ in range(masters * (1 + replicas))]
        tls_ports = [free_port(_MAX_CLUSTER_PORT) for _ in ports] if tls else []
        for i, port in enumerate(ports):
            args = [*DURABLE, *SYNC_AT_ONCE, "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf"]  # fmt: skip
            if tls:  # (a node tells each client the port of the client's own kind)
                cert, key = tls
                args += ["--tls-port", str(tls_ports[i]), "--tls-cluster", "yes",
                         "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip
            stack.enter_context(_server(stack, Path(tmp), port, args, "a cluster node"))
        created = subprocess.run(
            [redis_cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True,
            check=False,
            timeout=60,
        )  # fmt: skip
        if created.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed:\n{created.stdout[-2000:]!r}")
        deadline = time.monotonic() + 30

        def ready(port: int) -> bool:
            if b"cluster_state:ok" not in _command(port, "CLUSTER", "INFO"):
                return False
            role = _command(port, "INFO", "replication")
            if b"role:slave" in role and b"master_link_status:up" not in role:
                return False
            # every node sees every replica as one (gossip spreads roles after the
            # links are up: a client asking this node for the replicas finds them all)
            nodes = _command(port, "CLUSTER", "NODES").splitlines()
            seen = sum(1 for line in nodes if b"slave" in b"".join(line.split()[2:3]))
            return seen >= masters * replicas

        while not all(ready(p) for p in ports):
            if time.monotonic() > deadline:
                pytest.fail("the private redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        if tls:
            query = urlencode({"ssl_ca_certs": str(tls[0]), "ssl_cert_reqs": "required"})
            yield f"rediss+cluster://127.0.0.1:{tls_ports[0]}?{query}"
        else:
            yield f"redis+cluster://127.0.0.1:{ports[0]}"


@dataclass(frozen=True)
class Replicated:
    """A primary and its replicas, started by :func:`private_redis_replicated`."""

    url: str  #: the primary's ``redis://`` URL
    replica_urls: tuple[str, ...]
    replica_pids: tuple[int, ...]  #: to freeze a replica (SIGSTOP) and thaw it (SIGCONT)


@contextlib.contextmanager
def private_redis_replicated(replicas: int = 1) -> Iterator[Replicated]:
    """Start a throwaway durable primary and ``replicas`` durable replicas of it on
    127.0.0.1; yield them once every replica is in sync, then stop them all."""
    with (
        tempfile.TemporaryDirectory(prefix="sessionactors-replicated-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        primary = free_port()
        args = [*DURABLE, *SYNC_AT_ONCE]
        stack.enter_context(_server(stack, Path(tmp), primary, args, "the primary"))
        ports: list[int] = []
        pids: list[int] = []
        for _ in range(replicas):
            port = free_port()
            args = [*DURABLE, *SYNC_AT_ONCE, "--replicaof", "127.0.0.1", str(primary)]
            pids.append(stack.enter_context(_server(stack, Path(tmp), port, args, "a replica")).pid)
            ports.append(port)
        deadline = time.monotonic() + _START_TIMEOUT
        while not all(
            b"master_link_status:up" in _command(port, "INFO", "replication") for port in ports
        ):
            if time.monotonic() > deadline:
                pytest.fail("the private replicas did not reach master_link_status:up")
            time.sleep(0.05)
        yield Replicated(
            url=f"redis://127.0.0.1:{primary}/0",
            replica_urls=tuple(f"redis://127.0.0.1:{port}/0" for port in ports),
            replica_pids=tuple(pids),
        )


@contextlib.contextmanager
def private_redis_sentinel(service: str = "sa-test", *, replicas: int = 0) -> Iterator[str]:
    """Start a throwaway durable redis-server, ``replicas`` durable replicas of it and one
    Sentinel watching it as ``service``; yield the ``redis+sentinel://`` URL once the
    Sentinel knows the master and every replica is in sync, then stop them all."""
    with (
        tempfile.TemporaryDirectory(prefix="sessionactors-sentinel-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        master, sentinel = free_port(), free_port()
        args = [*DURABLE, *SYNC_AT_ONCE]
        stack.enter_context(_server(stack, Path(tmp), master, args, "redis-server"))
        ports = [free_port() for _ in range(replicas)]
        for port in ports:
            args = [*DURABLE, *SYNC_AT_ONCE, "--replicaof", "127.0.0.1", str(master)]
            stack.enter_context(_server(stack, Path(tmp), port, args, "a replica"))
        deadline = time.monotonic() + _START_TIMEOUT
        while not all(
            b"master_link_status:up" in _command(port, "INFO", "replication") for port in ports
        ):  # in sync before the Sentinel starts: its first look at the master lists them
            if time.monotonic() > deadline:
                pytest.fail("the private replicas did not reach master_link_status:up")
            time.sleep(0.05)
        conf = Path(tmp) / "sentinel.conf"
        conf.write_text(f"sentinel monitor {service} 127.0.0.1 {master} 1\n")
        args = [str(conf), "--sentinel"]
        stack.enter_context(_server(stack, Path(tmp), sentinel, args, "redis sentinel"))
        deadline = time.monotonic() + _START_TIMEOUT
        while str(master).encode() not in _command(
            sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", service
        ) or not all(
            str(port).encode() in _command(sentinel, "SENTINEL", "REPLICAS", service)
            for port in ports
        ):
            if time.monotonic() > deadline:
                pytest.fail("the private sentinel does not know its master and replicas")
            time.sleep(0.05)
        yield f"redis+sentinel://127.0.0.1:{sentinel}/{service}"


def _url_from_env(env: str) -> str | None:
    """This test process's URL in ``env`` (which may hold one for each), or None."""
    urls = os.environ.get(env, "").split()
    if not urls:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # unset without pytest-xdist
    number = int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else 0
    return urls[number % len(urls)]


@contextlib.contextmanager
def _from_env(env: str, start: contextlib.AbstractContextManager[str]) -> Iterator[str]:
    url = _url_from_env(env)
    if url:
        yield url
        return
    with start as url:
        yield url


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yield the URL of a usable redis server; skip (or fail) if there is none."""
    url = _url_from_env(URL_ENV)
    if url:
        parts = urlsplit(url)
        if parts.scheme == "redis" and not ping(parts.hostname or "127.0.0.1", parts.port or 6379):
            pytest.fail(f"{URL_ENV}={url} does not answer PING; start redis-server there")
        yield url
        return
    with private_redis_server() as url:
        yield url


def redis_cluster() -> contextlib.AbstractContextManager[str]:
    """The ``redis+cluster://`` URL of a three-master cluster; skip (or fail) if there is none."""
    return _from_env(CLUSTER_URL_ENV, private_redis_cluster())


def redis_sentinel() -> contextlib.AbstractContextManager[str]:
    """The ``redis+sentinel://`` URL of a master behind a Sentinel; skip (or fail) without one."""
    return _from_env(SENTINEL_URL_ENV, private_redis_sentinel())
