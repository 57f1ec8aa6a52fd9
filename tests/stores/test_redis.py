"""RedisStore against a real redis-server: the store contract, leases and fencing."""

from __future__ import annotations

import base64
import contextlib
import gc
import itertools
import os
import re
import signal
import socket
import sys
import tempfile
import uuid
import warnings
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit

import coredis
import pytest
import trio
import trio.testing

import sessionactors as sa
from net_proxy import proxy_to
from redis_keys import keys_of, rot_name
from sessionactors import (
    FencedOutError,
    SessionExistsError,
    SessionNotFoundError,
    SnapshotCorruptError,
    StoreError,
)
from sessionactors.stores import MAX_SEQ, JournalEntry, Lease, RedisStore, Store, StoredSession
from sessionactors.testing import EchoModel, check_store
from stream_checks import read_until_it_ends

pytestmark = pytest.mark.redis

E = JournalEntry
MakeStore = Callable[..., RedisStore]


def _new_prefix() -> str:
    return f"sa-test:{uuid.uuid4().hex}"


async def _drop_prefixes(url: str, prefixes: list[str]) -> None:
    async with coredis.Redis.from_url(url) as client:
        for prefix in prefixes:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
            if keys:
                await client.unlink(keys)


@pytest.fixture
async def make_store(redis_url: str) -> AsyncIterator[MakeStore]:
    """``make_store(prefix=None, **options)``: a RedisStore on a fresh prefix (or on
    ``prefix``), with RedisStore's ``options``."""
    stores: list[RedisStore] = []
    prefixes: list[str] = []

    def make(prefix: str | None = None, **options: Any) -> RedisStore:
        if prefix is None:
            prefix = _new_prefix()
        if prefix not in prefixes:
            prefixes.append(prefix)
        store = RedisStore(redis_url, prefix=prefix, **options)
        stores.append(store)
        return store

    yield make
    with trio.fail_after(30):
        for store in stores:
            await store.aclose()
        await _drop_prefixes(redis_url, prefixes)


def _group_key(store: RedisStore, name: str, suffix: str) -> str:
    """A key of the group of session ``name``, as the store's documented layout names it."""
    return f"{store.prefix}:{{g{zlib.crc32(name.encode()) % 1024}}}:{suffix}"


async def _keys_under(url: str, prefix: str) -> list[str]:
    async with coredis.Redis.from_url(url, decode_responses=True) as client:
        return sorted([key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)])


# -- the store contract ----------------------------------------------------------------


async def test_passes_check_store(make_store: MakeStore) -> None:
    """RedisStore passes the shared store conformance suite, what it acknowledged read
    through another RedisStore of the same prefix too."""

    def reopen(store: Store) -> RedisStore:
        assert isinstance(store, RedisStore)
        return make_store(store.prefix)

    with trio.fail_after(120):
        await check_store(make_store, reopen=reopen)


async def test_create_load_exists_and_duplicate(make_store: MakeStore) -> None:
    """A created session loads with its snapshot at seq 0, and creating it again fails."""
    store = make_store()
    with trio.fail_after(10):
        assert await store.load("s") is None
        assert not await store.exists("s")
        await store.create("s", b"snap", b"info")
        assert await store.exists("s")
        assert await store.load("s") == StoredSession(
            snapshot=b"snap", snapshot_seq=0, info=b"info"
        )
        with pytest.raises(SessionExistsError, match="'s' is already stored") as caught:
            await store.create("s", b"other", b"other")
        assert caught.value.session_id == "s"
        assert await store.load("s") == StoredSession(
            snapshot=b"snap", snapshot_seq=0, info=b"info"
        )
        assert await store.list_sessions() == [("s", b"info")]


