"""Races and faults around durability: what a caller was told stays true.

Each test drives one interleaving deterministically (the test kit's FaultyStore
holds or fails writes on demand). A "process death" is a cancel scope around a
registry: nothing after it runs, and the store keeps what it had. The checks
that any store must pass (and that catch the test kit's FlawedStore) are in
durability_checks.py, run by test_durability_controls.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

import sessionactors as sa
from durability_checks import (
    ECHO,
    assert_a_whole_new_turn,
    crash_in_a_held_turn,
    next_turn_after,
    watch,
)
from sessionactors.stores import MemoryStore
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel, crash


async def settle(
    outcomes: dict[str, object], name: str, request: Callable[[], Awaitable[object]]
) -> None:
    """Record what ``request`` ends with: its result, or the error it raises."""
    try:
        with trio.fail_after(3600):  # instant on the autojump clock; a hang fails
            outcomes[name] = await request()
    except (sa.SessionActorsError, trio.TooSlowError) as exc:
        outcomes[name] = exc


async def test_a_request_during_hibernation_keeps_the_session_live_and_its_lease() -> None:
    """A message that arrives while the hibernation snapshot is written keeps the
    session live here, lease included: another worker cannot take it meanwhile."""
    store = FaultyStore()
    async with (
        sa.open_registry(store=store, agents=ECHO, leases=True, worker_id="A") as a,
        sa.open_registry(store=store, agents=ECHO, leases=True, worker_id="B") as b,
    ):
        ref = await a.spawn("s")
        await ref.send("one")
        async with trio.open_nursery() as nursery:
            gate = store.hold("write_snapshot")
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()
            turn = await ref.submit("two")  # while the snapshot is being written
            gate.open()
        assert a.live() == ["s"]
        with pytest.raises(sa.SessionBusyError):
            await b.ref("s").send("from b")
        assert b.live() == []
        assert (await turn.reply()).text == "two"
    async with sa.open_registry(store=store, agents=ECHO) as c:
        assert [m.content for m in await c.ref("s").history()] == ["one", "one", "two", "two"]


async def test_a_request_while_the_lease_is_given_back_wakes_the_session_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The actor leaves before it gives its lease back: a request meanwhile is not
    stranded in a mailbox that is about to close."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, leases=True, worker_id="A") as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        async with trio.open_nursery() as nursery:
            gate = store.hold("release")
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()  # snapshot written, releasing
            assert gate.waiting == 1
            with trio.fail_after(60):
                assert (await ref.send("two")).text == "two"
            gate.open()
        assert reg.live() == ["s"]
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert [m.content for m in await reg.ref("s").history()] == ["one", "one", "two", "two"]


async def test_a_death_after_a_hibernation_that_stayed_live_reuses_no_seq() -> None:
    """The stored snapshot said hibernated while the session went on: the next wake
    must still jump past every seq that was published."""
    store = FaultyStore()
    seen: list[sa.Event] = []
    held = ScriptedModel(["one", Scripted(text="two two two", wait=trio.Event(), wait_after=1)])
    with trio.CancelScope() as process:
        async with (
            sa.open_registry(store=store, agents={"a": sa.Agent(model=held)}) as reg,
            trio.open_nursery() as nursery,
        ):
            ref = await reg.spawn("s")
            await ref.send("one")
            nursery.start_soon(watch, ref, seen)
            gate = store.hold("write_snapshot")
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()
            await ref.submit("two")  # keeps the session live
            gate.open()
            await trio.testing.wait_all_tasks_blocked()  # turn two streams, not committed
            crash(reg)
            process.cancel()
    assert any(isinstance(e, sa.Delta) for e in seen)
    last = seen[-1].seq
    assert_a_whole_new_turn(await next_turn_after(store, last), last)


async def test_without_a_journal_seqs_keep_rising_across_repeated_deaths() -> None:
    """With durability="hibernate" the turns are lost with the process (documented),
    but no seq that was published is ever used again."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO, durability="hibernate") as reg:
        await (await reg.spawn("s")).send("one")
    first: list[sa.Event] = []
    await crash_in_a_held_turn(store, first, durability="hibernate")
    second: list[sa.Event] = []
    await crash_in_a_held_turn(store, second, durability="hibernate")
    assert min(e.seq for e in second) > max(e.seq for e in first)
    last = second[-1].seq
    assert_a_whole_new_turn(await next_turn_after(store, last, durability="hibernate"), last)


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_a_request_during_delete_does_not_bring_the_session_back(durability: str) -> None:
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, durability=durability) as reg:
        await (await reg.spawn("s")).send("secret")
        gate = store.hold("delete")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.delete, "s")
            await trio.testing.wait_all_tasks_blocked()  # the actor is gone, the store not yet
            with pytest.raises(sa.SessionNotFoundError, match="being deleted"):
                await reg.ref("s").history()
            with pytest.raises(sa.SessionNotFoundError, match="being deleted"):
                await reg.ref("s").send("hello")
            gate.open()
        assert reg.live() == []
        assert not await store.exists("s")
        with pytest.raises(sa.SessionNotFoundError):
            await reg.ref("s").send("after")
        assert await (await reg.spawn("s")).history() == []


