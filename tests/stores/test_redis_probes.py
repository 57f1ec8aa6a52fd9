"""Probes of RedisStore at its edges: URLs with odd options, faults under a live registry."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import subprocess
import uuid
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import coredis
import pytest
import trio

import sessionactors as sa
from redis_server import free_port
from sessionactors.stores import JournalEntry, RedisStore, StoredSession
from test_cluster_faults import AOF_ALWAYS, TIMEOUT, lost_or_repeated, pid_of, run_through, untyped

pytestmark = pytest.mark.redis

PrivateServer = Callable[..., AbstractContextManager[str]]


def _new_prefix() -> str:
    return f"sa-probe-{uuid.uuid4().hex[:8]}"


# -- URLs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        # the client would decode replies (the store reads bytes) or ask for none
        ("redis://127.0.0.1:6379/0?decode_responses=true", "decode_responses"),
        ("redis://127.0.0.1:6379/0?noreply=yes", "noreply"),
        ("redis://127.0.0.1:6379/0?connection_class=x", "connection_class"),
        # a misspelt option of the store's own: no replica would be waited for
        ("redis://127.0.0.1:6379/0?replica=1", "replica"),
        ("redis://127.0.0.1:6379/0?persistance=volatile", "persistance"),
        # a TLS option on a URL without TLS
        ("redis://127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem", "rediss://"),
        # TLS options that no TLS connection can take (as a cluster URL's are checked)
        ("rediss://127.0.0.1:6380/0?ssl_cert_reqs=bogus", "none, optional, required"),
        ("rediss://127.0.0.1:6380/0?ssl_check_hostname=maybe", "not true or false"),
        ("rediss://h:1/0?ssl_cert_reqs=none&ssl_check_hostname=yes", "checks no certificate"),
        ("rediss://h:1/0?ssl_certfile=client.pem", "both ssl_certfile and ssl_keyfile"),
        # a port or a database that no server can have
        ("redis://127.0.0.1:notaport/0", "port"),
        ("redis://127.0.0.1:99999/0", "port"),
        ("redis://127.0.0.1:6379/0?db=abc", "database"),
        ("redis://127.0.0.1:6379/1?db=2", "database"),
        ("redis+cluster://127.0.0.1:99999", "port"),
        # no server named: every call failed with "check that redis-server is reachable"
        ("redis://", "host"),
        ("redis:///0", "host"),
        ("rediss://:secret@/0", "host"),
        ("unix://", "socket"),
        # a cluster has one database: a path would be dropped without a word
        ("redis+cluster://127.0.0.1:7000/3", "database"),
    ],
)
def test_a_url_the_store_cannot_use_as_written_is_refused_at_construction(
    url: str, says: str
) -> None:
    """An option that breaks the store (replies decoded to text, no replies), one that
    nothing reads (a misspelling: ``?replica=1`` would wait for no replica), a TLS option
    without TLS, a port out of range and a database in a cluster URL are refused when the
    store is built, with a ValueError naming what to change; before, they were accepted
    and then either ignored or failed every call with a StoreError that says to retry."""
    with pytest.raises(ValueError, match=says) as caught:
        RedisStore(url)
    assert "redis url" in str(caught.value)


def test_the_client_options_that_work_are_still_accepted() -> None:
    """The client's own options the store can live with still pass (positive control)."""
    for url in [
        "redis://127.0.0.1:6379/0?client_name=app&max_connections=20&connect_timeout=2",
        "redis://127.0.0.1:6379?stream_timeout=3&max_idle_time=30&timeout=5&db=2",
        "redis://127.0.0.1:6379/2?db=2&persistence=everysec&replicas=1",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem",
        "unix:///run/redis.sock?db=1",
        "redis://:secret@127.0.0.1/0?noevict=true&notouch=true",
    ]:
        assert RedisStore(url).url == url


async def test_an_odd_option_does_not_fail_every_call(redis_url: str) -> None:
    """Negative control at the call: a URL accepted at construction works at its first call."""
    store = RedisStore(f"{redis_url}?client_name=probe&connect_timeout=2", prefix=_new_prefix())
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i")
        assert await store.exists("s")
        await store.delete("s")
        await store.aclose()
    assert issubclass(sa.StoreError, sa.SessionActorsError)