async def test_append_load_and_read_journal(make_store: MakeStore) -> None:
    """Appended entries come back in order from load and read_journal; info follows each write."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i0")
        await store.append("s", [E(1, b"one"), E(2, b"two")], b"i1")
        await store.append("s", [], b"i2")
        await store.append("s", [E(5, b"five")], b"i3")
        loaded = await store.load("s")
        assert loaded is not None
        assert loaded.entries == (E(1, b"one"), E(2, b"two"), E(5, b"five"))
        assert await store.read_journal("s", 0) == (0, [E(1, b"one"), E(2, b"two"), E(5, b"five")])
        assert await store.read_journal("s", 2) == (0, [E(5, b"five")])
        assert await store.read_journal("s", 3) == (0, [E(5, b"five")])
        assert await store.read_journal("s", 5) == (0, [])
        assert await store.list_sessions() == [("s", b"i3")]


async def test_journal_pages_are_the_journal_cut_at_their_bounds(make_store: MakeStore) -> None:
    """read_journal_page answers the trimmed seq and first entries read_journal does, at
    most ``limit`` of them and none past the one that brings their data to ``max_bytes``,
    however many reads of the stream that takes."""
    store = make_store()
    with trio.fail_after(30):
        await store.create("s", b"snap", b"i")
        await store.append("s", [E(seq, b"d" * seq) for seq in range(1, 61)], b"i")
        await store.write_snapshot("s", b"snap", 3, b"i", trim_upto=3)
        for after in (0, 2, 3, 20, 59, 60):
            trimmed, journal = await store.read_journal("s", after)
            assert trimmed == 3
            for limit in (1, 2, 15, 16, 17, 33, 100):
                for max_bytes in (0, 1, 50, 400, 1 << 40):
                    want = []
                    for entry in journal[:limit]:
                        want.append(entry)
                        if sum(len(e.data) for e in want) >= max_bytes:
                            break
                    page = await store.read_journal_page(
                        "s", after, limit=limit, max_bytes=max_bytes
                    )
                    assert page == (3, want), (after, limit, max_bytes)
        with pytest.raises(SessionNotFoundError):
            await store.read_journal_page("missing", 0, limit=10, max_bytes=100)


async def test_append_rejects_seqs_not_above_stored_ones(make_store: MakeStore) -> None:
    """An append whose seqs are not strictly above every stored one fails and writes nothing."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i0")
        await store.append("s", [E(1, b"one"), E(2, b"two")], b"i1")
        before = await store.load("s")
        for batch in ([E(2, b"again")], [E(1, b"old"), E(3, b"new")], [E(4, b"x"), E(4, b"y")]):
            with pytest.raises(StoreError, match="'s'"):
                await store.append("s", batch, b"bad")
        assert await store.load("s") == before
        assert await store.list_sessions() == [("s", b"i1")]


async def test_write_snapshot_compacts_the_journal(make_store: MakeStore) -> None:
    """A snapshot replaces the old one and trims journal entries up to trim_upto."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap0", b"i0")
        await store.append("s", [E(seq, b"%d" % seq) for seq in range(1, 6)], b"i1")
        await store.write_snapshot("s", b"snap3", 3, b"i2", trim_upto=2)
        assert await store.load("s") == StoredSession(
            snapshot=b"snap3", snapshot_seq=3, entries=(E(4, b"4"), E(5, b"5")), info=b"i2"
        )
        assert await store.read_journal("s", 0) == (2, [E(3, b"3"), E(4, b"4"), E(5, b"5")])
        await store.write_snapshot("s", b"snap5", 5, b"i3", trim_upto=5)
        assert await store.load("s") == StoredSession(snapshot=b"snap5", snapshot_seq=5, info=b"i3")
        assert await store.read_journal("s", 0) == (5, [])
        with pytest.raises(StoreError):
            await store.append("s", [E(5, b"again")], b"bad")
        await store.append("s", [E(6, b"6")], b"i4")
        assert await store.read_journal("s", 0) == (5, [E(6, b"6")])
        assert await store.list_sessions() == [("s", b"i4")]
        with pytest.raises(StoreError, match="trim_upto"):
            await store.write_snapshot("s", b"x", 6, b"x", trim_upto=7)
        with pytest.raises(StoreError, match="older"):
            await store.write_snapshot("s", b"x", 4, b"x", trim_upto=0)
        assert await store.load("s") == StoredSession(
            snapshot=b"snap5", snapshot_seq=5, entries=(E(6, b"6"),), info=b"i4"
        )


async def test_missing_session_errors(make_store: MakeStore) -> None:
    """Writes and journal reads of a session that is not stored raise SessionNotFoundError."""
    store = make_store()
    with trio.fail_after(10):
        with pytest.raises(SessionNotFoundError, match="'nope'"):
            await store.append("nope", [E(1, b"x")], b"i")
        with pytest.raises(SessionNotFoundError, match="'nope'"):
            await store.write_snapshot("nope", b"x", 1, b"i", trim_upto=0)
        with pytest.raises(SessionNotFoundError, match="'nope'"):
            await store.read_journal("nope", 0)
        assert await store.list_sessions() == []
        assert not await store.exists("nope")


async def test_delete_removes_everything(make_store: MakeStore, redis_url: str) -> None:
    """Delete removes snapshot, journal, info, lease and index entry and says if it existed."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i0")
        await store.append("s", [E(1, b"one")], b"i1")
        lease = await store.claim("s", "w1", 30)
        assert lease is not None
        assert await store.delete("s")
        assert not await store.delete("s")
        assert await store.load("s") is None
        assert await store.list_sessions() == []
        assert await _keys_under(redis_url, store.prefix) == [_group_key(store, "s", "fence")]
        other = await store.claim("s", "w2", 30)
        assert other is not None
        assert other.fence > lease.fence
        await store.create("s", b"fresh", b"i")
        assert await store.load("s") == StoredSession(snapshot=b"fresh", snapshot_seq=0, info=b"i")
        await store.append("s", [E(1, b"one again")], b"i")
        assert await store.read_journal("s", 0) == (0, [E(1, b"one again")])


# -- names -----------------------------------------------------------------------------

AWKWARD_NAMES = [
    "*",
    "?",
    "[ab]",
    "[",
    "a*",
    "a?",
    "a",
    "a:b",
    ":",
    "a:s:b:meta",
    "sessions",
    "fence",
    "a\nb",
    "line\n",
    "\\",
    "{tag}",
    "sp ace",
    "会话-ü-😀",
    "x" * 256,
    "é" * 128,
    "😀" * 64,
]