async def test_without_a_journal_a_restart_keeps_every_answered_edit() -> None:
    """durability="hibernate": a crash drops only the request it interrupted."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, durability="hibernate") as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        assert await ref.truncate(0) == 2
        await ref.set_summary("what the user said")
        store.fail("write_snapshot")
        with pytest.raises(sa.StoreError):
            await ref.hibernate()  # the actor crashes and restarts
        state = await ref.state()
        assert state.messages == ()
        assert state.summary == "what the user said"
        assert reg.statistics().restarts == 1


async def test_a_registry_giving_up_on_a_stalled_store_answers_every_waiter(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = FaultyStore()
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as callers:
        async with sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg:
            ref = await reg.spawn("s")
            await ref.send("warm up")
            store.hold("append")  # never opened: the store stalls
            callers.start_soon(settle, outcomes, "in flight", (await ref.submit("in flight")).reply)
            callers.start_soon(settle, outcomes, "queued", (await ref.submit("queued")).reply)
            await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() < 60  # grace + write_bound, not forever
    assert isinstance(outcomes["in flight"], sa.SessionStoppedError)
    assert "may be lost" in str(outcomes["in flight"])
    assert isinstance(outcomes["queued"], sa.SessionStoppedError)


async def test_a_registry_giving_up_answers_a_stop_and_a_wake_too(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = FaultyStore()
    outcomes: dict[str, object] = {}
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        await (await reg.spawn("woken")).send("one")
    async with trio.open_nursery() as callers:
        async with sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg:
            ref = await reg.spawn("s")
            await ref.send("warm up")
            store.hold("append")  # never opened: the store stalls
            await ref.submit("in flight")
            await trio.testing.wait_all_tasks_blocked()
            callers.start_soon(settle, outcomes, "stop", ref.stop)
            store.hold("load")  # never opened: wakes stall too
            callers.start_soon(settle, outcomes, "wake", reg.ref("woken").history)
            await trio.testing.wait_all_tasks_blocked()
        assert reg.live() == []
    assert isinstance(outcomes["stop"], sa.SessionStoppedError)
    assert isinstance(outcomes["wake"], sa.SessionStoppedError)


async def read_replay(reg: sa.Registry) -> object:
    """Subscribe to the hibernated session "s" after seq 0 and read its first event."""
    async with reg.ref("s").subscribe(after=0) as events:
        return await anext(events)


#: Calls whose caller waits on the store itself (no session's task makes them): a
#: delete's write, a listing, get_or_spawn's look-up, a replay's read. (Not a spawn's
#: write: it waits on the store as long as the store takes.)
OWN_STORE_CALLS: list[tuple[str, Callable[[sa.Registry], Awaitable[object]]]] = [
    ("delete", lambda reg: reg.delete("s")),
    ("list_sessions", lambda reg: reg.sessions()),
    ("exists", lambda reg: reg.get_or_spawn("other")),
    ("read_journal", read_replay),
]


@pytest.mark.parametrize(
    ("operation", "call"), OWN_STORE_CALLS, ids=[o for o, _ in OWN_STORE_CALLS]
)
async def test_a_registry_giving_up_answers_callers_waiting_on_the_store_themselves(
    autojump_clock: trio.abc.Clock,
    operation: str,
    call: Callable[[sa.Registry], Awaitable[object]],
) -> None:
    """A caller whose own call of the store has no answer when the registry closes is
    answered SessionStoppedError naming its session, once the registry gives up on the
    store (after the grace and the store's bound), as a waiting turn is: none waits on
    for ever."""
    store = FaultyStore()
    outcomes: dict[str, object] = {}
    async with (  # (the registry closes first; the callers' nursery waits on them)
        trio.open_nursery() as callers,
        sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg,
    ):
        ref = await reg.spawn("s")
        await ref.send("warm up")
        await ref.hibernate()
        store.hold(operation)  # never opened: the store stalls
        callers.start_soon(settle, outcomes, operation, partial(call, reg))
        await trio.testing.wait_all_tasks_blocked()
        assert operation not in outcomes
    assert trio.current_time() < 60  # grace + write_bound, not forever
    error = outcomes[operation]
    assert isinstance(error, sa.SessionStoppedError), error
    assert "did not answer" in str(error)


# The write that makes a stop: the journal's, or without one the snapshot's.
STOP_WRITES = [("turn", "append"), ("hibernate", "write_snapshot")]


@pytest.mark.parametrize(("durability", "write"), STOP_WRITES)
async def test_a_stop_the_store_refuses_raises_and_the_session_goes_on(
    durability: str, write: str
) -> None:
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, durability=durability) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        store.fail(write)
        with pytest.raises(sa.StoreError):
            await ref.stop()
        assert (await ref.send("two")).text == "two"  # it was not stopped
        await ref.stop()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("three")
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert (await reg.ref("s").state()).status is sa.Status.STOPPED


async def test_a_stop_in_the_journal_holds_when_its_snapshot_fails() -> None:
    """The snapshot after a journaled stop only compacts: if it fails, the stop holds."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        store.fail("write_snapshot")
        await ref.stop()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("two")
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert (await reg.ref("s").state()).status is sa.Status.STOPPED
        with pytest.raises(sa.SessionStoppedError):
            await reg.ref("s").send("three")


@pytest.mark.parametrize(("durability", "write"), STOP_WRITES)
async def test_a_stop_the_store_does_not_answer_raises(
    autojump_clock: trio.abc.Clock, durability: str, write: str
) -> None:
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, durability=durability) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        gate = store.hold(write)  # stalled
        with pytest.raises(sa.StoreError, match="may not be stopped"):
            await ref.stop()
        gate.open()
        assert (await ref.send("two")).text == "two"


