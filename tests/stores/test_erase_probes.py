"""Probes of what a delete leaves of a session's text in the bytes a store keeps: the
SQLite file, its ``-wal`` and free pages; every key of a Redis store's prefix."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import coredis
import pytest
import trio

import sessionactors as sa
from redis_workers import open_worker
from sessionactors.testing import EchoModel

MARK = "ERASE-ME"


def _found(directory: Path, marker: str) -> dict[str, int]:
    """How many times each file of ``directory`` holds ``marker``, byte for byte."""
    found = {}
    for path in sorted(directory.iterdir()):
        count = path.read_bytes().count(marker.encode())
        if count:
            found[path.name] = count
    return found


@pytest.fixture(params=["platform", "upstream"])
def sqlite_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """SQLite as this platform built it (Debian's turns secure_delete on), and as
    upstream builds it (secure_delete off: every connection is opened with it off)."""
    build: str = request.param
    if build == "upstream":
        connect = sqlite3.connect

        def upstream(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = connect(*args, **kwargs)
            conn.execute("PRAGMA secure_delete = OFF")
            return conn

        monkeypatch.setattr(sqlite3, "connect", upstream)
    return build


async def _talk(registry: sa.Registry, name: str) -> None:
    ref = await registry.spawn(name, metadata={"email": f"{MARK}-{name}@example.com"})
    for i in range(20):
        await ref.send(f"{MARK}-{name}-{i} " + "pad " * 200)


async def test_no_byte_of_the_sqlite_files_holds_a_deleted_sessions_text(
    tmp_path: Path, sqlite_build: str
) -> None:
    """Once delete() returns, neither the SQLite file (its free pages included) nor its
    -wal holds anything of the session's messages or metadata, whether they were written
    before the last restart (in the file) or since (in the -wal), whatever SQLite's
    build: while the registry is still open, and after it closes."""
    agents = {"echo": sa.Agent(model=EchoModel())}
    store = sa.SQLiteStore(tmp_path / "s.db")
    with trio.fail_after(30):
        async with sa.open_registry(store=store, agents=agents) as registry:
            await _talk(registry, "before")
            await (await registry.spawn("kept")).send("kept words")
        assert list(_found(tmp_path, MARK)) == ["s.db"]  # (written into the file on close)
        async with sa.open_registry(store=store, agents=agents) as registry:
            await _talk(registry, "since")
            assert _found(tmp_path, f"{MARK}-since") != {}
            await registry.delete("before")
            await registry.delete("since")
            assert _found(tmp_path, MARK) == {}
            kept = await registry.ref("kept").history()
        assert _found(tmp_path, MARK) == {}
    assert [m.content for m in kept] == ["kept words", "kept words"]


async def test_a_reader_of_an_older_snapshot_delays_the_erasure_of_the_wal_until_it_ends(
    tmp_path: Path,
) -> None:
    """A reader in a transaction on an older snapshot (a backup, a shell) keeps what a
    delete removed in the -wal while it reads, without holding up the store's other
    writes; the store empties the -wal once the reader is done, without another write."""
    path = tmp_path / "s.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    with trio.fail_after(30):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            await _talk(registry, "gone")
            reader = sqlite3.connect(path)
            try:
                reader.execute("BEGIN")
                assert reader.execute("SELECT count(*) FROM journal").fetchone() != (0,)
                await registry.delete("gone")
                assert "s.db-wal" in _found(tmp_path, MARK)  # (the reader may read it)
                reply = await (await registry.spawn("other")).send("the store goes on")
                assert "s.db-wal" in _found(tmp_path, MARK)
            finally:
                reader.close()
            while _found(tmp_path, MARK):  # (tried again within a second or so)
                await trio.sleep(0.1)
            assert (await registry.ref("other").history())[-1].content == reply.text


async def _values(client: Any, key: bytes) -> bytes:
    """Everything a key holds, whatever its type, as one string of bytes."""
    kind = await client.type(key)
    if kind == b"stream":
        entries = await client.xrange(key, "-", "+")
        return b"|".join(
            bytes(k) + b"=" + bytes(v) for e in entries for k, v in e.field_values.items()
        )
    if kind == b"string":
        return bytes(await client.get(key) or b"")
    if kind == b"hash":
        return b"|".join(bytes(k) + b"=" + bytes(v) for k, v in (await client.hgetall(key)).items())
    if kind == b"zset":
        return b"|".join(bytes(m) for m in await client.zrange(key, 0, -1))
    if kind == b"set":
        return b"|".join(bytes(m) for m in await client.smembers(key))
    if kind == b"list":
        return b"|".join(bytes(m) for m in await client.lrange(key, 0, -1))
    return b""


@pytest.mark.redis
async def test_no_redis_key_holds_a_deleted_sessions_text_not_even_its_event_stream(
    redis_url: str,
) -> None:
    """A session that another worker subscribed to (so that its events went to its event
    stream) leaves nothing of its text in any key of the prefix once it is deleted: the
    stream, kept a while for the subscribers elsewhere to read its end, holds the end
    alone; the subscriber elsewhere is told that the session was deleted."""
    prefix = f"erase-{uuid.uuid4().hex}"
    ended: list[BaseException] = []

    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a") as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            ref = await a.spawn("gone", metadata={"email": f"{MARK}@example.com"})
            await ref.send(f"{MARK} first")  # live on a

            async def follow(task_status: trio.TaskStatus[None]) -> None:
                try:
                    async with b.ref("gone").subscribe() as events:
                        task_status.started()
                        async for event in events:
                            if isinstance(event, sa.TurnFinished):
                                seen.set()
                except sa.SessionNotFoundError as exc:
                    ended.append(exc)

            seen = trio.Event()
            async with trio.open_nursery() as nursery:
                await nursery.start(follow)
                await ref.send(f"{MARK} second " + "words " * 50)
                await seen.wait()  # (its events went through the stream)
                await a.delete("gone")
            async with coredis.Redis.from_url(redis_url, decode_responses=False) as client:
                keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
                holding = [key for key in keys if MARK.encode() in await _values(client, key)]
                events = [key for key in keys if key.endswith(b":ev")]
                stream = [await client.xrange(key, "-", "+") for key in events]
    assert holding == []
    assert [[dict(entry.field_values) for entry in entries] for entries in stream] == [
        [{b"gone": b"1"}]
    ]
    assert len(ended) == 1
    assert ended[0].session_id == "gone"
