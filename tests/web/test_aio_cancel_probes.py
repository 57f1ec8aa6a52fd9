"""sessionactors.aio under asyncio cancellation: a caller cancelled (or timed out) at any
await point, the registry closed with calls and readers still in flight, an opener that
gives up; the trio side is left clean and asyncio hears only what it should."""

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.testing import EchoModel, FaultyStore

#: Event-loop iterations after which a probe cancels its caller: 0 .. ITERATIONS - 1.
ITERATIONS = 24


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` under asyncio.run in debug mode, bounded in time, and fail if asyncio
    reported anything to its exception handler ("Task exception was never retrieved",
    "Future exception was never retrieved", an exception in a callback)."""
    reported: list[dict[str, Any]] = []

    async def bounded() -> Any:
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append(context)
        )
        async with asyncio.timeout(30):
            result = await main()
        gc.collect()  # a future dropped with its exception unread reports it now
        return result

    result = asyncio.run(bounded(), debug=True)
    gc.collect()
    assert [(c.get("message"), c.get("exception")) for c in reported] == []
    return result


class AsyncioShop:
    """An asyncio model: three chunks, or a call of the ``refund`` tool for "refund"."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        last = request.messages[-1]
        if last.role is sa.Role.USER and last.content == "refund":
            yield sa.ToolCallChunk(0, id="c1", name="refund", arguments="{}")
            return
        for word in ("one", " two", " three"):
            await asyncio.sleep(0)
            yield sa.TextChunk(word)


async def refund() -> str:
    """Refund the order."""
    await asyncio.sleep(0)
    return "refunded"


def shop() -> dict[str, sa.Agent]:
    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    return {"shop": sa.Agent(model=AsyncioShop(), tools=[tool])}


def test_an_opener_that_gives_up_at_any_point_leaves_nothing_behind() -> None:
    """Cancelling the task that opens aio.open_registry, at any await point, raises
    CancelledError in it and leaves no unread error and no trio run behind."""

    async def main() -> None:
        for n in range(ITERATIONS):

            async def opener() -> None:
                async with aio.open_registry(agents={"e": sa.Agent(model=EchoModel())}):
                    await asyncio.sleep(3600)

            task = asyncio.ensure_future(opener())
            for _ in range(n):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.wait([task])
            assert task.cancelled(), (n, task)
            gc.collect()
        async with aio.open_registry(agents={"e": sa.Agent(model=EchoModel())}) as registry:
            assert (await (await registry.spawn("after")).send("still works")).text == "still works"

    run(main)


def test_a_reader_behind_when_the_registry_closes_hears_that_it_lost_events() -> None:
    """A subscription whose reader fell behind when the registry closed gives the events it
    holds, then SubscriberLaggedError with the last seq given (not a trio error), and
    after=last_seq on the store resumes from there."""
    store = sa.MemoryStore()
    agents = {"e": sa.Agent(model=EchoModel())}
    words = " ".join(f"w{i}" for i in range(400))

    async def main() -> None:
        read = asyncio.Event()
        opened = asyncio.get_running_loop().create_future()
        got: list[sa.Event] = []

        async def reader(ref: aio.SessionRef) -> None:
            async with ref.subscribe() as events:
                opened.set_result(None)
                await read.wait()
                async for event in events:
                    got.append(event)

        async with aio.open_registry(store=store, agents=agents) as registry:
            ref = await registry.spawn("behind")
            task = asyncio.create_task(reader(ref))
            await opened
            await ref.send(words)
        read.set()
        with pytest.raises(sa.SubscriberLaggedError) as lagged:
            await task
        assert got, "the events it held are given first"
        assert lagged.value.last_seq == got[-1].seq
        assert "'behind'" in str(lagged.value)
        async with aio.open_registry(store=store, agents=agents) as registry:
            ref = registry.ref("behind")
            async with ref.subscribe(after=lagged.value.last_seq) as events:
                async for event in events:
                    assert event.seq > lagged.value.last_seq
                    if isinstance(event, sa.TurnFinished):
                        assert event.message.content == words
                        break

    run(main)


@pytest.mark.parametrize("operation", ["sessions", "spawn", "delete", "fork"])
def test_a_call_under_way_when_the_registry_closes_gets_session_stopped(operation: str) -> None:
    """A call still waiting on the store when the registry's block ends (from another task)
    ends with SessionStoppedError, a library error, not a RuntimeError, and no hang."""
    held = {"sessions": "list_sessions", "spawn": "create", "delete": "delete", "fork": "create"}

    async def main() -> None:
        store = FaultyStore()
        async with aio.open_registry(store=store, agents=shop(), shutdown_grace=0.01) as registry:
            await registry.spawn("there")
            gate = store.hold(held[operation])
            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "sessions": registry.sessions,
                "spawn": lambda: registry.spawn("new"),
                "delete": lambda: registry.delete("there"),
                "fork": lambda: registry.fork("there", "forked"),
            }
            task = asyncio.ensure_future(calls[operation]())
            while not gate.waiting:
                await asyncio.sleep(0)
        with pytest.raises(sa.SessionStoppedError, match="closed"):
            await task

    run(main)
