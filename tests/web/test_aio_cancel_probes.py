"""sessionactors.aio under asyncio cancellation: a caller cancelled (or timed out) at any
await point, the registry closed with calls and readers still in flight, an opener that
gives up; the trio side is left clean and asyncio hears only what it should."""

import asyncio
import gc
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import trio

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel

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


class Probe:
    """One call of the aio API on session ``name``, cancelled at some await point: ``prepare``
    sets the session up, ``call`` is the call, ``check`` what must hold afterwards."""

    def __init__(self, registry: aio.Registry, model: "HangingShop", name: str) -> None:
        self.registry, self.model, self.name = registry, model, name
        self.ref = registry.ref(name)
        self.review_id = ""

    async def prepare(self, operation: str) -> None:
        await self.registry.spawn(self.name)
        await self.ref.send("first")
        if operation == "retry":  # a last turn that was cancelled
            self.model.hang_next = True
            turn = await self.ref.submit("hang")
            while not await self.ref.cancel():
                await asyncio.sleep(0)
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
        elif operation == "review":
            [review] = (await self.ref.send("refund")).reviews
            self.review_id = review.id

    async def call(self, operation: str) -> object:
        ref, registry = self.ref, self.registry
        if operation == "send":
            return await ref.send("hello")
        if operation == "submit":
            return await (await ref.submit("hello")).reply()
        if operation == "stream":
            async with ref.stream("hello") as events:
                return [event async for event in events]
        if operation == "subscribe":
            async with ref.subscribe(after=0) as events:
                async for event in events:
                    if isinstance(event, sa.TurnFinished):
                        return event
        if operation == "history":
            return await ref.history()
        if operation == "cancel":
            return await ref.cancel()
        if operation == "hibernate":
            return await ref.hibernate()
        if operation == "spawn":
            return await registry.spawn(self.name + "-new")
        if operation == "get_or_spawn":
            return await registry.get_or_spawn(self.name + "-new")
        if operation == "delete":
            return await registry.delete(self.name)
        if operation == "retry":
            return await ref.retry()
        assert operation == "review"
        return await ref.review(self.review_id, approve=True)

    async def check(self, operation: str) -> None:
        """Nothing is left waiting in trio, and the sessions go on, whole."""
        registry = self.registry
        for _ in range(1000):  # a subscription's trio side ends within a few iterations
            if not registry.statistics().subscribers:
                break
            await asyncio.sleep(0)
        assert registry.statistics().subscribers == 0
        names = {info.session_id for info in await registry.sessions()}
        if operation == "delete" and self.name not in names:
            with pytest.raises(sa.SessionNotFoundError):
                await self.ref.history()
            return
        if operation in ("spawn", "get_or_spawn"):
            new = registry.ref(self.name + "-new")
            if self.name + "-new" in names:
                assert await new.history() == []
            else:
                with pytest.raises(sa.SessionNotFoundError):
                    await new.history()
        if operation == "review" and await self.ref.pending_reviews():  # not delivered
            await self.ref.review(self.review_id, approve=True)
        assert (await self.ref.send("later")).text == "one two three"
        history = await self.ref.history()
        turns = [m.content for m in history if m.role is sa.Role.USER]
        answers = [m for m in history if m.role is sa.Role.ASSISTANT and not m.tool_calls]
        assert len(answers) == len(turns), [(m.role.value, m.content) for m in history]
        assert turns.count("hello") <= 1  # a turn runs once, or not at all
        assert history[-1].content == "one two three"


class HangingShop(AsyncioShop):
    """AsyncioShop whose next turn, once ``hang_next`` is set, streams a word and hangs."""

    hang_next = False

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        if self.hang_next:
            self.hang_next = False
            yield sa.TextChunk("partial")
            await asyncio.Event().wait()
        async for chunk in super().stream(request):
            yield chunk


