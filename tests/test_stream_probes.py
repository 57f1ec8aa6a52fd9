"""Probes of subscriptions and streams at their edges: joined turns, resumes, ends."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import trio
import trio.testing

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, FaultyStore, Gate, Scripted, ScriptedModel

OUTCOMES = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)


def review_agent() -> sa.Agent:
    """An agent whose first turn calls a tool that needs review, then answers."""
    refund_call = sa.ToolCall(id="call_1", name="refund", arguments="{}")

    async def refund() -> str:  # (async: a sync tool's thread would let the clock jump)
        return "refunded"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call]), "Done."])
    return sa.Agent(model=model, tools=[tool])


async def read_until_review(events: object) -> list[sa.Event]:
    got: list[sa.Event] = []
    async for event in events:  # type: ignore[attr-defined]
        got.append(event)
        if isinstance(event, (sa.ReviewRequested, *OUTCOMES)):
            return got
    return got


@pytest.mark.parametrize("hibernate", [False, True])
async def test_a_keyed_stream_joining_a_turn_waiting_on_a_review_yields_its_events_so_far(
    autojump_clock: trio.testing.MockClock, hibernate: bool
) -> None:
    """A keyed ``ref.stream`` whose key joins a turn paused on a review yields that turn's
    events so far (up to its ``ReviewRequested``) at once, then the rest once reviewed."""
    async with sa.open_registry(agents={"a": review_agent()}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            async with ref.stream("Refund A1", idempotency_key="K") as events:
                first = await read_until_review(events)
        assert isinstance(first[-1], sa.ReviewRequested)
        if hibernate:
            await ref.hibernate()
            assert "s" not in registry.live()
        with trio.fail_after(5):
            async with ref.stream("Refund A1", idempotency_key="K") as events:
                again = await read_until_review(events)
                assert isinstance(again[0], sa.TurnStarted)
                assert again[0].turn_id == first[0].turn_id  # type: ignore[attr-defined]
                assert again[-1] == first[-1]  # the same ReviewRequested, same seq
                await ref.review(again[-1].review.id, approve=True)  # type: ignore[attr-defined]
                rest = [event async for event in events]
        assert isinstance(rest[-1], sa.TurnFinished)
        assert rest[-1].message.content == "Done."


async def test_a_keyed_stream_joining_a_running_turn_yields_it_from_its_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A keyed ``ref.stream`` that joins its key's turn while it runs yields that turn from
    its ``TurnStarted``, the deltas streamed before it joined included, to its outcome."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(chunks=["one ", "two ", "three"], wait=gate, wait_after=1)])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            async with ref.stream("go", idempotency_key="K") as first_events:
                first = [await anext(first_events), await anext(first_events)]
                assert isinstance(first[1], sa.Delta)
                assert isinstance(first[0], sa.TurnStarted)
                async with ref.stream("go", idempotency_key="K") as events:
                    gate.set()
                    joined = [event async for event in events]
                rest = [event async for event in first_events]
        assert [e.seq for e in joined] == [e.seq for e in first + rest]
        assert isinstance(joined[0], sa.TurnStarted)
        assert isinstance(joined[-1], sa.TurnFinished)


def test_an_asyncio_subscription_read_by_two_tasks_ends_for_both() -> None:
    """Two asyncio tasks reading one ``sessionactors.aio`` subscription share its events
    and both end when it ends, as two trio tasks do; neither waits forever."""

    async def main() -> dict[int, list[int]]:
        agents = {"a": sa.Agent(model=EchoModel())}
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("s")
            got: dict[int, list[int]] = {1: [], 2: []}
            async with ref.subscribe() as events:

                async def reader(i: int) -> None:
                    async for event in events:
                        got[i].append(event.seq)

                readers = [asyncio.create_task(reader(i)) for i in (1, 2)]
                for _ in range(3):
                    await asyncio.sleep(0)  # both wait for an event
                await ref.send("one two three")
                await ref.stop()
                async with asyncio.timeout(10):
                    await asyncio.gather(*readers)
            return got

    got = asyncio.run(main())
    seqs = sorted(got[1] + got[2])
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # each event once


async def test_a_stream_waiting_on_a_review_raises_when_its_session_is_deleted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``ref.stream`` of a turn paused on a review raises when the session is deleted,
    instead of ending as if nothing were wrong, without the turn's outcome."""
    async with sa.open_registry(agents={"a": review_agent()}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            async with ref.stream("Refund A1") as events:
                got = await read_until_review(events)
                assert isinstance(got[-1], sa.ReviewRequested)
                await registry.delete("s")
                with pytest.raises(sa.SessionNotFoundError):
                    await anext(events)


async def test_a_stream_waiting_on_a_review_raises_when_the_registry_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``ref.stream`` of a turn paused on a review raises SessionStoppedError when the
    registry closes, instead of ending as if nothing were wrong."""
    outcome: list[BaseException] = []
    with trio.fail_after(5):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(agents={"a": review_agent()}) as registry,
        ):
            ref = await registry.spawn("s")
            reviewed = trio.Event()

            async def follow() -> None:
                async with ref.stream("Refund A1") as events:
                    await read_until_review(events)
                    reviewed.set()
                    try:
                        await anext(events)
                    except sa.SessionActorsError as exc:
                        outcome.append(exc)

            nursery.start_soon(follow)
            await reviewed.wait()
    assert [type(e) for e in outcome] == [sa.SessionStoppedError]


@pytest.mark.parametrize("withheld", ["outcome", "hibernation"])
async def test_a_subscription_opened_while_an_event_is_being_stored_gets_it(
    autojump_clock: trio.testing.MockClock, withheld: str
) -> None:
    """A live subscription opened while an event waits for its write (a turn's outcome, a
    hibernation's status) gets that event once it is published, as every later one."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents={"a": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("warm up")
            if withheld == "outcome":
                gate = store.hold("append", session_id="s")
                turn = await ref.submit("hello world")
                done = turn.reply
            else:
                gate = store.hold("write_snapshot", session_id="s")
                done = ref.hibernate
            async with trio.open_nursery() as nursery:
                nursery.start_soon(done)
                await trio.testing.wait_all_tasks_blocked()
                async with ref.subscribe() as events:
                    gate.open()
                    event = await anext(events)
        if withheld == "outcome":
            assert isinstance(event, sa.TurnFinished)
            assert event.message.content == "hello world"
        else:
            assert isinstance(event, sa.StatusChanged)
            assert event.status is sa.Status.HIBERNATED


class HeldRedisStore(RedisStore):
    """A RedisStore whose next journal append, once ``arm()``-ed, waits for ``release``."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix=prefix, balance=False)
        self.armed = False
        self.held = trio.Event()
        self.release = trio.Event()

    async def append(self, *args: Any, **kwargs: Any) -> None:
        if self.armed:
            self.armed = False
            self.held.set()
            await self.release.wait()
        await super().append(*args, **kwargs)


@pytest.mark.redis
async def test_a_subscription_from_another_worker_opened_while_an_outcome_is_stored_gets_it(
    redis_url: str,
) -> None:
    """A live subscription on another worker, opened while the session's turn outcome
    waits for its write, gets that outcome once it is published."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store = HeldRedisStore(redis_url, prefix)
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="hello world", wait=gate)])
    agents = {"a": sa.Agent(model=model)}
    with trio.fail_after(10):
        async with (
            sa.open_registry(store=store, agents=agents, worker_id="a") as a,
            sa.open_registry(
                store=RedisStore(redis_url, prefix=prefix, balance=False),
                agents=agents,
                worker_id="b",
            ) as b,
        ):
            await a.spawn("s")
            turn = await a.ref("s").submit("hi")
            while len(await a.ref("s").history()) < 1:  # it started: its model waits
                await trio.sleep(0.01)
            store.armed = True
            gate.set()
            await store.held.wait()  # the turn's outcome waits for its write
            async with b.ref("s").subscribe() as events:
                store.release.set()
                event = await anext(events)
            assert isinstance(event, sa.TurnFinished), event
            assert event.turn_id == turn.id


async def test_a_stream_whose_session_restarts_slowly_after_a_crash_ends_with_the_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``ref.stream`` of a turn whose session crashed ends with the outcome the restarted
    session publishes (here ``TurnFailed`` with ``lost=True``) even when the restart
    reads the store for a long while, instead of raising SessionCrashedError meanwhile."""
    store = FaultyStore()
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="hello world", wait=gate)])
    async with sa.open_registry(store=store, agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        got: list[sa.Event] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery, ref.stream("hi") as events:
                async for event in events:
                    got.append(event)
                    if isinstance(event, sa.TurnStarted):
                        store.fail("append", session_id="s")  # the outcome's write fails
                        load = store.hold("load", session_id="s")  # the restart reads slowly
                        nursery.start_soon(open_after, load, 10)
                        gate.set()
        assert isinstance(got[-1], sa.TurnFailed)
        assert got[-1].lost
        assert got[-1].turn_id == got[0].turn_id  # type: ignore[attr-defined]


async def open_after(gate: Gate, seconds: float) -> None:
    await trio.sleep(seconds)
    gate.open()
