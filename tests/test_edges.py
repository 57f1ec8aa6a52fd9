"""Promises at the edges: bad input is refused before anything is written, errors
come out as themselves, a failing final write is loud, crashes are logged."""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import math
import os
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import trio

import sessionactors as sa
from sessionactors.stores import MAX_SEQ, JournalEntry, MemoryStore
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, crash

ECHO = {"echo": sa.Agent(model=EchoModel())}


async def test_an_error_from_the_block_comes_out_as_itself() -> None:
    """``except sa.SessionNotFoundError`` around the registry's block catches it."""
    with pytest.raises(sa.SessionNotFoundError) as info:
        async with sa.open_registry(agents=ECHO) as registry:
            await registry.ref("nobody").send("hi")
    assert not isinstance(info.value, BaseExceptionGroup)
    assert type(info.value).__module__ == "sessionactors"


async def test_errors_that_happened_together_stay_grouped() -> None:
    """A group the block's own nursery raised comes out as that group, not nested."""

    async def fail(exc: Exception) -> None:
        raise exc  # at once: both tasks fail in the same batch

    with pytest.RaisesGroup(KeyError, ValueError):
        async with sa.open_registry(agents=ECHO), trio.open_nursery() as nursery:
            nursery.start_soon(fail, KeyError("a"))
            nursery.start_soon(fail, ValueError("b"))