async def test_awkward_names_are_stored_exactly(make_store: MakeStore, redis_url: str) -> None:
    """Names with glob, separator, newline and non-ASCII characters round-trip and never collide."""
    store = make_store()
    assert all(len(name.encode()) <= 256 for name in AWKWARD_NAMES)
    with trio.fail_after(20):
        for index, name in enumerate(AWKWARD_NAMES):
            await store.create(name, name.encode() + b"!", b"%d" % index)
            await store.append(name, [E(1, name.encode())], b"%d" % index)
        assert await store.list_sessions() == sorted(
            (name, b"%d" % index) for index, name in enumerate(AWKWARD_NAMES)
        )
        for index, name in enumerate(AWKWARD_NAMES):
            assert await store.exists(name)
            assert await store.load(name) == StoredSession(
                snapshot=name.encode() + b"!",
                snapshot_seq=0,
                entries=(E(1, name.encode()),),
                info=b"%d" % index,
            )
        keys = await _keys_under(redis_url, store.prefix)
        escaped = re.compile(
            rf"{re.escape(store.prefix)}:(activity|\{{g[0-9]+\}}:(sessions|fence|s:[A-Za-z0-9_-]*:(meta|info|log)))"
        )
        assert all(escaped.fullmatch(key) for key in keys), keys
        assert await store.delete("a*")
        assert await store.delete("[ab]")
        remaining = [name for name in AWKWARD_NAMES if name not in ("a*", "[ab]")]
        assert [name for name, _ in await store.list_sessions()] == sorted(remaining)
        for name in remaining:
            assert await store.exists(name)


# -- leases and fencing ----------------------------------------------------------------


async def test_claim_renew_release(make_store: MakeStore) -> None:
    """A lease is exclusive until released, renewal needs the current token, and tokens grow."""
    store = make_store()
    with trio.fail_after(10):
        first = await store.claim("s", "w1", 30)
        assert first is not None
        assert first.owner == "w1"
        assert await store.claim("s", "w2", 30) is None
        again = await store.claim("s", "w1", 30)
        assert again is not None
        assert again.fence > first.fence
        assert not await store.renew("s", first, 30)
        assert await store.renew("s", again, 30)
        await store.release("s", first)  # stale: does nothing
        assert await store.claim("s", "w2", 30) is None
        await store.release("s", again)
        assert not await store.renew("s", again, 30)
        other = await store.claim("s", "w2", 30)
        assert other is not None
        assert other.fence > again.fence
        await store.release("s", Lease(owner="w1", fence=other.fence))  # wrong owner
        assert await store.claim("s", "w1", 30) is None


async def test_expired_lease_can_be_taken_over(make_store: MakeStore) -> None:
    """After its wall-clock ttl a lease is taken by another owner and its old token is refused."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i0")
        short = await store.claim("s", "w1", 0.05)
        assert short is not None
        await trio.sleep(0.2)
        with pytest.raises(FencedOutError, match="'s'"):
            await store.append("s", [E(1, b"late")], b"bad", fence=short.fence)
        assert not await store.renew("s", short, 30)
        taken = await store.claim("s", "w2", 30)
        assert taken is not None
        assert taken.fence > short.fence
        assert await store.load("s") == StoredSession(snapshot=b"snap", snapshot_seq=0, info=b"i0")


async def test_stale_token_is_rejected_and_nothing_written(make_store: MakeStore) -> None:
    """Append and write_snapshot with a superseded token raise FencedOutError and write nothing."""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap0", b"i0")
        old = await store.claim("s", "w1", 30)
        assert old is not None
        await store.append("s", [E(1, b"one")], b"i1", fence=old.fence)
        await store.release("s", old)
        new = await store.claim("s", "w2", 30)
        assert new is not None
        before = (await store.load("s"), await store.read_journal("s", 0))

        with pytest.raises(FencedOutError, match="'s'") as caught:
            await store.append("s", [E(2, b"stale")], b"stale", fence=old.fence)
        assert caught.value.session_id == "s"
        with pytest.raises(FencedOutError, match="'s'"):
            await store.write_snapshot("s", b"stale", 1, b"stale", trim_upto=1, fence=old.fence)
        with pytest.raises(FencedOutError):
            await store.append("s", [E(2, b"never issued")], b"x", fence=new.fence + 1000)

        assert (await store.load("s"), await store.read_journal("s", 0)) == before
        assert await store.list_sessions() == [("s", b"i1")]

        # Negative control: the current token, and no token at all, do write.
        await store.append("s", [E(2, b"two")], b"i2", fence=new.fence)
        await store.write_snapshot("s", b"snap2", 2, b"i3", trim_upto=1, fence=new.fence)
        await store.append("s", [E(3, b"three")], b"i4")
        assert await store.load("s") == StoredSession(
            snapshot=b"snap2", snapshot_seq=2, entries=(E(3, b"three"),), info=b"i4"
        )


async def test_fifty_concurrent_claims_have_one_winner(make_store: MakeStore) -> None:
    """Fifty tasks claiming one session through separate connections yield exactly one lease."""
    prefix = _new_prefix()
    # Fifty connections opened at once, each with its handshake and checks: on a busy
    # machine they can take longer than the default 5 s, which is not what is tested.
    stores = [make_store(prefix, timeout=15.0) for _ in range(50)]
    results: list[Lease | None] = [None] * 50

    async def claim(index: int) -> None:
        results[index] = await stores[index].claim("contested", f"w{index}", 30)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for index in range(50):
                nursery.start_soon(claim, index)
    winners = [lease for lease in results if lease is not None]
    assert len(winners) == 1


_WORKER = """
import sys
import zlib
import coredis
import trio
from sessionactors.stores import Lease, RedisStore

