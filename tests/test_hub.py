"""What a live session keeps for replay (its ring), and reads of a subscription that are cancelled."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


def deltas(events: Sequence[sa.Event]) -> list[str]:
    return [e.text for e in events if isinstance(e, sa.Delta)]


def seqs(events: Sequence[sa.Event]) -> list[int]:
    return [e.seq for e in events]


async def read(events: AsyncIterator[sa.Event], count: int) -> list[sa.Event]:
    with trio.fail_after(60):
        return [await anext(events) for _ in range(count)]


async def replay(ref: sa.SessionRef, after: int) -> list[sa.Event]:
    """Every event with a seq above ``after`` that a new subscription replays now."""
    final = (await ref.state()).event_seq
    got: list[sa.Event] = []
    async with ref.subscribe(after=after) as events:
        with trio.fail_after(60):
            while not got or got[-1].seq < final:
                got.append(await anext(events))
    return got


def registry(*steps: Scripted, **options: Any) -> AbstractAsyncContextManager[sa.Registry]:
    """A registry of one agent playing ``steps``; no journal, so a replay comes from memory."""
    model = ScriptedModel(list(steps))
    return sa.open_registry(agents={"a": sa.Agent(model=model)}, durability="hibernate", **options)


# ---- the replay ring ---------------------------------------------------------------


async def test_the_ring_keeps_the_newest_replay_events_events(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A live session replays its newest replay_events events whole, Deltas included; older
    Deltas are not replayed, only the message-level events are."""
    chunks = [f"{i} " for i in range(12)]
    async with registry(Scripted(chunks=chunks), replay_events=5) as reg:
        ref = await reg.spawn("s")
        with trio.fail_after(60):
            await ref.send("go")
        final = (await ref.state()).event_seq
        newest = await replay(ref, final - 5)
        everything = await replay(ref, 0)
    assert seqs(newest) == list(range(final - 4, final + 1))
    assert everything[-5:] == newest
    assert deltas(everything) == deltas(newest)
    assert deltas(newest) == chunks[-len(deltas(newest)) :]
    assert 0 < len(deltas(newest)) < 5
    kinds = {type(e) for e in everything}
    assert {sa.TurnStarted, sa.TurnFinished} <= kinds


async def test_the_deltas_in_the_ring_are_nothing_for_the_collector_to_visit(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The deltas a live session keeps for replay are not objects the garbage collector
    tracks (a reply streams many, a ring holds up to replay_events of them, and a
    thousand live sessions would add a million objects to every full collection);
    they replay as the events that were published."""
    chunks = [f"{i} " for i in range(300)]
    async with registry(Scripted(chunks=chunks)) as reg:
        ref = await reg.spawn("s")
        async with ref.subscribe() as live:
            with trio.fail_after(60):
                await ref.send("go")
            published = [repr(e) for e in await read(live, 303) if isinstance(e, sa.Delta)]
        gc.collect()
        tracked = sum(isinstance(o, sa.Delta) for o in gc.get_objects())
        replayed = [repr(e) for e in await replay(ref, 0) if isinstance(e, sa.Delta)]
    assert tracked <= 10, f"{tracked} deltas tracked"
    assert len(published) == 300
    assert replayed == published


async def test_deltas_nobody_heard_replay_as_those_a_subscriber_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn streamed while no one listens (its deltas kept for replay without being
    made into events) replays the events, seqs and texts that a subscriber reads live of
    the same turn on a twin session."""
    chunks = [f"{i} " for i in range(30)]
    async with registry(Scripted(chunks=chunks), Scripted(chunks=chunks)) as reg:
        heard, unheard = await reg.spawn("heard"), await reg.spawn("unheard")
        async with heard.subscribe() as live:
            with trio.fail_after(60):
                await heard.send("go")
            read_live = await read(live, 33)
        with trio.fail_after(60):
            await unheard.send("go")
        replayed = await replay(unheard, 0)

    def shape(events: Sequence[sa.Event]) -> list[tuple[str, int, str]]:
        # (seqs from each session's first: its first write jumped to the clock's time)
        return [(type(e).__name__, e.seq - events[0].seq, getattr(e, "text", "")) for e in events]

    assert shape(replayed) == shape(read_live)
    assert deltas(replayed) == chunks
    assert {e.session_id for e in replayed} == {"unheard"}
    turn = next(e.turn_id for e in replayed if isinstance(e, sa.TurnStarted))
    assert all(e.turn_id == turn for e in replayed if isinstance(e, sa.Delta))


async def test_the_ring_keeps_at_most_replay_bytes(autojump_clock: trio.abc.Clock) -> None:
    """The ring keeps no more of the newest events than their text fits in replay_bytes."""
    chunks = [f"{i:03} " + "x" * 96 for i in range(200)]  # 100 characters each
    limit = 50_000
    async with registry(Scripted(chunks=chunks), replay_bytes=limit) as reg:
        ref = await reg.spawn("s")
        with trio.fail_after(60):
            reply = await ref.send("go")
        kept = deltas(await replay(ref, 0))
    assert kept == chunks[-len(kept) :]
    # the reply is in the ring once (TurnFinished), then as many Deltas as fit
    assert 0 < len(kept) * 100 <= limit - len(reply.text)


async def test_an_event_larger_than_replay_bytes_empties_the_ring(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An event larger than replay_bytes is not kept for replay, and neither is any before it."""
    async with registry(
        Scripted(chunks=["small ", "deltas"]), Scripted(chunks=["y" * 5000]), replay_bytes=2000
    ) as reg:
        ref = await reg.spawn("s")
        with trio.fail_after(60):
            await ref.send("one")
            first = await replay(ref, 0)
            await ref.send("two")
        second = await replay(ref, 0)
    assert deltas(first) == ["small ", "deltas"]
    assert deltas(second) == []
    assert [e.message.content for e in second if isinstance(e, sa.TurnFinished)] == [
        "small deltas",
        "y" * 5000,
    ]


# ---- cancelled reads -------------------------------------------------------------------


async def test_a_read_cancelled_during_replay_loses_no_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A read cancelled while a subscription replays delivers nothing, and the next read
    gets that event."""
    async with registry(Scripted(text="one two three")) as reg:
        ref = await reg.spawn("s")
        with trio.fail_after(60):
            await ref.send("go")
        expected = await replay(ref, 0)
        async with ref.subscribe(after=0) as events:
            with trio.CancelScope() as scope:
                scope.cancel()
                await anext(events)
            assert scope.cancelled_caught
            got = await read(events, len(expected))
    assert got == expected


async def test_a_live_read_cancelled_while_waiting_loses_no_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A live read cancelled while it waits leaves the next event for the next read."""
    async with registry(Scripted(text="one two")) as reg:
        ref = await reg.spawn("s")
        async with ref.subscribe() as reference, ref.subscribe() as events:
            with trio.move_on_after(1) as waiting:
                await anext(events)
            assert waiting.cancelled_caught
            with trio.fail_after(60):
                reply = await ref.send("go")
            expected = await read(reference, 3)
            assert await read(events, 3) == expected
    assert isinstance(expected[0], sa.StatusChanged)
    assert expected[0].skipped_from == 1  # the session's first event
    assert reply.text == "one two"
