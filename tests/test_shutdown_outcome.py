"""A turn that a registry's close cuts off (its shutdown grace ran out) ends failed with
SessionStoppedError, not cancelled: its subscribers, its outcome and its replay from the
store say that the server stopped mid-reply, where a user's cancel says it was cancelled."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import MemoryStore
from sessionactors.testing import Gate, Scripted, ScriptedModel, journal_events

OUTCOMES = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)


def held_agents(gate: Gate, wait_after: int = 2) -> dict[str, sa.Agent]:
    """An agent whose model streams ``wait_after`` words of its answer, then waits at
    ``gate``."""
    script = Scripted(text="half a reply and no more", wait=gate, wait_after=wait_after)
    return {"held": sa.Agent(model=ScriptedModel([script]))}


async def follow(
    ref: sa.SessionRef,
    seen: list[object],
    *,
    every: bool = False,
    task_status: trio.TaskStatus[None],
) -> None:
    """Read ``ref``'s events into ``seen`` up to a turn's outcome (``every``: past it),
    or to their end (and the error that ended them, if one did)."""
    try:
        async with ref.subscribe() as events:
            task_status.started()
            async for event in events:
                seen.append(event)
                if not every and isinstance(event, OUTCOMES):
                    return
    except sa.SessionActorsError as exc:  # (the registry closed before the outcome)
        seen.append(exc)


def assert_cut_event(outcome: object, turn_id: str) -> None:
    assert isinstance(outcome, sa.TurnFailed), outcome
    assert outcome.turn_id == turn_id
    assert outcome.error_kind == "SessionStoppedError", outcome
    assert outcome.error_public, outcome
    assert not outcome.lost
    assert outcome.error.startswith("SessionStoppedError: the turn of session 's' was cut off")
    assert "stopped" in outcome.error, outcome.error
    assert "send the message again" in outcome.error, outcome.error


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
@pytest.mark.parametrize("how", ["grace", "cancelled"])
async def test_a_turn_cut_by_the_registrys_close_ends_failed_with_session_stopped(
    autojump_clock: trio.abc.Clock, durability: str, how: str
) -> None:
    """A turn still running when its registry closes (the shutdown grace ran out, or the
    block was cancelled) ends with a TurnFailed of kind SessionStoppedError whose public
    error says to send the message again, not a TurnCancelled; its caller still gets
    SessionStoppedError with its turn_id, what it streamed stays in the history marked
    interrupted, and once reopened the session says the same: turn_outcome and the state's
    turn record read failed with that error, and the store journals and replays that very
    TurnFailed (with durability="turn"; the closing snapshot holds it with "hibernate")."""
    store = MemoryStore()
    gate = Gate()
    agents = held_agents(gate)
    seen: list[object] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as outside:
                async with sa.open_registry(
                    store=store, agents=agents, shutdown_grace=5, durability=durability
                ) as registry:
                    ref = await registry.spawn("s")
                    await nursery.start(follow, ref, seen)
                    turn = await ref.submit("hello")
                    await trio.testing.wait_all_tasks_blocked()
                    if how == "cancelled":
                        outside.cancel()
        with pytest.raises(sa.SessionStoppedError) as stopped:
            await turn.reply()
        assert stopped.value.turn_id == turn.id
        counted = registry.statistics()
        assert (counted.turns_failed, counted.turns_cancelled) == (1, 0)

        assert not any(isinstance(e, sa.TurnCancelled) for e in seen), seen
        outcome = seen[-1]
        assert_cut_event(outcome, turn.id)
        assert isinstance(outcome, sa.TurnFailed)

        async with sa.open_registry(store=store, agents=agents) as registry:
            ref = registry.ref("s")
            told = await ref.turn_outcome(turn.id)
            history = await ref.history()
            state = await ref.state()
            replayed: list[sa.Event] = []
            if durability == "turn":  # (with "hibernate", the closing snapshot holds it all)
                async with ref.subscribe(after=0) as events:
                    async for event in events:
                        replayed.append(event)
                        if isinstance(event, OUTCOMES):
                            break
        journaled = await journal_events(store, "s")
    assert told.status is sa.TurnStatus.FAILED, told
    assert told.error == outcome.error
    assert [(m.role, m.content, m.interrupted) for m in history] == [
        (sa.Role.USER, "hello", False),
        (sa.Role.ASSISTANT, "half a", True),
    ]
    [record] = [r for r in state.turns if r.turn_id == turn.id]
    assert (record.status, record.error) == (sa.TurnStatus.FAILED, outcome.error)
    if durability == "turn":
        assert replayed[-1] == outcome
        assert outcome in journaled


async def test_a_cut_turn_that_streamed_nothing_leaves_the_failed_mark(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn cut off by its registry's close before its model streamed a word leaves the
    marked "(no reply: this turn failed)", as every failed turn does."""
    store = MemoryStore()
    agents = held_agents(Gate(), wait_after=0)
    with trio.fail_after(120):
        async with sa.open_registry(store=store, agents=agents, shutdown_grace=5) as registry:
            ref = await registry.spawn("s")
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(sa.SessionStoppedError):
            await turn.reply()
        async with sa.open_registry(store=store, agents=agents) as registry:
            last = (await registry.ref("s").history())[-1]
            told = await registry.ref("s").turn_outcome(turn.id)
    assert (last.content, last.interrupted) == ("(no reply: this turn failed)", True)
    assert told.status is sa.TurnStatus.FAILED


