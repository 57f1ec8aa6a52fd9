"""Errors no retry can fix are fatal and say what to change: a Redis user without a
command, a key pattern, scripting or blocking commands, and a cluster node reached
through a plain ``redis://`` URL. Real redis-servers and ACL users, no mocks."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from urllib.parse import urlsplit, urlunsplit

import coredis
import pytest
import trio

import sessionactors as sa
from redis_keys import admin_client, drop_prefix, group_key, replace_with_list, session_key
from sessionactors import StoreConfigurationError, StoreError
from sessionactors.stores import JournalEntry, Lease, RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

AGENTS = {"echo": sa.Agent(model=EchoModel())}
#: Everything a store and the multi-worker layer use: every command, key and channel.
FULL = ("on", "resetkeys", "~*", "resetchannels", "&*", "+@all")


@contextlib.asynccontextmanager
async def acl_user(url: str, *rules: str) -> AsyncIterator[str]:
    """A Redis user with ``rules`` on the server at ``url`` for the block; yield a URL
    that logs in as that user."""
    name = f"sa-test-{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex
    async with coredis.Redis.from_url(url) as admin:
        await admin.acl_setuser(name, "reset", f">{password}", *rules)
        try:
            parts = urlsplit(url)
            netloc = f"{name}:{password}@{parts.hostname}:{parts.port}"
            yield urlunsplit(parts._replace(netloc=netloc))
        finally:
            await admin.acl_deluser([name])


def _prefix() -> str:
    return f"sa-test:{uuid.uuid4().hex}"


def check_fatal(
    error: BaseException, *needles: str, closing: bool = False
) -> StoreConfigurationError:
    """``error`` is a StoreConfigurationError, or a group of nothing else, whose message
    says a retry cannot fix it and holds every needle; the first of them. With
    ``closing``, the group may also hold SessionStoppedError for calls that met the
    registry closing because of it."""
    errors = [error]
    while any(isinstance(e, BaseExceptionGroup) for e in errors):
        errors = [
            inner
            for e in errors
            for inner in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])
        ]
    if closing:
        errors = [
            e
            for e in errors
            if not (isinstance(e, sa.SessionStoppedError) and "registry is closing" in str(e))
        ]
    assert errors, repr(error)
    for each in errors:
        assert isinstance(each, StoreConfigurationError), repr(error)
        assert isinstance(each, StoreError)
        message = str(each)
        assert "a retry cannot fix this" in message
        for needle in needles:
            assert needle in message
    first = errors[0]
    assert isinstance(first, StoreConfigurationError)
    return first


@contextlib.contextmanager
def raises_fatal(*needles: str, closing: bool = False) -> Iterator[list[StoreConfigurationError]]:
    """Expect a StoreConfigurationError (perhaps in a group) from the block."""
    found: list[StoreConfigurationError] = []
    try:
        yield found
    except BaseException as exc:
        found.append(check_fatal(exc, *needles, closing=closing))
    else:
        pytest.fail("the block raised no StoreConfigurationError")


async def test_a_full_user_works(redis_url: str) -> None:
    """The control: a user granted every command, key and channel runs the store."""
    async with acl_user(redis_url, *FULL) as url:
        store = RedisStore(url, prefix=_prefix())
        with trio.fail_after(10):
            await store.create("chat", b"snap", b"info")
            await store.append("chat", [JournalEntry(1, b"one")], b"info")
            assert await store.list_page(after=None, limit=10) == [("chat", b"info")]
            await store.aclose()


@pytest.mark.parametrize(
    ("rules", "needles"),
    [
        # a command the store needs (its listing order, on one server a script's step)
        ((*FULL, "-zadd"), ("can't run this command",)),
        # a command a script needs: refused inside the script
        ((*FULL, "-xadd"), ("can't run this command",)),
        # the keys under the store's prefix
        (("on", "resetkeys", "~elsewhere:*", "&*", "+@all"), ("no permissions to access",)),
        # no scripting at all
        ((*FULL, "-@scripting"), ("no permissions to run the 'evalsha' command",)),
    ],
    ids=["no-zadd", "no-xadd", "no-keys", "no-scripting"],
)
async def test_a_user_without_a_needed_permission_gets_a_fatal_error(
    redis_url: str, rules: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    """A store whose Redis user lacks a command, a script's command, the keys under its
    prefix or scripting raises StoreConfigurationError naming the session and the
    refusal, at once and on every call: never a retryable StoreError."""
    async with acl_user(redis_url, *rules) as url:
        store = RedisStore(url, prefix=_prefix())
        with trio.fail_after(10):
            calls = [
                lambda: store.create("chat", b"snap", b"info"),
                lambda: store.append("chat", [JournalEntry(1, b"one")], b"info"),
            ]
            if "-xadd" in rules:  # a create writes no journal entry
                await calls.pop(0)()
            for call in calls:
                with raises_fatal(*needles, "grant the store's redis user") as found:
                    await call()
                error = found[0]
                assert error.session_id == "chat"
                assert "session 'chat'" in str(error)
            await store.aclose()


async def test_a_user_without_scripting_fails_a_registry_call_at_once(redis_url: str) -> None:
    """Through a registry, spawning with a user that cannot run scripts raises the
    StoreConfigurationError to the caller, within the store's timeout."""
    async with acl_user(redis_url, *FULL, "-@scripting") as url:
        store = RedisStore(url, prefix=_prefix(), timeout=2)
        with trio.fail_after(20), raises_fatal("no permissions to run the 'evalsha' command"):
            async with sa.open_registry(store=store, agents=AGENTS, lease_ttl=1) as registry:
                await registry.spawn("chat")
        await store.aclose()