def test_a_prefix_in_the_url_is_the_stores_prefix() -> None:
    """``?prefix=`` in any kind of URL sets the key prefix (the command line's --store
    has no other way to name it); one that contradicts ``prefix=`` (whatever it names,
    the default prefix too: only a prefix= left out defers to the URL), or holds a
    brace, is refused with a ValueError."""
    for url in [
        "redis://127.0.0.1:6379/0?prefix=chat",
        "redis+cluster://127.0.0.1:7000?prefix=chat",
        "redis+sentinel://127.0.0.1:26379/sessions?prefix=chat&persistence=everysec",
    ]:
        assert RedisStore(url).prefix == "chat"
        assert RedisStore(url, prefix="chat").prefix == "chat"
    assert RedisStore("redis://127.0.0.1:6379/0").prefix == "sessionactors"
    assert RedisStore("redis://127.0.0.1:6379/0", prefix="chat").prefix == "chat"
    assert RedisStore("redis://127.0.0.1:6379/0?prefix=sessionactors").prefix == "sessionactors"
    for explicit in ("other", "sessionactors"):
        with pytest.raises(ValueError, match=f"'chat' and prefix= names '{explicit}'; name one"):
            RedisStore("redis://127.0.0.1:6379/0?prefix=chat", prefix=explicit)
    with pytest.raises(ValueError, match="brace"):
        RedisStore("redis://127.0.0.1:6379/0?prefix=a{b}")
    with pytest.raises(ValueError, match="empty"):
        RedisStore("redis://127.0.0.1:6379/0?prefix=")


# -- faults under two live workers ------------------------------------------------------


async def test_redis_killed_and_restarted_keeps_every_acknowledged_turn(
    private_redis_server: PrivateServer, tmp_path: Path
) -> None:
    """redis-server killed by SIGKILL under traffic from two workers and started again on
    its files (appendonly yes, appendfsync always, as the Redis how-to asks): every send
    ends with a reply or a typed error, the workers go on once it is back, and nothing
    acknowledged is lost nor any keyed turn run twice."""
    port = free_port()
    with contextlib.ExitStack() as servers:
        url = servers.enter_context(
            private_redis_server(port, config=AOF_ALWAYS, directory=str(tmp_path))
        )
        pid = await pid_of(url)

        async def kill_and_restart() -> None:
            os.kill(pid, signal.SIGKILL)
            await trio.sleep(1.5 * TIMEOUT)
            await trio.to_thread.run_sync(
                servers.enter_context,
                private_redis_server(port, config=AOF_ALWAYS, directory=str(tmp_path)),
            )

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            traffic, texts = await run_through(url, kill_and_restart)
    assert untyped(traffic.outcomes) == []
    assert lost_or_repeated(traffic, texts) == []


async def test_every_client_connection_killed_under_traffic(
    private_redis_server: PrivateServer,
) -> None:
    """``CLIENT KILL`` of every connection but the killer's (the store's clients, the
    worker channels' subscriptions), twice, under traffic from two workers: every send
    ends with a reply or a typed error, replies come again, nothing acknowledged is lost."""
    with private_redis_server(config=AOF_ALWAYS) as url:

        async def kill_clients() -> None:
            async with coredis.Redis.from_url(url) as client:
                for _ in range(2):
                    for kind in (coredis.PureToken.NORMAL, coredis.PureToken.PUBSUB):
                        await client.client_kill(type_=kind, skipme=True)
                    await trio.sleep(0.2)

        traffic, texts = await run_through(url, kill_clients)
    assert untyped(traffic.outcomes) == []
    assert lost_or_repeated(traffic, texts) == []


# -- a cluster slot migrating ---------------------------------------------------------


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10
    )
    return done.stdout.strip()


