"""A client that resumes with a seq of a history its session no longer has (one lost when
the store was restored from an older backup, one of a deleted session of the same name,
one from before the session moved to another store) gets EventsExpiredError, never the
events of the session's present history under seqs it cannot place, even once that
history has gone past its seq."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import coredis
import pytest
import trio

import sessionactors as sa
from processes import sessions
from redis_keys import drop_prefix
from sessionactors.stores import JournalEntry, RedisStore, Store, dump_events, dump_info
from sessionactors.testing import EchoModel
from test_subscribe_beyond import refused

ECHO = {"a": sa.Agent(model=EchoModel())}


async def pass_seq(ref: sa.SessionRef, seq: int) -> str:
    """Send turns until the session's seq is past ``seq``; the last turn's id."""
    reply = await ref.send("a new turn")
    while (await ref.state()).event_seq <= seq + 5:
        reply = await ref.send("a new turn")
    return reply.turn_id


async def replayed(ref: sa.SessionRef, after: int, turn_id: str) -> list[str]:
    """The texts of the finished turns a subscription after ``after`` replays, up to the
    outcome of ``turn_id``."""
    texts = []
    with trio.fail_after(10):
        async with ref.subscribe(after=after) as events:
            async for event in events:
                assert event.seq > after
                if isinstance(event, sa.TurnFinished):
                    texts.append(event.message.content)
                    if event.turn_id == turn_id:
                        return texts
    raise AssertionError("the subscription ended before the turn's outcome")


def assert_not_told_a_death(error: sa.EventsExpiredError, name: str, after: int) -> None:
    """The error names the session and the seq, says to reload, and does not blame a
    process that stopped before it stored its events (every turn here was stored)."""
    message = str(error)
    assert error.session_id == name
    assert f"after seq {after}" in message, message
    assert "ref.state()" in message, message
    assert "stopped before it stored" not in message, message


Opened = Callable[[], Store]


async def restore_after_new_turns(
    make: Opened, back_up: Callable[[], Awaitable[object]], restore: Callable[[], Awaitable[None]]
) -> None:
    """The session is hibernated when the store is backed up, takes two turns, the
    backup is restored and the session takes new turns past the client's seq: a resume
    after that seq is refused (live, and in a new registry that reads the store), and
    one after the backup's last seq replays the new turns."""
    async with sa.open_registry(store=make(), agents=ECHO) as registry:
        ref = await registry.spawn("b")
        await ref.send("before the backup")
        await ref.hibernate()
        at_backup = (await sa.read_session(registry.store, "b")).event_seq
    await back_up()
    async with sa.open_registry(store=make(), agents=ECHO) as registry:
        ref = registry.ref("b")
        for text in ("lost one", "lost two"):
            await ref.send(text)
        assert await replayed(ref, at_backup, (await ref.send("lost three")).turn_id) == [
            "lost one",
            "lost two",
            "lost three",
        ]
        seen = (await ref.state()).event_seq
    await restore()
    async with sa.open_registry(store=make(), agents=ECHO) as registry:
        ref = registry.ref("b")
        assert (await ref.state()).event_seq == at_backup
        last_turn = await pass_seq(ref, seen)
        assert_not_told_a_death(await refused(ref, seen), "b", seen)
        assert set(await replayed(ref, at_backup, last_turn)) == {"a new turn"}
    async with sa.open_registry(store=make(), agents=ECHO) as registry:
        ref = registry.ref("b")
        assert_not_told_a_death(await refused(ref, seen), "b", seen)
        assert set(await replayed(ref, at_backup, last_turn)) == {"a new turn"}


async def test_a_resume_from_a_history_a_restored_sqlite_backup_lost_is_refused(
    tmp_path: Path,
) -> None:
    """A SQLite file restored from a copy taken while the session was hibernated: new
    turns reuse no seq of the history the restore lost."""
    path, backup = tmp_path / "sessions.db", tmp_path / "backup.db"

    async def back_up() -> None:
        shutil.copyfile(path, backup)

    async def restore() -> None:
        for extra in ("-wal", "-shm"):
            Path(f"{path}{extra}").unlink(missing_ok=True)
        shutil.copyfile(backup, path)

    with trio.fail_after(60):
        await restore_after_new_turns(lambda: sa.SQLiteStore(path), back_up, restore)


