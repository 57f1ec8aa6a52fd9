"""Edges of the single-process core: cancellations and faults at awkward points."""

from __future__ import annotations

import json

import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.testing import Scripted, ScriptedModel


async def test_a_cancel_while_an_approved_call_runs_leaves_the_call_answered(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelling a turn while its approved tool call runs records a result for the call,
    so the history the next turn sends never holds a call without its result."""
    release = trio.Event()
    started = trio.Event()

    async def refund(order_id: str) -> str:
        started.set()
        await release.wait()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    refund_call = sa.ToolCall(id="call_1", name="refund", arguments=json.dumps({"order_id": "A1"}))
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call]), "Next."])
    agent = sa.Agent(model=model, tools=[tool])
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            (review,) = waiting.reviews
            outcome: list[BaseException] = []

            async def approve() -> None:
                try:
                    await ref.review(review.id, approve=True)
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(approve)
                await started.wait()
                assert await ref.cancel()
            assert isinstance(outcome[0], sa.TurnCancelledError)
            history = await ref.history()
            assert tool_pairs_intact(history), [(m.role, m.content) for m in history]
            reply = await ref.send("And now?")
            assert reply.text == "Next."
            assert tool_pairs_intact(model.requests[-1].messages)
        await ref.hibernate()
        assert tool_pairs_intact(await registry.ref("s").history())