#: What each operation returns when it completes.
RESULTS: dict[str, type | tuple[type, ...]] = {
    "send": sa.Reply,
    "submit": sa.Reply,
    "stream": list,
    "subscribe": sa.TurnFinished,
    "history": list,
    "cancel": bool,
    "hibernate": type(None),
    "spawn": aio.SessionRef,
    "get_or_spawn": aio.SessionRef,
    "delete": type(None),
    "retry": sa.Reply,
    "review": sa.Reply,
}
OPERATIONS = list(RESULTS)


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_call_cancelled_at_any_await_point_leaves_trio_clean(operation: str, how: str) -> None:
    """A call cancelled after any number of loop iterations (task.cancel, or asyncio.timeout
    expiring) raises CancelledError (TimeoutError from asyncio.timeout) or completes; no
    subscription is left behind, the session works on with no turn lost or doubled, and the
    state after closing and reopening is the state before."""

    async def attempt(probe: Probe, n: int) -> tuple[object, BaseException | None]:
        loop = asyncio.get_running_loop()
        timeouts: list[asyncio.Timeout] = []

        async def caller() -> object:
            if how == "cancel":
                return await probe.call(operation)
            async with asyncio.timeout(None) as timeout:
                timeouts.append(timeout)
                return await probe.call(operation)

        task = asyncio.ensure_future(caller())
        for _ in range(n):
            await asyncio.sleep(0)
        if how == "cancel":
            task.cancel()
        elif timeouts and not task.done():
            timeouts[0].reschedule(loop.time())  # expires at the next iteration
        await asyncio.wait([task])
        if task.cancelled():
            assert how == "cancel", "asyncio.timeout let its CancelledError out"
            return None, asyncio.CancelledError()
        error = task.exception()
        return (None if error else task.result()), error

    async def main() -> None:
        store = sa.MemoryStore()
        model = HangingShop()
        tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
        agents = {"shop": sa.Agent(model=model, tools=[tool])}
        async with aio.open_registry(store=store, agents=agents) as registry:
            for n in range(ITERATIONS):
                probe = Probe(registry, model, f"s{n}")
                await probe.prepare(operation)
                result, error = await attempt(probe, n)
                expected = asyncio.CancelledError if how == "cancel" else TimeoutError
                if error is not None:
                    assert isinstance(error, expected), (n, error)
                else:
                    assert isinstance(result, RESULTS[operation]), (n, result)
                await probe.check(operation)
            before = {
                info.session_id: (await registry.ref(info.session_id).state()).messages
                for info in await registry.sessions()
            }
        async with aio.open_registry(store=store, agents=agents) as registry:
            after = {
                info.session_id: (await registry.ref(info.session_id).state()).messages
                for info in await registry.sessions()
            }
        assert after == before

    run(main)


def test_an_asyncio_subscription_or_stream_entered_twice_is_refused() -> None:
    """Entering one ``ref.subscribe()`` or ``ref.stream(text)`` a second time (its
    caller's bug) raises RuntimeError naming the session, as in trio, not a session's
    error that a front end would answer as "stopped, retry later", and submits no second
    turn."""

    async def main() -> None:
        async with aio.open_registry(agents={"e": sa.Agent(model=EchoModel())}) as registry:
            ref = await registry.spawn("twice")
            for manager, form in ((ref.subscribe(), "subscribe"), (ref.stream("hi"), "stream")):
                async with manager as events:
                    if form == "stream":
                        assert [type(e) async for e in events][-1] is sa.TurnFinished
                with pytest.raises(RuntimeError, match=rf"'twice'.*ref\.{form}") as info:
                    async with manager:
                        pass
                assert not isinstance(info.value, sa.SessionActorsError)
            await ref.send("after")
            assert [m.content for m in await ref.history()] == ["hi", "hi", "after", "after"]
            assert registry.statistics().subscribers == 0

    run(main)