# While holding the lease: raise a flag no one else may hold, count the round, log it.
ENTER = '''
if redis.call('GET', KEYS[1]) then return -1 end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX') then
  redis.call('RPUSH', KEYS[5], ARGV[1] .. ' overlaps ' .. redis.call('GET', KEYS[2]))
end
local round = redis.call('INCR', KEYS[3])
redis.call('RPUSH', KEYS[4], round .. ' ' .. ARGV[1] .. ' ' .. ARGV[2])
if round >= tonumber(ARGV[3]) then redis.call('SET', KEYS[1], '1') end
return round
'''
LEAVE = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end"
# Start the next round: wake every worker (a list keeps only the latest signal).
WAKE = '''
for _, key in ipairs(KEYS) do
  redis.call('RPUSH', key, ARGV[1])
  redis.call('LTRIM', key, -1, -1)
end
'''

# The negative control: a claim that hands out a fresh token (from the session's
# group's fencing counter) without looking at the lease.
class BrokenClaim(RedisStore):
    async def claim(self, session_id, owner, ttl):
        group = zlib.crc32(session_id.encode()) % 1024
        async with coredis.Redis.from_url(self.url) as client:
            fence = await client.incr(f"{self.prefix}:{{g{group}}}:fence")
            return Lease(owner=owner, fence=fence)

async def main(url, prefix, name, names, rounds, mode):
    store = (BrokenClaim if mode == "broken" else RedisStore)(url, prefix=prefix)
    keys = [f"{prefix}:test:{key}" for key in ("stop", "flag", "counter", "log", "errors")]
    wake = [f"{prefix}:test:wake:{other}" for other in names.split(",")]
    mine = f"{prefix}:test:wake:{name}"
    async with coredis.Redis.from_url(url) as client:
        await client.rpush(f"{prefix}:test:ready", [name])
        while True:
            signal = await client.blpop([mine], timeout=10)
            if signal is None:
                sys.exit(f"{name}: no signal for 10 s")
            if signal[1] == b"stop":
                break
            lease = await store.claim("race", name, 60)
            if lease is None:
                continue  # the holder wakes everyone once it has released
            entered = await client.eval(ENTER, keys, [name, str(lease.fence), str(rounds)])
            if entered != -1:
                await trio.sleep(0.002)  # held a while: an owner beside it cannot miss it
                await client.eval(LEAVE, [keys[1]], [name])
            await store.release("race", lease)
            await client.eval(WAKE, wake, ["stop" if entered in (-1, rounds) else "go"])
    await store.aclose()

