"""The tool loop: calls, concurrency, errors, limits, streamed fragments, events, journaling,
and resumption after a crash in the middle of a tool."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.stores import MemoryStore, load_events
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel


def call(name: str, arguments: object = None, *, id: str | None = None) -> sa.ToolCall:
    """A tool call with JSON ``arguments`` (``{}`` if None) and a fresh id unless given."""
    return sa.ToolCall(
        id=id or f"call_{uuid.uuid4().hex}",
        name=name,
        arguments=json.dumps(arguments if arguments is not None else {}),
    )


def tool_messages(history: Sequence[sa.Message]) -> list[sa.Message]:
    return [m for m in history if m.role is sa.Role.TOOL]


async def settle() -> None:
    """Let every task in the run reach a blocking point (the session finishes what it does)."""
    with trio.fail_after(10):
        await trio.testing.wait_all_tasks_blocked()


# ---- the loop -------------------------------------------------------------------------------


async def test_text_then_tool_call_then_final_answer(autojump_clock: trio.abc.Clock) -> None:
    """A turn streams text with a tool call, runs the tool, asks again, and replies with text."""
    seen: list[str] = []

    @sa.tool
    async def lookup(order_id: str) -> str:
        """Look up an order by its id."""
        seen.append(order_id)
        return f"order {order_id}: shipped"

    first = call("lookup", {"order_id": "A1"})
    model = ScriptedModel([Scripted(text="Let me check.", tool_calls=[first]), "It shipped."])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("Where is A1?")
        history = await ref.history()

    assert reply.text == "It shipped."
    assert reply.reviews == ()
    assert seen == ["A1"]
    assert [(m.role, m.content) for m in history] == [
        (sa.Role.USER, "Where is A1?"),
        (sa.Role.ASSISTANT, "Let me check."),
        (sa.Role.TOOL, "order A1: shipped"),
        (sa.Role.ASSISTANT, "It shipped."),
    ]
    assert history[1].tool_calls == (first,)
    assert history[2].tool_call_id == first.id
    assert not history[2].is_error
    assert len(model.requests) == 2
    assert [s.name for s in model.requests[0].tools] == ["lookup"]
    assert model.requests[0].tools == (lookup.spec,)
    assert model.requests[1].tools == (lookup.spec,)
    assert [m.role for m in model.requests[1].messages] == [
        sa.Role.USER,
        sa.Role.ASSISTANT,
        sa.Role.TOOL,
    ]


async def test_independent_calls_run_concurrently(autojump_clock: trio.abc.Clock) -> None:
    """Two calls of one step run at once: each waits on something only the other one sets."""
    ping_seen = trio.Event()
    pong_seen = trio.Event()

    @sa.tool
    async def ping() -> str:
        """Signal ping, then wait for pong."""
        ping_seen.set()
        await pong_seen.wait()
        return "ping done"

    @sa.tool
    async def pong() -> str:
        """Wait for ping, then signal pong."""
        await ping_seen.wait()
        pong_seen.set()
        return "pong done"

    model = ScriptedModel([Scripted(tool_calls=[call("ping"), call("pong")]), "both done"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[ping, pong])}) as reg:
        ref = await reg.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
        history = await ref.history()

    assert reply.text == "both done"
    assert [m.content for m in tool_messages(history)] == ["ping done", "pong done"]


async def test_concurrent_calls_take_the_longest_and_results_keep_call_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two 10 s tools of one step finish in 10 s, and their results follow the calls' order."""
    finished: list[str] = []

    @sa.tool
    async def slow(name: str, seconds: float) -> str:
        """Sleep, then answer."""
        await trio.sleep(seconds)
        finished.append(name)
        return f"{name} after {seconds}"

    calls = [
        call("slow", {"name": "first", "seconds": 10}),
        call("slow", {"name": "second", "seconds": 9}),
    ]
    model = ScriptedModel([Scripted(tool_calls=calls), "done"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[slow])}) as registry:
        ref = await registry.spawn("s")
        start = trio.current_time()
        with trio.fail_after(60):
            await ref.send("go")
        elapsed = trio.current_time() - start
        history = await ref.history()

    assert 10 <= elapsed < 11
    assert finished == ["second", "first"]  # the second call finished first...
    results = tool_messages(history)  # ...but the results are recorded in call order
    assert [m.tool_call_id for m in results] == [c.id for c in calls]
    assert [m.content for m in results] == ["first after 10.0", "second after 9.0"]


