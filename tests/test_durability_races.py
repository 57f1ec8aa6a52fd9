"""Races and faults around durability: what a caller was told stays true.

Each test drives one interleaving deterministically (a store whose writes can
be held or made to fail). A "process death" is a cancel scope around a
registry: nothing after it runs, and the store keeps what it had.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import sessionactors as sa
from faults import GatedStore
from sessionactors.stores import MemoryStore
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

ECHO = {"a": sa.Agent(model=EchoModel())}


async def watch(ref: sa.SessionRef, seen: list[sa.Event], after: int | None = None) -> None:
    async with ref.subscribe(after=after) as events:
        async for event in events:
            seen.append(event)


async def crash_in_a_held_turn(store: MemoryStore, seen: list[sa.Event], **options: object) -> None:
    """Wake ``s`` in a new "process", start a turn that streams and holds, then die."""
    held = ScriptedModel([Scripted(text="two two two", wait=trio.Event(), wait_after=1)])
    with trio.CancelScope() as process:
        async with (
            sa.open_registry(store=store, agents={"a": sa.Agent(model=held)}, **options) as reg,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watch, reg.ref("s"), seen)
            await trio.testing.wait_all_tasks_blocked()
            await reg.ref("s").submit("two")
            await trio.testing.wait_all_tasks_blocked()  # streaming, not committed
            process.cancel()
    assert any(isinstance(e, sa.Delta) for e in seen)


async def next_turn_after(store: MemoryStore, last: int, **options: object) -> list[sa.Event]:
    """In a new "process": resume a subscription after ``last``, run one turn."""
    got: list[sa.Event] = []
    async with (
        sa.open_registry(store=store, agents=ECHO, **options) as reg,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(watch, reg.ref("s"), got, last)
        await trio.testing.wait_all_tasks_blocked()
        await reg.ref("s").send("three")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return got


def assert_a_whole_new_turn(events: list[sa.Event], last: int) -> None:
    kinds = [type(e) for e in events]
    assert sa.TurnStarted in kinds, kinds
    assert sa.TurnFinished in kinds, kinds
    assert all(e.seq > last for e in events)


async def test_a_request_during_hibernation_keeps_the_session_live_and_its_lease() -> None:
    """A message that arrives while the hibernation snapshot is written keeps the
    session live here, lease included: another worker cannot take it meanwhile."""
    store = GatedStore()
    async with (
        sa.open_registry(store=store, agents=ECHO, leases=True, worker_id="A") as a,
        sa.open_registry(store=store, agents=ECHO, leases=True, worker_id="B") as b,
    ):
        ref = await a.spawn("s")
        await ref.send("one")
        async with trio.open_nursery() as nursery:
            gate = store.gates["write_snapshot"] = trio.Event()
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()
            turn = await ref.submit("two")  # while the snapshot is being written
            del store.gates["write_snapshot"]
            gate.set()
        assert a.live() == ["s"]
        with pytest.raises(sa.SessionBusyError):
            await b.ref("s").send("from b")
        assert b.live() == []
        assert (await turn.reply()).text == "two"
    async with sa.open_registry(store=store, agents=ECHO) as c:
        assert [m.content for m in await c.ref("s").history()] == ["one", "one", "two", "two"]


async def test_a_death_after_a_hibernation_that_stayed_live_reuses_no_seq() -> None:
    """The stored snapshot said hibernated while the session went on: the next wake
    must still jump past every seq that was published."""
    store = GatedStore()
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
            gate = store.gates["write_snapshot"] = trio.Event()
            nursery.start_soon(ref.hibernate)
            await trio.testing.wait_all_tasks_blocked()
            await ref.submit("two")  # keeps the session live
            del store.gates["write_snapshot"]
            gate.set()
            await trio.testing.wait_all_tasks_blocked()  # turn two streams, not committed
            process.cancel()
    assert any(isinstance(e, sa.Delta) for e in seen)
    last = seen[-1].seq
    assert_a_whole_new_turn(await next_turn_after(store, last), last)


async def test_a_death_in_the_first_turn_after_a_clean_wake_reuses_no_seq() -> None:
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        await (await reg.spawn("s")).send("one")
    seen: list[sa.Event] = []
    await crash_in_a_held_turn(store, seen)
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
    store = GatedStore()
    async with sa.open_registry(store=store, agents=ECHO, durability=durability) as reg:
        await (await reg.spawn("s")).send("secret")
        gate = store.gates["delete"] = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.delete, "s")
            await trio.testing.wait_all_tasks_blocked()  # the actor is gone, the store not yet
            with pytest.raises(sa.SessionNotFoundError, match="being deleted"):
                await reg.ref("s").history()
            with pytest.raises(sa.SessionNotFoundError, match="being deleted"):
                await reg.ref("s").send("hello")
            del store.gates["delete"]
            gate.set()
        assert reg.live() == []
        assert not await store.exists("s")
        with pytest.raises(sa.SessionNotFoundError):
            await reg.ref("s").send("after")
        assert await (await reg.spawn("s")).history() == []


async def test_without_a_journal_a_restart_keeps_every_answered_edit() -> None:
    """durability="hibernate": a crash drops only the request it interrupted."""
    store = GatedStore()
    async with sa.open_registry(store=store, agents=ECHO, durability="hibernate") as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        assert await ref.truncate(0) == 2
        await ref.set_summary("what the user said")
        store.failures["write_snapshot"] = 1
        with pytest.raises(sa.StoreError):
            await ref.hibernate()  # the actor crashes and restarts
        state = await ref.state()
        assert state.messages == ()
        assert state.summary == "what the user said"
        assert reg.statistics().restarts == 1


async def test_a_registry_giving_up_on_a_stalled_store_answers_every_waiter(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = GatedStore()
    outcomes: dict[str, object] = {}

    async def wait(name: str, turn: sa.Turn) -> None:
        try:
            with trio.fail_after(3600):  # instant on the autojump clock
                outcomes[name] = await turn.reply()
        except (sa.SessionActorsError, trio.TooSlowError) as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as callers:
        async with sa.open_registry(store=store, agents=ECHO, shutdown_grace=1) as reg:
            ref = await reg.spawn("s")
            await ref.send("warm up")
            store.gates["append"] = trio.Event()  # never set: the store stalls
            callers.start_soon(wait, "in flight", await ref.submit("in flight"))
            callers.start_soon(wait, "queued", await ref.submit("queued"))
            await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() < 60  # grace + write_bound, not forever
    assert isinstance(outcomes["in flight"], sa.SessionStoppedError)
    assert "may be lost" in str(outcomes["in flight"])
    assert isinstance(outcomes["queued"], sa.SessionStoppedError)


async def test_a_stop_the_store_refuses_raises_and_the_session_goes_on() -> None:
    store = GatedStore()
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        store.failures["append"] = 1
        with pytest.raises(sa.StoreError):
            await ref.stop()
        assert (await ref.send("two")).text == "two"  # it was not stopped
        await ref.stop()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("three")
    async with sa.open_registry(store=store, agents=ECHO) as reg:
        assert (await reg.ref("s").state()).status is sa.Status.STOPPED


class ShieldedModel:
    """Answers once ``release`` is set, waiting shielded: a cancel cannot cut it."""

    def __init__(self, release: trio.Event) -> None:
        self.release = release

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        with trio.CancelScope(shield=True):
            await self.release.wait()
        yield sa.TextChunk("done")


async def test_a_turn_whose_write_times_out_at_shutdown_gets_no_reply(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Past the grace, a turn that still finishes is answered only if it was stored."""
    store = GatedStore()
    release = trio.Event()
    outcome: list[object] = []

    async def wait(turn: sa.Turn) -> None:
        try:
            with trio.fail_after(3600):  # instant on the autojump clock
                outcome.append(await turn.reply())
        except (sa.SessionActorsError, trio.TooSlowError) as exc:
            outcome.append(exc)

    async def finish_late() -> None:
        await trio.sleep(5)  # past the grace: the registry is cutting the turn
        store.gates["append"] = trio.Event()  # from now on the store stalls
        release.set()

    agents = {"a": sa.Agent(model=ShieldedModel(release))}
    async with (
        trio.open_nursery() as outer,
        sa.open_registry(store=store, agents=agents, shutdown_grace=1) as reg,
    ):
        ref = await reg.spawn("s")
        outer.start_soon(wait, await ref.submit("x"))
        outer.start_soon(finish_late)
    [result] = outcome
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

    store = GatedStore()
    model = ScriptedModel(
        ["one", Scripted(tool_calls=[sa.ToolCall(id="c1", name="refund")]), "done"]
    )
    async with sa.open_registry(
        store=store, agents={"a": sa.Agent(model=model, tools=[refund])}
    ) as reg:
        ref = await reg.spawn("s")
        await ref.send("one")
        store.failures["append"] = 1  # the start of the refund
        with pytest.raises(sa.SessionCrashedError) as caught:
            await ref.send("refund it")
        assert isinstance(caught.value.__cause__, sa.StoreError)
        assert runs == []
        assert [m.content for m in await ref.history()] == ["one", "one"]
        assert reg.statistics().turns_failed == 0
