"""Sessions that talk to sessions: a tool (or a model) of one session's turn that
sends to another session of the same registry, as an orchestrator agent asks worker
agents. A request that would wait on the turn it is made from (its own session's
mailbox, or that of a session whose turn waits on this one) is refused at once with
SessionBusyError naming the sessions, before anything is sent: it would wait forever
(a session serves its mailbox one request at a time)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import EchoModel, FaultyStore

#: A user message "ask NAME: QUESTION" has the model call ``ask`` with them.
_ASK = "ask "


class Relay:
    """A model that, for a user message "ask NAME: QUESTION", calls the tool ``ask``
    (session NAME, question QUESTION), and then answers "got: " and the tool's result;
    for any other message, answers "[SESSION] " and the message. It awaits nothing, so
    it serves a trio registry and an asyncio one alike."""

    def __init__(self, session: str) -> None:
        self.session = session

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        last = request.messages[-1]
        if last.role is sa.Role.TOOL:
            yield sa.TextChunk(f"got: {last.content}")
            return
        if last.content.startswith(_ASK):
            name, _, question = last.content[len(_ASK) :].partition(": ")
            arguments = json.dumps({"session": name, "question": question})
            yield sa.ToolCallChunk(index=0, id="call-1", name="ask", arguments=arguments)
            return
        yield sa.TextChunk(f"[{self.session}] {last.content}")


@contextlib.asynccontextmanager
async def orchestra(
    names: str, ask: Callable[[sa.Registry, str, str], Awaitable[str]]
) -> AsyncIterator[tuple[sa.Registry, list[sa.SessionRef]]]:
    """A registry with a session per name in ``names``, each with an agent named after
    it whose tool ``ask`` calls ``ask(registry, session, question)``."""
    opened: list[sa.Registry] = []

    async def tool_ask(session: str, question: str) -> str:
        return await ask(opened[0], session, question)

    tool = sa.Tool(name="ask", fn=tool_ask, description="Ask another session.")
    agents = {name: sa.Agent(model=Relay(name), tools=[tool]) for name in names}
    async with sa.open_registry(agents=agents) as registry:
        opened.append(registry)
        yield registry, [await registry.spawn(name, agent=name) for name in names]


async def send(registry: sa.Registry, session: str, question: str) -> str:
    return (await registry.ref(session).send(question)).text


async def users(ref: sa.SessionRef) -> list[str]:
    return [m.content for m in await ref.history() if m.role is sa.Role.USER]


def tool_result(history: list[sa.Message]) -> sa.Message:
    [result] = [m for m in history if m.role is sa.Role.TOOL]
    return result


async def test_a_tool_that_sends_to_its_own_session_is_refused_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A tool that sends to the session whose turn runs it gets SessionBusyError at
    once (it waited forever); its turn goes on, and nothing was queued behind it."""
    async with orchestra("A", send) as (registry, [ref]):
        with trio.fail_after(5):
            reply = await ref.send("ask A: hello me")
        result = tool_result(await ref.history())
        assert result.is_error, result
        assert result.content.startswith("SessionBusyError: session 'A' "), result.content
        assert "its own turn" in result.content, result.content
        assert reply.text == f"got: {result.content}"
        await trio.testing.wait_all_tasks_blocked()
        assert await users(ref) == ["ask A: hello me"]  # nothing ran after it
        assert registry.statistics().turns_running == 0