async def test_a_stop_during_a_hibernation_still_stops() -> None:
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        gate = store.hold("write_snapshot")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ref.stop)
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("two")


class ShieldedModel:
    """Answers once ``release`` is set, waiting shielded: a cancel cannot cut it."""

    def __init__(self, release: trio.Event) -> None:
        self.release = release

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        with trio.CancelScope(shield=True):
            await self.release.wait()
        yield sa.TextChunk("done")


@pytest.mark.parametrize("snapshot_lands", [True, False])
async def test_a_turn_finishing_past_the_grace_is_answered_by_what_was_stored(
    autojump_clock: trio.abc.Clock, snapshot_lands: bool
) -> None:
    """Past the grace, a turn that still finishes but whose journal write times out
    gets its reply if the closing snapshot stores it, and an error if nothing does."""
    store = FaultyStore()
    release = trio.Event()
    outcomes: dict[str, object] = {}

    async def finish_late() -> None:
        await trio.sleep(5)  # past the grace: the registry is cutting the turn
        store.hold("append")  # from now on the store stalls
        if not snapshot_lands:
            store.hold("write_snapshot")
        release.set()

    agents = {"a": sa.Agent(model=ShieldedModel(release))}
    async with (
        trio.open_nursery() as outer,
        sa.open_registry(store=store, agents=agents, shutdown_grace=1) as reg,
    ):
        ref = await reg.spawn("s")
        outer.start_soon(settle, outcomes, "x", (await ref.submit("x")).reply)
        outer.start_soon(finish_late)
    result = outcomes["x"]
    if snapshot_lands:
        assert isinstance(result, sa.Reply), result
        assert result.text == "done"
        async with sa.open_registry(store=store, agents=ECHO) as reg:
            assert [m.content for m in await reg.ref("s").history()] == ["x", "done"]
    else:
        assert isinstance(result, sa.SessionStoppedError), result
        assert "may be lost" in str(result)