@pytest.mark.redis
async def test_a_resume_from_a_history_a_restored_redis_backup_lost_is_refused(
    redis_url: str,
) -> None:
    """Redis keys restored from a dump taken while the session was hibernated: new turns
    reuse no seq of the history the restore lost."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    dumped: dict[bytes, bytes] = {}

    async def back_up() -> None:
        async with coredis.Redis.from_url(redis_url, decode_responses=False) as client:
            async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                data = await client.dump(key)
                assert data is not None
                if await client.ttl(key) < 0:  # (a worker's liveness key expires anyway)
                    dumped[key] = data

    async def restore() -> None:
        await drop_prefix(redis_url, prefix)
        async with coredis.Redis.from_url(redis_url, decode_responses=False) as client:
            for key, data in dumped.items():
                await client.restore(key, 0, data)

    try:
        with trio.fail_after(60):
            await restore_after_new_turns(
                lambda: RedisStore(redis_url, prefix=prefix), back_up, restore
            )
    finally:
        await drop_prefix(redis_url, prefix)


async def test_a_resume_from_a_deleted_namesake_is_refused_once_the_new_one_passes_it(
    tmp_path: Path,
) -> None:
    """A session deleted and made again under its name: once the new one's seq has gone
    past a client's seq of the deleted one, a resume after it is refused (live,
    hibernated, and in a new registry), instead of handing over the new one's events."""
    path = tmp_path / "sessions.db"
    with trio.fail_after(60):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            ref = await registry.spawn("n")
            for text in ("one two three", "four five six"):
                await ref.send(text)
            old = (await ref.state()).event_seq
            await registry.delete("n")
            ref = await registry.spawn("n")
            await pass_seq(ref, old)
            assert_not_told_a_death(await refused(ref, old), "n", old)
            await ref.hibernate()
            assert_not_told_a_death(await refused(ref, old), "n", old)
            assert registry.live() == []
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            assert_not_told_a_death(await refused(registry.ref("n"), old), "n", old)
            last_turn = await pass_seq(registry.ref("n"), 0)
            assert set(await replayed(registry.ref("n"), 0, last_turn)) == {"a new turn"}


async def test_a_resume_from_before_a_session_moved_to_another_store_is_refused(
    tmp_path: Path,
) -> None:
    """A session exported from one store and imported into another keeps its seq but
    not its journal: a resume after a seq below it is refused (the events after it are
    not there), and one after its seq follows on."""
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    with trio.fail_after(60):
        async with sa.open_registry(store=sa.SQLiteStore(source), agents=ECHO) as registry:
            ref = await registry.spawn("m")
            for text in ("one two", "three four"):
                await ref.send(text)
        exported = sessions("export", "m", "--store", f"sqlite:///{source}")
        assert exported.returncode == 0, exported.stderr
        assert json.loads(exported.stdout)["session"]["session_id"] == "m"
        done = sessions("import", "-", "--store", f"sqlite:///{target}", stdin=exported.stdout)
        assert done.returncode == 0, done.stderr
        async with sa.open_registry(store=sa.SQLiteStore(target), agents=ECHO) as registry:
            ref = registry.ref("m")
            last = (await sa.read_session(registry.store, "m")).event_seq
            for after in (0, last - 1):
                error = await refused(ref, after)
                assert error.session_id == "m"
                assert error.oldest_seq == last + 1
            assert registry.live() == []
            turn = await ref.submit("five six")
            assert await replayed(ref, last, turn.id) == ["five six"]
    assert os.path.exists(target)


async def test_wakes_number_on_from_the_clock_and_stay_far_below_two_to_the_53() -> None:
    """Wakes after clean hibernations number a session's events on from the clock's time
    in microseconds, adding nothing per wake: after fifty, its seq is no further past the
    clock than its events take, and far below 2**53 (what a JavaScript number holds)."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("w")
        with trio.fail_after(60):
            for _ in range(50):
                await ref.send("one")
                await ref.hibernate()
        seq = (await ref.state()).event_seq
        assert seq <= time.time_ns() // 1000 + 50 * 5  # (each wake publishes 5 events)
        assert seq < 2**53 // 4


async def test_a_jump_journaled_before_skipped_from_existed_is_still_told() -> None:
    """A journal that records a wake's jump as an older sessionactors did (a status
    2**20 + 1 above the last stored seq, without skipped_from): a resume after a seq in
    the gap is refused, from the store; one at the last seq before it replays on."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        await (await registry.spawn("old")).send("before the jump")
    durable = (await sa.read_session(store, "old")).event_seq
    record = sa.StatusChanged(session_id="old", seq=durable + 2**20 + 1, status=sa.Status.IDLE)
    info = sa.SessionInfo(
        session_id="old",
        agent="a",
        status=sa.Status.IDLE,
        message_count=2,
        updated_at=datetime.datetime.now(datetime.UTC),
    )
    await store.append("old", [JournalEntry(record.seq, dump_events([record]))], dump_info(info))
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("old")
        error = await refused(ref, durable + 5)
        assert error.oldest_seq == record.seq
        assert registry.live() == []
        with trio.fail_after(10):
            async with ref.subscribe(after=durable) as events:
                assert await anext(events) == record
