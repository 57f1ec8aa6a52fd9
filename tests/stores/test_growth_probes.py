"""Probes of what the stores hold and write over a session's long life."""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import coredis
import msgpack
import pytest
import trio
import trio.testing

import sessionactors as sa
from processes import sessions
from sessionactors.stores import MAX_SNAPSHOT_BYTES, JournalEntry, RedisStore
from sessionactors.testing import EchoModel, export_document, journal_events

_KEEP = 6


@asynccontextmanager
async def _store(
    kind: str, tmp_path: Path, redis_url: Callable[[], str]
) -> AsyncIterator[sa.Store]:
    if kind == "memory":
        yield sa.MemoryStore()
    elif kind == "sqlite":
        store = sa.SQLiteStore(tmp_path / "sessions.db")
        try:
            yield store
        finally:
            await store.aclose()
    else:
        store = RedisStore(redis_url(), prefix=f"grow-{uuid.uuid4().hex}")
        try:
            yield store
        finally:
            await store.aclose()


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Each store in turn."""
    kind: str = request.param
    return kind


@pytest.fixture
def lazy_redis_url(request: pytest.FixtureRequest) -> Callable[[], str]:
    """The redis URL, started only by the tests that use it."""

    def url() -> str:
        value: str = request.getfixturevalue("redis_url")
        return value

    return url


async def test_a_session_that_hibernates_after_every_turn_keeps_a_bounded_journal(
    store_kind: str, tmp_path: Path, lazy_redis_url: Callable[[], str]
) -> None:
    """Many short wake / turn / hibernate cycles leave a journal of about
    journal_keep_events events, not one that grows with every cycle; a resume from
    within the kept events still replays them."""
    agent = sa.Agent(model=EchoModel())
    async with (
        _store(store_kind, tmp_path, lazy_redis_url) as store,
        sa.open_registry(
            store=store, agents={"echo": agent}, journal_keep_events=_KEEP, snapshot_every=1
        ) as registry,
    ):
        ref = await registry.spawn("chatty")
        for i in range(40):
            with trio.fail_after(10):
                await ref.send(f"turn {i}")
                await ref.hibernate()
        kept = await journal_events(store, "chatty")
        assert _KEEP <= len(kept) <= 3 * _KEEP
        with trio.fail_after(10):
            async with ref.subscribe(after=kept[-_KEEP].seq - 1) as events:
                first = await events.__anext__()
        assert first.seq == kept[-_KEEP].seq


# One turn of EchoModel adds its input twice (the user's message and the echo).
_BIG_TEXT = "x" * (1024 * 1024 - 64)
_TURNS_OVER_LIMIT = MAX_SNAPSHOT_BYTES // (2 * len(_BIG_TEXT)) + 1


async def _grow_past_the_snapshot_limit(ref: sa.SessionRef) -> None:
    for _ in range(_TURNS_OVER_LIMIT):
        await ref.send(_BIG_TEXT)


async def _snapshot_size(ref: sa.SessionRef) -> int:
    return len(sa.dump_snapshot(await ref.state()))


async def _grow_to_under_the_snapshot_limit(ref: sa.SessionRef, room: int) -> None:
    """Turns that leave the session's snapshot less than ``room`` bytes, and more than
    half of it, under the limit."""
    for _ in range(_TURNS_OVER_LIMIT - 2):
        await ref.send(_BIG_TEXT)
    left = MAX_SNAPSHOT_BYTES - await _snapshot_size(ref)
    await ref.send("z" * ((left - room * 3 // 4) // 2))  # (echoed: twice)
    left = MAX_SNAPSHOT_BYTES - await _snapshot_size(ref)
    assert room // 2 < left < room


async def test_a_session_too_large_to_snapshot_is_not_encoded_again_until_it_may_have_shrunk(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Once its state was too large for a snapshot, turns that only add to it do not
    make the idle timeout encode (and log) it again; an edit of its history or of its
    metadata does, and then it hibernates."""
    agent = sa.Agent(model=EchoModel())
    for edit in ("truncate", "metadata"):
        caplog.clear()
        async with sa.open_registry(agents={"echo": agent}, idle_timeout=5) as registry:
            ref = await registry.spawn("big")
            if edit == "truncate":
                await _grow_past_the_snapshot_limit(ref)
            else:  # (metadata is at most MAX_METADATA_BYTES: the history is most of it)
                blob = "y" * (sa.MAX_METADATA_BYTES - 16)
                await _grow_to_under_the_snapshot_limit(ref, room=len(blob))
                await ref.set_metadata({"blob": blob})
            await trio.sleep(60)
            assert caplog.text.count("until then it stays live") == 1
            for _ in range(3):
                with trio.fail_after(5):
                    assert (await ref.send("small")).text == "small"
                await trio.sleep(60)
            assert caplog.text.count("until then it stays live") == 1
            assert registry.live() == ["big"]
            if edit == "truncate":
                await ref.truncate(2)
            else:
                await ref.set_metadata({"blob": None})
            await trio.sleep(60)
            assert registry.live() == []


class _CountingStore(sa.MemoryStore):
    """A MemoryStore that counts its appends, and the bytes of info they are given."""

    appends = 0
    info_bytes = 0

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        self.appends += 1
        self.info_bytes += len(info)
        await super().append(session_id, entries, info, fence=fence)