async def test_a_cycle_of_sessions_is_refused_where_it_closes(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A's tool sends to B, whose tool sends to A: B's send is refused at once, naming
    both (it waited forever, and so did A); each turn goes on. Later, B sends to A
    from a turn of its own (not one A waits on), and is answered."""
    async with orchestra("AB", send) as (_, [a, b]):
        with trio.fail_after(5):
            reply = await a.send("ask B: ask A: back to you")
        result = tool_result(await b.history())
        assert result.is_error, result
        assert result.content.startswith(
            "SessionBusyError: session 'A' waits on the turn this request comes from (its "
            "turn waits on 'B', whose turn makes this request)"
        ), result.content
        assert reply.text == f"got: got: {result.content}"
        await trio.testing.wait_all_tasks_blocked()
        assert await users(a) == ["ask B: ask A: back to you"]
        # B's actor began in A's turn; its own turns since are not part of A's
        with trio.fail_after(5):
            again = await b.send("ask A: and now?")
        assert again.text == "got: [A] and now?"


async def test_a_turn_may_queue_a_turn_of_its_own_session_but_not_wait_for_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A tool may submit a turn to its own session (it runs after this one), but
    waiting for that turn's reply inside the turn is refused."""
    waited: list[str] = []

    async def follow_up(registry: sa.Registry, session: str, question: str) -> str:
        turn = await registry.ref(session).submit(question)
        try:
            await turn.reply()
        except sa.SessionBusyError as exc:
            waited.append(str(exc))
        return turn.id

    async with orchestra("A", follow_up) as (_, [ref]):
        with trio.fail_after(5):
            reply = await ref.send("ask A: later")
            queued = reply.text.removeprefix("got: ")
            while (await ref.turn_outcome(queued)).status is not sa.TurnStatus.FINISHED:
                await trio.sleep(0.01)
        [refused] = waited
        assert refused.startswith("session 'A' "), refused
        assert await users(ref) == ["ask A: later", "later"]


@pytest.mark.parametrize(
    "request_kind",
    ["stream", "retry", "truncate", "add_messages", "set_metadata", "stop", "hibernate"],
)
async def test_a_request_in_mailbox_order_from_its_own_turn_is_refused(
    autojump_clock: trio.abc.Clock, request_kind: str
) -> None:
    """Every request that waits its turn in the mailbox (a streamed turn, a retry, a
    history edit, a metadata change, a stop, a hibernation) is refused from the
    session's own turn, before anything is done; only a turn is told it may be
    submitted without waiting (a metadata change was told so too)."""
    calls: dict[str, Callable[[sa.SessionRef], Awaitable[Any]]] = {
        "stream": lambda ref: _drain(ref.stream("more")),
        "retry": lambda ref: ref.retry(),
        "truncate": lambda ref: ref.truncate(keep_last=0),
        "add_messages": lambda ref: ref.add_messages([sa.Message.create("user", "more")]),
        "set_metadata": lambda ref: ref.set_metadata({"verified": True}),
        "stop": lambda ref: ref.stop(),
        "hibernate": lambda ref: ref.hibernate(),
    }

    async def mailbox(registry: sa.Registry, session: str, question: str) -> str:
        await calls[request_kind](registry.ref(session))
        return "it was served"

    async with orchestra("A", mailbox) as (_, [ref]):
        with trio.fail_after(5):
            await ref.send("ask A: anything")
        result = tool_result(await ref.history())
        assert result.content.startswith("SessionBusyError: session 'A' "), result.content
        assert ("ref.submit" in result.content) == (request_kind == "stream"), result.content
        assert "from outside the turn" in result.content
        await trio.testing.wait_all_tasks_blocked()
        assert await users(ref) == ["ask A: anything"]


async def _drain(stream: Any) -> None:
    async with stream as events:
        async for _ in events:
            pass


async def test_a_turn_submitted_without_waiting_may_later_ask_its_sender(
    autojump_clock: trio.abc.Clock,
) -> None:
    """O's tool submits work to W without waiting, and O's turn ends; W's tool then
    reports to O, which is idle: answered (the submitted turn waits on no one)."""

    async def hand_off(registry: sa.Registry, session: str, question: str) -> str:
        if question.startswith("work"):
            turn = await registry.ref(session).submit(f"ask O: done with {question}")
            return f"queued {turn.id}"
        return await send(registry, session, question)

    async with orchestra("OW", hand_off) as (_, [o, w]):
        with trio.fail_after(5):
            await o.send("ask W: work X")
            while len(await users(o)) < 2:
                await trio.sleep(0.01)
        assert tool_result(await w.history()).content == "[O] done with work X"


async def test_a_task_a_tool_started_that_outlives_its_turn_is_part_of_no_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A tool starts a job in the app's nursery and returns; the job, which sends to the
    session while it runs another turn (unrelated), waits its turn and is answered."""
    go = trio.Event()
    told: list[str] = []

    async def job(registry: sa.Registry) -> None:
        await go.wait()
        told.append(await send(registry, "A", "job finished"))

    async with trio.open_nursery() as app:

        async def start_or_dawdle(registry: sa.Registry, session: str, question: str) -> str:
            if question == "start job":
                app.start_soon(job, registry)
                return "started"
            go.set()  # (the job sends while this turn runs)
            await trio.sleep(1)
            return "slow done"

        async with orchestra("A", start_or_dawdle) as (_, [a]):
            with trio.fail_after(10):
                await a.send("ask A: start job")
                await a.send("ask A: dawdle")
                while not told:
                    await trio.sleep(0.01)
    assert told == ["[A] job finished"]


async def test_a_wait_on_a_turn_of_its_own_session_that_finished_is_answered(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn's tool queues a follow-up on its own session and keeps its Turn; a later
    turn's tool reads the follow-up's reply, long finished: answered, not refused."""
    kept: list[sa.Turn] = []

    async def schedule_or_read(registry: sa.Registry, session: str, question: str) -> str:
        if question == "schedule":
            kept.append(await registry.ref(session).submit("follow-up"))
            return "scheduled"
        return (await kept[0].reply()).text

    async with orchestra("A", schedule_or_read) as (_, [a]):
        with trio.fail_after(10):
            await a.send("ask A: schedule")
            while (await a.turn_outcome(kept[0].id)).status is not sa.TurnStatus.FINISHED:
                await trio.sleep(0.01)
            assert (await a.send("ask A: read")).text == "got: [A] follow-up"


async def test_a_def_tool_that_calls_back_into_trio_is_refused_as_an_async_one() -> None:
    """A plain ``def`` tool (run in a worker thread) whose call back into trio
    (``trio.from_thread.run``) sends to its own session is refused as an async tool's
    send is (it waited forever)."""
    opened: list[sa.Registry] = []

    def ask(session: str, question: str) -> str:
        return trio.from_thread.run(send, opened[0], session, question)

    tool = sa.Tool(name="ask", fn=ask, description="Ask another session.")
    async with sa.open_registry(agents={"A": sa.Agent(model=Relay("A"), tools=[tool])}) as reg:
        opened.append(reg)
        ref = await reg.spawn("A", agent="A")
        with trio.fail_after(10):
            await ref.send("ask A: hello me")
        result = tool_result(await ref.history())
        assert result.content.startswith("SessionBusyError: session 'A' "), result.content


def _nested_sessions_example() -> Any:
    """docs/examples/howto_nested_sessions.py, imported (its tool and orchestrator)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "docs" / "examples" / "howto_nested_sessions.py"
    spec = importlib.util.spec_from_file_location("howto_nested_sessions", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Pondering:
    """A worker's model that thinks until its turn is cancelled."""

    def __init__(self) -> None:
        self.asked = 0

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.asked += 1
        yield sa.TextChunk("thinking")
        await trio.sleep_forever()


async def test_the_docs_orchestrator_cancels_its_workers_turns_when_its_turn_is_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The how-to's orchestrator tool (docs/examples/howto_nested_sessions.py), its turn
    cancelled while its workers think, cancels the workers' turns as the how-to says it
    does: they end cancelled, not run on (a tool that catches trio.Cancelled alone
    never sees the cancellation, which comes in its nursery's exception group, and one
    that cancels unshielded is cancelled itself before it can)."""
    example = _nested_sessions_example()
    worker = Pondering()
    agents = {
        "orchestrator": sa.Agent(model=example.Orchestrator(), tools=[example.ask_workers]),
        "worker": sa.Agent(model=worker),
    }
    async with sa.open_registry(agents=agents) as registry:
        example.REGISTRY.append(registry)
        boss = await registry.spawn("boss", agent="orchestrator")
        for name in ("w1", "w2"):
            await registry.spawn(name, agent="worker")
        turn = await boss.submit("ask w1,w2: think it over")
        with trio.fail_after(10):
            while worker.asked < 2:
                await trio.sleep(0.01)
            assert await boss.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            for name in ("w1", "w2"):
                while (state := await registry.ref(name).state()).status is not sa.Status.IDLE:
                    await trio.sleep(0.01)
                assert [t.status for t in state.turns] == [sa.TurnStatus.CANCELLED], name


async def test_the_docs_orchestrator_keeps_every_answer_when_one_worker_crashes() -> None:
    """The how-to's orchestrator tool, one of whose workers crashes (its store refuses
    the turn's write: SessionCrashedError, not TurnFailedError), tells its model that
    worker's failure by its kind and keeps the other workers' answers (an error that
    escaped its nursery lost them all, and the model read only "ExceptionGroup")."""
    example = _nested_sessions_example()
    store = FaultyStore()
    agents = {
        "orchestrator": sa.Agent(model=example.Orchestrator(), tools=[example.ask_workers]),
        "worker": sa.Agent(model=EchoModel(prefix="on it: ")),
    }
    async with sa.open_registry(store=store, agents=agents) as registry:
        example.REGISTRY.append(registry)
        boss = await registry.spawn("boss", agent="orchestrator")
        for name in ("w1", "w2", "w3"):
            await registry.spawn(name, agent="worker")
        store.fail("append", session_id="w2")
        with trio.fail_after(10):
            reply = await boss.send("ask w1,w2,w3: go")
        assert store.injected == 1
    said = json.loads(reply.text.removeprefix("The workers said: "))
    assert said == {"w1": "on it: go", "w2": "(failed: SessionCrashedError)", "w3": "on it: go"}