async def test_a_user_without_blocking_commands_ends_a_registry_with_a_fatal_error(
    redis_url: str,
) -> None:
    """A multi-worker registry whose Redis user cannot run blocking commands (its
    inbox and remote subscriptions are blocking reads) fails with
    StoreConfigurationError instead of hanging or retrying in silence (a call this
    test makes while the registry closes may end with SessionStoppedError)."""
    async with acl_user(redis_url, *FULL, "-@blocking") as url:
        store = RedisStore(url, prefix=_prefix(), timeout=2)
        refused = raises_fatal("no permissions to run the 'xread' command", closing=True)
        with trio.fail_after(20), refused:
            async with sa.open_registry(store=store, agents=AGENTS, lease_ttl=1) as registry:
                ref = await registry.spawn("chat")
                async with ref.stream("hello there") as events:
                    async for _ in events:
                        pass
                await trio.sleep_forever()
        await store.aclose()


async def test_a_plain_url_to_a_cluster_node_says_to_use_redis_cluster(
    redis_cluster_url: str,
) -> None:
    """A redis:// URL that points at a node of a Redis Cluster fails with a
    StoreConfigurationError that says to use redis+cluster://, for every session
    (whichever slot its keys hash to), never as a retryable error."""
    node = urlsplit(redis_cluster_url).netloc.split(",")[0]
    store = RedisStore(f"redis://{node}/0", prefix=_prefix())
    try:
        with trio.fail_after(20):
            for name in [f"chat-{index}" for index in range(8)]:
                with raises_fatal("redis+cluster://"):
                    await store.create(name, b"snap", b"info")
                with raises_fatal("redis+cluster://"):
                    await store.load(name)
        with trio.fail_after(10):
            host, _, port = node.rpartition(":")
            async with coredis.Redis(host, int(port)) as client:
                given = RedisStore(client=client, prefix=_prefix())
                with raises_fatal("redis+cluster://", "the given client"):
                    await given.exists("chat")
    finally:
        with trio.fail_after(10):
            await store.aclose()