async def test_a_tool_that_raises_gives_the_model_an_error_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A tool raising is an is_error result the model sees, not a failed turn."""

    @sa.tool
    async def explode() -> str:
        """Always fails."""
        raise ValueError("the warehouse is on fire")

    model = ScriptedModel([Scripted(tool_calls=[call("explode")]), "Sorry, that failed."])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[explode])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
        history = await ref.history()
        state = await ref.state()

    assert reply.text == "Sorry, that failed."
    (result,) = tool_messages(history)
    assert result.is_error
    assert "the warehouse is on fire" in result.content
    assert "ValueError" in result.content
    assert model.requests[1].messages[-1] == result
    assert state.status is sa.Status.IDLE


async def test_an_unknown_tool_gives_the_model_an_error_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A call of a tool the agent does not have is an error result naming the tools it has."""

    @sa.tool
    async def lookup() -> str:
        """Look something up."""
        return "found"

    model = ScriptedModel([Scripted(tool_calls=[call("teleport")]), "I cannot do that."])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
        history = await ref.history()

    assert reply.text == "I cannot do that."
    (result,) = tool_messages(history)
    assert result.is_error
    assert "'teleport'" in result.content
    assert "lookup" in result.content


async def test_max_steps_fails_the_turn_saying_so(autojump_clock: trio.abc.Clock) -> None:
    """A model that keeps calling tools fails the turn after max_steps, and the session goes on."""
    count = 0

    @sa.tool
    async def again() -> str:
        """Count a call."""
        nonlocal count
        count += 1
        return "again"

    looping = ScriptedModel([lambda request: Scripted(tool_calls=[call("again")])] * 3 + ["fine"])
    agent = sa.Agent(model=looping, tools=[again], max_steps=3)
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5), pytest.raises(sa.TurnFailedError, match="max_steps=3") as info:
            await ref.send("loop")
        with trio.fail_after(5):
            after = await ref.send("stop it")
        history = await ref.history()

    assert "MaxStepsError" in str(info.value)
    assert count == 3
    assert len(looping.requests) == 4
    assert after.text == "fine"
    assert tool_pairs_intact(history)


def test_max_steps_must_be_positive() -> None:
    """An agent refuses max_steps below one."""
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        sa.Agent(model=ScriptedModel(), max_steps=0)


