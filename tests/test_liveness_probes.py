"""Liveness probes on one process: every turn has one outcome, every caller and
stream gets an answer or a typed error in bounded time."""

from __future__ import annotations

import collections

import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel

OUTCOMES = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)


async def pay(amount: int) -> str:
    return f"paid {amount}"


async def test_a_turn_resumed_after_a_crash_publishes_one_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A turn whose start was durable when its session crashed resumes after the restart and publishes one outcome, its TurnFinished, not a lost TurnFailed first; ref.stream of it ends with that TurnFinished."""
    store = FaultyStore()
    call = sa.ToolCall(id="c1", name="pay", arguments='{"amount": 1}')
    model = ScriptedModel(["ok", Scripted(tool_calls=[call]), "done"])
    agent = sa.Agent(model=model, tools=[sa.Tool(name="pay", fn=pay, idempotent=False)])
    async with sa.open_registry(store=store, agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        await ref.send("warm up")
        seen: list[sa.Event] = []
        streamed: list[sa.Event] = []
        with trio.fail_after(60):
            async with ref.subscribe() as events:
                # the commit of the payment's start lands, its acknowledgement is lost:
                # the session crashes with the turn's start durable
                store.fail("append", session_id="s", after=True)
                async with ref.stream("pay please") as turn_events:
                    async for event in turn_events:
                        streamed.append(event)
                assert store.injected == 1
                async for event in events:
                    seen.append(event)
                    if isinstance(event, sa.TurnFinished):
                        break
        history = await ref.history()
    outcomes = collections.Counter(
        (type(e).__name__, e.turn_id) for e in seen if isinstance(e, OUTCOMES)
    )
    assert list(outcomes.values()) == [1], seen
    assert isinstance(streamed[-1], sa.TurnFinished), streamed
    assert history[-1].content == "done"