async def test_a_store_failure_inside_a_turn_is_not_the_agents_failure() -> None:
    """A non-idempotent tool's start could not be journaled: the tool does not run,
    the caller hears the session crashed (not that the agent failed), and the session
    restarts from what the store has."""
    runs: list[str] = []

    @sa.tool(idempotent=False)
    async def refund() -> str:
        """Refund the order."""
        runs.append("refund")
        return "refunded"

    store = FaultyStore()
    model = ScriptedModel(
        ["one", Scripted(tool_calls=[sa.ToolCall(id="c1", name="refund")]), "done"]
    )
    async with sa.open_registry(
        store=store, agents={"a": sa.Agent(model=model, tools=[refund])}
    ) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        store.fail("append")  # the start of the refund
        with pytest.raises(sa.SessionCrashedError) as caught:
            await ref.send("refund it")
        assert isinstance(caught.value.__cause__, sa.StoreError)
        assert runs == []
        assert [m.content for m in await ref.history()] == ["one", "one"]
        assert reg.statistics().turns_failed == 0


@pytest.mark.parametrize(
    ("action", "write"),
    [("send", "append"), ("hibernate", "write_snapshot"), ("stop", "append")],
)
async def test_nothing_is_published_before_the_write_that_covers_it(
    autojump_clock: trio.abc.Clock, action: str, write: str
) -> None:
    """After a clean wake, the first event of a turn (the status journaled first), a
    hibernation and a stop are published only once stored: a process dying during
    that write has shown its subscribers nothing a later wake could number again."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        await (await reg.spawn("s")).send("one")
    seen: list[sa.Event] = []
    with trio.CancelScope() as process:
        async with (
            sa.open_registry(store=store, agents=ECHO) as reg,
            trio.open_nursery() as nursery,
        ):
            ref = reg.ref("s")
            await ref.history()  # a read wakes it and writes nothing
            nursery.start_soon(watch, ref, seen)
            await trio.testing.wait_all_tasks_blocked()
            store.hold(write)
            request = {"send": partial(ref.send, "two"), "hibernate": ref.hibernate}
            nursery.start_soon(request.get(action, ref.stop))
            await trio.testing.wait_all_tasks_blocked()  # in the write
            crash(reg)
            process.cancel()
    assert seen == []


async def test_a_store_error_from_the_model_is_the_agents_failure() -> None:
    """Only the actor's own failed write restarts it; the same error type raised by
    the model fails the turn like any other model error."""
    model = ScriptedModel(
        [Scripted(text="half", error=sa.StoreError("the model's own", session_id="s")), "ok"]
    )
    async with sa.open_registry(store=MemoryStore(), agents={"a": sa.Agent(model=model)}) as reg:
        ref = await reg.spawn("s")
        with pytest.raises(sa.TurnFailedError):
            await ref.send("one")
        assert reg.statistics().restarts == 0
        assert (await ref.send("two")).text == "ok"


@pytest.mark.parametrize("fault", ["store", "too large"])
async def test_a_failed_compaction_does_not_undo_what_the_journal_took(fault: str) -> None:
    """The snapshot that compacts the journal comes after the write that counts: if
    it fails, the turn is still done and said to be."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, snapshot_every=1) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        if fault == "store":
            store.fail("write_snapshot")
        else:  # what the codec raises for an oversized snapshot
            store.fail("write_snapshot", error=ValueError("the snapshot is too large"))
        two = "two " + "x" * 400  # its journal entry outweighs the snapshot: compaction
        assert (await ref.send(two)).text == two
        assert store.injected == 1  # the compaction was tried
        assert reg.statistics().restarts == 0
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        state = await reg.ref("s").state()
    assert [m.content for m in state.messages] == ["one", "one", two, two]


