"""RedisStore(replicas=N): every acknowledged write waits for N replicas, and fewer in
time is a typed error, against a real durable primary and replica."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit

import coredis
import pytest
import trio

import sessionactors as sa
from sessionactors import StoreError, StoreNotReplicatedError
from sessionactors.stores import JournalEntry, RedisStore
from sessionactors.testing import EchoModel, check_store

pytestmark = pytest.mark.redis

E = JournalEntry
PATIENCE = 0.3  # replica_timeout of the tests that freeze the replica


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP) for the block, then resumed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _prefix() -> str:
    return f"sa-test:{uuid.uuid4().hex}"


def test_rejects_bad_replica_arguments() -> None:
    """A replica count that is not a whole number of at least 0, or a replica_timeout
    that is not a positive finite number of seconds, is refused at construction, as an
    argument or in the URL, with a message that names it and says what to pass."""
    url = "redis://127.0.0.1:6379/0"
    for replicas in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"redis replicas .* replicas=1"):
            RedisStore(url, replicas=replicas)  # type: ignore[arg-type]
    for patience in (0, -1, math.inf, math.nan, "1", False):
        with pytest.raises(ValueError, match=r"redis replica_timeout .* positive number"):
            RedisStore(url, replicas=1, replica_timeout=patience)  # type: ignore[arg-type]
    bad_urls = [
        f"{url}?replicas=-1",
        f"{url}?replicas=one",
        f"{url}?replicas=",
        f"{url}?replica_timeout=0",
        f"{url}?replica_timeout=soon",
        "redis+cluster://127.0.0.1:7000?replicas=x",
    ]
    for bad in bad_urls:
        with pytest.raises(ValueError, match="redis replica"):
            RedisStore(bad)
    default = RedisStore(url)
    assert (default.replicas, default.replica_timeout) == (0, 1.0)
    from_url = RedisStore(f"{url}?replicas=2&replica_timeout=0.25&persistence=everysec")
    assert (from_url.replicas, from_url.replica_timeout) == (2, 0.25)
    assert from_url.persistence == "everysec"
    both = RedisStore(f"{url}?replicas=1", replicas=1, replica_timeout=3)
    assert (both.replicas, both.replica_timeout) == (1, 3.0)
    assert RedisStore("redis+cluster://h1:1,h2:2?replicas=1").replicas == 1
    assert RedisStore("redis+sentinel://h:1/svc?replica_timeout=2").replica_timeout == 2.0
    assert "replicas=1" in repr(both)


@pytest.mark.parametrize(
    ("query", "named", "other", "same"),
    [
        ("replicas=2", "replicas", 1, 2),
        ("replica_timeout=0.25", "replica_timeout", 3, 0.25),
        ("persistence=always", "persistence", "volatile", "always"),
        ("persistence=everysec", "persistence", "always", "everysec"),
    ],
)
def test_an_option_named_in_the_url_and_as_an_argument_differently_is_refused(
    query: str, named: str, other: object, same: object
) -> None:
    """A URL's ``?persistence=`` (or replicas, replica_timeout) and the argument of the
    same name that differ raise ValueError naming both, as a differing ``?prefix=``
    does: neither silently wins (a URL demanding ``always`` is never weakened by an
    argument elsewhere in the code). The same value named twice is accepted."""
    url = f"redis://127.0.0.1:6379/0?{query}"
    with pytest.raises(ValueError, match=f"{named}.*name one") as refused:
        RedisStore(url, **{named: other})
    assert query.partition("=")[2] in str(refused.value)
    assert repr(other) in str(refused.value)
    assert getattr(RedisStore(url, **{named: same}), named) == same


async def test_passes_check_store_waiting_for_a_replica(redis_replicated: Any) -> None:
    """The store contract holds when every write waits for one replica (given 10 s: the
    check writes values as large as a session may, which a replica of a busy 2-core
    machine took over the default second to confirm once)."""
    stores: list[RedisStore] = []

    def make() -> RedisStore:
        store = RedisStore(redis_replicated.url, prefix=_prefix(), replicas=1, replica_timeout=10)
        stores.append(store)
        return store

    try:
        with trio.fail_after(120):
            await check_store(make)
    finally:
        with trio.fail_after(30):
            for store in stores:
                await store.aclose()


async def test_an_acknowledged_write_is_on_the_replica(redis_replicated: Any) -> None:
    """Once a create, an append, a snapshot or a delete returns, the replica holds it."""
    prefix = _prefix()
    store = RedisStore(redis_replicated.url, prefix=prefix, replicas=1)
    replica = RedisStore(redis_replicated.replica_urls[0], prefix=prefix)
    try:
        with trio.fail_after(20):
            await store.create("chat", b"snap", b"info")
            assert await replica.exists("chat")
            await store.append("chat", [E(1, b"one"), E(2, b"two")], b"info")
            stored = await replica.load("chat")
            assert stored is not None
            assert [e.seq for e in stored.entries] == [1, 2]
            await store.write_snapshot("chat", b"snap2", 2, b"info", trim_upto=2)
            stored = await replica.load("chat")
            assert stored is not None
            assert (stored.snapshot, stored.entries) == (b"snap2", ())
            assert await store.delete("chat")
            assert not await replica.exists("chat")
    finally:
        with trio.fail_after(10):
            await store.aclose()
            await replica.aclose()


@pytest.mark.parametrize("in_url", [False, True])
async def test_a_frozen_replica_fails_acknowledged_writes_in_time(
    redis_replicated: Any, in_url: bool
) -> None:
    """With the replica stopped (SIGSTOP), each write that waits for it raises
    StoreNotReplicatedError, naming the session, within replica_timeout; the write is
    kept on the primary; a store that does not wait (the control) writes as before."""
    prefix = _prefix()
    if in_url:
        url = f"{redis_replicated.url}?replicas=1&replica_timeout={PATIENCE}"
        store = RedisStore(url, prefix=prefix)
    else:
        store = RedisStore(
            redis_replicated.url, prefix=prefix, replicas=1, replica_timeout=PATIENCE
        )
    control = RedisStore(redis_replicated.url, prefix=prefix)
    try:
        with trio.fail_after(30):
            await store.create("chat", b"snap", b"info")
            with frozen(redis_replicated.replica_pids[0]):
                writes = [
                    lambda: store.append("chat", [E(1, b"one")], b"info"),
                    lambda: store.write_snapshot("chat", b"snap1", 1, b"info", trim_upto=0),
                    lambda: store.create("other", b"snap", b"info"),
                    lambda: store.delete("other"),
                ]
                for write in writes:
                    started = trio.current_time()
                    with pytest.raises(StoreNotReplicatedError) as caught:
                        await write()
                    took = trio.current_time() - started
                    assert PATIENCE <= took < PATIENCE + 2
                    error = caught.value
                    assert isinstance(error, StoreError)
                    assert isinstance(error, TimeoutError)
                    assert error.session_id in ("chat", "other")
                    message = str(error)
                    assert f"session {error.session_id!r}" in message
                    assert "fewer than 1 replica(s) confirmed it within 0.3 s" in message
                    assert "kept on the primary" in message
                    assert "INFO replication" in message
                # the control: a store that does not wait for replicas is not held up
                with trio.fail_after(PATIENCE):
                    await control.append("chat", [E(2, b"two")], b"info")
                # the unconfirmed writes are on the primary
                stored = await control.load("chat")
                assert stored is not None
                assert (stored.snapshot, [e.seq for e in stored.entries]) == (b"snap1", [2])
                assert not await control.exists("other")
            await store.append("chat", [E(3, b"three")], b"info")  # confirmed again
    finally:
        with trio.fail_after(10):
            await store.aclose()
            await control.aclose()


def _replica_pid(sentinel_url: str) -> int:
    """The process of the one replica of the master behind ``sentinel_url``."""
    port = urlsplit(sentinel_url.replace("redis+sentinel", "redis", 1)).port
    listed = subprocess.run(
        ["redis-cli", "-p", str(port), "SENTINEL", "replicas", "sa-test"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout.split()  # fmt: skip
    replica = listed[listed.index("port") + 1]
    info = subprocess.run(
        ["redis-cli", "-p", replica, "INFO", "server"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    return int(info.split("process_id:")[1].split()[0])


async def test_concurrent_writes_behind_a_sentinel_all_hear_their_replica_is_late(
    private_redis_sentinel: Callable[..., AbstractContextManager[str]],
) -> None:
    """Behind a Sentinel, with the replica stopped: ten writes at once each raise
    StoreNotReplicatedError. (The first to hear it closed the client under the others,
    for the next calls to ask the Sentinel again: they failed with "Connection lost!",
    told as a StoreError to check that redis is reachable, or with a RuntimeError of
    the client.)"""
    with private_redis_sentinel(replicas=1) as url:
        prefix = _prefix()
        store = RedisStore(url, prefix=prefix, replicas=1, replica_timeout=PATIENCE)
        setup = RedisStore(url, prefix=prefix)  # (no wait: a busy machine's replica is slow)
        raised: list[BaseException] = []

        async def append(name: str) -> None:
            try:
                await store.append(name, [E(1, b"one")], b"info")
            except Exception as exc:
                raised.append(exc)

        with trio.fail_after(30):
            names = [f"s{i}" for i in range(10)]
            for name in names:
                await setup.create(name, b"snap", b"info")
            await setup.aclose()
            with frozen(await trio.to_thread.run_sync(_replica_pid, url)):
                async with trio.open_nursery() as nursery:
                    for name in names:
                        nursery.start_soon(append, name)
            await store.aclose()
        assert len(raised) == 10
        assert all(isinstance(exc, StoreNotReplicatedError) for exc in raised), [
            f"{type(exc).__name__}: {exc}" for exc in raised
        ]


@pytest.mark.soak  # (slow: run by make soak)
async def test_a_cluster_with_replicas_waits_for_them(
    private_redis_cluster: Callable[..., AbstractContextManager[str]],
) -> None:
    """On a Redis Cluster whose masters each have a replica, the store contract holds when every write waits for one replica, and with every replica stopped (SIGSTOP) a write fails with StoreNotReplicatedError within replica_timeout, kept on its master."""
    with private_redis_cluster(replicas=1) as url:
        stores: list[RedisStore] = []

        def make(store_url: str = url, **options: Any) -> RedisStore:
            stores.append(RedisStore(store_url, prefix=_prefix(), replicas=1, **options))
            return stores[-1]

        try:
            with trio.fail_after(120):
                await check_store(make)
                waiting = make(replica_timeout=PATIENCE)
                control = RedisStore(url, prefix=waiting.prefix)
                stores.append(control)
                parts = urlsplit(url)
                pids = []
                async with coredis.RedisCluster(parts.hostname, parts.port) as admin:
                    for node in await admin.cluster_nodes():
                        if "slave" in node["flags"]:
                            async with coredis.Redis(node["host"], node["port"]) as replica:
                                pids.append(int(str((await replica.info("server"))["process_id"])))
                assert len(pids) == 3
                with contextlib.ExitStack() as stack:
                    for pid in pids:
                        stack.enter_context(frozen(pid))
                    for name in ("a", "b", "c"):  # (sessions on different masters, likely)
                        started = trio.current_time()
                        with pytest.raises(StoreNotReplicatedError, match=f"session {name!r}"):
                            await waiting.create(name, b"snap", b"info")
                        assert PATIENCE <= trio.current_time() - started < PATIENCE + 2
                        assert await control.exists(name)  # kept on its master
                await waiting.append("a", [E(1, b"one")], b"info")  # confirmed again
        finally:
            with trio.fail_after(30):
                for store in stores:
                    await store.aclose()


async def test_more_replicas_than_exist_is_refused(redis_replicated: Any) -> None:
    """Asking for more replicas than the primary has fails every acknowledged write
    with StoreNotReplicatedError, and reads still work."""
    store = RedisStore(redis_replicated.url, prefix=_prefix(), replicas=2, replica_timeout=PATIENCE)
    try:
        with trio.fail_after(10):
            with pytest.raises(StoreNotReplicatedError, match="fewer than 2 replica"):
                await store.create("chat", b"snap", b"info")
            assert await store.exists("chat")
    finally:
        with trio.fail_after(10):
            await store.aclose()


async def test_a_fenced_owner_writes_on_after_an_unconfirmed_append(
    redis_replicated: Any,
) -> None:
    """An append whose replicas did not confirm it leaves the lease holder able to write
    on (the store takes its outcome as unsure, not as lost or as another owner's)."""
    store = RedisStore(redis_replicated.url, prefix=_prefix(), replicas=1, replica_timeout=PATIENCE)
    try:
        with trio.fail_after(20):
            await store.create("chat", b"snap", b"info")
            lease = await store.claim("chat", "w1", 30)
            assert lease is not None
            await store.append("chat", [E(1, b"one")], b"info", fence=lease.fence)
            with frozen(redis_replicated.replica_pids[0]), pytest.raises(StoreNotReplicatedError):
                await store.append("chat", [E(2, b"two")], b"info", fence=lease.fence)
            await store.append("chat", [E(3, b"three")], b"info", fence=lease.fence)
            stored = await store.load("chat")
            assert stored is not None
            assert [e.seq for e in stored.entries] == [1, 2, 3]
    finally:
        with trio.fail_after(10):
            await store.aclose()


async def test_a_turn_through_a_registry_hears_of_an_unconfirmed_write(
    redis_replicated: Any,
) -> None:
    """Through a registry, a turn whose journal append no replica confirmed fails with
    SessionCrashedError caused by StoreNotReplicatedError; the session restarts from what
    the primary holds, which includes that turn."""
    store = RedisStore(redis_replicated.url, prefix=_prefix(), replicas=1, replica_timeout=PATIENCE)
    agents = {"echo": sa.Agent(model=EchoModel())}
    try:
        with trio.fail_after(30):
            async with sa.open_registry(store=store, agents=agents) as registry:
                ref = await registry.spawn("chat")
                await ref.send("first")
                with (
                    frozen(redis_replicated.replica_pids[0]),
                    pytest.raises(sa.SessionCrashedError) as caught,
                ):
                    await ref.send("second")
                assert isinstance(caught.value.__cause__, StoreNotReplicatedError)
                texts = [m.content for m in await ref.history()]
                assert texts[-2:] == ["second", "second"]
    finally:
        with trio.fail_after(10):
            await store.aclose()


@pytest.mark.parametrize("replicas", [0, 1])
async def test_a_sentinel_store_that_waits_for_no_replica_says_what_a_failover_loses(
    redis_sentinel_url: str, caplog: pytest.LogCaptureFixture, replicas: int
) -> None:
    """A store behind a Sentinel with the default replicas=0 says once, at WARNING as it
    first connects, that a failover loses what the old master acknowledged and had not
    sent, and how to wait for a replica (a Sentinel failover lost 486 of 2,079
    acknowledged turns with one ERROR line); one with replicas=1 says nothing."""
    store = RedisStore(redis_sentinel_url, prefix=_prefix(), replicas=replicas)
    with trio.fail_after(30):
        for _ in range(3):
            assert not await store.exists("nobody")
        await store.aclose()
    said = [r for r in caplog.records if "failover" in r.getMessage()]
    if replicas:
        assert said == []
    else:
        [warned] = said
        assert warned.levelname == "WARNING"
        assert "replicas=1" in warned.getMessage()