async def test_a_users_cancel_during_the_shutdown_grace_is_still_a_cancel(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn that ref.cancel() cuts while its registry closes, within the shutdown grace,
    ends with TurnCancelled and TurnCancelledError, as any cancel does."""
    store = MemoryStore()
    agents = held_agents(Gate())
    seen: list[object] = []
    with trio.fail_after(120):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(store=store, agents=agents, shutdown_grace=50) as registry,
        ):
            ref = await registry.spawn("s")
            await nursery.start(follow, ref, seen)
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()

            async def cancel_soon() -> None:
                await trio.sleep(1)  # (virtual) the registry is closing by then
                assert await ref.cancel(turn_id=turn.id)

            nursery.start_soon(cancel_soon)
        with pytest.raises(sa.TurnCancelledError):
            await turn.reply()
        async with sa.open_registry(store=store, agents=agents) as registry:
            told = await registry.ref("s").turn_outcome(turn.id)
    assert isinstance(seen[-1], sa.TurnCancelled), seen
    assert seen[-1].turn_id == turn.id
    assert told.status is sa.TurnStatus.CANCELLED


async def test_a_turn_cut_while_its_session_stops_ends_failed_with_session_stopped(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn that ref.stop() waits behind when the registry's shutdown grace runs out is
    cut off by the close, not cancelled by anyone: it ends with a TurnFailed of kind
    SessionStoppedError (counted failed), its caller gets SessionStoppedError with its
    turn_id, and the stop still happens."""
    store = MemoryStore()
    agents = held_agents(Gate())
    seen: list[object] = []
    stopped = trio.Event()
    with trio.fail_after(120):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(store=store, agents=agents, shutdown_grace=1) as registry,
        ):
            ref = await registry.spawn("s")
            await nursery.start(follow, ref, seen)
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()

            async def stop() -> None:
                await ref.stop()
                stopped.set()

            nursery.start_soon(stop)
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(sa.SessionStoppedError) as caught:
            await turn.reply()
        assert caught.value.turn_id == turn.id
        counted = registry.statistics()
        assert (counted.turns_failed, counted.turns_cancelled) == (1, 0)
    assert stopped.is_set()
    assert_cut_event(seen[-1], turn.id)


class SlowToLetGo:
    """A model that streams "half a", then waits; cancelled, it takes ``unwind``
    seconds (shielded) to let go, as a model closing its connection may."""

    def __init__(self, unwind: float) -> None:
        self.unwind = unwind

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk(text="half a")
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.unwind)


