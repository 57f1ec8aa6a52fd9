"""Subscribing to a stored session: one whose process died mid-turn wakes, so that its
turn ends and the subscriber sees how; one that waits on nothing, or on a person, stays
asleep."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel, crash

OUTCOMES = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)
CALL = sa.ToolCall(id="c1", name="refund", arguments=json.dumps({"order_id": "A1"}))

StoreFactory = Callable[[], sa.MemoryStore | sa.SQLiteStore]


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """One store seen by every process of a test: a MemoryStore, or a real SQLite file."""
    if request.param == "memory":
        store = sa.MemoryStore()
        return lambda: store
    return lambda: sa.SQLiteStore(tmp_path / "sessions.db")


def refund_agent(
    runs: list[str],
    release: trio.Event | None,
    *,
    review: bool,
    entered: trio.Event | None = None,
    resumed: bool = False,
) -> sa.Agent:
    """An agent whose model calls a non-idempotent refund, which sets ``entered`` and
    blocks until ``release`` is set (forever if None), then answers "done"; ``resumed``:
    the agent of the next process, whose model only answers (it is asked again after
    the interrupted call)."""

    async def refund(order_id: str) -> str:
        runs.append(order_id)
        if entered is not None:
            entered.set()
        if release is None:
            await trio.sleep_forever()
        else:
            await release.wait()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=review, idempotent=False)
    model = ScriptedModel(["done"] if resumed else [Scripted(tool_calls=[CALL]), "done"])
    return sa.Agent(model=model, tools=[tool])


async def die_in_refund(make_store: StoreFactory, runs: list[str]) -> int:
    """A process that runs session 's' into the refund and dies there; the seq of the
    last event a subscriber saw before it died."""
    entered = trio.Event()
    seen: list[sa.Event] = []

    async def watch(ref: sa.SessionRef) -> None:
        async with ref.subscribe() as events:
            async for event in events:
                seen.append(event)

    with trio.fail_after(10), trio.CancelScope() as process:
        agents = {"a": refund_agent(runs, None, review=False, entered=entered)}
        async with (
            sa.open_registry(store=make_store(), agents=agents) as registry,
            trio.open_nursery() as nursery,
        ):
            ref = await registry.spawn("s")
            nursery.start_soon(watch, ref)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ref.send, "refund A1")
            await entered.wait()
            await trio.testing.wait_all_tasks_blocked()  # the subscriber has what came
            crash(registry)
            process.cancel()
    assert runs == ["A1"]
    return seen[-1].seq


async def test_a_subscription_wakes_a_session_its_process_left_mid_turn(
    make_store: StoreFactory,
) -> None:
    """A subscriber resuming a session whose process died inside a non-idempotent tool
    (listed as running until then) wakes it: the turn ends (the model is told the call was
    interrupted), the tool does not run again, and the subscription gets the turn's result
    and outcome."""
    runs: list[str] = []
    last = await die_in_refund(make_store, runs)
    agents = {"a": refund_agent(runs, trio.Event(), review=False, resumed=True)}
    async with sa.open_registry(store=make_store(), agents=agents) as registry:
        ref = registry.ref("s")
        # told without waking it: a turn is open (running), and no review waits
        listed = [(i.session_id, i.status, i.pending_reviews) for i in await registry.sessions()]
        assert listed == [("s", sa.Status.RUNNING, 0)]
        assert (await sa.read_session(registry.store, "s")).status is sa.Status.RUNNING
        assert registry.live() == []
        got: list[sa.Event] = []
        async with ref.subscribe(after=last) as events:
            with trio.fail_after(10):
                async for event in events:
                    got.append(event)
                    if isinstance(event, OUTCOMES):
                        break
        assert isinstance(got[-1], sa.TurnFinished)
        assert got[-1].message.content == "done"
        results = [e for e in got if isinstance(e, sa.ToolResult)]
        assert [r.message.tool_call_id for r in results if r.message is not None] == ["c1"]
        assert "interrupted" in results[0].message.content  # type: ignore[union-attr]
        assert runs == ["A1"]  # not run again
        state = await ref.state()
        assert state.open_turn is None
        assert state.status is sa.Status.IDLE


async def test_a_live_subscription_wakes_a_session_its_process_left_mid_turn(
    make_store: StoreFactory,
) -> None:
    """A subscription from now on (no after=) to a session left mid-turn wakes it too,
    and gets the turn's outcome."""
    runs: list[str] = []
    await die_in_refund(make_store, runs)
    agents = {"a": refund_agent(runs, trio.Event(), review=False, resumed=True)}
    async with sa.open_registry(store=make_store(), agents=agents) as registry:
        async with registry.ref("s").subscribe() as events:
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, OUTCOMES):
                        break
        assert isinstance(event, sa.TurnFinished)
        assert runs == ["A1"]


async def test_a_subscription_does_not_wake_an_idle_or_waiting_session(
    make_store: StoreFactory,
) -> None:
    """Subscribing to a stored session that waits on nothing, or on a review (its turn
    has nothing to do until a person answers), leaves it asleep."""
    runs: list[str] = []
    agents = {
        "idle": sa.Agent(model=ScriptedModel(["hello"])),
        "review": refund_agent(runs, trio.Event(), review=True),
    }
    async with sa.open_registry(store=make_store(), agents=agents) as registry:
        await (await registry.spawn("idle", agent="idle")).send("hi")
        reply = await (await registry.spawn("waiting", agent="review")).send("refund A1")
        assert reply.reviews
    async with sa.open_registry(store=make_store(), agents=agents) as registry:
        for name in ("idle", "waiting"):
            async with registry.ref(name).subscribe(after=0):
                with trio.fail_after(10):
                    await trio.testing.wait_all_tasks_blocked()
                assert registry.live() == []
    assert runs == []


async def test_a_subscription_from_a_registry_without_its_agent_does_not_wake_it(
    make_store: StoreFactory,
) -> None:
    """An observer (a dashboard, another app on the same store) opened without the
    session's agent cannot resume its turn: its subscription must not wake the session
    and hold it there, where the turn never ends and the server that has the agent
    finds the session taken. The server's own subscription then wakes and finishes it."""
    runs: list[str] = []
    last = await die_in_refund(make_store, runs)
    with trio.fail_after(10):
        async with (
            sa.open_registry(store=make_store(), agents={}) as observer,
            observer.ref("s").subscribe(after=last),
        ):
            await trio.testing.wait_all_tasks_blocked()
            assert observer.live() == []
        state = await sa.read_session(make_store(), "s")
        assert state.open_turn is not None
        agents = {"a": refund_agent(runs, trio.Event(), review=False, resumed=True)}
        async with (
            sa.open_registry(store=make_store(), agents=agents) as registry,
            registry.ref("s").subscribe(after=last) as events,
        ):
            async for event in events:
                if isinstance(event, OUTCOMES):
                    break
    assert isinstance(event, sa.TurnFinished)
    assert runs == ["A1"]