def test_agent_refuses_what_is_not_a_model_or_a_tool() -> None:
    """A model name, None, or a plain function among the tools is refused when the agent is
    made, with a TypeError that says what to pass, not at the first turn."""

    def lookup(order_id: str) -> str:
        return order_id

    with pytest.raises(TypeError, match=r"model must have a stream\(request\) method.*str"):
        sa.Agent(model="gpt-4o")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must have a stream"):
        sa.Agent(model=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tools\[0\] is a function.*@sa.tool"):
        sa.Agent(model=ScriptedModel(), tools=[lookup])
    with pytest.raises(TypeError, match=r"tools must be a list of sa\.Tool"):
        sa.Agent(model=ScriptedModel(), tools=lookup)  # type: ignore[arg-type]
    assert sa.Agent(model=ScriptedModel(), tools=[sa.tool(lookup)]).tool_specs[0].name == "lookup"


async def test_fragments_of_calls_spread_over_many_chunks_assemble_exactly(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Interleaved fragments (id and name first, arguments in many pieces) become exact calls."""
    args_a = json.dumps({"order_id": "A-1001", "note": 'quotes " and \\ and ünïcode'})
    args_b = json.dumps({"order_id": "B-7", "items": [1, 2, 3]})
    got: list[tuple[str, str]] = []

    @sa.tool(parameters={"type": "object"})
    async def record(**kwargs: object) -> str:
        """Record the arguments."""
        got.append(("record", json.dumps(kwargs)))
        return "ok"

    class FragmentModel:
        """Streams two interleaved calls, their arguments one character at a time."""

        def __init__(self) -> None:
            self.requests: list[sa.ModelRequest] = []

        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            self.requests.append(request)
            await trio.lowlevel.checkpoint()
            if len(self.requests) > 1:
                yield sa.TextChunk("recorded")
                return
            yield sa.TextChunk("Recording ")
            yield sa.ToolCallChunk(1, id="call_b", name="record")
            yield sa.ToolCallChunk(0, id="call_a", name="record")
            yield sa.TextChunk("both.")
            for i in range(max(len(args_a), len(args_b))):
                if i < len(args_b):
                    yield sa.ToolCallChunk(1, arguments=args_b[i])
                if i < len(args_a):
                    yield sa.ToolCallChunk(0, arguments=args_a[i])
                if i % 5 == 0:
                    yield sa.ToolCallChunk(0)  # an empty fragment changes nothing

    model = FragmentModel()
    agent = sa.Agent(model=model, tools=[record])
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
        history = await ref.history()

    assert reply.text == "recorded"
    assert history[1].content == "Recording both."
    assert history[1].tool_calls == (
        sa.ToolCall(id="call_a", name="record", arguments=args_a),
        sa.ToolCall(id="call_b", name="record", arguments=args_b),
    )
    assert sorted(got) == sorted([("record", args_a), ("record", args_b)])
    assert [m.tool_call_id for m in tool_messages(history)] == ["call_a", "call_b"]


async def test_only_non_idempotent_starts_are_journaled(autojump_clock: trio.abc.Clock) -> None:
    """Both starts are published; only the non-idempotent call's is journaled and kept
    in the open turn (a wake must not run it again; an idempotent call just runs again)."""

    @sa.tool
    async def lookup() -> str:
        """Look something up."""
        return "found"

    @sa.tool(idempotent=False)
    async def refund() -> str:
        """Refund the order."""
        return "refunded"

    safe, risky = call("lookup"), call("refund")
    model = ScriptedModel([Scripted(tool_calls=[safe, risky]), "done"])
    store = MemoryStore()
    agents = {"a": sa.Agent(model=model, tools=[lookup, refund])}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        published: list[sa.Event] = []
        async with ref.subscribe() as stream:
            with trio.fail_after(5):
                await ref.send("go")
                async for event in stream:
                    published.append(event)
                    if isinstance(event, sa.TurnFinished):
                        break
        _, entries = await store.read_journal("s", 0)

    journaled = [event for entry in entries for event in load_events(entry.data)]
    started = [e.tool_call for e in published if isinstance(e, sa.ToolCallStarted)]
    assert started == [safe, risky]
    assert [e.tool_call for e in journaled if isinstance(e, sa.ToolCallStarted)] == [risky]
    # the calls are journaled all the same, as a message, and their results with them
    added = [e.message for e in journaled if isinstance(e, sa.MessageAdded)]
    assert [c.id for m in added for c in m.tool_calls] == [safe.id, risky.id]
    results = [e.message for e in journaled if isinstance(e, sa.ToolResult)]
    assert [m.tool_call_id for m in results if m is not None] == [safe.id, risky.id]


async def test_tool_events_carry_the_turn_id(autojump_clock: trio.abc.Clock) -> None:
    """ToolCallStarted and ToolResult are published, in order, with the id of their turn."""

    @sa.tool
    async def lookup() -> str:
        """Look something up."""
        return "found"

    first = call("lookup")
    model = ScriptedModel([Scripted(tool_calls=[first]), "done"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        events: list[sa.Event] = []
        async with ref.subscribe() as stream:
            with trio.fail_after(5):
                reply = await ref.send("go")
                async for event in stream:
                    events.append(event)
                    if isinstance(event, sa.TurnFinished):
                        break

    tool_events = [e for e in events if isinstance(e, sa.ToolCallStarted | sa.ToolResult)]
    assert [type(e) for e in tool_events] == [sa.ToolCallStarted, sa.ToolResult]
    started, result = tool_events
    assert isinstance(started, sa.ToolCallStarted)
    assert isinstance(result, sa.ToolResult)
    assert started.turn_id == result.turn_id == reply.turn_id
    assert started.tool_call == first
    assert result.tool_call_id == first.id
    assert result.content == "found"
    assert not result.is_error
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs)


@pytest.mark.parametrize("how", ["hibernate", "restart"])
async def test_tool_calls_are_journaled_like_messages(
    how: str, autojump_clock: trio.abc.Clock
) -> None:
    """After hibernation or a registry restart the history holds the calls and results."""

    @sa.tool
    async def lookup(key: str) -> str:
        """Look something up."""
        return f"value of {key}"

    calls = [call("lookup", {"key": "x"}), call("lookup", {"key": "y"})]
    store = MemoryStore()
    model = ScriptedModel([Scripted(text="checking", tool_calls=calls), "x and y found"])
    agents = {"a": sa.Agent(model=model, tools=[lookup])}
    async with sa.open_registry(agents=agents, store=store) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("go")
        before = await ref.history()
        if how == "hibernate":
            await ref.hibernate()
            assert "s" not in registry.live()
            after = await registry.ref("s").history()
    if how == "restart":
        async with sa.open_registry(agents=agents, store=store) as registry:
            after = await registry.ref("s").history()

    assert after == before
    assert [m.role for m in after] == [
        sa.Role.USER,
        sa.Role.ASSISTANT,
        sa.Role.TOOL,
        sa.Role.TOOL,
        sa.Role.ASSISTANT,
    ]
    assert after[1].tool_calls == tuple(calls)
    assert [m.content for m in after[2:4]] == ["value of x", "value of y"]


# ---- a crash in the middle of a tool -------------------------------------------------------


def arm(store: FaultyStore) -> None:
    """Make the store's next append fail, unless a fault fired already (a tool run again
    after the crash does not crash it again): the actor crashes after the tool started,
    as a process death would."""
    if not store.injected:
        store.fail("append", error=OSError("injected store fault"))


def crash_harness(
    store: FaultyStore, calls: Sequence[sa.ToolCall]
) -> tuple[sa.Agent, ScriptedModel, dict[str, int]]:
    """An agent whose one step calls ``calls``; its tools count runs and arm the store fault.

    ``charge`` is not idempotent, ``lookup`` is.
    """
    runs = {"charge": 0, "lookup": 0}

    async def charge(amount: int) -> str:
        runs["charge"] += 1
        arm(store)
        await trio.lowlevel.checkpoint()
        return f"charged {amount}"

    async def lookup(key: str) -> str:
        runs["lookup"] += 1
        arm(store)
        await trio.lowlevel.checkpoint()
        return f"value of {key}"

    tools = [
        sa.Tool(name="charge", fn=charge, idempotent=False),
        sa.Tool(name="lookup", fn=lookup),
    ]
    model = ScriptedModel(
        [Scripted(tool_calls=calls), "lost with the crash", "answered after the crash"]
    )
    return sa.Agent(model=model, tools=tools), model, runs


async def crash_mid_tool(
    store: FaultyStore, agent: sa.Agent
) -> tuple[list[sa.Message], sa.SessionState]:
    """Send one turn that crashes after its tools started; the history and state once settled."""
    async with sa.open_registry(agents={"a": agent}, store=store) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5), pytest.raises(sa.SessionCrashedError, match="injected"):
            await ref.send("pay")
        await settle()
        assert registry.statistics().restarts == 1
        history = await ref.history()
        state = await ref.state()
    assert store.injected == 1
    return history, state


async def test_a_non_idempotent_tool_interrupted_by_a_crash_is_not_run_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """After a crash mid-tool the non-idempotent call ran once; the model is told it was interrupted."""
    store = FaultyStore()
    charge = call("charge", {"amount": 5})
    agent, model, runs = crash_harness(store, [charge])

    history, state = await crash_mid_tool(store, agent)

    assert runs == {"charge": 1, "lookup": 0}
    assert [m.role for m in history] == [
        sa.Role.USER,
        sa.Role.ASSISTANT,
        sa.Role.TOOL,
        sa.Role.ASSISTANT,
    ]
    result = history[2]
    assert result.tool_call_id == charge.id
    assert result.is_error
    assert "interrupted" in result.content
    assert history[3].content == "answered after the crash"
    assert len(model.requests) == 3  # the turn was resumed: the model was asked again
    assert model.requests[2].messages[-1] == result
    assert state.open_turn is None
    assert state.status is sa.Status.IDLE
    assert tool_pairs_intact(history)


async def test_crash_harness_counts_a_call_run_again(autojump_clock: trio.abc.Clock) -> None:
    """The harness counts a second run, with no interruption noted, for a call that the
    recovery runs again (the idempotent lookup next to the charge): the negative control of
    the tests that find one run."""
    store = FaultyStore()
    lookup = call("lookup", {"key": "k"})
    agent, _, runs = crash_harness(store, [call("charge", {"amount": 5}), lookup])

    history, _ = await crash_mid_tool(store, agent)

    assert runs["lookup"] == 2
    result = next(m for m in tool_messages(history) if m.tool_call_id == lookup.id)
    assert "interrupted" not in result.content


@pytest.mark.parametrize("order", ["charge_first", "lookup_first"])
async def test_an_idempotent_tool_interrupted_by_a_crash_is_run_again(
    order: str, autojump_clock: trio.abc.Clock
) -> None:
    """After a crash mid-batch the idempotent call runs again, the non-idempotent one does not."""
    store = FaultyStore()
    charge = call("charge", {"amount": 5})
    lookup = call("lookup", {"key": "k"})
    calls = [charge, lookup] if order == "charge_first" else [lookup, charge]
    agent, model, runs = crash_harness(store, calls)

    history, _ = await crash_mid_tool(store, agent)

    assert runs == {"charge": 1, "lookup": 2}
    results = {m.tool_call_id: m for m in tool_messages(history)}
    assert set(results) == {charge.id, lookup.id}
    assert "interrupted" in results[charge.id].content
    assert results[charge.id].is_error
    assert results[lookup.id].content == "value of k"
    assert not results[lookup.id].is_error
    assert history[-1].content == "answered after the crash"
    assert len(model.requests) == 3
    assert tool_pairs_intact(history)


async def test_cancelling_a_turn_while_tools_run_answers_every_call(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn cancelled while its tools run leaves every call of the step with a result."""
    started = trio.Event()

    async def slow() -> str:
        started.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    async def quick() -> str:
        await trio.lowlevel.checkpoint()
        return "quick"

    tools = [
        sa.Tool(name="slow", fn=slow),
        sa.Tool(name="quick", fn=quick),
        sa.Tool(name="refund", fn=quick, requires_review=True, idempotent=False),
    ]
    calls = [call("quick"), call("slow"), call("refund"), call("quick")]
    model = ScriptedModel([Scripted(tool_calls=calls), "next answer"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=tools)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            turn = await ref.submit("go")
            await started.wait()
            assert await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            history = await ref.history()
            reply = await ref.send("and now?")
        state = await ref.state()

    results = {m.tool_call_id: m for m in tool_messages(history)}
    assert set(results) == {c.id for c in calls}
    assert all(results[c.id].is_error for c in calls[1:])
    assert all("cancelled" in results[c.id].content for c in calls[1:])
    assert tool_pairs_intact(history)
    assert reply.text == "next answer"
    assert tool_pairs_intact(model.requests[-1].messages)
    assert state.reviews == ()


# ---- sync tools ---------------------------------------------------------------------------


class BlockingTool:
    """A sync tool that blocks its thread (as a sync HTTP client or database driver does)
    until ``release`` is set, or for at most ``bound`` seconds; it answers whether it was
    released, and ``started`` says that it runs."""

    def __init__(self, bound: float = 5.0) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.bound = bound
        self.threads: list[int] = []

    def __call__(self, order_id: str) -> str:
        self.threads.append(threading.get_ident())
        self.started.set()
        return "released" if self.release.wait(self.bound) else "not released"


async def test_a_sync_tool_runs_in_a_worker_thread_and_blocks_no_other_session() -> None:
    """A plain ``def`` tool that blocks runs in a worker thread, as a web framework runs a
    ``def`` route: while it blocks, the trio run (another session's turn) goes on, and
    the threads the rest of the app uses (trio's default limit) stay free."""
    trio.to_thread.current_default_thread_limiter().total_tokens = 1
    blocking = BlockingTool()
    tool = sa.Tool(name="lookup", fn=blocking)
    model = ScriptedModel([Scripted(tool_calls=[call("lookup", {"order_id": "A1"})]), "done"])
    agents = {"tools": sa.Agent(model=model, tools=[tool]), "echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="tools")
        other = await registry.spawn("other", agent="echo")
        with trio.fail_after(10):
            turn = await ref.submit("where is A1?")
            await trio.to_thread.run_sync(blocking.started.wait, abandon_on_cancel=True)
            assert (await other.send("still here")).text == "still here"
            blocking.release.set()
            reply = await turn.reply()
        history = await ref.history()
    assert reply.text == "done"
    assert [m.content for m in tool_messages(history)] == ["released"]
    assert blocking.threads != [threading.get_ident()]


async def test_cancelling_a_turn_in_a_blocked_sync_tool_ends_it_at_once() -> None:
    """``ref.cancel()`` ends a turn whose sync tool blocks without waiting for the tool
    (its thread is left to finish; its result is answered as cut short)."""
    blocking = BlockingTool()
    tool = sa.Tool(name="lookup", fn=blocking)
    model = ScriptedModel([Scripted(tool_calls=[call("lookup", {"order_id": "A1"})]), "done"])
    try:
        async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
            ref = await registry.spawn("s")
            with trio.fail_after(10):
                turn = await ref.submit("where is A1?")
                await trio.to_thread.run_sync(blocking.started.wait, abandon_on_cancel=True)
                assert await ref.cancel()
                with pytest.raises(sa.TurnCancelledError):
                    await turn.reply()
                assert not blocking.release.is_set()
            [result] = tool_messages(await ref.history())
    finally:
        blocking.release.set()
    assert result.is_error
    assert "may or may not have taken effect" in result.content


@pytest.mark.parametrize("landed", [True, False], ids=["kept", "not kept"])
async def test_a_refused_write_of_a_calls_start_tells_the_caller_to_ask_about_the_turn(
    landed: bool,
) -> None:
    """The store refuses the write that records a non-idempotent call's start before it
    runs (with ``landed``: after it kept the write, as a timeout after the server
    applied it). The caller's SessionCrashedError names the turn and says to ask
    turn_outcome before sending the message again, as for a write the store did not
    answer in time: never "retry the request", which, the start kept, runs the payment
    a second time (the restarted session resumes the turn, and the retry is a new one)."""
    paid: list[int] = []

    async def pay(amount: int) -> str:
        await trio.lowlevel.checkpoint()
        paid.append(amount)
        return "paid"

    tool = sa.Tool(name="pay", fn=pay, idempotent=False)
    call = sa.ToolCall(id="c1", name="pay", arguments='{"amount": 5}')
    model = ScriptedModel(["hello", Scripted(tool_calls=[call]), "the call was cut"])
    store = FaultyStore()
    agents = {"a": sa.Agent(model=model, tools=[tool])}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send("hi")
            store.fail("append", session_id="s", after=landed)
            with pytest.raises(sa.SessionCrashedError) as crashed:
                await ref.send("pay 5")
            assert store.injected == 1
            error = crashed.value
            assert error.turn_id, str(error)
            assert "turn_outcome" in str(error), str(error)
            assert "retry the request" not in str(error), str(error)
            # what it says to ask answers for the turn, whatever the store kept of it
            outcome = await ref.turn_outcome(error.turn_id)
            assert outcome.status is not sa.TurnStatus.QUEUED, outcome
    assert paid == []  # (a call whose start the store may not hold never runs)
