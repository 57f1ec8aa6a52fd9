"""Probes of the OpenTelemetry plug-in at its edges: every span ends whatever the turn
meets, what spans carry stays bounded and valid, and the metrics agree with what
happened and with ``registry.statistics()``."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode

import sessionactors as sa
import sessionactors.aio as aio
from otel_sdk import Otel
from sessionactors.otel import OpenTelemetry
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel


def call(name: str, id: str, **arguments: Any) -> sa.ToolCall:
    return sa.ToolCall(id=id, name=name, arguments=json.dumps(arguments))


def texts(span: ReadableSpan) -> list[tuple[str, str]]:
    """Every string the span carries (attributes, status, events), by where it is."""
    out = [(k, v) for k, v in span.attributes.items() if isinstance(v, str)]
    out.append(("status", span.status.description or ""))
    for event in span.events:
        out += [(f"{event.name}.{k}", v) for k, v in event.attributes.items() if isinstance(v, str)]
    return out


class _ConnectFails:
    """A model whose ``stream`` raises at once (it connects before returning a stream)."""

    def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        raise ConnectionError("the model's server refused the connection")


async def test_a_model_whose_stream_raises_at_once_ends_its_chat_span(otel: Otel) -> None:
    """``Model.stream`` need not be an async generator: one that raises when called (before
    any chunk) fails the turn, and its chat span ends with the error like any other."""
    async with sa.open_registry(
        agents={"a": sa.Agent(model=_ConnectFails())}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10), pytest.raises(sa.TurnFailedError):
            await ref.send("hi")
    assert otel.still_open() == []
    [chat] = otel.named("chat ")
    assert chat.status.status_code is StatusCode.ERROR
    assert chat.attributes["error.type"] == "ConnectionError"
    [point] = otel.points("gen_ai.client.operation.duration")
    assert point.count == 1
    assert point.attributes["error.type"] == "ConnectionError"


async def test_a_summarizer_whose_stream_raises_at_once_ends_its_chat_span(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """The same for compaction's summarizer: the turn fails, its chat span ends."""
    agent = sa.Agent(
        model=ScriptedModel(["first answer, long enough to compact", "never"]),
        compaction=sa.Compaction(max_tokens=5, keep_last=1, summarizer=_ConnectFails()),
    )
    async with sa.open_registry(agents={"a": agent}, telemetry=otel.telemetry) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send("hello there, a first message")
            with pytest.raises(sa.TurnFailedError):
                await ref.send("a second message that needs compaction first")
    assert otel.still_open() == []
    failed = [s for s in otel.named("chat ") if s.status.status_code is StatusCode.ERROR]
    assert [s.name for s in failed] == ["chat _ConnectFails"]


