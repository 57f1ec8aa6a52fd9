"""Hand-overs between workers that a session's state holds up: a turn waiting on a review."""

from __future__ import annotations

import json
import uuid

import pytest
import trio

import sessionactors as sa
from redis_workers import TTL, open_worker
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

pytestmark = pytest.mark.redis


def refund_agent(refunds: list[str]) -> sa.Agent:
    """An agent that asks to refund the order its user names, which needs a review, and
    then says it is done; ``refunds`` lists the refunds that ran."""

    async def do_refund(order_id: str) -> str:
        refunds.append(order_id)
        return f"refunded {order_id}"

    refund = sa.Tool(
        name="refund",
        fn=do_refund,
        description="Refund an order in full.",
        requires_review=True,
        idempotent=False,
    )

    def answer(request: sa.ModelRequest) -> str | Scripted:
        last = request.messages[-1]
        if last.role is sa.Role.TOOL:
            return "refund done"
        order = json.dumps({"order_id": last.content.split()[-1]})
        return Scripted(tool_calls=[sa.ToolCall(id="call_1", name="refund", arguments=order)])

    return sa.Agent(model=ScriptedModel([answer], repeat=True), tools=[refund])


async def test_sessions_waiting_on_a_review_move_with_it_to_a_worker_that_joins(
    redis_url: str,
) -> None:
    """With balancing, sessions whose turns wait on a review are handed over to a worker that joins like idle ones, their pending reviews with them: each review resolves through either worker, every refund runs once, and every turn ends."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    names = [f"review-{i}" for i in range(8)]
    refunds: list[str] = []
    agents = {"refund": refund_agent(refunds)}

    with trio.fail_after(60):
        async with open_worker(redis_url, prefix, "a", agents=agents, balance=True) as a:
            reviews = {}
            for name in names:
                reply = await (await a.spawn(name)).send(f"refund {name}")
                (reviews[name],) = reply.reviews
            async with open_worker(redis_url, prefix, "b", agents=agents, balance=True) as b:
                with trio.move_on_after(10 * TTL):  # a hands b's share over
                    while len(a.live()) > 6:
                        await trio.sleep(0.05)
                for name in names:  # wakes on b the sessions a handed over
                    assert (await b.ref(name).state()).status is sa.Status.WAITING
                on_b = set(b.live())
                assert 2 <= len(on_b) <= 6
                assert on_b.isdisjoint(a.live())
                for i, name in enumerate(names):
                    reviewer = (a, b)[i % 2]
                    reply = await reviewer.ref(name).review(reviews[name].id, approve=True)
                    assert reply.text == "refund done"
                assert sorted(refunds) == sorted(names)  # each ran once
                assert set(b.live()) == on_b
                for name in names:
                    history = await b.ref(name).history()
                    assert [m.role for m in history] == [
                        sa.Role.USER,
                        sa.Role.ASSISTANT,
                        sa.Role.TOOL,
                        sa.Role.ASSISTANT,
                    ]


@pytest.mark.soak  # (slow: run by make soak)
async def test_a_worker_hands_over_its_share_of_many_shards_without_waiting_for_rounds(
    redis_url: str,
) -> None:
    """With balancing, a worker hands over every shard that prefers a worker that joins within a few balancing rounds however many there are: the next hand-over starts as soon as one is done, eight at a time, instead of eight per round."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    agents = {"echo": sa.Agent(model=EchoModel())}

    with trio.fail_after(60):
        async with open_worker(redis_url, prefix, "a", agents=agents, balance=True) as a:
            limit = trio.CapacityLimiter(16)

            async def wake(name: str) -> None:
                async with limit:
                    await (await a.spawn(name)).send("hello")

            async with trio.open_nursery() as nursery:
                for i in range(384):  # about 320 shards: half of them prefer b
                    nursery.start_soon(wake, f"many-{i}")
            async with open_worker(redis_url, prefix, "b", agents=agents, balance=True):
                await trio.sleep(3 * TTL)  # 9 rounds: 72 shards at eight per round
                handed_over = 384 - len(a.live())
                await trio.sleep(3 * TTL)
                assert 384 - len(a.live()) == handed_over  # nothing was left to hand over
                assert 100 <= handed_over <= 284