trio.run(main, *sys.argv[1:5], int(sys.argv[5]), sys.argv[6])
"""


async def _race(
    url: str, prefix: str, processes: int, rounds: int, mode: str
) -> tuple[list[str], list[tuple[int, str, int]]]:
    """Run the worker processes; return the overlaps seen and the log of (round, owner, fence)."""
    names = [f"p{index}" for index in range(processes)]

    async def worker(name: str) -> None:
        command = [sys.executable, "-c", _WORKER, url, prefix, name, ",".join(names)]
        command += [str(rounds), mode]
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
        if done.returncode != 0:
            raise AssertionError(f"worker {name} failed:\n{done.stderr.decode(errors='replace')}")

    async with coredis.Redis.from_url(url, decode_responses=True) as client:
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(worker, name)
            for _ in names:  # start together, once every process is up
                assert await client.blpop([f"{prefix}:test:ready"], timeout=30) is not None
            for name in names:
                await client.rpush(f"{prefix}:test:wake:{name}", ["go"])
        overlaps = await client.lrange(f"{prefix}:test:errors", 0, -1)
        lines = await client.lrange(f"{prefix}:test:log", 0, -1)
    log = [(int(round_), name, int(fence)) for round_, name, fence in map(str.split, lines)]
    return overlaps, log


@pytest.mark.parametrize(
    ("processes", "rounds"), [(2, 600), pytest.param(8, 400, marks=pytest.mark.soak)]
)
async def test_processes_racing_for_a_lease_have_one_owner_per_round(
    make_store: MakeStore, redis_url: str, processes: int, rounds: int
) -> None:
    """Processes racing to claim one session never overlap as owners, and tokens keep growing."""
    with trio.fail_after(60):
        overlaps, log = await _race(redis_url, make_store().prefix, processes, rounds, "real")
    assert overlaps == []
    assert [round_ for round_, _, _ in log] == list(range(1, rounds + 1))
    assert all(a < b for a, b in itertools.pairwise(fence for _, _, fence in log))
    assert len({name for _, name, _ in log}) > 1  # the race was real: several processes won


async def test_process_race_catches_a_claim_without_exclusion(
    make_store: MakeStore, redis_url: str
) -> None:
    """The process race reports overlapping owners when claims ignore the current lease."""
    with trio.fail_after(60):
        overlaps, log = await _race(redis_url, make_store().prefix, 2, 50, "broken")
    assert overlaps != []
    assert len(log) == 50


# -- connections -----------------------------------------------------------------------


async def test_reconnects_after_aclose(make_store: MakeStore) -> None:
    """After aclose (which may be repeated) the next call connects again and sees the same data."""
    store = make_store()
    with trio.fail_after(10):
        await store.aclose()
        await store.create("s", b"snap", b"i")
        await store.aclose()
        await store.aclose()
        assert await store.load("s") == StoredSession(snapshot=b"snap", snapshot_seq=0, info=b"i")
        await store.append("s", [E(1, b"one")], b"i1")
        await store.aclose()
        assert await store.read_journal("s", 0) == (0, [E(1, b"one")])


async def test_concurrent_first_calls_all_succeed(make_store: MakeStore) -> None:
    """Many tasks making the first calls on a fresh store all succeed."""
    store = make_store()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for index in range(200):
                nursery.start_soon(store.create, f"s{index}", b"snap", b"i")
        assert len(await store.list_sessions()) == 200


def test_usable_from_a_new_trio_run(redis_url: str) -> None:
    """A store used in one trio run connects again in the next one."""
    store = RedisStore(redis_url, prefix=_new_prefix())

    async def first() -> None:
        with trio.fail_after(10):
            await store.create("s", b"snap", b"i")

    async def second() -> None:
        with trio.fail_after(10):
            assert await store.load("s") == StoredSession(
                snapshot=b"snap", snapshot_seq=0, info=b"i"
            )
            await store.aclose()
            await _drop_prefixes(redis_url, [store.prefix])

    trio.run(first)
    trio.run(second)


async def test_uses_a_given_client_and_leaves_it_open(redis_url: str) -> None:
    """A store built on an open coredis client uses it and does not close it."""
    prefix = _new_prefix()
    with trio.fail_after(10):
        async with coredis.Redis.from_url(redis_url) as client:
            store = RedisStore(client=client, prefix=prefix)
            await store.create("s", b"snap", b"i")
            await store.aclose()
            assert await store.exists("s")
            assert await client.exists([_group_key(store, "s", "sessions")]) == 1
        await _drop_prefixes(redis_url, [prefix])


async def test_unreachable_server_raises_store_error() -> None:
    """Calls against a server that is not there raise StoreError naming the session."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix=_new_prefix())
        with warnings.catch_warnings():
            # coredis leaves a failed connection's internal streams to the garbage collector.
            warnings.simplefilter("ignore", ResourceWarning)
            with trio.fail_after(10):
                with pytest.raises(StoreError, match="'s'") as caught:
                    await store.load("s")
                assert caught.value.session_id == "s"
                # the cause itself, not the wording of a task group around it
                assert "Unable to establish a connection" in str(caught.value)
                assert "sub-exception" not in str(caught.value)
                with pytest.raises(StoreError, match="'s'"):
                    await store.claim("s", "w1", 30)
                await store.aclose()
            del caught
            gc.collect()


def test_rejects_bad_arguments() -> None:
    """Bad urls, an empty prefix and a decoding client are refused at construction, without I/O."""
    with pytest.raises(ValueError, match="url"):
        RedisStore("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="prefix"):
        RedisStore(prefix="")
    for url in ("redis://127.0.0.1:6379/sessions", "rediss://h:6379/0/1", "redis://h/-1"):
        with pytest.raises(ValueError, match="database number"):
            RedisStore(url)
    RedisStore("redis://127.0.0.1:6379")
    RedisStore("redis://127.0.0.1:6379/")
    RedisStore("unix:///run/redis.sock?db=2")
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(client=coredis.Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True))
    assert "secret" not in repr(RedisStore("redis://:secret@127.0.0.1:6379/0"))