class ExitingModel:
    """A model whose stream raises what it was given (``sys.exit()``, say)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        raise self.exc
        yield sa.TextChunk("never")  # pragma: no cover


#: What user code raises that is not an ``Exception`` and is still its own failure
#: (a KeyboardInterrupt, trio's Cancelled are not: they stop the registry, or the turn):
#: ``sys.exit()``, a misused generator's exit, an asyncio task's cancellation that code
#: run with ``asyncio.run`` lets out, a bare BaseException, a group of them.
EXITS = [
    SystemExit(3),
    GeneratorExit(),
    asyncio.CancelledError("its own task"),
    BaseException("bare"),
    BaseExceptionGroup("its own", [GeneratorExit(), ValueError("v")]),
]


@pytest.mark.parametrize("exc", EXITS, ids=lambda exc: type(exc).__name__)
async def test_a_model_that_exits_fails_its_turn_only(exc: BaseException) -> None:
    """SystemExit or GeneratorExit from a model is that turn's failure; the session
    takes the next turn."""
    agents = {"x": sa.Agent(model=ExitingModel(exc)), "echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(agents=agents) as registry:
        bad = await registry.spawn("bad", agent="x")
        good = await registry.spawn("good", agent="echo")
        with pytest.raises(sa.TurnFailedError) as info:
            await bad.send("hi")
        assert isinstance(info.value.__cause__, type(exc))
        assert (await good.send("still here")).text == "still here"
        assert registry.statistics().crashes == 0


@pytest.mark.parametrize("in_thread", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("exc", EXITS, ids=lambda exc: type(exc).__name__)
async def test_a_tool_that_exits_fails_its_call_only(exc: BaseException, in_thread: bool) -> None:
    """SystemExit, GeneratorExit, an asyncio CancelledError, any BaseException but a
    KeyboardInterrupt from a tool, async or run in a thread, becomes an error result
    the model sees; a session's turn beside it goes on. (All but SystemExit ended the
    whole registry.)"""

    def leave_now() -> str:
        """Leave."""
        raise exc

    async def leave_soon() -> str:
        """Leave."""
        raise exc

    leave = sa.tool(name="leave")(leave_now if in_thread else leave_soon)
    call = sa.ToolCall(id="c1", name="leave", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), Scripted(text="ok")])
    agents = {"a": sa.Agent(model=model, tools=[leave]), "echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="a")
        beside = await (await registry.spawn("beside", agent="echo")).submit("meanwhile")
        with trio.fail_after(10):
            assert (await ref.send("go")).text == "ok"
            assert (await beside.reply()).text == "meanwhile"
        tool_messages = [m for m in await ref.history() if m.role is sa.Role.TOOL]
        assert tool_messages[0].is_error
        assert type(exc).__name__ in tool_messages[0].content
        assert registry.statistics().crashes == 0


async def test_a_cancellation_through_a_tools_nursery_still_cancels_the_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn cancelled while its tool waits in a nursery of its own (the cancellation
    comes out of the tool as a group) is cancelled: its call is answered as one the
    cancellation cut, not as the tool's failure ("BaseExceptionGroup: ...")."""

    @sa.tool
    async def fan_out() -> str:
        """Wait on two things."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
        return "never"  # pragma: no cover

    call = sa.ToolCall(id="c1", name="fan_out", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), Scripted(text="never")])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[fan_out])}) as registry:
        ref = await registry.spawn("s")
        turn = await ref.submit("go")
        await trio.testing.wait_all_tasks_blocked()
        assert await ref.cancel(turn_id=turn.id)
        with pytest.raises(sa.TurnCancelledError):
            await turn.reply()
        assert (await ref.turn_outcome(turn.id)).status is sa.TurnStatus.CANCELLED
        [result] = [m for m in await ref.history() if m.role is sa.Role.TOOL]
        assert result.content.startswith("this call was cancelled"), result.content


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("idle_timeout", math.nan, ValueError),
        ("idle_timeout", math.inf, ValueError),
        ("idle_timeout", 0, ValueError),
        ("idle_timeout", "5", TypeError),
        ("mailbox_size", 1.5, TypeError),
        ("mailbox_size", 0, ValueError),
        ("mailbox_size", True, TypeError),
        ("lease_ttl", math.inf, ValueError),
        ("lease_ttl", math.nan, ValueError),
        ("shutdown_grace", -1, ValueError),
        ("max_restarts", -1, ValueError),
        ("restart_window", math.nan, ValueError),
        ("subscriber_buffer", 0, ValueError),
        ("durability", "sometimes", ValueError),
        ("leases", "yes", TypeError),
        ("worker_id", "", ValueError),
        ("worker_id", "w\udc00", ValueError),
        ("agents", {1: ECHO["echo"]}, TypeError),
        ("agents", {"": ECHO["echo"]}, ValueError),
        ("agents", {"a\ud800": ECHO["echo"]}, ValueError),
    ],
)
async def test_options_are_checked_when_the_registry_opens(
    option: str, value: object, error: type[Exception]
) -> None:
    """A bad option fails open_registry with an error that names it, before anything runs."""
    options = {"agents": ECHO, option: value}
    with pytest.raises(error, match=option):
        async with sa.open_registry(**options):  # type: ignore[arg-type]
            pytest.fail("the registry opened")  # pragma: no cover


BAD_CALLS = {
    "send with an int key": lambda ref: ref.send("hi", idempotency_key=5),
    "send with a bytes key": lambda ref: ref.send("hi", idempotency_key=b"k"),
    "submit with an empty key": lambda ref: ref.submit("hi", idempotency_key=""),
    "send of bytes": lambda ref: ref.send(b"hi"),
    "send of a lone surrogate": lambda ref: ref.send("broken \ud800 text"),
    "set_summary of an int": lambda ref: ref.set_summary(123),
    "truncate to a float": lambda ref: ref.truncate(1.5),
    "truncate to True": lambda ref: ref.truncate(True),
    "rewind to an int": lambda ref: ref.rewind(7),
    "review with a non-bool": lambda ref: ref.review("r", approve="yes"),
    "set_metadata with NaN": lambda ref: ref.set_metadata({"score": math.nan}),
    "set_metadata with an infinity in a list": lambda ref: ref.set_metadata({"s": [1, math.inf]}),
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
async def test_bad_arguments_are_refused_before_anything_is_written(call: str) -> None:
    """A wrong type or value is a TypeError/ValueError naming the session, and the
    session reloads as it was."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("edge-1")
        await ref.send("before")
        before = await ref.state()
        with pytest.raises((TypeError, ValueError), match="edge-1"):
            await BAD_CALLS[call](ref)
        assert (await ref.state()).messages == before.messages
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        after = await registry.ref("edge-1").state()
    assert [m.content for m in after.messages] == ["before", "before"]