async def test_a_session_restarted_while_the_registry_closes_is_hibernated(
    autojump_clock: trio.abc.Clock,
) -> None:
    """durability="hibernate": the closing snapshot fails once; the restarted actor
    takes nothing new and hibernates what was answered, without waiting out the grace."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, durability="hibernate") as reg:
        await (await reg.spawn("s")).send("one")
        store.fail("write_snapshot")
    assert trio.current_time() < 1
    assert store.injected == 1
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert [m.content for m in await reg.ref("s").history()] == ["one", "one"]


async def test_a_stop_racing_a_crash_of_its_actor_stops_the_session_or_raises(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stop() racing a crash of the actor it found either stops the session (the crashed
    actor's successor) or raises, and never returns without stopping it; the race is decided
    by trio's scheduling, so it is run many times and both outcomes must occur."""
    store = FaultyStore()
    outcomes: Counter[str] = Counter()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        for i in range(30):
            name = f"s{i}"
            ref = await reg.spawn(name)
            await ref.send("one")
            gate = store.hold("append", session_id=name)
            results: dict[str, object] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(settle, results, "two", partial(ref.send, "two"))
                await trio.testing.wait_all_tasks_blocked()  # its first write is held
                store.fail("append", session_id=name)
                gate.open()  # the write fails: the actor crashes as the stop arrives
                await settle(results, "stop", ref.stop)
            assert isinstance(results["two"], sa.SessionCrashedError), results
            if results["stop"] is None:
                outcomes["stopped"] += 1
            else:  # the crash came first: the stop did not happen, and says so
                assert isinstance(results["stop"], sa.StoreError), results
                outcomes["refused"] += 1
                with trio.fail_after(5):
                    await ref.stop()
            with pytest.raises(sa.SessionStoppedError):
                await ref.send("three")
    assert store.injected == 30
    assert set(outcomes) == {"stopped", "refused"}, outcomes


async def test_a_stalled_compaction_does_not_make_a_stored_stop_unsure(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO, snapshot_every=1) as reg:
        ref = await reg.spawn("s")  # its journal outweighs its snapshot at the first write
        gate = store.hold("write_snapshot")  # snapshots stall
        await ref.stop()  # journaled: done, whatever the snapshot after it does
        gate.open()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("two")


async def test_a_stop_while_a_hibernation_ends_stops_the_session() -> None:
    """stop() finds the actor, and the actor leaves (hibernated) before the stop
    reaches it: the stop goes to the session's next actor instead of being lost.
    The race is decided by trio's scheduling, so it is run many times."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        for i in range(30):
            ref = await reg.spawn(f"s{i}")
            await ref.send("one")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ref.hibernate)
                await ref.stop()
            with pytest.raises(sa.SessionStoppedError):
                await ref.send("two")


async def test_a_registry_giving_up_on_parallel_tools_answers_the_caller(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelled inside the tools' nursery, the actor sees a group of cancellations."""

    async def stubborn() -> str:
        """Ignores cancellation for a while."""
        with trio.CancelScope(shield=True):
            await trio.sleep(100)
        await trio.lowlevel.checkpoint()
        return "done"

    tools = [sa.Tool(name=n, fn=stubborn) for n in ("a", "b")]
    calls = [sa.ToolCall(id=n, name=n) for n in ("a", "b")]
    model = ScriptedModel([Scripted(tool_calls=calls), "ok"])
    outcomes: dict[str, object] = {}

    async with (
        trio.open_nursery() as callers,
        sa.open_registry(agents={"a": sa.Agent(model=model, tools=tools)}, shutdown_grace=1) as reg,
    ):
        ref = await reg.spawn("s")
        callers.start_soon(settle, outcomes, "go", (await ref.submit("go")).reply)
        await trio.testing.wait_all_tasks_blocked()
    assert isinstance(outcomes["go"], sa.SessionStoppedError), outcomes["go"]


