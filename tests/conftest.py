"""Shared fixtures."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import sessionactors as sa
from redis_workers import open_worker
from sessionactors.testing import EchoModel


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Captured output and logs with lone surrogates (tests feed the library such text on
    purpose) are kept with the surrogates escaped: a test's report must be UTF-8 to
    travel from a ``-n`` worker process (pytest-xdist) to the main one."""
    report = yield
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]
    return report


@pytest.fixture
def otel() -> Iterator[Any]:
    """An OpenTelemetry SDK of the test's own, in memory: ``otel_sdk.Otel``."""
    from otel_sdk import Otel  # (the SDK is imported only by the tests that use it)

    setup = Otel()
    yield setup
    setup.shutdown()


@pytest.fixture
def echo_agents() -> dict[str, sa.Agent]:
    """One agent, "echo", whose model streams the user's words back."""
    return {"echo": sa.Agent(model=EchoModel())}


def _load_redis_server() -> ModuleType:
    # tests/ is not a package: load the helper from its path, whatever sys.path holds.
    name = "_sessionactors_tests_redis_server"
    module = sys.modules.get(name)
    if module is None:
        path = Path(__file__).resolve().parent / "redis_server.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of a redis-server for this test session (skips if there is none)."""
    with _load_redis_server().redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """The ``redis+cluster://`` URL of a three-master Redis Cluster (skips if there is none)."""
    with _load_redis_server().redis_cluster() as url:
        yield url


@pytest.fixture(scope="session")
def redis_sentinel_url() -> Iterator[str]:
    """The ``redis+sentinel://`` URL of a master behind a Sentinel (skips if there is none)."""
    with _load_redis_server().redis_sentinel() as url:
        yield url


@pytest.fixture(params=["redis", "cluster", "sentinel"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Each deployment in turn: one server, a three-master cluster, a Sentinel's master."""
    fixture = {"redis": "redis_url", "cluster": "redis_cluster_url"}.get(
        request.param, "redis_sentinel_url"
    )
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def two_redis_workers(
    redis_url: str,
) -> Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]]:
    """``two_redis_workers(agents, prefix=None)``: a context manager opening the registries
    of two workers, "a" and "b", on the test session's Redis under ``prefix`` (a fresh
    one if None): ``redis_workers.open_worker``'s, with ``agents``."""

    @contextlib.asynccontextmanager
    async def start(
        agents: dict[str, sa.Agent], prefix: str | None = None
    ) -> AsyncIterator[tuple[sa.Registry, sa.Registry]]:
        under = prefix or f"sa-test:{uuid.uuid4().hex}"
        async with (
            open_worker(redis_url, under, "a", agents=agents) as a,
            open_worker(redis_url, under, "b", agents=agents) as b,
        ):
            yield a, b

    return start


@pytest.fixture
def private_redis_server() -> Callable[..., AbstractContextManager[str]]:
    """``private_redis_server(port=None)``: a context manager running a throwaway redis-server."""
    start: Callable[..., AbstractContextManager[str]] = _load_redis_server().private_redis_server
    return start


@pytest.fixture
def private_redis_sentinel() -> Callable[..., AbstractContextManager[str]]:
    """``private_redis_sentinel(service=..., replicas=0)``: a context manager running a
    throwaway master, its replicas and a Sentinel; it gives the ``redis+sentinel://`` URL."""
    start: Callable[..., AbstractContextManager[str]] = _load_redis_server().private_redis_sentinel
    return start


@pytest.fixture
def private_redis_cluster() -> Callable[..., AbstractContextManager[str]]:
    """``private_redis_cluster(masters=3, tls=None)``: a context manager running a
    throwaway Redis Cluster (over TLS with ``tls=(certificate, key)``); it gives the URL."""
    start: Callable[..., AbstractContextManager[str]] = _load_redis_server().private_redis_cluster
    return start


@pytest.fixture
def tls_certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (skips without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make the test's certificate")
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def redis_replicated() -> Iterator[Any]:
    """A durable primary with one durable replica for this test session: ``.url``,
    ``.replica_urls``, ``.replica_pids`` (``tests/redis_server.py``'s ``Replicated``)."""
    with _load_redis_server().private_redis_replicated() as replicated:
        yield replicated