async def test_bad_spawn_arguments_are_refused() -> None:
    """spawn() checks system_prompt and metadata before it stores anything."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        with pytest.raises(TypeError, match="system_prompt"):
            await registry.spawn("s", system_prompt=123)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="metadata"):
            await registry.spawn("s", metadata=[("a", 1)])  # type: ignore[arg-type]
        assert await registry.sessions() == []


LONE = "broken \ud800 text"  # a lone surrogate: a str that no store can hold


def _message(content: str = "x", **changes: object) -> sa.Message:
    return attrs.evolve(sa.Message.create(sa.Role.USER, content), **changes)


LONE_SURROGATES = {
    "spawn system_prompt": ("system_prompt", lambda r, ref: r.spawn("n", system_prompt=LONE)),
    "get_or_spawn system_prompt": (
        "system_prompt",
        lambda r, ref: r.get_or_spawn("n", system_prompt=LONE),
    ),
    "spawn metadata value": ("metadata", lambda r, ref: r.spawn("n", metadata={"a": LONE})),
    "spawn metadata key": ("metadata", lambda r, ref: r.spawn("n", metadata={LONE: 1})),
    "set_metadata value": ("metadata", lambda r, ref: ref.set_metadata({"a": [LONE]})),
    "set_metadata key": ("metadata", lambda r, ref: ref.set_metadata({LONE: 1})),
    "send": ("message", lambda r, ref: ref.send(LONE)),
    "set_summary": ("summary", lambda r, ref: ref.set_summary(LONE)),
    "add_messages content": ("content", lambda r, ref: ref.add_messages([_message(LONE)])),
    "add_messages metadata": (
        "metadata",
        lambda r, ref: ref.add_messages([_message(metadata={"a": LONE})]),
    ),
    "replace_history content": ("content", lambda r, ref: ref.replace_history([_message(LONE)])),
}


@pytest.mark.parametrize("call", sorted(LONE_SURROGATES))
async def test_text_that_is_not_valid_unicode_is_refused_as_such(call: str) -> None:
    """A lone surrogate in any text a caller gives is a ValueError naming the session and
    the input, saying what is wrong and what to do, and nothing is written."""
    what, bad = LONE_SURROGATES[call]
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("edge-1")
        await ref.send("before")
        with pytest.raises(ValueError, match=r"'edge-1'|'n'") as info:
            await bad(registry, ref)
        assert [name for name, _ in await store.list_sessions()] == ["edge-1"]
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        after = await registry.ref("edge-1").state()
    assert [m.content for m in after.messages] == ["before", "before"]
    message = str(info.value)
    assert what in message
    assert "lone surrogate" in message
    assert "errors='replace'" in message
    assert "plain data" not in message


async def test_spawn_metadata_of_a_type_with_no_stored_form_says_what_metadata_may_hold() -> None:
    """spawn(metadata=...) with a value the store cannot hold is a TypeError that names the
    key and says what metadata may hold."""
    async with sa.open_registry(agents=ECHO) as registry:
        with pytest.raises(TypeError, match=r"'s'.*metadata.*when.*plain data"):
            await registry.spawn("s", metadata={"when": object()})
        assert await registry.sessions() == []


async def test_subscribe_checks_after() -> None:
    """``after`` must be an int seq: a str is a TypeError naming the session."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("s")
        with pytest.raises(TypeError, match="'s'"):
            ref.subscribe(after="5")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'s'"):
            ref.subscribe(after=-1)


async def test_library_objects_have_no_public_constructor() -> None:
    """Registry, SessionRef and Turn are made by the library; calling them says how."""
    with pytest.raises(TypeError, match="open_registry"):
        sa.Registry()
    with pytest.raises(TypeError, match=r"registry\.ref"):
        sa.SessionRef()
    with pytest.raises(TypeError, match="submit"):
        sa.Turn()