async def test_a_crash_while_being_deleted_does_not_restart_the_session() -> None:
    """A write that was already running (shielded) when the deletion began fails:
    the session is not restarted from the store that is being cleared."""

    @sa.tool(idempotent=False)
    async def refund() -> str:
        """Refund the order."""
        return "refunded"

    store = FaultyStore()
    model = ScriptedModel([Scripted(tool_calls=[sa.ToolCall(id="c1", name="refund")]), "ok"])
    outcome: list[BaseException] = []

    async def send(ref: sa.SessionRef) -> None:
        with pytest.raises(sa.SessionActorsError) as caught:
            await ref.send("refund it")
        outcome.append(caught.value)

    async with sa.open_registry(
        store=store, agents={"a": sa.Agent(model=model, tools=[refund])}
    ) as reg:
        ref = await reg.spawn("s")
        async with trio.open_nursery() as nursery:
            gate = store.hold("append")
            nursery.start_soon(send, ref)
            await trio.testing.wait_all_tasks_blocked()  # journaling the refund's start
            nursery.start_soon(reg.delete, "s")
            await trio.testing.wait_all_tasks_blocked()
            store.fail("append")
            gate.open()
        assert isinstance(outcome[0], sa.SessionNotFoundError)
        assert reg.live() == []
        assert reg.statistics().restarts == 0
        assert not await store.exists("s")


class Chatty:
    """Streams ``count`` one-character chunks at once: many events, quickly."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await trio.lowlevel.checkpoint()
        for _ in range(self.count):
            yield sa.TextChunk("x")


#: How far past the highest stored seq a wake after a death numbers its events (see
#: docs/examples/explanation_unclean_stop.py): a session must not publish more unstored.
SEQ_JUMP = 2**20


async def test_without_a_journal_a_long_live_session_keeps_the_jump_ahead(
    autojump_clock: trio.abc.Clock,
) -> None:
    """durability="hibernate" writes nothing between snapshots, so a session live for long
    publishes more events than a wake's jump covers: it journals a status whenever it is
    half-way there, and a death after that reuses no seq."""
    store = MemoryStore()
    agents = {"a": sa.Agent(model=Chatty(300_000))}
    with trio.CancelScope() as process:
        async with sa.open_registry(store=store, agents=agents, durability="hibernate") as reg:
            ref = await reg.spawn("s")
            for _ in range(4):
                await ref.send("go")
            last = (await ref.state()).event_seq
            crash(reg)
            process.cancel()
    assert last > SEQ_JUMP
    assert_a_whole_new_turn(await next_turn_after(store, last, durability="hibernate"), last)


async def test_a_stop_racing_a_delete_says_the_session_is_gone() -> None:
    async with sa.open_registry(store=MemoryStore(), agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.delete, "s")
            with pytest.raises(sa.SessionNotFoundError):
                await ref.stop()


async def test_a_stopped_session_reads_the_same_every_time() -> None:
    """Its stop is compacted into a snapshot before stop() returns, so a read replays
    no journal tail (which would stamp the stop with the time of the read)."""
    async with sa.open_registry(store=MemoryStore(), agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        await ref.stop()
        await trio.testing.wait_all_tasks_blocked()  # the snapshot after the stop
        [info] = await reg.sessions()
        first = await ref.state()
        second = await ref.state()
    assert first.updated_at == second.updated_at == info.updated_at
    assert first.status is sa.Status.STOPPED