async def test_a_server_without_scripts_gets_a_fatal_error(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """A server whose EVAL and EVALSHA are disabled (renamed away) fails every store
    call with StoreConfigurationError, not a retryable error."""
    disabled = ("--rename-command", "EVALSHA", "", "--rename-command", "EVAL", "")
    with contextlib.ExitStack() as stack:
        url = await trio.to_thread.run_sync(
            stack.enter_context, private_redis_server(config=disabled)
        )
        store = RedisStore(url, prefix=_prefix())
        with trio.fail_after(10):
            with raises_fatal("unknown command", "session 'chat'"):
                await store.create("chat", b"snap", b"info")
            with raises_fatal("unknown command"):
                await store.load("chat")
            await store.aclose()


@pytest.mark.parametrize(
    ("login", "database", "needles"),
    [
        ("wrong-user:wrong-password@", None, ("check the user name and password",)),
        ("", "99999", ("/99999", "check the database number")),
    ],
    ids=["wrong-password", "missing-database"],
)
@pytest.mark.parametrize("persistence", ["always", "volatile"])
async def test_a_url_the_server_refuses_at_connect_gets_a_fatal_error(
    redis_url: str, login: str, database: str | None, needles: tuple[str, ...], persistence: str
) -> None:
    """A password the server refuses, or a database number it does not have, is refused
    as the store connects, whatever persistence it demands: StoreConfigurationError
    saying that the server refused the store's connection and what to check in the URL,
    never a StoreError that says to retry (nothing changes on a retry), and the same on
    the next call. A registry (as `serve` opens one) fails with it at once."""
    parts = urlsplit(redis_url)
    netloc = f"{login}{parts.hostname}:{parts.port}"
    path = f"/{database}" if database is not None else parts.path
    url = urlunsplit(parts._replace(netloc=netloc, path=path))
    store = RedisStore(url, prefix=_prefix(), persistence=persistence)
    with trio.fail_after(10):
        for _ in range(2):
            with raises_fatal("refused the store's connection", *needles) as found:
                await store.load("chat")
            assert "then retry" not in str(found[0])
            assert "wrong-password" not in str(found[0])
        await store.aclose()


async def stored_sessions(url: str, prefix: str) -> None:
    """Store sessions "old" and "other" under ``prefix``, each with a turn."""
    async with sa.open_registry(store=RedisStore(url, prefix=prefix), agents=AGENTS) as registry:
        for name in ("old", "other"):
            await (await registry.spawn(name)).send("hello")


async def types_under(url: str, prefix: str) -> dict[str, str]:
    async with coredis.Redis.from_url(url, decode_responses=True) as client:
        return {key: await client.type(key) for key in await client.keys(f"{prefix}:*")}


@pytest.mark.parametrize(
    ("part", "call"),
    [
        ("activity", "list"),  # the listing order
        ("sessions", "list"),  # the index of a key group's sessions
        ("fence", "send"),  # a key group's fencing counter
        ("shard", "send"),  # the lease of a key group's sessions
    ],
)
async def test_a_key_the_sessions_share_of_another_type_gets_a_fatal_error(
    redis_url: str, part: str, call: str
) -> None:
    """A key under the store's prefix that the store keeps for many sessions (the
    listing order, a key group's index, fencing counter or shard lease) holding another
    type of value (another application's, under the same prefix) fails a listing or a
    request to a session of that group with StoreConfigurationError, which names the key
    and says to give the store a prefix of its own, never a StoreError that says to
    retry; the other application's key is left as it was."""
    prefix = _prefix()
    await stored_sessions(redis_url, prefix)
    key = f"{prefix}:activity" if part == "activity" else group_key(prefix, "old", part)
    await replace_with_list(redis_url, key)
    before = await types_under(redis_url, prefix)
    with trio.fail_after(20):
        store = RedisStore(redis_url, prefix=prefix)
        async with sa.open_registry(store=store, agents=AGENTS) as registry:
            with raises_fatal(f"{key!r} holds a list", "a prefix of its own") as found:
                if call == "list":
                    await registry.sessions()
                else:
                    await registry.ref("old").send("hello")
            assert found[0].session_id == (None if call == "list" else "old")
            assert "then retry" not in str(found[0])
    after = await types_under(redis_url, prefix)
    await drop_prefix(redis_url, prefix)
    assert {key: after.get(key) for key in before} == before


@pytest.mark.parametrize("part", ["meta", "log", "lease"])
async def test_a_key_of_one_session_of_another_type_fails_that_session_only(
    redis_url: str, part: str
) -> None:
    """A key of one stored session (its snapshot, journal or lease) holding another
    type of value fails a request to that session with SnapshotCorruptError, which names
    the session and the key, not with StoreConfigurationError; the other session
    answers, and the listing lists it. What the error says to do works: remove a lease
    (no part of the conversation), delete a session whose snapshot or journal is
    damaged."""
    prefix = _prefix()
    await stored_sessions(redis_url, prefix)
    key = session_key(prefix, "old", part)
    await replace_with_list(redis_url, key)
    with trio.fail_after(20):
        store = RedisStore(redis_url, prefix=prefix)
        async with sa.open_registry(store=store, agents=AGENTS) as registry:
            with pytest.raises(sa.SnapshotCorruptError) as found:
                await registry.ref("old").send("hello")
            error = found.value
            assert error.session_id == "old"
            assert "session 'old'" in str(error)
            assert f"{key!r} holds a list" in str(error)
            assert (await registry.ref("other").send("hi")).text == "hi"
            assert "other" in [info.session_id for info in await registry.sessions()]
            if part == "lease":
                assert f"remove that key (redis-cli DEL {key!r})" in str(error)
                async with coredis.Redis.from_url(redis_url) as client:
                    await client.delete([key])
                assert (await registry.ref("old").send("again")).text == "again"
            else:
                assert "delete it with registry.delete('old')" in str(error)
                await registry.delete("old")
                assert [info.session_id for info in await registry.sessions()] == ["other"]
    await drop_prefix(redis_url, prefix)


async def everything_under(url: str, prefix: str) -> dict[bytes, tuple[bytes, bool]]:
    """Every key under ``prefix``: its value (``DUMP``) and whether it expires."""
    async with coredis.Redis.from_url(url) as client:
        found = {}
        for key in await client.keys(f"{prefix}:*"):
            found[bytes(key)] = (bytes(await client.dump(key)), await client.pttl(key) >= 0)
        return found


#: (what is written, the key that holds another type of value, whether it is a key of
#: the session's own): each key is one that the write's script meets after a first write.
_REFUSED_WRITES = [
    ("create", "sessions", False),
    ("create", "activity", False),
    ("append", "activity", False),
    ("snapshot", "log", True),
    ("snapshot", "activity", False),
    ("delete", "sessions", False),
    ("delete", "activity", False),
    ("claim", "lease", True),
    ("claim", "meta", True),
    ("release", "shard", False),
]


async def make_write(store: RedisStore, write: str, name: str, lease: Lease | None) -> None:
    """Make the ``write`` to session ``name`` (a store call of that name) under ``lease``."""
    if write == "create":
        await store.create(name, b"a snapshot", b"")
    elif write == "claim":
        await store.claim(name, "w1", 30.0)
    elif write == "delete":
        await store.delete(name)
    else:
        assert lease is not None
        if write == "append":
            await store.append(name, [JournalEntry(2, b"two")], b"", fence=lease.fence)
        elif write == "snapshot":
            await store.write_snapshot(name, b"a snapshot", 1, b"", trim_upto=1, fence=lease.fence)
        else:
            await store.release(name, lease)


@pytest.mark.parametrize(("write", "part", "own"), _REFUSED_WRITES)
async def test_a_write_refused_for_a_key_of_another_type_writes_nothing(
    redis_url: str, write: str, part: str, own: bool
) -> None:
    """A write that meets a key of another type than the store keeps there (the
    session's own: SnapshotCorruptError; one the sessions share: StoreConfigurationError;
    each naming the session and the key) writes nothing: every key under the store's
    prefix holds what it held before, with the same expiry (a claim took no fencing
    token and left no shard lease without one; a snapshot, a create or a delete did not
    land in part)."""
    prefix = _prefix()
    name = "new" if write == "create" else "s"
    if part == "activity":
        key = f"{prefix}:activity"
    elif part in ("sessions", "shard", "fence"):
        key = group_key(prefix, name, part)
    else:
        key = session_key(prefix, name, part)
    store = RedisStore(redis_url, prefix=prefix)
    snapshot = b"a snapshot"  # (the store keeps the bytes as they are)
    try:
        with trio.fail_after(20):
            await store.create("other", snapshot, b"")  # (the listing order exists)
            lease = None
            if write != "create":
                await store.create(name, snapshot, b"")
                if write != "claim":
                    lease = await store.claim(name, "w1", 30.0)
                    assert lease is not None
                    await store.append(name, [JournalEntry(1, b"one")], b"", fence=lease.fence)
            await replace_with_list(redis_url, key)
            before = await everything_under(redis_url, prefix)
            expected = sa.SnapshotCorruptError if own else StoreConfigurationError
            with pytest.raises(expected) as found:
                await make_write(store, write, name, lease)
            error = found.value
            assert error.session_id == name, repr(error)
            assert f"{key!r} holds a list" in str(error)
            after = await everything_under(redis_url, prefix)
    finally:
        await store.aclose()
        await drop_prefix(redis_url, prefix)
    assert after == before


async def test_on_a_cluster_a_listing_order_of_another_type_fails_no_write_that_landed(
    redis_cluster_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On a Redis Cluster, where a write puts its session in the listing order after the
    write (the order sits in a slot of its own), an order that holds another type of
    value does not fail the writes that landed (a create, an append: they are stored),
    and each is logged at ERROR naming the key; a listing fails with
    StoreConfigurationError naming it."""
    prefix = _prefix()
    key = f"{prefix}:activity"
    store = RedisStore(redis_cluster_url, prefix=prefix)
    try:
        with trio.fail_after(20):
            await store.create("other", b"a snapshot", b"")
            await replace_with_list(redis_cluster_url, key)
            await store.create("s", b"a snapshot", b"")
            lease = await store.claim("s", "w1", 30.0)
            assert lease is not None
            await store.append("s", [JournalEntry(1, b"one")], b"", fence=lease.fence)
            stored = await store.load("s")
            assert stored is not None
            assert [entry.data for entry in stored.entries] == [b"one"]
            told = [r for r in caplog.records if repr(key) in r.getMessage()]
            assert [r.levelname for r in told] == ["ERROR", "ERROR"], told
            with raises_fatal(f"{key!r} holds a list"):
                await store.list_page(after=None, limit=10)
    finally:
        await store.aclose()
        async with admin_client(redis_cluster_url) as cluster:
            for primary in list(cluster.primaries):
                async with primary as client:
                    async for found in client.scan_iter(match=f"{prefix}:*"):
                        await client.delete([found])