class SnapshotRefusingStore(MemoryStore):
    """A MemoryStore whose snapshot writes fail while ``broken`` (a stuck disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.refused = 0

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        if self.broken:
            self.refused += 1
            await trio.lowlevel.checkpoint()
            raise sa.StoreError(f"disk stuck writing {session_id!r}", session_id=session_id)
        await super().write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await super().append(session_id, entries, info, fence=fence)


@pytest.mark.parametrize("broken", [True, False])
async def test_a_final_snapshot_that_fails_without_a_journal_is_loud(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, broken: bool
) -> None:
    """With durability="hibernate", a closing snapshot the store keeps refusing is
    retried, then raised from the registry's block naming the session, and logged;
    with a sound store (the control) nothing is raised."""
    store = SnapshotRefusingStore()

    async def run() -> None:
        async with sa.open_registry(store=store, agents=ECHO, durability="hibernate") as reg:
            ref = await reg.spawn("kept-1")
            await ref.send("acknowledged")
            store.broken = broken

    if broken:
        with pytest.raises(sa.StoreError, match="kept-1"):
            await run()
        assert store.refused > 1  # retried
        assert any(
            r.levelno == logging.ERROR and "kept-1" in r.getMessage() for r in caplog.records
        )
    else:
        await run()
        async with sa.open_registry(store=store, agents=ECHO) as reg:
            assert [m.content for m in await reg.ref("kept-1").history()] == [
                "acknowledged",
                "acknowledged",
            ]


class CrashOnceStore(MemoryStore):
    """Its next append for a session raises a plain OSError (a fault of the store)."""

    def __init__(self) -> None:
        super().__init__()
        self.crash = False

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        if self.crash:
            self.crash = False
            await trio.lowlevel.checkpoint()
            raise OSError("the disk went away")
        await super().append(session_id, entries, info, fence=fence)


async def test_a_crash_and_its_restart_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """An actor crash leaves one WARNING naming the session under 'sessionactors'."""
    store = CrashOnceStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("logged-1")
        await ref.send("first")
        store.crash = True
        with pytest.raises(sa.SessionCrashedError):
            await ref.send("boom")
        assert (await ref.send("again")).text == "again"
    records = [r for r in caplog.records if r.name == "sessionactors"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "logged-1" in records[0].getMessage()


async def test_a_stream_ends_when_its_session_crashes_mid_turn() -> None:
    """The turn's stream ends with a TurnFailed marked lost, and the history does
    not hold the turn."""
    store = CrashOnceStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("crashy")
        await ref.send("first")
        store.crash = True  # the next turn's journal write fails: the actor crashes
        seen: list[sa.Event] = []
        with trio.fail_after(5):
            async with ref.stream("lost words") as events:
                seen.extend([event async for event in events])
        assert isinstance(seen[0], sa.TurnStarted)
        outcome = seen[-1]
        assert isinstance(outcome, sa.TurnFailed)
        assert outcome.lost
        assert [m.content for m in await ref.history()] == ["first", "first"]


async def test_a_stream_whose_session_is_deleted_raises() -> None:
    """A stream whose session is deleted mid-turn raises SessionNotFoundError."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="never finished", wait=gate, wait_after=1)])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("doomed")

        async def stream_and_delete() -> None:
            async with ref.stream("hi") as events:
                async for event in events:
                    if isinstance(event, sa.Delta):
                        await registry.delete("doomed")

        with trio.fail_after(5), pytest.raises(sa.SessionNotFoundError):
            await stream_and_delete()