async def test_a_turn_of_a_session_with_the_largest_metadata_writes_a_bounded_info() -> None:
    """The info a turn's append writes carries the session's whole metadata again (the
    store protocol's append takes the whole info), so metadata is bounded: with the
    largest metadata spawn takes, each append writes at most MAX_METADATA_BYTES and
    the info's own fields (under 1 KiB), however many turns there are."""
    store = _CountingStore()
    metadata = {"blob": "y" * (sa.MAX_METADATA_BYTES - 9)}
    assert len(msgpack.packb(metadata)) == sa.MAX_METADATA_BYTES
    async with sa.open_registry(store=store, agents={"echo": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("meta", metadata=metadata)
        await ref.send("warm up")
        before = (store.appends, store.info_bytes)
        for i in range(5):
            await ref.send(f"turn {i}")
        appends, info_bytes = store.appends - before[0], store.info_bytes - before[1]
        assert appends >= 5
        assert info_bytes / appends <= sa.MAX_METADATA_BYTES + 1024


async def test_an_export_carries_no_journal_bookkeeping_and_older_exports_still_import(
    tmp_path: Path,
) -> None:
    """The export of a session that hibernated often holds its conversation, not the
    source store's journal bookkeeping, and imports; so does the same export as an
    exporter that did not know that bookkeeping wrote it."""
    store = sa.MemoryStore()
    async with sa.open_registry(
        store=store, agents={"echo": sa.Agent(model=EchoModel())}, journal_keep_events=2
    ) as registry:
        ref = await registry.spawn("often")
        for i in range(4):
            await ref.send(f"turn {i}")
            await ref.hibernate()
    state = await sa.read_session(store, "often")
    document = export_document(state)
    older = json.loads(json.dumps(document))
    for key in ("journal_mark_seq", "journal_mark_events"):
        older["session"].pop(key, None)
    assert older == document
    target = f"sqlite:///{tmp_path / 'target.db'}"
    done = await trio.to_thread.run_sync(
        lambda: sessions("import", "-", "--store", target, stdin=json.dumps(older))
    )
    assert done.returncode == 0, done.stderr
    imported = await sa.read_session(sa.SQLiteStore(tmp_path / "target.db", readonly=True), "often")
    assert imported.messages == state.messages


async def test_truncating_a_session_of_keyed_turns_makes_its_snapshot_small() -> None:
    """After truncate(0), the snapshot of a session whose turns had idempotency keys no
    longer holds their replies."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents={"echo": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("keyed")
        for i in range(10):
            await ref.send("x" * 100_000, idempotency_key=f"key-{i}")
        await ref.truncate(0)
        await ref.hibernate()
        stored = await store.load("keyed")
        assert stored is not None
        assert len(stored.snapshot) < 100_000


@pytest.mark.xfail(
    strict=True,
    reason="design decision: a session may grow past the snapshot limit (documented: it "
    "stays live, its journal keeps every turn, hibernate raises SnapshotError until an "
    "edit makes it smaller); refusing the request that crosses it needs the state's "
    "encoded size at every turn and add_messages, and changes that documented behaviour",
)
async def test_add_messages_that_would_pass_the_snapshot_limit_is_refused() -> None:
    """add_messages whose messages would make the state too large to snapshot is refused
    before anything is written, with an error naming the session."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("imports")
        batch = [sa.Message.create(sa.Role.USER, "x" * 1_000_000) for _ in range(10)]
        refused = None
        for _ in range(8):
            try:
                await ref.add_messages(
                    [sa.Message.create(m.role, m.content) for m in batch]  # fresh ids
                )
            except (ValueError, sa.SnapshotError) as exc:
                refused = exc
                break
        assert refused is not None
        assert "'imports'" in str(refused)
        await ref.hibernate()


async def test_a_deleted_session_leaves_no_rows_or_keys_behind(
    tmp_path: Path, redis_url: str
) -> None:
    """After registry.delete, neither SQLite (rows of every table) nor Redis (keys under
    the prefix, but the fencing counter and the expiring end of its event stream) holds
    anything of a session that took turns, hibernated, woke and had a subscriber."""
    prefix = f"gone-{uuid.uuid4().hex}"
    path = tmp_path / "sessions.db"
    for store in (sa.SQLiteStore(path), RedisStore(redis_url, prefix=prefix)):
        async with sa.open_registry(
            store=store, agents={"echo": sa.Agent(model=EchoModel())}, snapshot_every=1
        ) as registry:
            ref = await registry.spawn("gone", metadata={"tenant": "acme"})
            for i in range(3):
                await ref.send(f"turn {i}")
                await ref.hibernate()
            await ref.send("awake")
            async with ref.subscribe():
                await registry.delete("gone")
            assert await registry.sessions() == []
        await store.aclose()
    with sqlite3.connect(path) as conn:
        for table in ("sessions", "snapshots", "journal"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    async with coredis.Redis.from_url(redis_url) as client:
        left = {key async for key in client.scan_iter(match=f"{prefix}:*")}
        for key in left:
            assert key.endswith((b":fence", b":ev")), key
            assert key.endswith(b":fence") or await client.pttl(key) > 0, key
