"""Probes of the stores' and the codec's limits, and of what a session keeps over time."""

from __future__ import annotations

import base64
import functools
import gc
import sqlite3
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import coredis
import msgpack
import pytest
import trio
import trio.testing

import sessionactors as sa
from processes import sessions
from sessionactors.stores import MAX_JOURNAL_ENTRY_BYTES, MAX_SEQ, MAX_SNAPSHOT_BYTES, RedisStore
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel, crash

# One turn of EchoModel adds its input twice (the user's message and the echo).
_BIG_TEXT = "x" * (1024 * 1024 - 64)
_TURNS_OVER_LIMIT = MAX_SNAPSHOT_BYTES // (2 * len(_BIG_TEXT)) + 1


async def _grow_past_the_snapshot_limit(ref: sa.SessionRef) -> None:
    for _ in range(_TURNS_OVER_LIMIT):
        await ref.send(_BIG_TEXT)


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_hibernating_a_session_too_large_to_snapshot_says_so_and_keeps_it_live(
    durability: str,
) -> None:
    """hibernate() of a session whose snapshot would pass the limit raises a SnapshotError
    naming it, and the session stays live and healthy: no crash, no restart, never failed."""
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}, durability=durability) as registry:
        ref = await registry.spawn("big")
        await _grow_past_the_snapshot_limit(ref)
        for _ in range(5):  # more than the restart intensity allows
            with pytest.raises(sa.SnapshotError, match=r"'big'.*truncate") as caught:
                await ref.hibernate()
            assert caught.value.session_id == "big"
        stats = registry.statistics()
        assert (stats.crashes, stats.restarts, stats.failed) == (0, 0, 0)
        assert registry.live() == ["big"]
        assert (await ref.state()).status is sa.Status.IDLE
        await ref.truncate(2)
        await ref.hibernate()
        assert registry.live() == []
        assert len(await ref.history()) == 2


async def test_a_session_too_large_to_snapshot_is_closed_with_a_warning_and_loses_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """durability="turn": the registry's exit cannot hibernate a session too large to
    snapshot; it says so in the log, and the next registry wakes it whole from its
    journal."""
    store = sa.MemoryStore()
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        await _grow_past_the_snapshot_limit(await registry.spawn("big"))
    assert "'big' closed without its hibernation snapshot" in caplog.text
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        assert len(await registry.ref("big").history()) == 2 * _TURNS_OVER_LIMIT
        await registry.ref("big").truncate(2)