class _Unprintable(Exception):
    """An exception whose ``str()`` raises (a buggy client library's)."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


async def test_an_exception_whose_str_raises_ends_every_span_and_counts_the_turn(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """A tool and a model that raise an exception whose ``str()`` raises: the turn fails as
    usual, every span still ends marked ERROR with the exception's type, and the turn is
    counted."""

    @sa.tool
    async def broken() -> str:
        """Fails oddly."""
        raise _Unprintable()

    model = ScriptedModel([Scripted(tool_calls=[call("broken", "c1")]), _Unprintable()])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[broken])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10), pytest.raises(sa.TurnFailedError):
            await ref.send("hi")
        assert registry.statistics().turns_failed == 1
    assert otel.still_open() == []
    [turn] = otel.named("invoke_agent")
    [tool] = otel.named("execute_tool")
    failed_chat = otel.named("chat ")[-1]
    for span in (turn, tool, failed_chat):
        assert span.status.status_code is StatusCode.ERROR, span.name
        assert span.attributes["error.type"] == "_Unprintable", span.name
        [event] = span.events
        assert event.name == "exception"
        assert event.attributes["exception.type"].endswith("_Unprintable")
    [point] = otel.points("sessionactors.turns")
    assert (point.value, point.attributes["sessionactors.turn.outcome"]) == (1, "failed")


async def test_error_text_in_spans_is_bounded_and_valid_unicode(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """A tool that raises with the model's argument in its message (a megabyte, with a lone
    surrogate, as ``json.loads`` makes of ``"\\ud800"``) and a model whose error carries a huge response body: no string on a span is
    whole (each stays within a few kilobytes) and every one is valid UTF-8, which an OTLP
    exporter needs to send the batch at all."""
    huge = "\\ud800" + "x" * 1_000_000

    @sa.tool
    async def raising(text: str) -> str:
        """Raises with its argument."""
        raise ValueError(f"cannot parse {text}")

    arguments = '{"text": "' + huge + '"}'
    model = ScriptedModel(
        [
            Scripted(
                tool_calls=[
                    sa.ToolCall(id="c1", name="raising", arguments=arguments),
                ]
            ),
            RuntimeError("HTTP 400: " + "y" * 1_000_000 + "\udc80"),
        ]
    )
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[raising])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30), pytest.raises(sa.TurnFailedError):
            await ref.send("hi")
    assert otel.still_open() == []
    spans = otel.spans()
    assert {s.name for s in spans} == {
        "invoke_agent a",
        "chat ScriptedModel",
        "execute_tool raising",
    }
    for span in spans:
        for where, text in texts(span):
            assert len(text) <= 20_000, (span.name, where, len(text))
            text.encode("utf-8")  # no lone surrogate
    assert "cannot parse" in otel.named("execute_tool raising")[0].status.description


async def test_a_cancelled_model_call_is_no_error(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """``ref.cancel()`` during a model call: the turn's span says ``cancelled`` without an
    error, and so does its chat span (no ERROR status, no ``error.type`` on the span or on
    the call's duration), as for the tool calls a cancel cuts: a dashboard of model errors
    does not count the users' cancels."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="one two three", wait=gate, wait_after=1)])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model)}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            turn = await ref.submit("hi")
            await trio.testing.wait_all_tasks_blocked()
            assert await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
        assert registry.statistics().turns_cancelled == 1
    assert otel.still_open() == []
    [turn_span] = otel.named("invoke_agent")
    [chat] = otel.named("chat ")
    assert turn_span.attributes["sessionactors.turn.outcome"] == "cancelled"
    for span in (turn_span, chat):
        assert span.status.status_code is StatusCode.UNSET, span.name
        assert "error.type" not in span.attributes, span.name
    [point] = otel.points("gen_ai.client.operation.duration")
    assert "error.type" not in point.attributes


async def test_session_counters_never_fall_back_when_a_registry_closes(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """One OpenTelemetry serves two registries: when one closes, the hibernations and wakes
    it counted (its closing hibernations included) stay in the counters (a counter that
    fell would read as a reset, and a backend would count the other registry's total
    again), while the live sessions gauge drops to what still runs."""
    agents = {"a": sa.Agent(model=ScriptedModel(["one", "two", "three"]))}
    with trio.fail_after(10):
        async with sa.open_registry(agents=agents, telemetry=otel.telemetry) as staying:
            async with sa.open_registry(agents=agents, telemetry=otel.telemetry) as closing:
                for registry, name in ((closing, "c1"), (closing, "c2"), (staying, "s1")):
                    await (await registry.spawn(name)).send("hi")
                await closing.ref("c1").hibernate()
                await closing.ref("c1").state()  # woken again
                assert otel.value("sessionactors.sessions.live") == 3
                assert otel.value("sessionactors.sessions.hibernations") == 1
                assert otel.value("sessionactors.sessions.wakes") == 4
            closed = closing.statistics()
            assert closed.hibernated == 3  # c1 twice, c2 once (at the close)
            assert otel.value("sessionactors.sessions.live") == 1
            assert otel.value("sessionactors.sessions.hibernations") == closed.hibernated
            assert otel.value("sessionactors.sessions.wakes") == closed.woken + 1  # s1's
            await staying.ref("s1").hibernate()
            assert otel.value("sessionactors.sessions.hibernations") == closed.hibernated + 1
        assert otel.value("sessionactors.sessions.live") == 0
        assert otel.value("sessionactors.sessions.hibernations") == closed.hibernated + 1
        assert otel.value("sessionactors.sessions.wakes") == closed.woken + 1


async def test_statistics_and_session_metrics_read_from_another_thread(otel: Otel) -> None:
    """A metric reader collects in its own thread (OpenTelemetry's periodic reader; a
    Prometheus collector too): with a session marked failed after a store fault, the
    session metrics are still observed there and ``registry.statistics()`` answers there
    as in the registry's thread (it raised "must be called from async context")."""
    store = FaultyStore()
    async with sa.open_registry(
        agents={"a": sa.Agent(model=ScriptedModel(["x"]))},
        store=store,
        telemetry=otel.telemetry,
        max_restarts=0,
    ) as registry:
        ref = await registry.spawn("s")
        await (await registry.spawn("t")).send("hi")
        store.fail("append", session_id="s", times=None)
        with trio.fail_after(10), pytest.raises(sa.SessionCrashedError):
            await ref.send("hi")
        here = registry.statistics()
        assert here.failed_sessions == 1
        with trio.fail_after(10):
            there = await trio.to_thread.run_sync(registry.statistics)
            data = await trio.to_thread.run_sync(otel.reader.get_metrics_data)
        assert there == here
        assert data is not None
        observed = {
            metric.name: metric.data.data_points[0].value
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name.startswith("sessionactors.sessions.")
        }
        assert observed == {
            "sessionactors.sessions.live": here.live,
            "sessionactors.sessions.hibernations": here.hibernated,
            "sessionactors.sessions.wakes": here.woken,
            "sessionactors.sessions.unclean_wakes": here.unclean_wakes,
        }


async def test_a_stop_that_ends_a_turn_waiting_on_a_review_is_counted_as_cancelled(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """``ref.stop()`` ends the turn that waits on a review as cancelled (its
    ``TurnCancelled``, ``statistics().turns_cancelled``): the telemetry hears that end
    too, as the review's continuation would be, an ``invoke_agent`` span of the same turn
    with outcome ``cancelled``, so the turns metric agrees with the statistics."""

    @sa.tool(requires_review=True)
    async def pay() -> str:
        """Pays."""
        return "paid"

    model = ScriptedModel([Scripted(tool_calls=[call("pay", "c1")])])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[pay])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            waiting = await ref.send("pay")
            assert waiting.reviews
            await ref.stop()
        assert registry.statistics().turns_cancelled == 1
    assert otel.still_open() == []
    turns = otel.named("invoke_agent")
    assert [t.attributes["sessionactors.turn.outcome"] for t in turns] == ["waiting", "cancelled"]
    assert {t.attributes["sessionactors.turn.id"] for t in turns} == {waiting.turn_id}
    assert turns[1].status.status_code is StatusCode.UNSET
    counted = {
        p.attributes["sessionactors.turn.outcome"]: p.value
        for p in otel.points("sessionactors.turns")
    }
    assert counted == {"waiting": 1, "cancelled": 1}


async def test_a_registry_cancelled_from_outside_is_closed_for_the_telemetry(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """The application cancels the scope around ``open_registry`` (its own shutdown) while
    a turn runs: the telemetry still hears ``registry_closed`` (the OpenTelemetry plug-in
    held on to the dead registry, and observed it, for ever), and every span ends."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="one two three", wait=gate, wait_after=1)])
    closed: list[sa.Registry] = []

    class Hears(OpenTelemetry):
        def registry_closed(self, registry: Any) -> None:
            closed.append(registry)
            super().registry_closed(registry)

    telemetry = Hears(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    with trio.move_on_after(5) as cut:
        async with sa.open_registry(
            agents={"a": sa.Agent(model=model)}, telemetry=telemetry
        ) as registry:
            ref = await registry.spawn("s")
            await (await registry.spawn("t")).state()  # live, idle
            await ref.submit("hi")
            await trio.sleep(100)
    assert cut.cancelled_caught
    assert closed == [registry]
    assert repr(telemetry) == "<OpenTelemetry registries=0>"
    assert otel.still_open() == []


class _AsyncioModel:
    """An asyncio model with a name of its own (as an asyncio client's wrapper has)."""

    model = "gpt-test"

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await asyncio.sleep(0)
        yield sa.TextChunk("hello")


def test_an_asyncio_model_under_the_asyncio_host_is_named_after_itself(otel: Otel) -> None:
    """``sessionactors.aio`` runs an asyncio model through a wrapper: its chat spans and
    call metrics are named after the model (its ``model``), not after the wrapper."""

    async def main() -> None:
        async with aio.open_registry(
            agents={"a": sa.Agent(model=_AsyncioModel())}, telemetry=otel.telemetry
        ) as registry:
            ref = await registry.spawn("s")
            assert (await asyncio.wait_for(ref.send("hi"), 10)).text == "hello"

    asyncio.run(main())
    [chat] = otel.named("chat ")
    assert chat.name == "chat gpt-test"
    assert chat.attributes["gen_ai.request.model"] == "gpt-test"
    [point] = otel.points("gen_ai.client.operation.duration")
    assert point.attributes["gen_ai.request.model"] == "gpt-test"


def test_under_the_asyncio_host_a_turn_is_its_own_trace_and_asyncio_spans_nest_in_it(
    otel: Otel,
) -> None:
    """Under ``sessionactors.aio`` as under trio, a turn sent from inside an asyncio
    handler's span is the root of its own trace (not the handler's child), and the spans
    an asyncio model and an asyncio tool make, in their asyncio tasks, nest under the
    call's chat span and the tool's execute_tool span."""
    app_tracer = otel.tracer_provider.get_tracer("app")

    class Traced:
        model = "gpt-test"

        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            with app_tracer.start_as_current_span("POST /chat/completions"):
                await asyncio.sleep(0)
            if request.messages[-1].role is sa.Role.USER:
                yield sa.ToolCallChunk(index=0, id="c1", name="lookup", arguments="{}")
            else:
                yield sa.TextChunk("done")

    @sa.tool
    async def lookup() -> str:
        """Looks up."""
        with app_tracer.start_as_current_span("SELECT orders"):
            await asyncio.sleep(0)
        return "shipped"

    async def main() -> None:
        async with aio.open_registry(
            agents={"a": sa.Agent(model=Traced(), tools=[lookup])}, telemetry=otel.telemetry
        ) as registry:
            ref = await registry.spawn("s")
            with app_tracer.start_as_current_span("GET /chat"):
                assert (await asyncio.wait_for(ref.send("hi"), 10)).text == "done"

    asyncio.run(main())
    assert otel.still_open() == []
    by_id = {s.context.span_id: s for s in otel.spans()}

    def parent(span: ReadableSpan) -> str | None:
        return by_id[span.parent.span_id].name if span.parent is not None else None

    [turn] = otel.named("invoke_agent")
    [handler] = otel.named("GET /chat")
    assert turn.parent is None
    assert turn.context.trace_id != handler.context.trace_id
    chats = otel.named("chat ")
    requests = otel.named("POST ")
    assert len(chats) == len(requests) == 2
    assert {r.parent.span_id for r in requests if r.parent} == {c.context.span_id for c in chats}
    assert [parent(s) for s in chats] == ["invoke_agent a", "invoke_agent a"]
    [tool] = otel.named("execute_tool")
    assert parent(tool) == "invoke_agent a"
    assert parent(otel.named("SELECT ")[0]) == "execute_tool lookup"
    assert {s.context.trace_id for s in otel.spans() if s is not handler} == {turn.context.trace_id}


async def test_a_models_huge_tool_call_id_is_not_whole_on_the_span(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """The model chooses its tool call ids: one that streams a 500,000-character id (it
    is kept whole in the history, within the answer's bound) gets a bounded
    ``gen_ai.tool.call.id`` on its execute_tool span."""

    @sa.tool
    async def ping() -> str:
        """Pings."""
        return "pong"

    huge_id = "call_" + "x" * 500_000
    model = ScriptedModel([Scripted(tool_calls=[call("ping", huge_id)]), "done"])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[ping])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            assert (await ref.send("hi")).text == "done"
    [tool] = otel.named("execute_tool")
    call_id = tool.attributes["gen_ai.tool.call.id"]
    assert len(call_id) <= 400
    assert call_id.startswith("call_xxx")


async def test_a_turn_whose_outcome_write_fails_is_not_counted_completed(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """The store refuses the write of a turn's outcome: the session crashes and restarts,
    the caller hears so, and the turn is counted crashed by the telemetry. The
    statistics counted it completed as well (before the write), and again when the
    caller retried it with its key: two completed turns for one reply."""
    store = FaultyStore()
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="lost", wait=gate), "kept"])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model)}, store=store, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            turn = await ref.submit("hi", idempotency_key="k")
            await trio.testing.wait_all_tasks_blocked()
            store.fail("append", session_id="s")
            gate.set()
            with pytest.raises(sa.SessionCrashedError):
                await turn.reply()
            assert store.injected == 1
            assert registry.statistics().turns_completed == 0
            assert (await ref.send("hi", idempotency_key="k")).text == "kept"
        stats = registry.statistics()
        assert (stats.crashes, stats.turns_completed) == (1, 1)
    counted = {
        p.attributes["sessionactors.turn.outcome"]: p.value
        for p in otel.points("sessionactors.turns")
    }
    assert counted == {"crashed": 1, "finished": 1}


