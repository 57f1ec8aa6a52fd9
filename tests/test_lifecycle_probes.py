"""Probes at the edges of a session's life: wakes, hibernations, deletes, closes.

Each test places one interleaving deterministically (the test kit's FaultyStore
holds or fails store calls; ``wait_all_tasks_blocked`` lets everything else run
first) and checks a promise: every caller and every stream gets an answer or a
typed error naming the session, and nothing acknowledged is lost.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import (
    EchoModel,
    FaultyStore,
    Gate,
    Scripted,
    ScriptedModel,
    crash,
)

ECHO = {"a": sa.Agent(model=EchoModel())}


async def follow(ref: sa.SessionRef, outcome: list[object]) -> None:
    """Subscribe and read to the end: every event, then "ended", or the error."""
    try:
        with trio.fail_after(3600):
            async with ref.subscribe() as events:
                outcome.extend([e async for e in events])
                outcome.append("ended")
    except (sa.SessionActorsError, trio.TooSlowError) as exc:
        outcome.append(exc)


async def test_a_stream_whose_wake_fails_ends_with_the_turns_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    """ref.stream() to a hibernated session whose wake fails (the store's load
    raises): the turn is refused with the store's error, and iterating the stream
    raises it (its events end before any outcome), instead of waiting forever for an
    outcome event that never comes."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        await ref.hibernate()
        assert reg.live() == []
        outcome: list[object] = []

        async def stream() -> None:
            try:
                with trio.fail_after(3600):
                    async with ref.stream("two") as events:
                        async for event in events:
                            outcome.append(event)
            except (sa.SessionActorsError, trio.TooSlowError) as exc:
                outcome.append(exc)

        first = store.hold("load")  # the subscription's read of the stored session
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await trio.testing.wait_all_tasks_blocked()
            assert first.waiting == 1
            second = store.hold("load")  # the wake's
            first.open()
            await trio.testing.wait_all_tasks_blocked()
            assert second.waiting == 1
            store.fail("load", session_id="s")
            second.open()
        assert store.injected == 1
        assert len(outcome) == 1
        assert isinstance(outcome[0], sa.StoreError), outcome
        assert outcome[0].session_id == "s"
        # the store is back: the session wakes and serves
        assert (await ref.send("three")).text == "three"


@pytest.mark.parametrize("stopped", [True, False])
async def test_a_subscription_opened_while_a_wake_reads_the_store_ends_as_without_it(
    autojump_clock: trio.abc.Clock, stopped: bool
) -> None:
    """A read of a stopped session (or of a name never stored) starts an actor that
    finds it so and leaves. A subscription opened meanwhile must end as it does
    otherwise (a stopped session's ends; a missing one's is refused with
    SessionNotFoundError), not stay open on a session that is not there."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        if stopped:
            ref = await reg.spawn("s")
            await ref.send("one")
            await ref.stop()
        ref = reg.ref("s")
        outcome: list[object] = []

        async def read() -> None:
            with contextlib.suppress(sa.SessionNotFoundError):
                await ref.history()

        gate = store.hold("load")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert gate.waiting == 1  # the wake reads the store
            assert reg.live() == ["s"]
            nursery.start_soon(follow, ref, outcome)
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
        if stopped:
            assert outcome == ["ended"]
        else:
            assert len(outcome) == 1
            assert isinstance(outcome[0], sa.SessionNotFoundError), outcome


async def test_a_subscription_opened_while_a_wake_reads_the_store_ends_as_the_registry_closes(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A subscription opened while a wake reads the store, when the registry closes
    before the store answers, ends as every subscription does then, instead of
    staying open on a hub that no actor will ever publish to, or close."""
    store = FaultyStore()
    outcome: list[object] = []
    gate = store.hold("load")
    async with trio.open_nursery() as outside:
        async with sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg:
            await reg.spawn("s")
            ref = reg.ref("s")

            async def read() -> None:
                try:
                    await ref.history()
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            outside.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert gate.waiting == 1  # the wake reads the store
            outside.start_soon(follow, ref, outcome)
            await trio.testing.wait_all_tasks_blocked()
        gate.open()  # the store answers once the registry is gone
    assert len(outcome) == 2, outcome
    assert "ended" in outcome, outcome
    assert [type(o) for o in outcome if o != "ended"] == [sa.SessionStoppedError], outcome