async def test_recovers_when_the_server_comes_back(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """While the server is down calls raise StoreError, and once it is back they work again."""
    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        url = await trio.to_thread.run_sync(first.enter_context, private_redis_server())
        store = RedisStore(url, prefix=_new_prefix())
        with trio.fail_after(30):
            await store.create("s", b"snap", b"i")
            await trio.to_thread.run_sync(first.close)  # the server stops, its data is gone
            with warnings.catch_warnings():
                # coredis leaves a failed connection's internal streams to the garbage collector.
                warnings.simplefilter("ignore", ResourceWarning)
                with pytest.raises(StoreError, match="'s'"):
                    await store.exists("s")
                gc.collect()
            port = urlsplit(url).port
            await trio.to_thread.run_sync(second.enter_context, private_redis_server(port))
            assert not await store.exists("s")
            await store.create("s", b"again", b"i")
            assert await store.load("s") == StoredSession(
                snapshot=b"again", snapshot_seq=0, info=b"i"
            )
            await store.aclose()


async def test_recovers_when_its_connections_go_silent(redis_url: str) -> None:
    """Every connection the store holds goes silent, both ends still open (a server gone without a word, a firewall that lost its state); new connections work. A call gets no answer within the timeout and raises StoreError; the calls after it open new connections and work."""
    async with proxy_to(redis_url) as (proxy, proxied):
        store = RedisStore(proxied, prefix=_new_prefix(), timeout=0.5)
        with trio.fail_after(30):
            await store.create("s", b"snap", b"i")
            assert proxy.blackhole() >= 1
            with pytest.raises(StoreError, match=r"did not answer within 0\.5 s"):
                await store.exists("s")
            assert await store.exists("s")  # (a call that fails again would raise here)
            await store.aclose()


async def test_cancelled_calls_leave_replies_in_order(make_store: MakeStore) -> None:
    """Calls cancelled while waiting for redis do not hand their replies to later calls."""
    store = make_store()
    with trio.fail_after(30):
        for index in range(20):
            await store.create(f"s{index}", b"snap-%d" % index, b"i")
        wrong: list[StoredSession | None] = []

        async def loader(index: int) -> None:
            for attempt in range(40):
                with trio.move_on_after(0.0001 * (attempt % 20)):
                    got = await store.load(f"s{index}")
                    if got is None or got.snapshot != b"snap-%d" % index:
                        wrong.append(got)
                got = await store.load(f"s{index}")
                if got is None or got.snapshot != b"snap-%d" % index:
                    wrong.append(got)

        async with trio.open_nursery() as nursery:
            for index in range(20):
                nursery.start_soon(loader, index)
    assert wrong == []


# -- values written behind the store's back --------------------------------------------


def _key(store: RedisStore, name: str, part: str) -> str:
    """A session's key, as the store's documented layout names it."""
    encoded = base64.urlsafe_b64encode(name.encode()).rstrip(b"=").decode()
    return _group_key(store, name, f"s:{encoded}:{part}")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("snapshot seq", "the snapshot's seq"),
        ("negative snapshot seq", "the snapshot's seq"),
        ("trimmed", "trimmed seq"),
        ("no trimmed", "trimmed seq"),
        ("no snapshot seq", "the snapshot's seq"),
        ("journal seq", "journal seq"),
        ("journal layout", "foreign layout"),
    ],
)
async def test_values_read_back_are_range_checked(
    make_store: MakeStore, redis_url: str, change: str, match: str
) -> None:
    """A seq out of range, not a number or missing, or a journal entry of another
    layout, read back from redis is SnapshotCorruptError naming the session. (A
    missing trimmed seq read as a session not stored: "create it first".)"""
    store = make_store()
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        await store.append("s", [E(1, b"one")], b"info")
        async with coredis.Redis.from_url(redis_url) as client:
            if change == "snapshot seq":
                await client.hset(_key(store, "s", "meta"), {"seq": str(MAX_SEQ + 1)})
            elif change == "negative snapshot seq":
                await client.hset(_key(store, "s", "meta"), {"seq": "-3"})
            elif change == "trimmed":
                await client.hset(_key(store, "s", "meta"), {"trimmed": "lots"})
            elif change.startswith("no "):
                field = "trimmed" if change == "no trimmed" else "seq"
                await client.hdel(_key(store, "s", "meta"), [field])
            elif change == "journal seq":
                await client.xadd(
                    _key(store, "s", "log"), {"d": b"x"}, identifier="2305843009213693952-0"
                )
            else:
                await client.xadd(_key(store, "s", "log"), {"other": b"x"}, identifier="5-0")
        raised: list[SnapshotCorruptError] = []
        for read in (lambda: store.load("s"), lambda: store.read_journal("s", 0)):
            try:
                await read()
            except SnapshotCorruptError as exc:
                raised.append(exc)
        assert raised
        assert all(exc.session_id == "s" and match in str(exc) for exc in raised)


@pytest.mark.parametrize("field", ["seq", "last", "trimmed"])
@pytest.mark.parametrize("damage", ["missing", "not a number"])
async def test_a_write_over_a_damaged_seq_field_is_refused_as_corrupt_writing_nothing(
    make_store: MakeStore, redis_url: str, field: str, damage: str
) -> None:
    """A seq field of a session's meta hash lost or overwritten behind the store's
    back: an append and a snapshot write raise SnapshotCorruptError naming the session
    and the field, and change nothing. (They failed with a Lua error, as a StoreError
    saying to check that redis is reachable and retry.)"""
    store = make_store()
    meta = _key(store, "s", "meta")
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        await store.append("s", [E(1, b"one")], b"info")
        async with coredis.Redis.from_url(redis_url) as client:
            if damage == "missing":
                await client.hdel(meta, [field])
            else:
                await client.hset(meta, {field: "lots"})
            before = await client.hgetall(meta)

            def append() -> Any:
                return store.append("s", [E(2, b"two")], b"info")

            def snapshot() -> Any:
                return store.write_snapshot("s", b"snap2", 1, b"info", trim_upto=1)

            writes = {"seq": [append, snapshot], "last": [append], "trimmed": [snapshot]}
            for write in writes[field]:
                with pytest.raises(SnapshotCorruptError) as info:
                    await write()
                assert info.value.session_id == "s"
                named = {"seq": "the snapshot's seq", "last": "last seq", "trimmed": "trimmed"}
                assert named[field] in str(info.value), str(info.value)
                assert await client.hgetall(meta) == before
                assert await client.xlen(_key(store, "s", "log")) == 1