class _Migration:
    """The slot of a store's keys (all in one slot: one session) moved from its master to
    another, as ``redis-cli --cluster reshard`` does: in steps."""

    def __init__(self, url: str) -> None:
        self.first = urlsplit(url).port or 0
        # id, port of every master, and the slots it serves
        self.masters: dict[str, tuple[int, list[str]]] = {}
        for line in _cli(self.first, "CLUSTER", "NODES").splitlines():
            (
                node_id,
                address,
                flags,
                *_,
            ) = line.split()[:4]
            if "master" in flags:
                port = int(address.split("@")[0].rpartition(":")[2])
                self.masters[node_id] = (port, line.split()[8:])

    def start(self, prefix: str) -> None:
        keys: list[str] = []
        for node_id, (port, _) in self.masters.items():
            found = _cli(port, "--scan", "--pattern", f"{prefix}:{{*").split()  # (one group)
            if found:
                keys, self.source = found, node_id
        self.keys = keys
        self.slot = _cli(self.first, "CLUSTER", "KEYSLOT", keys[0])
        self.target = next(n for n in self.masters if n != self.source)
        src, dst = self.masters[self.source][0], self.masters[self.target][0]
        assert _cli(dst, "CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.source) == "OK"
        assert _cli(src, "CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.target) == "OK"

    def move_keys(self, keys: list[str]) -> None:
        src, dst = self.masters[self.source][0], self.masters[self.target][0]
        assert _cli(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", *keys) == "OK"

    def finish(self) -> None:
        for port, _ in self.masters.values():
            _cli(port, "CLUSTER", "SETSLOT", self.slot, "NODE", self.target)


@pytest.mark.soak  # (a fault run: make soak)
async def test_writes_wait_through_a_slot_migration(private_redis_cluster: PrivateServer) -> None:
    """A session's slot moves to another master (resharding: the slot migrating, its keys
    moved, then the slot handed over) while the store appends to it: Redis refuses a
    script whose keys are not all on one side meanwhile (TRYAGAIN, ASK), and the
    store's keys include some that need not exist (the lease, the shard), so every
    write to the slot's sessions was refused for the whole migration, and the caller
    got a StoreError ("Maximum retries exhausted", "check that redis-server is
    reachable"). A migration shorter than the store's timeout is now waited through;
    one longer ends with a StoreError that says the slot is being migrated."""
    with private_redis_cluster() as url, trio.fail_after(60):
        prefix = _new_prefix()
        store = RedisStore(url, prefix=prefix, timeout=5)
        await store.create("s", b"snap", b"i")
        await store.append("s", [JournalEntry(1, b"one")], b"i")
        migration = _Migration(url)
        await trio.to_thread.run_sync(migration.start, prefix)
        log = next(k for k in migration.keys if k.endswith(":log"))
        await trio.to_thread.run_sync(migration.move_keys, [log])  # the keys split

        async def finish_later() -> None:
            await trio.sleep(0.5)
            rest = [k for k in migration.keys if k != log]
            await trio.to_thread.run_sync(migration.move_keys, rest)
            await trio.sleep(0.3)
            await trio.to_thread.run_sync(migration.finish)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(finish_later)
            await store.append("s", [JournalEntry(2, b"two")], b"i")
        loaded = await store.load("s")
        assert loaded is not None
        assert [e.data for e in loaded.entries] == [b"one", b"two"]

        # a migration that outlasts the timeout: a StoreError that says so, in time
        short = RedisStore(url, prefix=prefix, timeout=1)  # (no time to wait: at once)
        await trio.to_thread.run_sync(migration.__init__, url)
        await trio.to_thread.run_sync(migration.start, prefix)
        await trio.to_thread.run_sync(migration.move_keys, [log])
        with pytest.raises(sa.StoreError, match="migrat") as caught:
            await short.append("s", [JournalEntry(3, b"three")], b"i")
        assert caught.value.session_id == "s"
        await store.aclose()
        await short.aclose()


# -- redis out of memory ------------------------------------------------------------


async def test_a_full_redis_says_so_and_the_store_recovers(
    private_redis_server: PrivateServer,
) -> None:
    """``maxmemory`` reached with ``noeviction`` (what the how-to recommends): a write
    raises a StoreError that names the session and says redis is out of memory and what
    to do (before: "check that redis-server is reachable", which it is); once memory is
    freed the same store writes again and nothing stored was lost."""
    with private_redis_server() as url, trio.fail_after(30):
        store = RedisStore(url, prefix=_new_prefix())
        await store.create("s", b"snap", b"i")
        await store.append("s", [JournalEntry(1, b"one")], b"i")
        async with coredis.Redis.from_url(url) as client:
            used = int((await client.info("memory"))["used_memory"])
            await client.config_set({"maxmemory": str(used // 2)})
            with pytest.raises(sa.StoreError, match="out of memory") as caught:
                await store.append("s", [JournalEntry(2, b"two")], b"i")
            assert caught.value.session_id == "s"
            assert "maxmemory" in str(caught.value)
            assert "reachable" not in str(caught.value)
            await client.config_set({"maxmemory": "0"})
        await store.append("s", [JournalEntry(2, b"two")], b"i")
        loaded = await store.load("s")
        assert loaded is not None
        assert [e.data for e in loaded.entries] == [b"one", b"two"]
        await store.aclose()


# -- hostile prefixes -------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [b"app", 5, "app\udc80", None])
def test_a_prefix_no_key_can_start_with_is_refused_at_construction(prefix: object) -> None:
    """A prefix that is not text, or text with a lone surrogate (no UTF-8, so no redis
    key), is refused when the store is built with a ValueError naming it; before, bytes
    and numbers met a bare TypeError from a brace check, and a lone surrogate passed and
    then failed every call with a UnicodeEncodeError, an error of no sessionactors type."""
    with pytest.raises(ValueError, match="prefix"):
        RedisStore("redis://127.0.0.1:6379/0", prefix=prefix)  # type: ignore[arg-type]


async def test_glob_and_non_ascii_prefixes_keep_their_sessions_apart(redis_url: str) -> None:
    """Prefixes with glob characters, non-ASCII text, or one that starts another, keep
    their sessions apart (no key pattern is ever built from a prefix)."""
    base = _new_prefix()
    prefixes = [f"{base}*", f"{base}?[a]", f"{base}é", base, f"{base}:activity", f"{base}:w"]
    stores = [RedisStore(redis_url, prefix=p) for p in prefixes]
    with trio.fail_after(20):
        for i, store in enumerate(stores):
            await store.create(f"only-{i}", b"snap", b"info")
        for i, store in enumerate(stores):
            assert [n for n, _ in await store.list_sessions()] == [f"only-{i}"]
            assert [n for n, _ in await store.list_page(after=None, limit=10)] == [f"only-{i}"]
        for i, store in enumerate(stores):
            assert await store.delete(f"only-{i}")
            await store.aclose()


# -- a cluster master lost --------------------------------------------------------------


async def _kill_a_master_without(url: str, prefix: str) -> None:
    """SIGKILL a master of the cluster at ``url`` that holds no key under ``prefix``."""
    migration = await trio.to_thread.run_sync(_Migration, url)
    holding = set()
    for node_id, (port, _) in migration.masters.items():
        if await trio.to_thread.run_sync(
            lambda p=port: _cli(p, "--scan", "--pattern", f"{prefix}:*")
        ):
            holding.add(node_id)
    port = next(p for n, (p, _) in migration.masters.items() if n not in holding)
    info = await trio.to_thread.run_sync(_cli, port, "INFO", "server")
    pid = int(next(line for line in info.splitlines() if line.startswith("process_id:"))[11:])
    os.kill(pid, signal.SIGKILL)


async def test_a_cluster_master_killed_fails_calls_with_store_errors_only(
    private_redis_cluster: PrivateServer,
) -> None:
    """A master of a Redis Cluster killed (SIGKILL; no replica to take over): renewing
    leases goes through a pipeline of scripts, for which the cluster client asks every
    master whether it has them; the dead master's answer, an exception, made the client
    fail inside its merge with a TypeError, which reached the registry as no error of
    sessionactors' and ended it. Now the calls that need the dead master raise
    StoreError, and a session whose keys live on a master still up keeps working: its
    lease is renewed too (the pipeline failed, so the leases of every session of the
    worker lapsed, whichever master held them)."""
    with private_redis_cluster() as url, trio.fail_after(60):
        prefix = _new_prefix()
        store = RedisStore(url, prefix=prefix, timeout=20)
        await store.create("s", b"snap", b"i")
        lease = await store.claim("s", "me", 30)
        assert lease is not None
        assert await store.renew_many({"s": lease}, 30) == set()
        await _kill_a_master_without(url, prefix)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            for _ in range(3):
                assert await store.renew_many({"s": lease}, 30) == set()
            await store.append("s", [JournalEntry(1, b"one")], b"i", fence=lease.fence)
            loaded = await store.load("s")
            assert loaded is not None
            assert [e.data for e in loaded.entries] == [b"one"]
            await store.aclose()


async def test_leases_on_the_masters_still_up_are_renewed_when_one_master_is_lost(
    private_redis_cluster: PrivateServer,
) -> None:
    """A master of a Redis Cluster killed that holds some of a worker's sessions: one
    renewal of every lease fails for those (StoreError, saying the others were renewed),
    and renews the leases of the sessions on the masters still up, which another owner
    then cannot claim. (The whole renewal failed, and every lease lapsed.)"""
    with private_redis_cluster() as url, trio.fail_after(60):
        prefix = _new_prefix()
        store = RedisStore(url, prefix=prefix, timeout=5)
        names = await _twelve_sessions(store)
        held_at = await _held_at(url, prefix, names)
        lost_port, lost = next((p, held) for p, held in held_at.items() if held)
        kept = set(names) - lost
        assert kept, held_at
        ttl = 4
        first = trio.current_time()
        leases = {}
        for name in names:
            lease = await store.claim(name, "me", ttl)
            assert lease is not None
            leases[name] = lease
        claimed = trio.current_time()
        assert claimed - first < 2, "the claims took too long for this test's timing"
        await trio.to_thread.run_sync(_kill, lost_port)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            await trio.sleep_until(first + 2.5)  # renewed late: the claims lapse before
            with pytest.raises(sa.StoreError, match="the others were renewed"):
                await store.renew_many(leases, ttl)
            await trio.sleep_until(claimed + ttl + 0.5)  # past every lease as claimed
            for name in kept:  # (another worker's claim, through this store's client)
                assert await store.claim(name, "other", 3) is None, name
            await store.aclose()


async def _twelve_sessions(store: RedisStore) -> list[str]:
    """Twelve sessions created in ``store`` (on a cluster, spread over its masters)."""
    names = [f"s{i}" for i in range(12)]
    for name in names:
        await store.create(name, b"snap", b"i")
    return names


async def _held_at(url: str, prefix: str, names: list[str]) -> dict[int, set[str]]:
    """The sessions of ``names`` under ``prefix`` whose keys each master of the cluster
    at ``url`` holds, by the master's port (the store's documented key layout)."""

    def part(name: str) -> str:  # (what every key of the session holds)
        return ":s:" + base64.urlsafe_b64encode(name.encode()).rstrip(b"=").decode() + ":"

    held_at: dict[int, set[str]] = {}
    for port, _ in (await trio.to_thread.run_sync(_Migration, url)).masters.values():
        keys = await trio.to_thread.run_sync(
            lambda p=port: _cli(p, "--scan", "--pattern", f"{prefix}:*").split()
        )
        held_at[port] = {n for n in names if any(part(n) in key for key in keys)}
    return held_at


def _kill(port: int) -> None:
    """SIGKILL the redis-server at ``port``."""
    info = _cli(port, "INFO", "server")
    os.kill(int(info.split("process_id:")[1].split()[0]), signal.SIGKILL)


# -- listing while sessions come and go -------------------------------------------------


class _Interleaved(coredis.Redis):  # type: ignore[type-arg]
    """A client that runs a step of another process's right after a listing reads a
    page of the listing order (``after_page``), and right before it drops members whose
    session it found gone (``before_drop``): the interleavings a busy app meets."""

    after_page: Callable[[], Any] | None = None
    before_drop: Callable[[], Any] | None = None

    def zrange(self, *args: Any, **kwargs: Any) -> Any:
        step, self.after_page = self.after_page, None
        reply = super().zrange(*args, **kwargs)
        if step is None:
            return reply

        async def run() -> Any:
            members = await reply
            await step()
            return members

        return run()

    def zrem(self, *args: Any, **kwargs: Any) -> Any:
        step, self.before_drop = self.before_drop, None
        if step is None:
            return super().zrem(*args, **kwargs)

        async def run() -> Any:
            await step()
            return await super(_Interleaved, self).zrem(*args, **kwargs)

        return run()


async def test_a_session_deleted_and_created_again_during_a_listing_stays_listed(
    redis_url: str,
) -> None:
    """A listing reads a page naming session "x"; another process deletes "x" (the
    listing finds no info for it: gone) and creates it again before the listing drops
    the member it found gone. The listing dropped the new session's member too, so "x",
    stored, was missing from every later listing of that store object (until its next
    write). Now a member dropped is checked again and put back if its session exists."""
    prefix = _new_prefix()
    other = RedisStore(redis_url, prefix=prefix)
    async with _Interleaved.from_url(redis_url, decode_responses=False) as client:
        store = RedisStore(client=client, prefix=prefix, persistence="volatile")
        with trio.fail_after(20):
            await other.create("x", b"snap", b"i")
            await other.create("y", b"snap", b"i")
            assert sorted(n for n, _ in await store.list_page(after=None, limit=10)) == ["x", "y"]

            async def delete() -> None:
                await other.delete("x")

            async def create() -> None:
                await other.create("x", b"snap", b"again")

            client.after_page, client.before_drop = delete, create
            await store.list_page(after=None, limit=10)
            assert await store.exists("x")
            listed = [n for n, _ in await store.list_page(after=None, limit=10)]
            assert sorted(listed) == ["x", "y"]
            for name in ("x", "y"):
                await other.delete(name)
            await other.aclose()


async def test_a_write_stands_when_only_the_listing_orders_master_is_down(
    private_redis_cluster: PrivateServer,
) -> None:
    """On a cluster the listing order (one key, ``<prefix>:activity``) sits on one master,
    and a write puts its session in it with a command of its own after the write. With
    that master killed, every write to sessions on the masters still up ran, and then
    raised StoreError all the same: a create the caller took as failed (a retry then met
    SessionExistsError), an append the registry took as unsure (its session crashed), so
    no session of the whole cluster could take a turn. The order may be a step behind
    (the how-to says how it is mended): the write now stands."""
    with private_redis_cluster() as url, trio.fail_after(60):
        prefix = _new_prefix()
        store = RedisStore(url, prefix=prefix, timeout=20)
        names = await _twelve_sessions(store)
        held_at = await _held_at(url, prefix, names)
        holder = next(p for p in held_at if _cli(p, "EXISTS", f"{prefix}:activity") == "1")
        name = next(n for p, held in held_at.items() if p != holder for n in sorted(held))
        _kill(holder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            await store.append(name, [JournalEntry(1, b"one")], b"i")
            loaded = await store.load(name)
            assert loaded is not None
            assert [e.data for e in loaded.entries] == [b"one"]
            assert await store.delete(name)
            await store.create(name, b"again", b"i")
            assert await store.load(name) == StoredSession(
                snapshot=b"again", snapshot_seq=0, info=b"i"
            )
            await store.aclose()


# -- a server restarted with weaker persistence -----------------------------------------


async def test_a_server_restarted_without_its_append_only_file_is_refused(
    private_redis_server: PrivateServer, tmp_path: Path
) -> None:
    """redis-server killed and started again on the same port without ``appendonly`` (an
    operator's mistake, a config file lost): the store's client reconnects by itself,
    and the new connection is checked before anything goes over it, so every call
    raises StoreNotDurableError and nothing lands until the server is fixed (before, it
    went on unchecked, acknowledging writes that the next restart loses)."""
    port = free_port()
    with contextlib.ExitStack() as servers, trio.fail_after(30):
        url = servers.enter_context(private_redis_server(port, directory=str(tmp_path)))
        store = RedisStore(url, prefix=_new_prefix())
        await store.create("s", b"snap", b"i")
        os.kill(await pid_of(url), signal.SIGKILL)
        await trio.to_thread.run_sync(
            servers.enter_context,
            private_redis_server(port, config=("--appendonly", "no"), directory=str(tmp_path)),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            with contextlib.suppress(sa.StoreError):  # (the client reconnects by itself)
                await store.exists("s")
            for _ in range(2):  # (refused until the server is fixed)
                with pytest.raises(sa.StoreNotDurableError, match="appendonly is off"):
                    await store.create("t", b"snap", b"i")
            async with coredis.Redis.from_url(url) as client:
                assert await client.dbsize() == 0  # nothing written unchecked
                await client.config_set({"appendonly": "yes"})
            await store.create("t", b"snap", b"i")  # fixed: accepted
        await store.aclose()


async def test_a_connection_cancelled_as_it_opens_logs_no_error(
    private_redis_server: Callable[..., AbstractContextManager[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store call cancelled while its connection's handshake waits on a stalled
    redis-server (SIGSTOP: a move_on_after, a registry closing, a task the app
    cancelled), and the store closed while it still waits, log nothing at ERROR: the
    Redis client said "Connection attempt failed unexpectedly!" with a hundred lines of
    cancellations, which pages an operator for what is no failure. A store works once
    the server answers again."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with private_redis_server() as url, trio.fail_after(30):
        store = RedisStore(url, prefix=prefix, timeout=5.0)
        pid = await pid_of(url)
        os.kill(pid, signal.SIGSTOP)
        try:
            with trio.move_on_after(0.5) as cancelled:
                await store.load("s")
            assert cancelled.cancelled_caught
            await store.aclose()  # (its connection still opening)
        finally:
            os.kill(pid, signal.SIGCONT)
        again = RedisStore(url, prefix=prefix, timeout=5.0)
        assert await again.load("s") is None
        await again.aclose()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [f"{r.name}: {r.getMessage()}" for r in errors]
    # Control: what the client logs of a failure that is no cancellation still shows.
    failure = ConnectionResetError("reset by peer")
    logging.getLogger("coredis").error("Connection attempt failed unexpectedly!", exc_info=failure)
    assert [r.exc_info and r.exc_info[1] for r in caplog.records] == [failure]