@pytest.mark.parametrize("first", ["cancel", "grace"])
async def test_what_cut_a_turn_first_decides_its_outcome(
    autojump_clock: trio.abc.Clock, first: str
) -> None:
    """A turn that ref.cancel() cut ends cancelled (TurnCancelled, TurnCancelledError)
    even when the registry's shutdown grace runs out while it lets go; one that the end
    of the grace cut ends failed with SessionStoppedError even when ref.cancel() comes
    while it lets go: what cut it first decides, not what the session is doing when it
    ends."""
    store = MemoryStore()
    agents = {"slow": sa.Agent(model=SlowToLetGo(unwind=10))}
    seen: list[object] = []
    # the grace ends at 5 (virtual) seconds; the cancel comes at 3 or at 7
    cancel_at = 3 if first == "cancel" else 7
    with trio.fail_after(120):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(store=store, agents=agents, shutdown_grace=5) as registry,
        ):
            ref = await registry.spawn("s")
            await nursery.start(follow, ref, seen)
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()

            async def cancel_later() -> None:
                await trio.sleep(cancel_at)
                assert await ref.cancel(turn_id=turn.id)

            nursery.start_soon(cancel_later)
        counted = registry.statistics()
        if first == "cancel":
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            assert isinstance(seen[-1], sa.TurnCancelled), seen
            assert (counted.turns_failed, counted.turns_cancelled) == (0, 1)
        else:
            with pytest.raises(sa.SessionStoppedError):
                await turn.reply()
            assert_cut_event(seen[-1], turn.id)
            assert (counted.turns_failed, counted.turns_cancelled) == (1, 0)
        async with sa.open_registry(store=store, agents=agents) as registry:
            told = await registry.ref("s").turn_outcome(turn.id)
    expected = sa.TurnStatus.CANCELLED if first == "cancel" else sa.TurnStatus.FAILED
    assert told.status is expected, told


async def test_a_cut_turn_is_logged_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn that its registry's close cut off is logged once, at WARNING, with its
    session and turn: where a client told that it failed may be sent to look."""
    agents = held_agents(Gate())
    with caplog.at_level(logging.INFO, logger="sessionactors"), trio.fail_after(120):
        async with sa.open_registry(agents=agents, shutdown_grace=1) as registry:
            ref = await registry.spawn("s")
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(sa.SessionStoppedError):
            await turn.reply()
    told = [r for r in caplog.records if turn.id in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert told[0].levelno == logging.WARNING
    assert "'s'" in told[0].getMessage()
    assert "cut off" in told[0].getMessage()


@pytest.mark.parametrize("how", ["close", "stop"])
async def test_turns_still_queued_when_their_session_ends_are_told_to_subscribers(
    autojump_clock: trio.abc.Clock, how: str
) -> None:
    """Turns waiting in the mailbox when the registry closes (or the session stops) never
    begin: their callers get SessionStoppedError, and their subscribers a TurnFailed of
    kind SessionStoppedError each, whose public error says what to do (published, never
    journaled: they left nothing in the history), so that a client that only watches the
    event stream is not left waiting for outcomes that never come."""
    store = MemoryStore()
    gate = Gate()
    agents = held_agents(gate)
    seen: list[object] = []
    with trio.fail_after(120):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(store=store, agents=agents, shutdown_grace=1) as registry,
        ):
            ref = await registry.spawn("s")
            await nursery.start(functools.partial(follow, every=True), ref, seen)
            first = await ref.submit("hello")
            queued = [await ref.submit(f"queued {i}") for i in range(2)]
            await trio.testing.wait_all_tasks_blocked()
            if how == "stop":
                nursery.start_soon(ref.stop)
                await trio.testing.wait_all_tasks_blocked()
                gate.open()
        for turn in queued:
            with pytest.raises(sa.SessionStoppedError):
                await turn.reply()
        async with sa.open_registry(store=store, agents=agents) as registry:
            history = await registry.ref("s").history()
    outcomes = {e.turn_id: e for e in seen if isinstance(e, OUTCOMES)}
    assert set(outcomes) == {first.id, *(t.id for t in queued)}, seen
    for turn in queued:
        told = outcomes[turn.id]
        assert isinstance(told, sa.TurnFailed), told
        assert (told.error_kind, told.error_public, told.lost) == (
            "SessionStoppedError",
            True,
            False,
        )
        if how == "close":
            assert "never began" in told.error, told.error
            assert "send the message again" in told.error, told.error
        else:
            assert "session 's' was stopped" in told.error, told.error
    seqs = [e.seq for e in seen if isinstance(e, sa.Event)]
    assert seqs == sorted(set(seqs)), seqs
    if how == "stop":  # (published before the queued turns' outcomes: none is dropped)
        stops = [
            e for e in seen if isinstance(e, sa.StatusChanged) and e.status is sa.Status.STOPPED
        ]
        assert len(stops) == 1, seen
        assert stops[0].seq < min(outcomes[t.id].seq for t in queued), seen
    assert not any("queued" in m.content for m in history), history