async def test_nothing_waits_on_a_closed_registry() -> None:
    """After the registry closes, subscribing raises and an open subscription ends."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("s")
        subscription = ref.subscribe()
        events = await subscription.__aenter__()
    with trio.fail_after(5):
        remaining = [event async for event in events]  # ends: the hub closed
    assert all(isinstance(event, sa.StatusChanged) for event in remaining), remaining
    await subscription.__aexit__(None, None, None)
    with pytest.raises(sa.SessionStoppedError, match="'s'"):
        async with ref.subscribe():
            pass  # pragma: no cover
    with pytest.raises(sa.SessionStoppedError):
        await ref.send("late")


async def test_a_stream_whose_session_crashes_before_its_turn_starts_ends() -> None:
    """A turn that a crash takes with it before it starts (the wake's first write
    fails) ends its stream with a TurnFailed marked lost."""
    store = CrashOnceStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("crashy")
        store.crash = True  # the wake's first write fails
        with trio.fail_after(5):
            async with ref.stream("never started") as events:
                seen = [event async for event in events]
        assert len(seen) == 1
        assert isinstance(seen[0], sa.TurnFailed)
        assert seen[0].lost
        assert (await ref.send("again")).text == "again"


async def test_turns_a_crash_takes_with_it_are_marked_lost_for_subscribers() -> None:
    """The turn in flight and the turns queued behind it each get a TurnFailed marked
    lost when the session crashes; their callers get SessionCrashedError."""
    store = CrashOnceStore()
    gate = trio.Event()
    model = ScriptedModel(
        [Scripted(text="warm"), Scripted(text="held", wait=gate), Scripted(text="queued")]
    )
    async with sa.open_registry(store=store, agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        await ref.send("warm up")
        async with ref.subscribe() as events:
            first = await ref.submit("one")
            second = await ref.submit("two")
            store.crash = True
            gate.set()
            lost: set[str] = set()
            with trio.fail_after(5):
                async for event in events:
                    if isinstance(event, sa.TurnFailed) and event.lost:
                        lost.add(event.turn_id)
                        if lost == {first.id, second.id}:
                            break
        for turn in (first, second):
            with pytest.raises(sa.SessionCrashedError):
                await turn.reply()


async def test_one_unreadable_record_does_not_fail_the_listing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A session whose stored info is garbage is listed as its snapshot says, and
    logged; one whose snapshot is garbage too is listed as failed, and logged; the
    other sessions are listed as they are."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        await (await registry.spawn("good")).send("hi")
        now = datetime.datetime.now(datetime.UTC)
        state = sa.SessionState(session_id="bad", agent="echo", created_at=now, updated_at=now)
        await store.create("bad", sa.dump_snapshot(state), b"\xc1 not msgpack")
        await store.create("worse", b"\xc1 not msgpack", b"\xc1 not msgpack")
        infos = {info.session_id: info for info in await registry.sessions()}
        assert (infos["bad"].status, infos["bad"].agent) == (sa.Status.NEW, "echo")
        assert infos["worse"].status is sa.Status.FAILED
        assert infos["good"].message_count == 2
        assert await registry.pending_reviews() == []
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'bad'" in t for t in told), told
    assert any("'worse'" in t for t in told), told


async def test_a_client_connected_before_an_unclean_stop_resumes() -> None:
    """Retention is counted in events: after an unclean stop (the seq jumps far) and
    many snapshots, a client resumes after the last seq it saw before the stop."""
    store = MemoryStore()
    seen: list[sa.Event] = []
    with trio.CancelScope() as process:  # a process that dies without closing
        async with sa.open_registry(store=store, agents=ECHO) as registry:
            ref = await registry.spawn("s")
            async with ref.subscribe() as events:
                for word in ("one", "two", "three"):
                    await ref.send(word)
                async for event in events:
                    seen.append(event)
                    if isinstance(event, sa.TurnFinished) and event.message.content == "three":
                        break
            crash(registry)
            process.cancel()
    last = seen[-1].seq
    async with sa.open_registry(store=store, agents=ECHO, snapshot_every=1) as registry:
        ref = registry.ref("s")
        for i in range(40):
            await ref.send(f"after {i}")
        async with ref.subscribe(after=last) as events:
            replayed = []
            with trio.fail_after(5):
                async for event in events:
                    replayed.append(event)
                    if isinstance(event, sa.TurnFinished) and event.message.content == "after 39":
                        break
    finished = [e.message.content for e in replayed if isinstance(e, sa.TurnFinished)]
    assert finished == [f"after {i}" for i in range(40)]
    assert all(e.seq > last for e in replayed)


class ChunkModel:
    """Streams the given chunks, as they are (a model under test)."""

    def __init__(self, *chunks: object) -> None:
        self.chunks = chunks

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for chunk in self.chunks:
            yield chunk  # type: ignore[misc]


class ReturnsChunks:
    """A model whose stream is an ``async def`` that returns its chunks (no ``yield``)."""

    async def stream(self, request: sa.ModelRequest) -> list[sa.ModelChunk]:
        return [sa.TextChunk("hi")]


class SyncChunks:
    """A model whose stream is a plain generator."""

    def stream(self, request: sa.ModelRequest) -> Iterator[sa.ModelChunk]:
        yield sa.TextChunk("hi")


@pytest.mark.parametrize(
    ("model", "kind"), [(ReturnsChunks(), "coroutine"), (SyncChunks(), "generator")]
)
async def test_a_model_whose_stream_is_no_async_iterator_fails_its_turn_saying_what_to_write(
    model: object, kind: str
) -> None:
    """A model whose stream() returns no async iterator (an async def that returns, a
    plain generator) fails its turn with a TypeError that says what stream must be,
    not Python's words about ``async for``; a coroutine is closed (no warning that it was
    never awaited), and the session goes on."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a coroutine never awaited warns)
        async with sa.open_registry(agents={"m": sa.Agent(model=model)}) as registry:  # type: ignore[arg-type]
            ref = await registry.spawn("adapter")
            with trio.fail_after(10), pytest.raises(sa.TurnFailedError) as caught:
                await ref.send("hi")
            gc.collect()
    cause = caught.value.__cause__
    assert isinstance(cause, TypeError), repr(cause)
    told = str(cause)
    assert f"returned a {kind}" in told, told
    assert "async generator" in told, told
    assert "yield" in told, told