async def test_a_trio_stream_entered_twice_is_refused() -> None:
    """Entering one trio ``ref.stream(text)`` a second time raises RuntimeError naming
    the session, as a subscription entered twice does (not an AttributeError), and not
    a session's error; the session goes on."""
    async with sa.open_registry(agents={"e": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("twice")
        stream = ref.stream("hi")
        async with stream as events:
            assert [type(e) async for e in events][-1] is sa.TurnFinished
        with pytest.raises(RuntimeError, match=r"'twice'.*ref\.stream") as info:
            async with stream:
                pass
        assert not isinstance(info.value, sa.SessionActorsError)
        assert len(await ref.history()) == 2
        assert (await ref.send("on")).text == "on"


async def test_a_trio_subscription_entered_by_two_tasks_at_once_opens_one() -> None:
    """One trio ``ref.subscribe(after=...)`` entered by two tasks at the same moment opens
    one subscription: the second entry raises RuntimeError, and no subscription
    is left open once the first leaves."""
    async with sa.open_registry(agents={"e": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("twice")
        await ref.send("hi")
        await ref.hibernate()  # (its replay reads the store: the first entry waits there)
        manager = registry.ref("twice").subscribe(after=0)
        outcomes: list[str] = []

        async def enter() -> None:
            try:
                async with manager:
                    outcomes.append("entered")
            except RuntimeError as exc:
                outcomes.append("refused" if "'twice'" in str(exc) else repr(exc))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(enter)
                nursery.start_soon(enter)
        assert sorted(outcomes) == ["entered", "refused"]
        assert registry.statistics().subscribers == 0


#: A registry opened on the loop while the loop's last registry closes, n iterations after
#: that one began to close, for n in 0..ITERATIONS - 1; then one that gives up doing so.
REOPEN_SCRIPT = """
import asyncio, sys
import sessionactors as sa, sessionactors.aio as aio
from sessionactors.testing import EchoModel

AGENTS = {"e": sa.Agent(model=EchoModel())}

async def attempt(n, give_up):
    closing = asyncio.Event()

    async def first():
        async with aio.open_registry(agents=AGENTS) as registry:
            await (await registry.spawn("a")).send("x")
            closing.set()

    async def second():
        await closing.wait()
        for _ in range(n):
            await asyncio.sleep(0)
        async with aio.open_registry(agents=AGENTS) as registry:
            if give_up:
                await asyncio.sleep(3600)
            return (await (await registry.spawn("b")).send("y")).text

    one, two = asyncio.ensure_future(first()), asyncio.ensure_future(second())
    if give_up:
        await closing.wait()
        for _ in range(n):
            await asyncio.sleep(0)
        two.cancel()
    await asyncio.wait([one, two])
    assert one.result() is None
    assert two.cancelled() if give_up else two.result() == "y"

async def main():
    for give_up in (False, True):
        for n in range(int(sys.argv[1])):
            await attempt(n, give_up)
    print("ok")

asyncio.run(main())
"""


def test_a_registry_opened_while_the_last_one_closes_waits_for_it() -> None:
    """A registry opened on the loop just as the loop's last registry finishes closing
    waits for that trio run to end and starts its own; the loop never spins in place."""
    done = subprocess.run(
        [sys.executable, "-c", REOPEN_SCRIPT, str(ITERATIONS * 2)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


@pytest.mark.parametrize("form", ["subscribe", "stream"])
def test_a_subscription_opening_when_the_registry_closes_gets_session_stopped(form: str) -> None:
    """A subscription or stream still opening (its session waking from a store that holds
    the load) when the registry's block ends raises SessionStoppedError, not RuntimeError."""

    async def main() -> None:
        store = FaultyStore()
        async with aio.open_registry(store=store, agents=shop(), shutdown_grace=0.01) as registry:
            await (await registry.spawn("waking")).hibernate()
            gate = store.hold("load")
            ref = registry.ref("waking")

            async def read() -> list[sa.Event]:
                manager = ref.subscribe() if form == "subscribe" else ref.stream("hi")
                async with manager as events:
                    return [event async for event in events]

            task = asyncio.ensure_future(read())
            while not gate.waiting:
                await asyncio.sleep(0)
        with pytest.raises(sa.SessionStoppedError, match="closed"):
            await task

    run(main)


def test_a_delete_after_the_block_is_refused_and_deletes_nothing() -> None:
    """registry.delete after the registry's block (from a task that kept the registry)
    raises SessionStoppedError, like every other request, and the session stays stored."""
    store = sa.MemoryStore()
    agents = {"e": sa.Agent(model=EchoModel())}

    async def main() -> None:
        async with aio.open_registry(agents=agents) as keeping:  # the loop's trio run goes on
            async with aio.open_registry(store=store, agents=agents) as registry:
                await (await registry.spawn("kept")).send("hello")
            with pytest.raises(sa.SessionStoppedError, match="'kept'"):
                await registry.delete("kept")
            assert keeping.live() == []  # (the other registry is untouched)
        async with aio.open_registry(store=store, agents=agents) as registry:
            assert [m.content for m in await registry.ref("kept").history()] == ["hello"] * 2

    run(main)


async def test_a_trio_delete_after_the_block_is_refused_and_deletes_nothing() -> None:
    """The trio registry's delete after its block raises SessionStoppedError and leaves the
    session in the store."""
    store = sa.MemoryStore()
    agents = {"e": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=store, agents=agents) as registry:
        await (await registry.spawn("kept")).send("hello")
    with pytest.raises(sa.SessionStoppedError, match="'kept'"):
        await registry.delete("kept")
    async with sa.open_registry(store=store, agents=agents) as registry:
        assert len(await registry.ref("kept").history()) == 2


class CallsTool:
    """An asyncio model that calls tool ``name`` first, then answers "ok"."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        if request.messages[-1].role is sa.Role.USER:
            yield sa.ToolCallChunk(0, id="c1", name=self.name, arguments="{}")
        else:
            yield sa.TextChunk("ok")


@pytest.mark.parametrize("kind", ["model", "tool", "tool-finishes"])
def test_an_asyncio_model_or_tool_ending_its_own_way_when_cancelled_is_heard(kind: str) -> None:
    """When ``ref.cancel()`` cancels an asyncio model or tool that then raises, or that
    finishes after all, the turn records what it did as under trio (the model's error
    fails the turn; the tool's error or result is its call's result), and asyncio reports
    no exception left unread."""

    async def main() -> None:
        started = asyncio.Event()

        class CleanupFails:
            """An asyncio model whose stream, when cancelled, fails while closing."""

            async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
                yield sa.TextChunk("partial")
                started.set()
                try:
                    await asyncio.Event().wait()
                finally:
                    raise ConnectionError("closing the HTTP stream failed")

        async def cleanup_fails() -> str:
            """A tool whose cleanup fails when it is cancelled."""
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                raise ConnectionError("tool cleanup failed")

        async def finishes_anyway() -> str:
            """A tool that, once cancelled, still finishes its write and says so."""
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await asyncio.sleep(0)  # the write it had begun
                return "refunded anyway"
            return "unreachable"

        agents = {
            "model": sa.Agent(model=CleanupFails()),
            "tool": sa.Agent(model=CallsTool("cleanup_fails"), tools=[sa.tool(cleanup_fails)]),
            "tool-finishes": sa.Agent(
                model=CallsTool("finishes_anyway"), tools=[sa.tool(finishes_anyway)]
            ),
        }
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("c", agent=kind)
            turn = await ref.submit("go")
            await started.wait()
            assert await ref.cancel()
            if kind == "model":
                with pytest.raises(sa.TurnFailedError) as failed:
                    await turn.reply()
                assert isinstance(failed.value.__cause__, ConnectionError)
            else:
                with pytest.raises(sa.TurnCancelledError):
                    await turn.reply()
                history = await ref.history()
                [result] = [m.content for m in history if m.role is sa.Role.TOOL]
                expected = "ConnectionError: tool cleanup failed"
                assert result == (expected if kind == "tool" else "refunded anyway")
            gc.collect()

    run(main)


@pytest.mark.parametrize("operation", ["spawn", "delete", "fork", "subscribe"])
def test_a_call_cut_off_when_the_trio_run_ends_names_its_session(operation: str) -> None:
    """A call on one session that the end of the loop's trio run cuts off raises
    SessionStoppedError naming that session (message and ``session_id``) and saying
    what to do."""
    held = {
        "spawn": "create",
        "delete": "delete",
        "fork": "create",
        "subscribe": "load",
    }
    named = {
        "spawn": "new",
        "delete": "there",
        "fork": "forked",
        "subscribe": "asleep",
    }

    async def main() -> None:
        store = FaultyStore()
        async with aio.open_registry(store=store, agents=shop(), shutdown_grace=0.01) as registry:
            await registry.spawn("there")
            await (await registry.spawn("asleep")).hibernate()
            gate = store.hold(held[operation])

            async def subscribe() -> object:
                async with registry.ref("asleep").subscribe() as events:
                    return [event async for event in events]

            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "spawn": lambda: registry.spawn("new"),
                "delete": lambda: registry.delete("there"),
                "fork": lambda: registry.fork("there", "forked"),
                "subscribe": subscribe,
            }
            task = asyncio.ensure_future(calls[operation]())
            while not gate.waiting:
                await asyncio.sleep(0)
        with pytest.raises(sa.SessionStoppedError) as stopped:
            await task
        name = named[operation]
        assert stopped.value.session_id == name
        text = str(stopped.value)
        assert f"session {name!r}" in text
        # (a call waiting on the store itself is cut as the close gives up on the
        # store, before the trio run ends, with the trio registry's advice)
        assert "open_registry" in text or "send it again once a registry is open" in text

    run(main)


class HungModel:
    """An asyncio model that streams a word, then never answers."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("thinking")
        await asyncio.Event().wait()


def test_a_registry_cancelled_in_its_shutdown_grace_ends_at_once_and_keeps_the_turn() -> None:
    """The task holding the block is cancelled while the block closes, in the grace of a
    turn that never ends: the closing goes on at once (the turn is cut, kept interrupted,
    the session hibernated), instead of waiting out the grace or hanging."""
    store = sa.MemoryStore()
    agents = {"a": sa.Agent(model=HungModel())}

    async def main() -> list[tuple[str, bool]]:
        async def body() -> None:
            async with aio.open_registry(store=store, agents=agents, shutdown_grace=600) as reg:
                await (await reg.spawn("s")).submit("hi")
                await asyncio.sleep(0.5)  # streaming "thinking"; then the block closes

        task = asyncio.create_task(body())
        await asyncio.sleep(1.5)  # closing, in its grace
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=20)
        assert done, "the registry was still closing 20 s after its task was cancelled"
        with pytest.raises(asyncio.CancelledError):
            task.result()
        async with aio.open_registry(store=store, agents=agents) as reg:
            return [(m.content, m.interrupted) for m in await reg.ref("s").history()]

    assert run(main) == [("hi", False), ("thinking", True)]


def test_a_registry_cancelled_inside_its_block_shuts_down_at_once() -> None:
    """The task holding the block is cancelled while the block runs (a timeout around
    it, the task cancelled, Ctrl-C under asyncio.run), a turn that never ends under way:
    the registry shuts down at once, as if shutdown_grace were 0, as a cancellation from
    outside the block does in trio (the turn is cut, kept interrupted, the session
    hibernated), instead of waiting out the grace."""
    store = sa.MemoryStore()
    agents = {"a": sa.Agent(model=HungModel())}

    async def main() -> list[tuple[str, bool]]:
        async def body() -> None:
            async with (
                asyncio.timeout(1),
                aio.open_registry(store=store, agents=agents, shutdown_grace=600) as reg,
            ):
                await (await reg.spawn("s")).submit("hi")
                await asyncio.sleep(600)

        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await body()
        assert loop.time() - started < 20, "the registry waited out its grace"
        async with aio.open_registry(store=store, agents=agents) as reg:
            return [(m.content, m.interrupted) for m in await reg.ref("s").history()]

    assert run(main) == [("hi", False), ("thinking", True)]


class CancelledByTheLoop:
    """An asyncio model whose task is cancelled by someone else than sessionactors after
    its first chunk, as the end of asyncio.run (or a server's second Ctrl-C) cancels
    every task of the loop."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("thinking")
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)


def test_a_model_task_the_loop_cancels_fails_its_turn_as_stopped_not_as_the_model() -> None:
    """A turn whose asyncio model task the loop cancelled (not sessionactors) fails with
    SessionStoppedError, what a turn its registry's close cut off fails with (clients
    send the message again), not as a failure of the model (a RuntimeError)."""

    async def main() -> tuple[BaseException, sa.TurnOutcome]:
        async with aio.open_registry(agents={"a": sa.Agent(model=CancelledByTheLoop())}) as reg:
            ref = await reg.spawn("s")
            turn = await ref.submit("hi")
            with pytest.raises(sa.SessionActorsError) as caught:
                await turn.reply()
            return caught.value, await ref.turn_outcome(turn.id)

    error, outcome = run(main)
    assert outcome.status is sa.TurnStatus.FAILED
    assert (outcome.error or "").startswith("SessionStoppedError: "), outcome.error
    assert isinstance(error.__cause__ or error, sa.SessionStoppedError), repr(error)


def test_an_asyncio_tool_that_lets_out_its_own_inner_cancellation_fails_its_call_only() -> None:
    """An asyncio tool whose inner task someone cancelled, and which lets that
    CancelledError out (nobody cancelled the tool's own task): its call's error result
    says so, as any exception a tool raises; the turn goes on. (It was told as the
    loop cutting the turn: "SessionStoppedError ... send the message again".)"""

    @sa.tool
    async def fetch_price() -> str:
        """The price, from a request whose task a pool closing cancels."""
        inner = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_soon(inner.cancel)
        await inner
        return "never"  # pragma: no cover

    call = sa.ToolCall(id="c1", name="fetch_price", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), Scripted(text="no price")])

    async def main() -> tuple[str, list[sa.Message]]:
        async with aio.open_registry(
            agents={"a": sa.Agent(model=model, tools=[fetch_price])}
        ) as reg:
            ref = await reg.spawn("s")
            async with asyncio.timeout(10):
                reply = await ref.send("price?")
            return reply.text, await ref.history()

    text, history = run(main)
    assert text == "no price"
    [result] = [m for m in history if m.role is sa.Role.TOOL]
    assert result.is_error
    assert result.content.startswith("CancelledError"), result.content


#: An asyncio loop run cell by cell (``loop.run_until_complete``), as IPython's terminal,
#: ``python -m asyncio`` and scripts driving their own loop run it, leaving SIGINT to
#: Python's default handler; a Ctrl-C while a cell streams a reply.
CTRL_C_SCRIPT = """
import asyncio, contextlib, os, signal, sys, threading, time
import sessionactors as sa, sessionactors.aio as aio

class Slow:
    async def stream(self, request):
        for word in request.messages[-1].content.split():
            if sys.argv[1] == "busy":  # (the interrupt comes while the model's task runs)
                time.sleep(0.05)
                await asyncio.sleep(0)
            else:  # (it comes while the loop waits)
                await asyncio.sleep(0.05)
            yield sa.TextChunk(word + " ")

# (as in a terminal: a process started in the background, as CI starts the tests,
# inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
loop = asyncio.new_event_loop()
run = loop.run_until_complete
stack = contextlib.AsyncExitStack()

async def open_cell():
    registry = await stack.enter_async_context(aio.open_registry(agents={"a": sa.Agent(model=Slow())}))
    return await registry.spawn("demo")

ref = run(open_cell())
started = threading.Event()

async def stream_cell():
    async with ref.stream(" ".join(["word"] * 40)) as events:
        async for event in events:
            if isinstance(event, sa.Delta):
                started.set()

def press_ctrl_c():
    started.wait(10)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=press_ctrl_c).start()
try:
    run(stream_cell())
    print("stream: not interrupted")
except KeyboardInterrupt:
    print("stream: interrupted")

async def send_cell():
    async with asyncio.timeout(10):
        return (await ref.send("still there?")).text
print("send:", run(send_cell()))
run(stack.aclose())
print("closed")
print("handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("model", ["waiting", "busy"])
def test_ctrl_c_in_a_loop_that_leaves_sigint_alone_interrupts_the_cell_not_the_registry(
    model: str,
) -> None:
    """A Ctrl-C in an asyncio loop that leaves SIGINT to Python (IPython's terminal, ``python
    -m asyncio``) interrupts the code it ran (a cell) with KeyboardInterrupt, as it would
    without the registry; the registry's trio run goes on: the next call is answered and
    the close is clean, whether the interrupt comes while the loop waits or while the
    model's asyncio task runs. (The trio run took the interrupt: the registry died, the
    call raised SessionStoppedError and the close a group of KeyboardInterrupt; then
    one in the model's task was the model's failure, and it closed the registry.)"""
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_SCRIPT, model],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.splitlines() == [
        "stream: interrupted",
        "send: still there? ",
        "closed",
        "handler restored: True",
    ], done.stdout + done.stderr