#: A server that keeps only what its last SAVE wrote (the backup a restore goes back to).
RDB_ONLY = ("--appendonly", "no")


async def restored_from_an_older_backup(
    private_redis_server: Callable[..., AbstractContextManager[str]], *, fenced: bool
) -> list[str]:
    """Owner A claims after redis saved a backup and writes; redis restarts from that
    backup; B claims and writes; then A writes again. Problems: a write of A accepted
    after B's, or A's stale write in the journal after B's."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="sessionactors-rdb-") as directory:
        server = contextlib.ExitStack()
        url = await trio.to_thread.run_sync(
            server.enter_context, private_redis_server(directory=directory, config=RDB_ONLY)
        )
        try:
            a = RedisStore(url, prefix="r", persistence="volatile")
            b = RedisStore(url, prefix="r", persistence="volatile")
            with trio.fail_after(30):
                await a.create("s", b"snap", b"i")
                await a.append("s", [E(1, b"early")], b"i")
                async with coredis.Redis.from_url(url) as client:
                    await client.save()  # the backup: before A's claim
                    pid = int((await client.info("server"))["process_id"])
                lease_a = await a.claim("s", "A", 0.5)
                assert lease_a is not None
                fence_a = lease_a.fence if fenced else None
                await a.append("s", [E(2, b"A's turn")], b"i", fence=fence_a)
                os.kill(pid, signal.SIGKILL)  # restarted from the older backup
                port = urlsplit(url).port
                server.close()
                await trio.to_thread.run_sync(
                    server.enter_context,
                    private_redis_server(port, directory=directory, config=RDB_ONLY),
                )
                with warnings.catch_warnings():  # (see test_recovers_when_the_server_comes_back)
                    warnings.simplefilter("ignore", ResourceWarning)
                    for _attempt in range(20):  # the connection breaks once
                        with contextlib.suppress(StoreError):
                            lease_b = await b.claim("s", "B", 30)
                            break
                    gc.collect()
                assert lease_b is not None
                await b.append(
                    "s", [E(2, b"B's turn")], b"i", fence=lease_b.fence if fenced else None
                )
                try:
                    await a.append("s", [E(3, b"A's stale turn")], b"i", fence=fence_a)
                    problems.append("A's write after B's was accepted")
                except FencedOutError:
                    pass
                _, entries = await b.read_journal("s", 0)
                if [e.data for e in entries] != [b"early", b"B's turn"]:
                    problems.append(f"the journal holds {[e.data for e in entries]}")
            await a.aclose()
            await b.aclose()
        finally:
            server.close()
    return problems


async def test_a_stale_owner_is_fenced_out_after_a_restore_from_an_older_backup(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """After redis restarts from a backup older than A's claim and B claims, A's next write is refused and the journal holds no stale write after B's."""
    assert await restored_from_an_older_backup(private_redis_server, fenced=True) == []