async def test_a_model_streaming_wrong_types_fails_its_turn_and_stores_nothing_bad() -> None:
    """A tool-call fragment with an int name fails the turn; the session reloads."""
    store = MemoryStore()
    model = ChunkModel(sa.ToolCallChunk(index=0, name=123))  # type: ignore[arg-type]
    async with sa.open_registry(store=store, agents={"m": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("typed")
        with pytest.raises(sa.TurnFailedError, match="name"):
            await ref.send("hi")
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        history = await registry.ref("typed").history()
    assert [m.role for m in history] == [sa.Role.USER, sa.Role.ASSISTANT]  # + "no reply"
    assert history[-1].interrupted


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"index": "0", "name": "lookup"}, "whose index is '0'"),
        ({"index": True, "name": "lookup"}, "whose index is True"),
        ({"index": 0, "id": 5, "name": "lookup"}, "whose id is 5"),
        ({"index": 0, "name": "lookup", "arguments": None}, "whose arguments are None"),
    ],
)
async def test_a_tool_call_fragment_of_a_wrong_type_fails_its_turn_naming_the_field(
    fields: dict[str, object], said: str
) -> None:
    """Each field of a streamed tool-call fragment is checked (a bool is no index);
    the turn fails saying which field holds what, and the session reloads."""
    store = MemoryStore()
    model = ChunkModel(sa.ToolCallChunk(**fields))  # type: ignore[arg-type]
    async with sa.open_registry(store=store, agents={"m": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("typed")
        with pytest.raises(sa.TurnFailedError, match=said):
            await ref.send("hi")
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        history = await registry.ref("typed").history()
    assert [m.role for m in history] == [sa.Role.USER, sa.Role.ASSISTANT]
    assert history[-1].interrupted


async def test_text_that_is_not_valid_unicode_is_stored_repaired() -> None:
    """Lone surrogates from a model or a tool become U+FFFD, a pair split across two
    chunks is joined, and the session reloads after a restart, identical."""

    @sa.tool
    async def listing() -> str:
        """A file name that is not UTF-8."""
        return os.fsdecode(b"report-\xff.txt")

    call = sa.ToolCall(id="c1", name="listing", arguments="{}")
    split = "\ud83d\ude00"  # two lone surrogates: the halves of one emoji
    tool_model = ScriptedModel([Scripted(tool_calls=[call]), Scripted(chunks=["ok"])])
    agents = {
        "text": sa.Agent(
            model=ChunkModel(sa.TextChunk("smile " + split[0]), sa.TextChunk(split[1]))
        ),
        "lone": sa.Agent(model=ChunkModel(sa.TextChunk("broken \ud800 end"))),
        "tool": sa.Agent(model=tool_model, tools=[listing]),
    }
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=agents) as registry:
        assert (await (await registry.spawn("a", agent="text")).send("hi")).text == "smile 😀"
        assert (
            await (await registry.spawn("b", agent="lone")).send("hi")
        ).text == "broken \ufffd end"
        tool_ref = await registry.spawn("c", agent="tool")
        await tool_ref.send("list")
        before = {name: await registry.ref(name).history() for name in "abc"}
    async with sa.open_registry(store=store, agents=agents) as registry:
        after = {name: await registry.ref(name).history() for name in "abc"}
    assert after == before
    assert "report-\ufffd.txt" in [m.content for m in after["c"]]


async def test_a_stored_seq_near_the_largest_fails_its_own_session_only() -> None:
    """A session stored with a seq a wake cannot jump past is SnapshotCorruptError for it;
    the other sessions go on."""
    store = MemoryStore()
    now = datetime.datetime.now(datetime.UTC)
    state = sa.SessionState(
        session_id="far", agent="echo", created_at=now, updated_at=now, event_seq=MAX_SEQ - 10
    )
    await store.create("far", sa.dump_snapshot(state), b"")
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        other = await registry.spawn("near")
        with pytest.raises(sa.SnapshotCorruptError, match="far"):
            await registry.ref("far").send("hi")
        assert (await other.send("fine")).text == "fine"
        assert registry.statistics().crashes == 0


@pytest.mark.parametrize("value", [math.nan, -math.inf, {"deep": [math.inf]}])
async def test_spawn_refuses_metadata_that_json_cannot_carry(value: object) -> None:
    """A float that is not finite (NaN, an infinity) has no JSON form: spawn refuses it
    in metadata with a ValueError naming the session and the key, and stores nothing
    (a session holding one made every JSON answer listing it invalid JSON)."""
    async with sa.open_registry(agents=ECHO) as registry:
        with pytest.raises(ValueError, match=r"session 'm'.*score.*finite"):
            await registry.spawn("m", metadata={"score": value})
        assert await registry.sessions() == []


async def test_a_store_serves_one_registry_at_a_time_without_leases(tmp_path: Path) -> None:
    """Two registries open at once on one store object, without leases, would each run
    a session and overwrite each other's journal (a crash, and acknowledged turns lost):
    the second open_registry is refused, naming the way out; once the first closed, the
    store opens again, and with leases several registries share it (a session runs in
    one of them at a time)."""
    for store in (sa.MemoryStore(), sa.SQLiteStore(str(tmp_path / "s.db"))):
        async with sa.open_registry(agents=ECHO, store=store) as first:
            await (await first.spawn("x")).send("hi")
            with pytest.raises(ValueError, match=r"already used by an open registry.*leases=True"):
                async with sa.open_registry(agents=ECHO, store=store):
                    pytest.fail("the second registry opened")  # pragma: no cover
            assert (await first.ref("x").send("still here")).text == "still here"
        async with sa.open_registry(agents=ECHO, store=store) as again:
            assert len(await again.ref("x").history()) == 4
    shared = sa.MemoryStore()
    async with (
        sa.open_registry(agents=ECHO, store=shared, leases=True) as one,
        sa.open_registry(agents=ECHO, store=shared, leases=True) as two,
    ):
        await (await one.spawn("y")).send("a")
        with pytest.raises(sa.LeaseHeldError):  # live in the other: it runs it alone
            await two.ref("y").send("b")


async def test_two_store_objects_of_one_sqlite_file_serve_one_registry_at_a_time(
    tmp_path: Path,
) -> None:
    """Two SQLiteStore objects on one file (an app's registry and an admin one in the same
    process; the path spelled another way) are one store: the second registry without
    leases is refused, naming the file, before it runs (and answers) a session the first
    runs too; once the first closed, it opens."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "s.db"
    other = tmp_path / "d" / ".." / "s.db"
    async with sa.open_registry(agents=ECHO, store=sa.SQLiteStore(path)) as first:
        await (await first.spawn("x")).send("hi")
        with pytest.raises(
            ValueError, match=r"SQLiteStore of '.*s\.db' is already used by an open"
        ):
            async with sa.open_registry(agents=ECHO, store=sa.SQLiteStore(str(other))):
                pytest.fail("the second registry opened")  # pragma: no cover
        assert (await first.ref("x").send("still here")).text == "still here"
        reader = sa.SQLiteStore(path, readonly=True)  # (an operator's read: no registry)
        assert await reader.load("x") is not None
        await reader.aclose()
    async with sa.open_registry(agents=ECHO, store=sa.SQLiteStore(str(other))) as again:
        assert len(await again.ref("x").history()) == 4


async def test_a_store_is_freed_at_close_though_its_path_now_resolves_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry on a relative path frees its store at close, as it claimed it, though
    the process moved meanwhile (its path would resolve to another file now): the file
    opens again."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    async with sa.open_registry(agents=ECHO, store=sa.SQLiteStore("s.db")) as first:
        await (await first.spawn("x")).send("hi")
        monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)
    async with sa.open_registry(agents=ECHO, store=sa.SQLiteStore("s.db")) as again:
        assert len(await again.ref("x").history()) == 2


async def test_errors_repeat_only_the_start_of_a_long_value_from_the_caller(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """An error about a long value a caller gave (a session name of 5,000 bytes, an
    agent, a review id, a listing cursor, a message or turn id, a metadata key, the ids
    of added messages) repeats its first characters and its length, never all of it, in
    its message or its session_id: a web front end passes both on."""
    long = "n" * 5000

    def short(error: BaseException) -> None:
        assert getattr(error, "session_id", None) in (None, "s"), str(error)[:300]
        assert "n" * 65 not in str(error), str(error)[:300]
        assert "5,000 characters" in str(error), str(error)[:300]

    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=echo_agents) as registry:
        with pytest.raises(sa.InvalidSessionNameError) as name_error:
            registry.ref(long)
        short(name_error.value)
        with pytest.raises(ValueError, match="asks for agent") as agent_error:
            await registry.get_or_spawn("s", agent=long)
        short(agent_error.value)
        ref = await registry.spawn("s")
        with pytest.raises(sa.ReviewNotFoundError) as review_error:
            await ref.review(long, approve=True)
        short(review_error.value)
        with pytest.raises(sa.InvalidSessionNameError) as after_error:
            await registry.sessions(after=long)
        short(after_error.value)
        await ref.send("hi")
        with pytest.raises(sa.MessageNotFoundError) as at_error:
            await registry.fork("s", "t", at=long)
        short(at_error.value)
        with pytest.raises(sa.MessageNotFoundError) as rewind_error:
            await ref.rewind(long)
        short(rewind_error.value)
        with pytest.raises(sa.TurnNotFoundError) as turn_error:
            await ref.turn_outcome(long)
        short(turn_error.value)
        for metadata in ({long: float("nan")}, {"a": {long: object()}}):
            with pytest.raises((TypeError, ValueError)) as key_error:
                await ref.set_metadata(metadata)
            short(key_error.value)
        now = datetime.datetime.now(datetime.UTC)
        call = sa.ToolCall(id=long, name="t", arguments="{}")
        for messages in (
            [sa.Message(id=long, role=sa.Role.USER, content="a", created_at=now)] * 2,
            [
                sa.Message(
                    id="m", role=sa.Role.ASSISTANT, content="", created_at=now, tool_calls=(call,)
                )
            ],
            [sa.Message(id="m", role=sa.Role.TOOL, content="r", created_at=now, tool_call_id=long)],
        ):
            with pytest.raises(sa.InvalidHistoryError) as history_error:
                await ref.add_messages(messages)
            short(history_error.value)
    async with sa.open_registry(store=store) as managing:  # (no agents: any agent name)
        with pytest.raises(sa.SessionExistsError) as exists_error:
            await managing.get_or_spawn("s", agent=long)
        short(exists_error.value)