async def test_a_resumed_subscription_replays_no_outcome_before_it_is_stored(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A subscriber resuming from beyond the replay ring while a turn's outcome is being
    written must not be shown that outcome before it is stored: the write fails, the
    turn is void (TurnFailed, lost), and live subscribers never see it finish."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, replay_events=2) as reg:
        ref = await reg.spawn("s")
        await ref.send("one two three")
        first = (await ref.state()).event_seq  # the first turn's outcome
        gate = store.hold("append", session_id="s")
        store.fail("append", session_id="s")
        live: list[sa.Event] = []
        resumed: list[sa.Event] = []
        async with ref.subscribe() as events:
            turn = await ref.submit("four five six")
            await trio.testing.wait_all_tasks_blocked()
            assert gate.waiting == 1  # the turn's outcome is being written
            async with ref.subscribe(after=first - 1) as replayed:  # beyond the ring
                gate.open()
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
                with trio.move_on_after(60):
                    async for event in events:
                        live.append(event)
                with trio.move_on_after(60):
                    async for event in replayed:
                        resumed.append(event)
        assert store.injected == 1

        def ends(seen: list[sa.Event]) -> list[str]:
            return [
                type(e).__name__
                for e in seen
                if isinstance(e, sa.TurnFinished | sa.TurnFailed) and e.turn_id == turn.id
            ]

        assert ends(live) == ["TurnFailed"]
        assert ends(resumed) == ["TurnFailed"], resumed


async def test_a_stopped_session_deleted_and_spawned_again_is_not_overwritten(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stop is journaled, then compacted into a snapshot. If the session is
    deleted and its name spawned afresh while that snapshot is being written, the
    new session must not become the old one (its history, its stopped status)."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("secret")
        gate = store.hold("write_snapshot", session_id="s")
        spawned: list[sa.SessionRef] = []

        async def delete_and_spawn() -> None:
            await reg.delete("s")
            spawned.append(await reg.spawn("s"))

        async def stop() -> None:
            # (deleted before it returned: it says so, as a stop racing a delete does)
            with contextlib.suppress(sa.SessionNotFoundError):
                await ref.stop()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop)
            await trio.testing.wait_all_tasks_blocked()
            assert gate.waiting == 1  # the stop is journaled; its compaction is held
            nursery.start_soon(delete_and_spawn)
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
        [fresh] = spawned
        assert await fresh.history() == []
        assert (await fresh.send("hello")).text == "hello"


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_a_message_during_a_failed_idle_hibernation_is_served(
    autojump_clock: trio.abc.Clock, durability: str
) -> None:
    """The idle timeout hibernates a session; the store refuses the snapshot while a
    message arrives. Nobody asked for that hibernation: the message is served (not
    failed as if the session had crashed handling it), nothing is lost, and the
    session hibernates once the store takes snapshots again."""
    store = FaultyStore()
    async with sa.open_registry(
        store=store, agents=ECHO, idle_timeout=10, durability=durability
    ) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        gate = store.hold("write_snapshot", session_id="s")
        store.fail("write_snapshot", session_id="s")
        await trio.sleep(11)
        assert gate.waiting == 1  # the idle hibernation's snapshot
        turn = await ref.submit("two")
        gate.open()
        assert (await turn.reply()).text == "two"
        assert store.injected == 1
        assert reg.statistics().crashes == 0
        await trio.sleep(11)
        assert reg.live() == []  # hibernated this time
    async with sa.open_registry(store=store.store, agents=ECHO) as reg:
        history = [m.content for m in await reg.ref("s").history()]
        assert history == ["one", "one", "two", "two"]


@pytest.mark.parametrize("how", ["idle", "explicit"])
async def test_a_registry_closing_on_a_stalled_hibernation_reports_what_it_lost(
    autojump_clock: trio.abc.Clock, how: str
) -> None:
    """durability="hibernate": an answered turn is in memory only until a snapshot.
    The registry closes while an idle (or a requested) hibernation's snapshot stalls,
    and gives up on it: the turn is lost, and leaving the registry must say so with
    StoreError naming the session, as it does when its own closing snapshot stalls."""
    store = FaultyStore()

    async def close_while_hibernating() -> None:
        async with trio.open_nursery() as outside:
            async with sa.open_registry(
                store=store,
                agents=ECHO,
                durability="hibernate",
                shutdown_grace=1,
                idle_timeout=10 if how == "idle" else None,
            ) as reg:
                ref = await reg.spawn("s")
                await ref.send("one")  # answered: in memory, in no write yet
                gate = store.hold("write_snapshot")
                if how == "idle":
                    await trio.sleep(11)
                else:

                    async def hibernate() -> None:
                        with pytest.raises(sa.SessionStoppedError):
                            await ref.hibernate()

                    outside.start_soon(hibernate)
                    await trio.testing.wait_all_tasks_blocked()
                assert gate.waiting == 1  # the hibernation's snapshot stalls
            gate.open()

    with pytest.raises(ExceptionGroup) as raised:  # (out of the nursery around it)
        await close_while_hibernating()
    [error] = raised.value.exceptions
    assert isinstance(error, sa.StoreError)
    assert "['s']" in str(error)
    async with sa.open_registry(store=store.store, agents=ECHO) as reg:
        assert await reg.ref("s").history() == []  # lost, as the error said


async def test_closing_the_registry_while_a_wake_reads_a_stalled_store_keeps_to_the_grace(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Leaving the registry's block while a session wakes and the store's load does
    not answer: once the shutdown grace runs out the wake is given up (it has read
    nothing, so there is nothing to write), the caller waiting on it hears that the
    registry closed, naming the session, and the block ends, instead of waiting the
    whole write bound for a read."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        await ref.hibernate()
    store.hold("load")  # never opened
    outcome: list[object] = []

    async def read(ref: sa.SessionRef) -> None:
        try:
            await ref.history()
        except sa.SessionActorsError as exc:
            outcome.append(exc)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        async with sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg:
            nursery.start_soon(read, reg.ref("s"))
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)  # the read waits for the wake; the block is left
            assert outcome == []
        closed = trio.current_time() - start
    assert closed < 5  # the grace, not the 30 s write bound
    assert len(outcome) == 1
    error = outcome[0]
    assert isinstance(error, sa.SessionStoppedError)
    assert error.session_id == "s"


async def test_a_stalled_wake_holding_answered_turns_is_not_given_up_silently(
    autojump_clock: trio.abc.Clock,
) -> None:
    """durability="hibernate": an incarnation restarted after a crash carries the
    answered turns that no write holds yet, and must read the store before it can
    write them. If that read stalls while the registry closes, giving it up at the
    grace's end would drop those turns without a word: the registry's exit reports
    them as not written instead, naming the session."""
    store = FaultyStore()

    async def crash_while_waking() -> None:
        async with sa.open_registry(
            store=store, agents=ECHO, durability="hibernate", shutdown_grace=1
        ) as reg:
            ref = await reg.spawn("s")
            await ref.send("one")  # answered; only a snapshot would hold it
            store.hold("load")  # the restarted incarnation's read: never answered
            store.fail("write_snapshot")
            with pytest.raises(sa.StoreError):
                await ref.hibernate()  # the actor crashes and restarts
            await trio.testing.wait_all_tasks_blocked()

    with pytest.raises(sa.StoreError, match="'s'") as caught:
        await crash_while_waking()
    assert "lost" in str(caught.value)


def answer_then_hold() -> dict[str, sa.Agent]:
    """An agent that answers its first turn, then streams one word of the second and
    holds it open for good."""
    held = Scripted(text="cut off here", wait=trio.Event(), wait_after=1)
    return {"a": sa.Agent(model=ScriptedModel([Scripted(text="first answer"), held]))}


@pytest.mark.parametrize("durability", ["hibernate", "turn"])
@pytest.mark.parametrize("moment", ["idle", "mid-turn"])
async def test_a_registry_block_cancelled_from_outside_keeps_what_it_answered(
    autojump_clock: trio.abc.Clock, durability: sa.Durability, moment: str
) -> None:
    """A cancel scope around the registry's block is cancelled (a deadline, a parent
    shutting its children down): leaving the block shuts the registry down at once, as
    if the shutdown grace were 0, and still writes what it answered. With
    durability="hibernate" the closing snapshot is the only write of an answered turn:
    the cancellation must not cut it. A turn in flight is cut as at the end of the
    grace (its caller hears so; what it streamed is kept, marked interrupted)."""
    store = sa.MemoryStore()
    agents = answer_then_hold()
    outcome: list[object] = []
    start = trio.current_time()
    with trio.CancelScope() as outside:
        async with sa.open_registry(
            store=store, agents=agents, durability=durability, shutdown_grace=100
        ) as reg:
            ref = await reg.spawn("s")
            assert (await ref.send("one")).text == "first answer"
            if moment == "mid-turn":
                turn = await ref.submit("two")

                async def wait_reply() -> None:
                    with trio.CancelScope(shield=True):
                        try:
                            await turn.reply()
                        except sa.SessionActorsError as exc:
                            outcome.append(exc)

                trio.lowlevel.spawn_system_task(wait_reply)
                await trio.testing.wait_all_tasks_blocked()
            outside.cancel()
            await trio.sleep(1)
    assert outside.cancelled_caught
    assert trio.current_time() - start < 50  # the grace (100 s) was not waited for
    async with sa.open_registry(store=store, agents=agents) as reg:
        history = await reg.ref("s").history()
    assert [m.content for m in history[:2]] == ["one", "first answer"]
    if moment == "mid-turn":
        await trio.testing.wait_all_tasks_blocked()
        [error] = outcome
        assert isinstance(error, sa.SessionStoppedError)
        assert error.session_id == "s"
        assert [(m.content, m.interrupted) for m in history[2:]] == [
            ("two", False),
            ("cut", True),
        ]
    else:
        assert len(history) == 2


async def test_a_cancellation_during_the_shutdown_grace_cuts_it_short_and_still_hibernates(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The block is left normally with a turn in flight (the grace begins), then a deadline
    around it expires during the grace: the shutdown goes on at once, as if the grace had
    ended (the turn is cut, kept interrupted), writes the hibernation, and the block ends at
    the deadline, not when the turn would end (never)."""
    store = sa.MemoryStore()
    agents = answer_then_hold()
    start = trio.current_time()
    with trio.fail_after(3600), trio.move_on_after(5) as deadline:
        async with sa.open_registry(
            store=store, agents=agents, durability="hibernate", shutdown_grace=100
        ) as reg:
            ref = await reg.spawn("s")
            await ref.send("one")
            await ref.submit("two")
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1)  # the block is left at 1 s; the deadline comes at 5 s
    assert deadline.cancelled_caught
    assert trio.current_time() - start < 50
    async with sa.open_registry(store=store, agents=agents) as reg:
        history = await reg.ref("s").history()
    assert [(m.content, m.interrupted) for m in history] == [
        ("one", False),
        ("first answer", False),
        ("two", False),
        ("cut", True),
    ]


class ShieldedModel:
    """A model that cannot be cancelled while it thinks (as an asyncio model under
    sessionactors.aio finishes its step before it hears of a cancel)."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        with trio.CancelScope(shield=True):
            await trio.sleep(1)
        yield sa.TextChunk("done")


async def open_late(gate: Gate) -> None:
    """Open ``gate`` 1000 s from now: a store that comes back long after every bound
    (so that a test of a bound ends, failing, where the bound is missing)."""
    await trio.sleep(1000)
    gate.open()


def paying(paid: list[int]) -> sa.Agent:
    """An agent whose second turn calls ``pay``, a tool that is not idempotent (its
    start is journaled before it runs), which records what it paid in ``paid``."""

    async def pay(amount: int) -> str:
        paid.append(amount)
        return f"paid {amount}"

    call = sa.ToolCall(id="c1", name="pay", arguments='{"amount": 1}')
    model = ScriptedModel(["ok", Scripted(tool_calls=[call]), "done"])
    return sa.Agent(model=model, tools=[sa.Tool(name="pay", fn=pay, idempotent=False)])


async def cancel_as_it_ends(ref: sa.SessionRef, store: FaultyStore) -> tuple[sa.Turn, Gate]:
    """Submit a turn to a session of ShieldedModel and cancel it as it ends, with the
    store holding every append from then on: its outcome's write hangs."""
    turn = await ref.submit("hi")
    await trio.sleep(0.5)  # the model thinks, shielded
    gate = store.hold("append")
    assert await ref.cancel()
    await trio.sleep(1)  # the model is done: the outcome is written
    assert gate.waiting == 1
    return turn, gate


async def pay_unrecorded(ref: sa.SessionRef, store: FaultyStore) -> tuple[sa.Turn, Gate]:
    """Submit the paying turn of a session of ``paying`` with the store holding every
    append: the write of the call's start, which must be durable before it runs, hangs
    (and a cancel does not cut it)."""
    await ref.send("warm up")
    gate = store.hold("append")
    turn = await ref.submit("pay please")
    await trio.testing.wait_all_tasks_blocked()
    assert gate.waiting == 1
    assert await ref.cancel()
    return turn, gate


HANGS = {"outcome of a turn cancelled as it ended": "slow", "start of a payment": "pay"}


@pytest.mark.parametrize("where", HANGS)
async def test_a_shielded_write_that_the_store_never_takes_fails_its_caller_in_bounded_time(
    autojump_clock: trio.abc.Clock, where: str
) -> None:
    """A write that a cancel must not cut (the outcome of a turn cancelled as it ended,
    the start of a call that is not idempotent) and that the store never takes: within
    the write bound (30 s) the caller gets SessionCrashedError naming the session (the
    write is not acknowledged; a payment whose start is not durable never runs), and the
    session, restarted from its durable state, answers again once the store is back."""
    store = FaultyStore()
    paid: list[int] = []
    agents = {"slow": sa.Agent(model=ShieldedModel()), "pay": paying(paid)}
    async with trio.open_nursery() as nursery, sa.open_registry(store=store, agents=agents) as reg:
        ref = await reg.spawn("s", agent=HANGS[where])
        turn, gate = await (cancel_as_it_ends if where.startswith("outcome") else pay_unrecorded)(
            ref, store
        )
        nursery.start_soon(open_late, gate)
        with trio.fail_after(60), pytest.raises(sa.SessionCrashedError) as crashed:
            await turn.reply()
        assert crashed.value.session_id == "s"
        assert paid == []
        gate.open()
        with trio.fail_after(60):
            assert (await ref.send("again")).text == "done"


@pytest.mark.parametrize("cut", [False, True], ids=["closed", "cancelled"])
@pytest.mark.parametrize("where", HANGS)
async def test_a_registry_closes_in_bounded_time_while_a_shielded_write_hangs(
    autojump_clock: trio.abc.Clock, where: str, cut: bool
) -> None:
    """The registry's block is left (or cancelled from outside, as by a Ctrl-C) while a
    session waits on a write that a cancel must not cut and the store never takes: the
    close ends within its grace and write bound, not when the store comes back, and the
    turn's caller has a typed error naming the session."""
    store = FaultyStore()
    agents = {"slow": sa.Agent(model=ShieldedModel()), "pay": paying([])}
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as outside:
            async with sa.open_registry(store=store, agents=agents) as reg:
                ref = await reg.spawn("s", agent=HANGS[where])
                turn, gate = await (
                    cancel_as_it_ends if where.startswith("outcome") else pay_unrecorded
                )(ref, store)
                nursery.start_soon(open_late, gate)
                left = trio.current_time()
                if cut:
                    outside.cancel()
                    await trio.sleep_forever()
        assert trio.current_time() - left < 100  # (grace 10 s, write bound 30 s)
        with trio.fail_after(1), pytest.raises(sa.SessionActorsError) as error:
            await turn.reply()
        assert error.value.session_id == "s"
        nursery.cancel_scope.cancel()


class ShieldedReviewModel:
    """A model that cannot be cancelled while it thinks, and then asks for a call that
    needs a person's review (the turn pauses for it); after the review it says "done"."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        if request.messages[-1].role is sa.Role.TOOL:
            yield sa.TextChunk("done")
            return
        with trio.CancelScope(shield=True):
            await trio.sleep(1)
        yield sa.ToolCallChunk(index=0, id="r1", name="refund", arguments="{}")


def refunding() -> sa.Agent:
    """An agent of ShieldedReviewModel whose ``refund`` tool needs a review."""

    async def refund() -> str:
        return "refunded"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True)
    return sa.Agent(model=ShieldedReviewModel(), tools=[tool])


async def pay_answered_late(ref: sa.SessionRef, store: FaultyStore) -> tuple[sa.Turn, Gate]:
    """Submit the paying turn of a session of ``paying`` with the store answering every
    append late: the start of the call reaches the store, its answer does not come."""
    await ref.send("warm up")
    gate = store.hold("append", after=True)
    turn = await ref.submit("pay please")
    await trio.testing.wait_all_tasks_blocked()
    assert gate.waiting == 1
    return turn, gate


async def pause_answered_late(ref: sa.SessionRef, store: FaultyStore) -> tuple[sa.Turn, Gate]:
    """Submit a turn of a session of ``refunding`` and cancel it as it pauses for its
    review, with the store answering every append late: the review request reaches the
    store, its answer does not come."""
    turn = await ref.submit("refund please")
    await trio.sleep(0.5)  # the model thinks, shielded
    gate = store.hold("append", after=True)
    assert await ref.cancel()
    await trio.sleep(1)  # the model is done: the turn pauses, its review is written
    assert gate.waiting == 1
    return turn, gate


LATE = {"start of a payment": "pay", "review a cancelled turn paused for": "refund"}


@pytest.mark.parametrize("where", LATE)
async def test_a_shielded_write_the_store_took_but_answered_late_is_told_as_unknown(
    autojump_clock: trio.abc.Clock, where: str
) -> None:
    """A write that a cancel must not cut reaches the store, whose answer comes after the
    write bound: the write may have landed, so the caller's SessionCrashedError names the
    turn and asks for its outcome (ref.turn_outcome) before a retry, rather than telling
    it to retry (a second turn, a second payment); the store did keep the turn, and a call
    whose start was written never runs."""
    store = FaultyStore()
    paid: list[int] = []
    agents = {"pay": paying(paid), "refund": refunding()}
    async with trio.open_nursery() as nursery, sa.open_registry(store=store, agents=agents) as reg:
        ref = await reg.spawn("s", agent=LATE[where])
        turn, gate = await (
            pay_answered_late if where.startswith("start") else pause_answered_late
        )(ref, store)
        nursery.start_soon(open_late, gate)
        with trio.fail_after(60), pytest.raises(sa.SessionCrashedError) as crashed:
            await turn.reply()
        error = crashed.value
        assert (error.session_id, error.turn_id) == ("s", turn.id), str(error)
        assert f"ask ref.turn_outcome({turn.id!r})" in str(error), str(error)
        assert "may or may not have landed" in str(error), str(error)
        assert "retry the request" not in str(error), str(error)
        gate.open()
        with trio.fail_after(60):
            history = await ref.history()
        assert [m.content for m in history if m.role is sa.Role.USER][-1].endswith("please")
        assert paid == []


@pytest.mark.parametrize("where", HANGS)
async def test_a_slow_compaction_after_a_shielded_write_does_not_fail_its_turn(
    autojump_clock: trio.abc.Clock, where: str
) -> None:
    """The compaction snapshot that follows a write a cancel must not cut (the start of a
    call that is not idempotent, the outcome of a turn cancelled as it ended) is optional:
    a store slow to take it (past the write bound) does not fail the turn, whose write
    landed; the call runs once and the caller gets its reply (once the store is back, if
    the turn itself waits on that snapshot)."""
    store = FaultyStore()
    paid: list[int] = []
    agents = {"slow": sa.Agent(model=ShieldedModel()), "pay": paying(paid)}
    async with (
        trio.open_nursery() as nursery,
        sa.open_registry(store=store, agents=agents, snapshot_every=1) as reg,
    ):
        ref = await reg.spawn("s", agent=HANGS[where])
        await ref.send("warm up")  # (the journal now outweighs the snapshot)
        if where.startswith("outcome"):
            turn = await ref.submit("hi")
            await trio.sleep(0.5)  # the model thinks, shielded
            gate = store.hold("write_snapshot")
            assert await ref.cancel()
        else:
            gate = store.hold("write_snapshot")
            turn = await ref.submit("pay please")
        nursery.start_soon(open_late, gate)
        with trio.fail_after(3600):
            assert (await turn.reply()).text == "done"
        assert paid == ([] if where.startswith("outcome") else [1])


#: A trio program whose session's hibernation never returns, told to stop three times.
THREE_CTRL_C = """
import signal, trio, trio.testing
import sessionactors as sa
from sessionactors.testing import EchoModel, FaultyStore

# (as in a terminal: a test run started in the background inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)

async def ctrl_c():
    for t in (2, 3, 4, 5, 6):
        await trio.sleep_until(t)
        signal.raise_signal(signal.SIGINT)

async def main():
    trio.lowlevel.spawn_system_task(ctrl_c)
    store = FaultyStore()
    async with sa.open_registry(store=store, agents={"e": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("s")
        await ref.send("hi")
        store.hold("write_snapshot")  # never opened: a store that hangs
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ref.hibernate)
            await trio.sleep_forever()

try:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
except KeyboardInterrupt:
    print("stopped by Ctrl-C")
"""


def test_ctrl_c_pressed_again_while_the_shutdown_waits_for_a_stalled_store_stops() -> None:
    """Ctrl-C in a trio program whose store hangs, pressed again while the shutdown waits
    for it, and again: the program ends with KeyboardInterrupt, never hangs."""
    done = subprocess.run(
        [sys.executable, "-c", THREE_CTRL_C], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "stopped by Ctrl-C", done.stderr


def cut_by_ctrl_c() -> dict[str, sa.Agent]:
    """An agent that answers two turns, then streams two words of the third and raises
    KeyboardInterrupt (a Ctrl-C landing while the model streams)."""
    cut = Scripted(text="cut off", error=KeyboardInterrupt())
    return {"a": sa.Agent(model=ScriptedModel(["first answer", "second answer", cut]))}


async def answer_twice_then_ctrl_c(
    store: sa.Store, durability: sa.Durability, turns: list[sa.Turn], *, hang: bool = False
) -> None:
    """Session "A" answers two turns, then its model raises KeyboardInterrupt in the
    third (``turns``: it), while the application goes on; ``hang``: the store never
    takes a snapshot from then on."""
    async with sa.open_registry(store=store, agents=cut_by_ctrl_c(), durability=durability) as reg:
        ref = await reg.spawn("A")
        assert (await ref.send("one")).text == "first answer"
        assert (await ref.send("two")).text == "second answer"
        if hang:
            assert isinstance(store, FaultyStore)
            store.hold("write_snapshot")  # never opened
        turns.append(await ref.submit("three"))
        await trio.sleep_forever()  # the application goes on: the Ctrl-C ends it


@pytest.mark.parametrize("durability", ["hibernate", "turn"])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_ctrl_c_in_a_session_keeps_what_that_session_answered(
    tmp_path: Path, kind: str, durability: sa.Durability
) -> None:
    """A KeyboardInterrupt escaping one session's model ends the registry as itself, and
    that session is hibernated on the way out as the others are: with
    durability="hibernate" the turns it answered are kept (the closing snapshot is their
    only write), and the turn it cut is kept, marked interrupted (its caller hears so)."""
    memory = sa.MemoryStore()

    def store() -> sa.Store:
        return memory if kind == "memory" else sa.SQLiteStore(str(tmp_path / "s.db"))

    turns: list[sa.Turn] = []
    with trio.fail_after(30), pytest.raises(KeyboardInterrupt):
        await answer_twice_then_ctrl_c(store(), durability, turns)
    async with sa.open_registry(store=store(), agents=ECHO) as reg:
        history = await reg.ref("A").history()
    assert [(m.content, m.interrupted) for m in history] == [
        ("one", False),
        ("first answer", False),
        ("two", False),
        ("second answer", False),
        ("three", False),
        ("cut off", True),
    ]
    [turn] = turns
    with trio.fail_after(30), pytest.raises(sa.SessionStoppedError) as stopped:
        await turn.reply()
    assert stopped.value.session_id == "A"
    assert stopped.value.turn_id == turn.id


async def test_a_ctrl_c_in_a_session_whose_store_hangs_ends_within_the_write_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A KeyboardInterrupt escaping a session whose store never takes its snapshot: the
    session's hibernation waits for the store at most the write bound (30 s), then the
    registry ends, as the KeyboardInterrupt, and the cut turn's caller has its answer."""
    turns: list[sa.Turn] = []
    start = trio.current_time()
    with trio.fail_after(3600), pytest.raises(KeyboardInterrupt):
        await answer_twice_then_ctrl_c(FaultyStore(), "hibernate", turns, hang=True)
    assert trio.current_time() - start < 100
    with trio.fail_after(1), pytest.raises(sa.SessionStoppedError):
        await turns[0].reply()


class AnswerThenCtrlCWhenCancelled:
    """A model that answers its first turn; in the next it streams a word and waits, and
    cancelled, it raises KeyboardInterrupt (a Ctrl-C landing in its cleanup)."""

    def __init__(self) -> None:
        self.turns = 0

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.turns += 1
        await trio.lowlevel.checkpoint()
        if self.turns == 1:
            yield sa.TextChunk("answer")
            return
        yield sa.TextChunk("partial")
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise KeyboardInterrupt from None


async def test_a_ctrl_c_escaping_a_session_of_a_crashed_registry_writes_nothing() -> None:
    """After crash(registry), a KeyboardInterrupt escaping a session as it is stopped
    writes nothing (a process's death does not hibernate): the store holds what it held,
    which with durability="hibernate" is the session as spawned."""
    store = sa.MemoryStore()
    agents = {"a": sa.Agent(model=AnswerThenCtrlCWhenCancelled())}

    async def process() -> None:
        with trio.CancelScope() as death:
            async with sa.open_registry(store=store, agents=agents, durability="hibernate") as reg:
                ref = await reg.spawn("A")
                assert (await ref.send("one")).text == "answer"
                await ref.submit("two")
                await trio.testing.wait_all_tasks_blocked()
                crash(reg)
                death.cancel()
                await trio.sleep_forever()

    # (grouped with the block's own cancellation, which the process's scope then takes)
    with trio.fail_after(30), pytest.RaisesGroup(KeyboardInterrupt, allow_unwrapped=True):
        await process()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert await reg.ref("A").history() == []