async def test_the_restore_check_catches_unfenced_writes(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """The same check reports the stale write when writes carry no fencing token (negative control)."""
    problems = await restored_from_an_older_backup(private_redis_server, fenced=False)
    assert "A's write after B's was accepted" in problems


async def test_a_database_the_server_lacks_is_named_in_the_error(redis_url: str) -> None:
    """A database number the server does not have: the error says so (a retry cannot fix it)."""
    store = RedisStore(redis_url.rsplit("/", 1)[0] + "/99999", prefix=_new_prefix())
    try:
        with trio.fail_after(10), pytest.raises(StoreError, match="DB index is out of range"):
            await store.load("s")
    finally:
        await store.aclose()


async def test_a_write_whose_lease_is_gone_is_refused_without_claiming_lost_data(
    make_store: MakeStore, redis_url: str
) -> None:
    """A fenced write that finds no lease of its session is refused with a FencedOutError
    that names every cause the store cannot tell apart (the lease released, expired, taken
    over and released, or lost with the server's data) and claims no lost data: a worker
    whose lease lapsed while another claimed the session and hibernated it (released its
    lease) meets the same, and so does one whose lease key the server lost; a lease that
    another owner claimed since says another worker took it over."""
    a = make_store()
    b = make_store(a.prefix)
    with trio.fail_after(10):
        await a.create("s", b"snap", b"i0")
        stale = await a.claim("s", "A", 0.2)
        assert stale is not None
        await a.append("s", [E(1, b"one")], b"i1", fence=stale.fence)
        while (taken_over := await b.claim("s", "B", 30)) is None:  # A's lease lapses
            await trio.sleep(0.05)
        await b.release("s", taken_over)  # B hibernates the session
        with pytest.raises(FencedOutError) as released:
            await a.append("s", [E(2, b"two")], b"i2", fence=stale.fence)
        lease = await a.claim("s", "A", 30)
        assert lease is not None
        async with coredis.Redis.from_url(redis_url, decode_responses=True) as client:
            [key] = [k async for k in client.scan_iter(match=f"{a.prefix}:*:lease")]
            await client.delete([key])
        with pytest.raises(FencedOutError) as lost:
            await a.append("s", [E(2, b"two")], b"i2", fence=lease.fence)
        other = make_store()
        await other.create("s", b"snap", b"i0")
        first = await other.claim("s", "w1", 30)
        assert first is not None
        await other.release("s", first)
        assert await other.claim("s", "w2", 30) is not None
        with pytest.raises(FencedOutError) as taken:
            await other.append("s", [E(1, b"one")], b"i1", fence=first.fence)
    for error in (released.value, lost.value):
        assert not error.lost_data, error
        assert "holds no lease of session 's'" in str(error)
        assert "released, expired, taken over and released" in str(error)
        assert "or the store lost or rolled back data" in str(error)
        assert "send the request again" in str(error)
    assert not taken.value.lost_data
    assert "another worker took the session over" in str(taken.value)
    assert "lost or rolled back data" not in str(taken.value)


async def test_a_session_name_that_is_not_utf8_is_left_out_of_listings_and_logged(
    make_store: MakeStore, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored session whose name is not valid UTF-8 (damage to its keys) is left out of
    the registry's listings with a WARNING that names its bytes and how to delete it (as
    on SQLite), its keys are kept until deleted, and the other sessions list and wake as
    before; store.delete of the name as listings give it removes every key of it."""
    store = make_store()
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        for name in ("alpha", "beta", "x19"):  # x19 last: the newest, listed first
            await (await registry.spawn(name)).send("hello")
    with trio.fail_after(10):
        moved = await rot_name(redis_url, store.prefix, "x19", b"\xff19")
    assert len(moved) == 3  # meta, info, log (no lease: it hibernated)
    caplog.set_level("WARNING", logger="sessionactors")
    store = make_store(store.prefix)
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        with trio.fail_after(30):
            assert [i.session_id for i in await registry.sessions()] == ["beta", "alpha"]
            assert [i.session_id for i in await registry.sessions(limit=1)] == ["beta"]
            assert await registry.pending_reviews() == []
            assert (await registry.ref("alpha").send("again")).text == "again"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned
    assert all("$'\\xff19'" in text and "sessions delete" in text for text in warned), warned
    with trio.fail_after(10):  # still there, listed every time
        assert len(await keys_of(redis_url, store.prefix, b"\xff19")) == 5
        listed = [name for name, _ in await store.list_sessions()]
        assert listed == ["alpha", "beta", "\udcff19"]
        assert await store.delete("\udcff19")
        assert await keys_of(redis_url, store.prefix, b"\xff19") == []
        assert not await store.delete("\udcff19")
        assert [name for name, _ in await store.list_sessions()] == ["alpha", "beta"]


def _port_below(highest: int) -> int:
    """A free port of 127.0.0.1 at most ``highest``."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port <= highest:
            return port


async def test_a_live_session_that_redis_lost_says_its_data_may_be_lost(
    private_redis_server: Callable[..., AbstractContextManager[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A live session whose keys are gone from redis when it writes (FLUSHALL, or a server
    restarted empty) fails its turn with a SessionNotFoundError that says the store no
    longer holds a session this process had loaded and that its data may have been
    lost, not that it was never created; the registry logs that at ERROR."""
    agent = sa.Agent(model=EchoModel())
    with contextlib.ExitStack() as server:
        url = await trio.to_thread.run_sync(
            server.enter_context, private_redis_server(_port_below(55535))
        )
        store = RedisStore(url, prefix="lost")
        async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
            with trio.fail_after(30):
                ref = await registry.spawn("s")
                assert (await ref.send("one")).text == "one"
                ended: list[BaseException] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_until_it_ends, ref, ended)
                    await trio.testing.wait_all_tasks_blocked()
                    async with coredis.Redis.from_url(url) as client:
                        await client.flushall()
                    with pytest.raises(sa.SessionNotFoundError) as caught:
                        await ref.send("two")
    said = str(caught.value)
    assert [str(e) for e in ended] == [said]  # a subscriber is told, not left waiting
    assert "no longer holds session 's', which this process had loaded" in said, said
    assert "FLUSHALL" in said, said
    assert "append-only file" in said, said
    assert "create it first" not in said, said
    assert caught.value.session_id == "s"
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "sessionactors"]
    assert any("which this process had loaded" in r.getMessage() for r in errors), caplog.text
