"""sessionactors.aio: the library from asyncio, under asyncio.run and under uvicorn, with a
model and a tool that await asyncio."""

import asyncio
import contextlib
import datetime
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.testing import EchoModel, Scripted, ScriptedModel
from test_nested_sends import Relay

from .chat_agents import AsyncioModel, asyncio_agents
from .servers import serve_asyncio


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` under asyncio.run, bounded in time."""

    async def bounded() -> Any:
        async with asyncio.timeout(20):
            return await main()

    return asyncio.run(bounded())


class GatedModel:
    """An asyncio model that streams "partial" then waits for ``gate`` before "done"."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.cancelled = 0

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("partial")
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield sa.TextChunk(" done")


class Broken(Exception):
    """An asyncio model's own error."""


class BrokenModel:
    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await asyncio.sleep(0)
        yield sa.TextChunk("so far")
        raise Broken("the upstream API broke")


def test_an_asyncio_model_and_tool_run_in_asyncio_tasks_with_a_review() -> None:
    """Under asyncio.run, an asyncio model streams and an asyncio tool runs (after its review),
    each in an asyncio task; replies, streams and subscriptions work as in trio."""

    async def main() -> None:
        agents = asyncio_agents(delay=0.001)
        model = agents["shop"].model
        assert isinstance(model, AsyncioModel)
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("a-1")
            reply = await ref.send("hello from asyncio")
            assert reply.text == "hello from asyncio"

            async with ref.stream("one two three") as events:
                kinds = [type(event).__name__ async for event in events]
            assert kinds[-1] == "TurnFinished"
            assert kinds.count("Delta") == 3

            reply = await ref.send("refund C3")
            [review] = reply.reviews
            assert await ref.pending_reviews() == [review]
            assert await registry.pending_reviews() == [review]
            reply = await ref.review(review.id, approve=True, note="ok")
            assert reply.text == "Refunded: order C3 refunded"
            assert model.tasks
            assert all(model.tasks)

            async with ref.subscribe(after=0) as events:
                replayed = []
                async for event in events:
                    replayed.append(event)
                    if isinstance(event, sa.TurnFinished) and event.message.content.startswith(
                        "Refunded"
                    ):
                        break
            assert [e.seq for e in replayed] == sorted({e.seq for e in replayed})
            history = await ref.history()
            roles = [m.role for m in history][-3:]
            assert roles == [sa.Role.ASSISTANT, sa.Role.TOOL, sa.Role.ASSISTANT]
            assert (await ref.state()).session_id == "a-1"
            assert registry.live() == ["a-1"]
            assert [i.session_id for i in await registry.sessions()] == ["a-1"]
            [info] = await registry.sessions()
            idle = await registry.sessions(active_before=info.updated_at)
            assert idle == []
            later = info.updated_at + datetime.timedelta(microseconds=1)
            assert [i.session_id for i in await registry.sessions(active_before=later)] == ["a-1"]
            with pytest.raises(ValueError, match="active_before must be an aware datetime"):
                await registry.sessions(active_before=later.replace(tzinfo=None))

            fork = await registry.fork("a-1", "a-2", at=history[1].id)
            assert [m.content for m in await fork.history()] == [history[0].content] * 2
            assert await fork.truncate(0) == 2
            await fork.set_summary("a summary")
            assert (await fork.state()).summary == "a summary"
            await fork.stop()
            await registry.delete("a-2")
            assert registry.statistics().subscribers == 0

    run(main)


def test_an_asyncio_tool_that_sends_to_a_session_its_turn_waits_on_is_refused() -> None:
    """An asyncio tool's send to its own session, or to one whose turn waits on its
    own, is refused at once with SessionBusyError, as a trio tool's is (it waited
    forever); a send to another session is answered."""
    opened: list[aio.Registry] = []

    async def ask(session: str, question: str) -> str:
        await asyncio.sleep(0)  # (asyncio code)
        return (await opened[0].ref(session).send(question)).text

    tool = sa.Tool(name="ask", fn=ask, description="Ask another session.")

    async def main() -> tuple[str, str, str]:
        agents = {name: sa.Agent(model=Relay(name), tools=[tool]) for name in "AB"}
        async with aio.open_registry(agents=agents) as registry:
            opened.append(registry)
            a = await registry.spawn("A", agent="A")
            await registry.spawn("B", agent="B")
            own = (await a.send("ask A: hello me")).text
            cycle = (await a.send("ask B: ask A: back to you")).text
            other = (await a.send("ask B: hello B")).text
            return own, cycle, other

    own, cycle, other = run(main)
    assert own.startswith("got: SessionBusyError: session 'A' is running the turn"), own
    assert cycle.startswith("got: got: SessionBusyError: session 'A' waits on"), cycle
    assert other == "got: [B] hello B"


def test_an_asyncio_registry_says_in_its_repr_once_it_is_closed() -> None:
    """An asyncio registry kept after its block says it is closed when shown."""

    async def main() -> tuple[str, str]:
        async with aio.open_registry(agents={"e": sa.Agent(model=EchoModel())}) as registry:
            await (await registry.spawn("s")).send("hi")
            live = repr(registry)
        return live, repr(registry)

    assert run(main) == ("<aio Registry live=1>", "<aio Registry live=0 closed>")


def test_library_errors_reach_asyncio_code_as_themselves() -> None:
    """Errors raised by the registry, the refs and the turns arrive as the library's own
    exceptions, not wrapped; an asyncio model's error is the turn error's cause."""

    async def main() -> None:
        agents = {"broken": sa.Agent(model=BrokenModel())}
        async with aio.open_registry(agents=agents, mailbox_size=1) as registry:
            with pytest.raises(sa.SessionNotFoundError, match="'nobody'"):
                await registry.ref("nobody").send("hi")
            with pytest.raises(sa.InvalidSessionNameError):
                registry.ref("")
            ref = await registry.spawn("b")
            with pytest.raises(sa.SessionExistsError):
                await registry.spawn("b")
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send("x")
            assert isinstance(failed.value.__cause__, Broken)
            with pytest.raises(sa.ReviewNotFoundError):
                await ref.review("no-such-review", approve=True)
            with pytest.raises(TypeError):
                await ref.send(42)  # type: ignore[arg-type]
            # an async method the core adds before aio spells it out is forwarded
            forwarded = registry.__getattr__("sessions")
            assert [info.session_id for info in await forwarded()] == ["b"]
            with pytest.raises(AttributeError):
                registry.no_such_method  # noqa: B018
            with pytest.raises(AttributeError, match="not an async method"):
                ref.__getattr__("submit_nowait")
        with pytest.raises(TypeError, match="agents"):
            async with aio.open_registry(agents=[]):  # type: ignore[arg-type]
                pass

    run(main)


def test_a_subscription_after_a_seq_beyond_the_session_raises_at_once() -> None:
    """An asyncio subscription after a seq the session never reached (a stale
    Last-Event-ID) raises EventsExpiredError as it is entered, live and hibernated."""

    async def main() -> None:
        async with aio.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
            ref = await registry.spawn("ahead")
            await ref.send("one two")
            last = (await ref.state()).event_seq
            for hibernated in (False, True):
                if hibernated:
                    await ref.hibernate()
                entered: list[bool] = []

                async def subscribe(entered: list[bool] = entered) -> None:
                    async with asyncio.timeout(5), ref.subscribe(after=last + 1000) as events:
                        entered.append(True)
                        await anext(events)

                with pytest.raises(sa.EventsExpiredError, match="'ahead'") as caught:
                    await subscribe()
                assert not entered
                assert last < caught.value.oldest_seq <= last + 2
                assert registry.live() == ([] if hibernated else ["ahead"])

    run(main)


def test_the_trio_registry_under_asyncio_says_to_use_the_aio_one() -> None:
    """sessionactors.open_registry under asyncio (a FastAPI lifespan, say) fails at once
    with a RuntimeError that names sessionactors.aio.open_registry."""

    async def main() -> None:
        async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}):
            pass

    with pytest.raises(RuntimeError, match=r"from asyncio.*sessionactors\.aio\.open_registry"):
        run(main)


def test_cancelling_an_asyncio_caller_abandons_only_its_wait() -> None:
    """Cancelling the asyncio task that awaits a reply abandons the wait: the turn runs on;
    ``ref.cancel()`` cancels the turn, whose asyncio model task is cancelled; a full mailbox
    raises MailboxFullError from submit_nowait."""

    async def main() -> None:
        model = GatedModel()
        async with aio.open_registry(agents={"g": sa.Agent(model=model)}, mailbox_size=1) as reg:
            ref = await reg.spawn("c")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await ref.send("first")
            model.gate.set()
            while (await ref.history())[-1].content != "partial done":
                await asyncio.sleep(0.01)

            model.gate.clear()
            turn = await ref.submit("second")
            waiter = asyncio.ensure_future(turn.reply())
            while (await ref.history())[-1].content != "second":
                await asyncio.sleep(0.01)
            ref.submit_nowait("queued")
            with pytest.raises(sa.MailboxFullError):
                ref.submit_nowait("one too many")
            assert await ref.cancel() is True
            with pytest.raises(sa.TurnCancelledError):
                await waiter
            assert model.cancelled == 1
            model.gate.set()
            while [m.content for m in await ref.history()][-2:] != ["queued", "partial done"]:
                await asyncio.sleep(0.01)

            async with ref.subscribe() as events:
                task = asyncio.ensure_future(events.__anext__())
                await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert reg.statistics().subscribers == 1
            assert reg.statistics().subscribers == 0

    run(main)


def test_an_asyncio_ref_cancels_only_the_turn_it_names() -> None:
    """``await ref.cancel(turn_id=...)`` from asyncio cancels the turn in flight only if it is
    that turn, and answers False for another id; a turn id that is not a str is a TypeError."""

    async def main() -> None:
        model = GatedModel()
        async with aio.open_registry(agents={"g": sa.Agent(model=model)}) as reg:
            ref = await reg.spawn("named")
            turn = await ref.submit("hello")
            while (await ref.turn_outcome(turn.id)).status is not sa.TurnStatus.RUNNING:
                await asyncio.sleep(0.01)
            assert await ref.cancel(turn_id=turn.id + "0") is False
            with pytest.raises(TypeError, match="'named'"):
                await ref.cancel(turn_id=b"bytes")  # type: ignore[arg-type]
            assert model.cancelled == 0
            assert await ref.cancel(turn_id=turn.id) is True
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            assert model.cancelled == 1

    run(main)


def test_leaving_the_block_shuts_down_like_the_trio_registry(tmp_path: Path) -> None:
    """Leaving the block lets an accepted turn finish within shutdown_grace and hibernates
    every session: a new registry on the same store finds the whole conversation."""
    path = str(tmp_path / "sessions.db")

    class Slow:
        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            await asyncio.sleep(0.1)
            yield sa.TextChunk("finished in the grace period")

    async def main() -> None:
        agents = {"slow": sa.Agent(model=Slow())}
        async with aio.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            ref = await registry.spawn("d")
            turn = await ref.submit("go")
        assert turn.done  # its reply is still the caller's, as a trio turn's is
        assert (await turn.reply()).text == "finished in the grace period"
        async with aio.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            [info] = await registry.sessions()
            assert info.status is sa.Status.HIBERNATED
            assert registry.live() == []
            history = await registry.ref("d").history()
            assert [m.content for m in history] == ["go", "finished in the grace period"]

    run(main)


def test_a_turn_cut_by_the_blocks_end_fails_with_session_stopped(tmp_path: Path) -> None:
    """A turn still running when the block's shutdown grace runs out ends, for its asyncio
    subscriber, with a TurnFailed of kind SessionStoppedError (not a TurnCancelled, which
    is a user's cancel); its caller gets SessionStoppedError, and a new registry reads the
    turn failed."""
    path = str(tmp_path / "sessions.db")

    async def main() -> None:
        agents = {"g": sa.Agent(model=GatedModel())}
        seen: list[sa.Event] = []
        async with aio.open_registry(
            store=sa.SQLiteStore(path), agents=agents, shutdown_grace=0.05
        ) as registry:
            ref = await registry.spawn("cut")
            subscribed = asyncio.Event()

            async def read() -> None:  # (on past the block's end, as a page's stream is)
                async with ref.subscribe() as events:
                    subscribed.set()
                    async for event in events:
                        seen.append(event)
                        if isinstance(event, sa.TurnFinished | sa.TurnFailed | sa.TurnCancelled):
                            return

            reader = asyncio.ensure_future(read())
            await subscribed.wait()
            turn = await ref.submit("hello")
            while (await ref.turn_outcome(turn.id)).status is not sa.TurnStatus.RUNNING:
                await asyncio.sleep(0.01)
        await reader
        with pytest.raises(sa.SessionStoppedError) as stopped:
            await turn.reply()
        assert stopped.value.turn_id == turn.id
        outcome = seen[-1]
        assert isinstance(outcome, sa.TurnFailed), seen
        assert (outcome.turn_id, outcome.error_kind) == (turn.id, "SessionStoppedError")
        assert outcome.error_public
        assert "send the message again" in outcome.error
        async with aio.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            told = await registry.ref("cut").turn_outcome(turn.id)
            last = (await registry.ref("cut").history())[-1]
        assert told.status is sa.TurnStatus.FAILED
        assert (last.content, last.interrupted) == ("partial", True)

    run(main)


def test_registries_on_one_loop_share_its_trio_run_and_end_it() -> None:
    """Two registries open at once on one loop work side by side; after both closed, a
    later asyncio.run (or trio.run) in the same thread starts afresh."""

    async def main() -> None:
        agents = {"echo": sa.Agent(model=EchoModel())}
        async with aio.open_registry(agents=agents) as one:
            async with aio.open_registry(agents=agents) as two:
                a = await one.spawn("x")
                b = await two.spawn("x")  # another registry: another namespace
                assert (await a.send("from one")).text == "from one"
                assert (await b.send("from two")).text == "from two"
            assert (await a.send("still open")).text == "still open"

    run(main)
    run(main)
    trio.run(trio.sleep, 0)


def test_trio_native_marks_a_model_to_run_in_trio() -> None:
    """A model marked trio_native runs in the trio run (it may call trio), as do the
    library's own models."""

    class TrioModel:
        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            await trio.sleep(0)
            yield sa.TextChunk("from trio")

    async def main() -> None:
        agents = {
            "t": sa.Agent(model=aio.trio_native(TrioModel())),
            "e": sa.Agent(model=EchoModel()),
        }
        async with aio.open_registry(agents=agents) as registry:
            assert (await (await registry.spawn("t", agent="t")).send("x")).text == "from trio"
            assert (await (await registry.spawn("e", agent="e")).send("echo")).text == "echo"

    run(main)
    with pytest.raises(TypeError, match="weak reference"):
        aio.trio_native(3)


def test_open_registry_needs_a_running_asyncio_loop() -> None:
    """Outside asyncio, aio.open_registry says so, and under trio it names
    sessionactors.open_registry."""

    async def main() -> None:
        async with aio.open_registry(agents={"e": sa.Agent(model=EchoModel())}):
            pass

    with pytest.raises(RuntimeError, match=r"under trio.*use sessionactors\.open_registry"):
        trio.run(main)


async def test_an_asyncio_app_under_uvicorn_uses_the_registry_from_its_handlers() -> None:
    """A Starlette app under uvicorn opens the registry in its lifespan; its handlers send,
    stream and catch library errors as themselves; a client that goes away cancels its
    handler, which abandons only the wait, and leaves no subscription."""
    state: dict[str, Any] = {}

    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with aio.open_registry(agents=asyncio_agents(delay=0.02)) as registry:
            state["registry"] = registry
            yield
            state["history"] = await registry.ref("u").history()

    async def send(request: Request) -> JSONResponse:
        registry: aio.Registry = state["registry"]
        name = request.path_params["name"]
        try:
            reply = await registry.ref(name).send((await request.json())["text"])
        except sa.SessionNotFoundError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        return JSONResponse({"text": reply.text})

    async def stream(request: Request) -> StreamingResponse:
        registry: aio.Registry = state["registry"]
        ref = await registry.get_or_spawn(request.path_params["name"])
        text = request.query_params["text"]

        async def body() -> AsyncIterator[str]:
            async with ref.stream(text) as events:
                async for event in events:
                    if isinstance(event, sa.Delta):
                        yield event.text

        return StreamingResponse(body(), media_type="text/plain")

    app = Starlette(
        routes=[
            Route("/send/{name}", send, methods=["POST"]),
            Route("/stream/{name}", stream),
        ],
        lifespan=contextlib.asynccontextmanager(lifespan),
    )
    async with serve_asyncio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            r = await client.post("/send/nobody", json={"text": "hi"})
            assert r.status_code == 404
            assert "'nobody'" in r.json()["error"]
            r = await client.get("/stream/u", params={"text": "streamed over http"})
            assert r.text == "streamed over http"
            r = await client.post("/send/u", json={"text": "sent over http"})
            assert r.json() == {"text": "sent over http"}
            text = "a long reply that the client stops reading"
            async with client.stream("GET", "/stream/u", params={"text": text}) as r:
                async for _chunk in r.aiter_text():
                    break
            registry: aio.Registry = state["registry"]
            while registry.statistics().subscribers:
                await trio.sleep(0.01)
            r = await client.post("/send/u", json={"text": "and now?"})  # queued behind it
            assert r.json() == {"text": "and now?"}
    contents = [m.content for m in state["history"]]
    assert contents[-4:] == [text, text, "and now?", "and now?"]


@pytest.mark.parametrize(
    ("trio_class", "aio_class"),
    [(sa.Registry, aio.Registry), (sa.SessionRef, aio.SessionRef), (sa.Turn, aio.Turn)],
    ids=["Registry", "SessionRef", "Turn"],
)
def test_the_asyncio_classes_spell_out_every_method_of_the_trio_ones(
    trio_class: type, aio_class: type
) -> None:
    """Every public method of the trio class has its asyncio counterpart, async where the
    trio one is async (a method the core adds is forwarded meanwhile, but untyped)."""
    for name, member in vars(trio_class).items():
        if name.startswith("_") or not callable(member):
            continue
        ours = vars(aio_class).get(name)
        assert ours is not None, f"sessionactors.aio.{aio_class.__name__} lacks {name}()"
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(member), name


@pytest.mark.parametrize(
    ("trio_class", "aio_class"),
    [(sa.Registry, aio.Registry), (sa.SessionRef, aio.SessionRef), (sa.Turn, aio.Turn)],
    ids=["Registry", "SessionRef", "Turn"],
)
def test_the_asyncio_classes_offer_every_property_of_the_trio_ones(
    trio_class: type, aio_class: type
) -> None:
    """Every public attribute of the trio class that is not a method (a property, a slot)
    is one of the asyncio class too, read without a call into the trio run."""
    for name, member in vars(trio_class).items():
        if name.startswith("_") or callable(member):
            continue
        ours = vars(aio_class).get(name)
        assert ours is not None, f"sessionactors.aio.{aio_class.__name__} lacks .{name}"
        assert not callable(ours), name


def test_the_registrys_properties_read_as_given_from_any_thread() -> None:
    """An asyncio registry's worker_id, config, store and agents say what it was opened
    with (the agents as given, their asyncio models unwrapped), from a handler, from a
    worker thread, and after its block."""
    model = AsyncioModel(0.0)

    async def main() -> None:
        store = sa.MemoryStore()
        agents = {"echo": sa.Agent(model=model)}
        async with aio.open_registry(
            store=store, agents=agents, worker_id="web-1", shutdown_grace=3
        ) as registry:
            assert registry.worker_id == "web-1"
            assert registry.config.shutdown_grace == 3
            assert registry.store is store
            assert dict(registry.agents) == agents
            assert registry.agents["echo"].model is model
            read = await asyncio.to_thread(
                lambda: (registry.worker_id, registry.config, registry.store, registry.agents)
            )
            assert read == (registry.worker_id, registry.config, store, registry.agents)
        assert registry.worker_id == "web-1"
        async with aio.open_registry() as registry:
            assert isinstance(registry.store, sa.MemoryStore)
            assert dict(registry.agents) == {}
            assert registry.worker_id

    run(main)


def test_a_sync_tool_runs_in_a_worker_thread_and_leaves_the_loop_free() -> None:
    """Under asyncio, a plain ``def`` tool that blocks runs in a worker thread, as FastAPI
    runs a ``def`` route: the loop goes on serving (another session's turn) meanwhile, and
    the tool may reach the loop with ``asyncio.run_coroutine_threadsafe``."""
    started, release = threading.Event(), threading.Event()
    loop: asyncio.AbstractEventLoop | None = None

    async def on_the_loop(order_id: str) -> str:
        return f"order {order_id}"

    @sa.tool
    def lookup(order_id: str) -> str:
        """Look up an order with a blocking client."""
        assert loop is not None
        started.set()
        if not release.wait(5):
            return "not released"
        return asyncio.run_coroutine_threadsafe(on_the_loop(order_id), loop).result(5)

    call = sa.ToolCall(id="c1", name="lookup", arguments='{"order_id": "A1"}')
    model = ScriptedModel([Scripted(tool_calls=[call]), "done"])
    agents = {"tools": sa.Agent(model=model, tools=[lookup]), "echo": sa.Agent(model=EchoModel())}

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("s", agent="tools")
            other = await registry.spawn("other", agent="echo")
            turn = await ref.submit("where is A1?")
            await asyncio.to_thread(started.wait)
            assert (await other.send("still here")).text == "still here"
            release.set()
            assert (await turn.reply()).text == "done"
            [result] = [m for m in await ref.history() if m.role is sa.Role.TOOL]
            assert result.content == "order A1"

    try:
        run(main)
    finally:
        release.set()