@pytest.mark.redis
async def test_a_subscriber_on_another_worker_that_lags_is_counted(
    otel: Otel, redis_url: str
) -> None:
    """A subscriber on worker a of a session live on worker b reads a mirror of its events:
    when it falls behind and is cut off, worker a's ``sessionactors.subscribers.lagged``
    counts it, as it counts the subscribers of the sessions live on a."""
    from redis_workers import open_worker

    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", subscriber_buffer=2, telemetry=otel.telemetry) as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            await b.spawn("s")
            await b.ref("s").state()  # live on b
            async with a.ref("s").subscribe() as stream:
                await b.ref("s").send("more words than the buffer of two holds")  # never read
                with pytest.raises(sa.SubscriberLaggedError):
                    async for _ in stream:
                        pass
    assert otel.value("sessionactors.subscribers.lagged") == 1


async def test_spans_the_models_own_code_makes_nest_under_its_chat_span(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """A model's own spans (an instrumented HTTP client's request, say) nest under the chat
    span of the call that made them, as a tool's nest under its execute_tool span; the
    spans after the call (the tools') are the turn's children again."""
    app_tracer = otel.tracer_provider.get_tracer("http-client")

    class Traced:
        model = "gpt-test"

        def __init__(self) -> None:
            self.answers = iter([Scripted(tool_calls=[call("ping", "c1")]), Scripted(text="done")])

        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            answer = next(self.answers)
            with app_tracer.start_as_current_span("POST /chat/completions"):
                await trio.sleep(1)
            if answer.tool_calls:
                [tool_call] = answer.tool_calls
                yield sa.ToolCallChunk(
                    index=0, id=tool_call.id, name=tool_call.name, arguments=tool_call.arguments
                )
            else:
                yield sa.TextChunk(answer.text)

    @sa.tool
    async def ping() -> str:
        """Pings."""
        with app_tracer.start_as_current_span("ping"):
            return "pong"

    async with sa.open_registry(
        agents={"a": sa.Agent(model=Traced(), tools=[ping])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            assert (await ref.send("hi")).text == "done"
    assert otel.still_open() == []
    by_id = {s.context.span_id: s for s in otel.spans()}

    def parent(span: ReadableSpan) -> str | None:
        return by_id[span.parent.span_id].name if span.parent is not None else None

    [turn] = otel.named("invoke_agent")
    chats = otel.named("chat ")
    requests = otel.named("POST ")
    assert len(chats) == len(requests) == 2
    for request in requests:
        assert parent(request) == "chat gpt-test"
    assert {r.parent.span_id for r in requests if r.parent} == {c.context.span_id for c in chats}
    assert [parent(s) for s in chats] == ["invoke_agent a", "invoke_agent a"]
    [tool] = otel.named("execute_tool")
    assert parent(tool) == "invoke_agent a"
    assert parent(otel.named("ping")[0]) == "execute_tool ping"
    assert turn.parent is None


class _RaisingProcessor(SpanProcessor):
    """A span processor of the SDK that raises as spans start, or as they end."""

    def __init__(self, when: str) -> None:
        self.when = when

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.when == "start":
            raise RuntimeError("the span processor failed")

    def on_end(self, span: Any) -> None:
        if self.when == "end":
            raise RuntimeError("the span processor failed")


@pytest.mark.parametrize("when", ["start", "end"])
async def test_a_span_processor_that_raises_leaves_the_metrics_whole(
    when: str, caplog: pytest.LogCaptureFixture, autojump_clock: trio.abc.Clock
) -> None:
    """A span processor that raises as spans start or end (a broken trace pipeline)
    leaves turns and their metrics alone: every turn, model call and tool call is
    counted and timed, and one WARNING says so. (Every turn metric was missing: traces
    and metrics share the turn's hook, which was given up after its first failure.)"""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(_RaisingProcessor(when))
    reader = InMemoryMetricReader()
    telemetry = OpenTelemetry(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )

    @sa.tool
    async def lookup() -> str:
        """Looks up."""
        return "found"

    steps: list[Scripted | str] = []
    for i in range(3):  # three turns, each a tool call and its answer
        steps += [Scripted(tool_calls=[call("lookup", f"c{i}")]), "done"]
    model = ScriptedModel(steps)
    agents = {"a": sa.Agent(model=model, tools=[lookup])}
    async with sa.open_registry(agents=agents, telemetry=telemetry) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            for _ in range(3):
                assert (await ref.send("hi")).text == "done"
    data = reader.get_metrics_data()
    assert data is not None
    counted = {
        metric.name: sum(
            getattr(p, "value", getattr(p, "count", 0)) for p in metric.data.data_points
        )
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert counted.get("sessionactors.turns") == 3, counted
    assert counted.get("sessionactors.turn.duration") == 3, counted
    assert counted.get("gen_ai.client.operation.duration") == 6, counted
    assert counted.get("sessionactors.tool.calls") == 3, counted
    warned = [r for r in caplog.records if "span" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