async def test_an_idle_session_too_large_to_snapshot_stays_live_without_crashing(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The idle timeout's hibernation of a session too large to snapshot leaves it live,
    serving requests, instead of crashing and reloading it from the store each time; it
    is tried (and logged) once, and again only after an edit that may have shrunk it."""
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}, idle_timeout=5) as registry:
        ref = await registry.spawn("big")
        await _grow_past_the_snapshot_limit(ref)
        await trio.sleep(60)
        stats = registry.statistics()
        assert (stats.crashes, stats.restarts, stats.woken) == (0, 0, 1)  # (the spawn)
        assert len(await ref.history()) == 2 * _TURNS_OVER_LIMIT  # a read changes nothing
        await trio.sleep(60)
        assert caplog.text.count("until then it stays live") == 1
        with trio.fail_after(5):
            assert (await ref.send("small")).text == "small"
        await trio.sleep(60)
        assert caplog.text.count("until then it stays live") == 1  # a turn only adds to it
        assert registry.live() == ["big"]
        await ref.truncate(2)
        await trio.sleep(60)
        assert registry.live() == []
        assert len(await ref.history()) == 2


async def _held_after(ref: sa.SessionRef, turns: int) -> int:
    """Bytes still allocated after ``turns`` more turns, each truncated away at once."""
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(turns):
            await ref.send("a message of some length " * 10)
            await ref.truncate(2)
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


async def test_without_a_journal_a_busy_session_holds_no_more_than_its_history(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """durability="hibernate": a session that stays live and keeps its history short holds
    bounded memory, however many turns it runs (the events not yet written are folded
    into a copy of its state, without writing, every snapshot_every of them)."""
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(
        agents={"echo": agent},
        durability="hibernate",
        snapshot_every=20,
        replay_events=10,
        replay_bytes=4096,
    ) as registry:
        ref = await registry.spawn("busy")
        await _held_after(ref, 100)  # warm up
        short = await _held_after(ref, 100)
        long = await _held_after(ref, 800)
        assert long < short + 64 * 1024, (short, long)
        assert len(await ref.history()) == 2


async def _folded_session(registry: sa.Registry) -> sa.SessionRef:
    """A session with more answered events than snapshot_every (20), none of them written."""
    ref = await registry.spawn("busy")
    for i in range(30):
        await ref.send(f"turn {i}")
    await ref.truncate(4)
    await ref.send("last")
    return ref


async def test_without_a_journal_a_restart_after_folding_keeps_every_answered_turn() -> None:
    """durability="hibernate": a restart after the answered events were folded into the
    in-memory state keeps all of them, and so does the next clean exit."""
    store = FaultyStore()
    async with sa.open_registry(
        store=store,
        agents={"echo": sa.Agent(model=EchoModel())},
        durability="hibernate",
        snapshot_every=20,
    ) as registry:
        ref = await _folded_session(registry)
        before = await ref.state()
        store.fail("write_snapshot")
        with pytest.raises(sa.StoreError):
            await ref.hibernate()  # the actor crashes and restarts
        assert registry.statistics().restarts == 1
        after = await ref.state()
        assert after.messages == before.messages
        assert (after.turn_count, after.usage) == (before.turn_count, before.usage)
    async with sa.open_registry(store=store, agents={"echo": sa.Agent(model=EchoModel())}) as again:
        assert await again.ref("busy").history() == list(before.messages)


async def test_without_a_journal_a_failed_closing_snapshot_after_folding_is_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """durability="hibernate": answered turns folded into memory are still reported as not
    written when the registry's closing snapshot fails."""
    store = FaultyStore()

    async def run() -> None:
        async with sa.open_registry(
            store=store,
            agents={"echo": sa.Agent(model=EchoModel())},
            durability="hibernate",
            snapshot_every=20,
        ) as registry:
            ref = await registry.spawn("busy")
            for i in range(10):  # 20 events: all folded, none left to write but the fold
                await ref.send(f"turn {i}")
            store.fail("write_snapshot", times=None)

    with pytest.raises(sa.StoreError, match="'busy'"):
        await run()


async def test_without_a_journal_replay_from_before_a_fold_expires_instead_of_skipping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """durability="hibernate": a resume from a seq whose events were folded away (and have
    left the ring) gets EventsExpiredError; from a later seq, every durable event after it."""
    async with sa.open_registry(
        agents={"echo": sa.Agent(model=EchoModel())},
        durability="hibernate",
        snapshot_every=20,
        replay_events=4,
    ) as registry:
        ref = await registry.spawn("busy")
        await ref.send("turn 0")
        first = (await ref.state()).event_seq  # the first turn's outcome
        for i in range(1, 25):  # folded after turns 9 and 19 (20 events each time)
            await ref.send(f"turn {i}")
        with pytest.raises(sa.EventsExpiredError) as expired:
            async with ref.subscribe(after=first):
                pass
        oldest = expired.value.oldest_seq
        assert oldest > first
        durable = (sa.TurnStarted, sa.TurnFinished)
        async with ref.subscribe(after=oldest - 1) as events:
            await ref.send("one more")
            replayed: list[sa.Event] = []
            with trio.fail_after(60):
                async for event in events:
                    replayed.append(event)
                    if isinstance(event, sa.TurnFinished) and event.message.content == "one more":
                        break
        finished = [e.message.content for e in replayed if isinstance(e, sa.TurnFinished)]
        assert finished == [f"turn {i}" for i in range(20, 25)] + ["one more"]
        seqs = [e.seq for e in replayed if isinstance(e, durable)]
        assert seqs == sorted(set(seqs))


@pytest.mark.parametrize("damage", ["'not bytes'", "42", "4.5"])
async def test_a_stored_info_of_the_wrong_sql_type_is_listed_from_its_history(
    tmp_path: Path, damage: str
) -> None:
    """An SQLite row whose info is not a blob (text, a number) is listed as its intact
    history says; the listing and every other session go on."""
    path = tmp_path / "sessions.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        for name in ("victim", "other"):
            await (await registry.spawn(name)).send("hello")
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE sessions SET info = {damage} WHERE session_id = 'victim'")
    db.close()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        listed = {info.session_id: info.status for info in await registry.sessions()}
        assert listed == {"victim": sa.Status.HIBERNATED, "other": sa.Status.HIBERNATED}
        assert await registry.pending_reviews() == []
        assert (await registry.ref("other").send("still here")).text == "still here"


async def _two_sessions_in_redis(redis_url: str) -> str:
    """A fresh prefix holding the hibernated sessions 'victim' and 'other'."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=RedisStore(redis_url, prefix=prefix), agents=agents) as reg:
        for name in ("victim", "other"):
            await (await reg.spawn(name)).send("hello")
    return prefix


async def _listed_after(redis_url: str, prefix: str) -> dict[str, sa.Status]:
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=RedisStore(redis_url, prefix=prefix), agents=agents) as reg:
        with trio.fail_after(20):
            listed = {info.session_id: info.status for info in await reg.sessions()}
            assert (await reg.ref("other").send("still here")).text == "still here"
    return listed


@pytest.mark.redis
async def test_a_redis_info_key_of_the_wrong_type_is_listed_from_its_history(
    redis_url: str,
) -> None:
    """A session whose info key holds a hash instead of a string is listed as its intact
    history says; the listing and the other sessions go on."""
    prefix = await _two_sessions_in_redis(redis_url)
    victim = base64.urlsafe_b64encode(b"victim").rstrip(b"=").decode()
    async with coredis.Redis.from_url(redis_url) as client:
        (key,) = [k async for k in client.scan_iter(match=f"{prefix}:*:s:{victim}:info")]
        await client.delete([key])
        await client.hset(key, {"not": "a string"})
    listed = await _listed_after(redis_url, prefix)
    assert listed == {"victim": sa.Status.HIBERNATED, "other": sa.Status.HIBERNATED}


@pytest.mark.redis
async def test_a_stray_member_of_the_redis_listing_order_is_skipped(redis_url: str) -> None:
    """A member of the listing order that names no session (not hex of a name) does not
    fail the listing."""
    prefix = await _two_sessions_in_redis(redis_url)
    async with coredis.Redis.from_url(redis_url) as client:
        await client.zadd(f"{prefix}:activity", {"not hex!": 2**40, "ff": 2**40})
    listed = await _listed_after(redis_url, prefix)
    assert listed == {"victim": sa.Status.HIBERNATED, "other": sa.Status.HIBERNATED}


async def _sessions_command(*args: str, stdin: str | None = None) -> str:
    """The output of ``python -m sessionactors sessions ARGS``, which must succeed."""
    done = await trio.to_thread.run_sync(functools.partial(sessions, *args, stdin=stdin))
    assert done.returncode == 0, done.stderr
    return done.stdout


async def _refund(order_id: str) -> str:
    return f"refunded {order_id}"


async def test_a_session_moved_to_another_store_knows_its_open_turn(tmp_path: Path) -> None:
    """A session waiting on a review, exported and imported into another store under its
    own name (a move: a copy under another name is refused while the review waits),
    reports its open turn as waiting, then finished."""
    refund = sa.Tool(name="refund", fn=_refund, requires_review=True, idempotent=False)
    call = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')
    agent = sa.Agent(model=ScriptedModel([Scripted(tool_calls=[call]), "done"]), tools=[refund])
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    async with sa.open_registry(store=sa.SQLiteStore(source), agents={"a": agent}) as registry:
        reply = await (await registry.spawn("first")).send("refund A1")
        assert reply.reviews
    exported = await _sessions_command("export", "first", "--store", f"sqlite:///{source}")
    await _sessions_command("import", "-", "--store", f"sqlite:///{target}", stdin=exported)
    async with sa.open_registry(store=sa.SQLiteStore(target), agents={"a": agent}) as registry:
        ref = registry.ref("first")
        outcome = await ref.turn_outcome(reply.turn_id)
        assert (outcome.session_id, outcome.status) == ("first", sa.TurnStatus.WAITING)
        (review,) = await ref.pending_reviews()
        final = await ref.review(review.id, approve=True)
        assert (final.turn_id, final.text) == (reply.turn_id, "done")
        assert (await ref.turn_outcome(reply.turn_id)).status is sa.TurnStatus.FINISHED


async def test_a_journal_entry_of_another_session_is_refused_not_folded(tmp_path: Path) -> None:
    """A journal row that holds another session's events (a bad restore, a hand edit) is
    SnapshotCorruptError naming the session, on wake and on replay: never folded into
    its history, never replayed to its subscribers; the other session is untouched."""
    path = tmp_path / "sessions.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    with trio.CancelScope() as process:  # dies: the turns stay in the journal only
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            for name in ("victim", "other"):
                await (await registry.spawn(name)).send(f"{name}'s words")
            crash(registry)
            process.cancel()
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE journal SET data = (SELECT data FROM journal WHERE session_id = 'other' "
            "ORDER BY seq DESC LIMIT 1) WHERE session_id = 'victim' AND seq = "
            "(SELECT max(seq) FROM journal WHERE session_id = 'victim')"
        )
    db.close()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        victim = registry.ref("victim")
        with pytest.raises(sa.SnapshotCorruptError, match=r"'victim'.*'other'") as caught:
            await victim.history()
        assert caught.value.session_id == "victim"
        with pytest.raises(sa.SnapshotCorruptError, match="'victim'"):
            async with victim.subscribe(after=0):
                pass
        texts = [m.content for m in await registry.ref("other").history()]
        assert texts == ["other's words", "other's words"]


async def test_metadata_changes_whose_merge_passes_the_limit_are_refused_without_a_crash() -> None:
    """set_metadata() whose changes each fit but whose merge with the session's metadata
    would pass the size limit raises ValueError naming the session, before anything is
    written; the session does not crash, and keeps its metadata."""
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("meta")
        big = "x" * (sa.MAX_METADATA_BYTES * 2 // 5)
        await ref.set_metadata({"a": big})
        await ref.set_metadata({"b": big})
        for _ in range(5):  # more than the restart intensity allows
            with pytest.raises(ValueError, match=r"'meta'.*over the limit"):
                await ref.set_metadata({"c": big})
        stats = registry.statistics()
        assert (stats.crashes, stats.restarts, stats.failed) == (0, 0, 0)
        assert sorted((await ref.state()).metadata) == ["a", "b"]
        assert (await ref.send("still here")).text == "still here"


@sa.tool
async def _look(q: str) -> str:
    """Look something up."""
    return "found"


_HUGE = "y" * (MAX_JOURNAL_ENTRY_BYTES + 1)
_HUGE_STEPS: dict[str, list[str | Scripted]] = {
    "reply": [_HUGE],
    "text beside a tool call": [
        Scripted(text=_HUGE, tool_calls=[sa.ToolCall(id="c1", name="_look", arguments="{}")])
    ],
    "tool call arguments": [
        Scripted(tool_calls=[sa.ToolCall(id="c1", name="_look", arguments=f'{{"q": "{_HUGE}"}}')])
    ],
}


async def test_metadata_at_the_edge_of_its_size_limit_is_stored_or_refused_never_a_crash() -> None:
    """Metadata of about MAX_METADATA_BYTES encoded is stored by spawn() and
    set_metadata() when within the limit, and refused with ValueError before anything
    is written when over it, to the byte: the session never crashes, its turns run, and
    what is stored reloads."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("edge")
        for size in range(sa.MAX_METADATA_BYTES - 8, sa.MAX_METADATA_BYTES + 8):
            text = size - len(msgpack.packb({"a": "", "b": ""})) - 2 * 2  # (2-byte lengths)
            metadata = {"a": "x" * (text // 2), "b": "y" * (text - text // 2)}
            assert len(msgpack.packb(metadata)) == size
            fits = size <= sa.MAX_METADATA_BYTES
            try:
                await ref.set_metadata(metadata)
            except ValueError:
                assert not fits
            else:
                assert fits
                await ref.set_metadata({"a": None, "b": None})
            try:
                other = await registry.spawn("spawned", metadata=metadata)
            except ValueError:
                assert not fits
                continue
            assert fits
            assert (await other.send("hi")).text == "hi"
            await other.hibernate()
            assert (await other.state()).metadata == metadata
            await registry.delete("spawned")
        assert registry.statistics().crashes == 0
        await ref.hibernate()
        assert (await ref.state()).metadata == {}


@pytest.mark.parametrize("where", sorted(_HUGE_STEPS))
async def test_a_model_message_too_large_to_journal_fails_its_turn_not_the_session(
    where: str,
) -> None:
    """durability="turn": a model message larger than a journal entry holds (its reply,
    or a step that calls tools) fails its turn with TurnFailedError saying so (the
    user's message is kept, with the failure): the model's answer is stopped at
    MAX_TEXT_CHARS characters; the session does not crash, and its next turn runs."""
    model = ScriptedModel([*_HUGE_STEPS[where], "small"])
    agent = sa.Agent(model=model, tools=[_look])
    async with sa.open_registry(agents={"big": agent}) as registry:
        ref = await registry.spawn("talker")
        with pytest.raises(sa.TurnFailedError, match=r"'talker'.*answer went over") as caught:
            await ref.send("tell me everything")
        assert (await ref.turn_outcome(caught.value.turn_id)).status is sa.TurnStatus.FAILED
        assert (await ref.send("briefly?")).text == "small"
        stats = registry.statistics()
        assert (stats.crashes, stats.turns_failed) == (0, 1)
        history = await ref.history()
        assert history[0].content == "tell me everything"
        assert len(history) == 4


class _CountingModel:
    """Says hi, reporting 2**52 input tokens twice per answer (each chunk is valid)."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("hi")
        for _ in range(2):
            yield sa.UsageChunk(input_tokens=2**52, output_tokens=1)


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_token_counts_stop_at_the_largest_count_a_store_keeps(durability: str) -> None:
    """A model whose reported tokens add up past 2**53 - 1 (within an answer, or over the
    session's life) leaves counts that stop there: its turns finish, the session never
    crashes, hibernates, and wakes with the same usage."""
    agents = {"counted": sa.Agent(model=_CountingModel())}
    async with sa.open_registry(agents=agents, durability=durability) as registry:
        ref = await registry.spawn("counted")
        for _ in range(3):
            reply = await ref.send("hello")
            assert reply.message.usage == sa.Usage(input_tokens=MAX_SEQ, output_tokens=2)
        usage = (await ref.state()).usage
        assert usage == sa.Usage(input_tokens=MAX_SEQ, output_tokens=6)
        assert registry.statistics().crashes == 0
        await ref.hibernate()
        assert (await ref.state()).usage == usage


async def test_reading_a_session_that_was_not_hibernated_says_idle_not_new(tmp_path: Path) -> None:
    """read_session() and `sessions show` of a session that ran a turn and was never
    hibernated (a server still running it, or one that died) give its status as idle, as
    the listing does, never new (a session never used)."""
    path = tmp_path / "sessions.db"
    with trio.CancelScope() as process:
        agents = {"echo": sa.Agent(model=EchoModel())}
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            await (await registry.spawn("used")).send("hello")
            await registry.spawn("unused")
            crash(registry)
            process.cancel()
    reader = sa.SQLiteStore(path, readonly=True)
    try:
        assert (await sa.read_session(reader, "used")).status is sa.Status.IDLE
        assert (await sa.read_session(reader, "unused")).status is sa.Status.NEW
    finally:
        await reader.aclose()
    shown = await _sessions_command("show", "used", "--store", f"sqlite:///{path}")
    assert "status: idle" in shown
    listed = await _sessions_command("list", "--store", f"sqlite:///{path}")
    assert "used\tidle" in listed
