"""OpenTelemetry: spans and metrics of turns, model and tool calls, checked with the SDK's
in-memory exporters; and the core never imports opentelemetry without the plug-in."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

import sessionactors as sa
from otel_sdk import Otel
from sessionactors.otel import METRICS, OpenTelemetry
from sessionactors.testing import Scripted, ScriptedModel


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def call(name: str, id: str, **arguments: Any) -> sa.ToolCall:
    return sa.ToolCall(id=id, name=name, arguments=json.dumps(arguments))


async def test_a_turn_is_one_trace_with_chat_and_tool_spans_and_the_tools_own_spans_nested(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """invoke_agent is the root of each turn's own trace; chat and execute_tool spans are its
    children with the GenAI attributes, and spans a tool makes (in concurrent tools too) nest
    under that tool's execute_tool span."""
    app_tracer = otel.tracer_provider.get_tracer("app")

    @sa.tool
    async def lookup(order_id: str) -> str:
        """Look up an order."""
        with app_tracer.start_as_current_span(f"db {order_id}"):
            await trio.sleep(1)
        return "shipped"

    model = ScriptedModel(
        [
            Scripted(
                text="Checking.",
                tool_calls=[
                    call("lookup", "c1", order_id="A1"),
                    call("lookup", "c2", order_id="B2"),
                ],
                usage=sa.Usage(input_tokens=50, output_tokens=7),
            ),
            Scripted(text="Both shipped.", usage=sa.Usage(input_tokens=80, output_tokens=3)),
            "Bye.",
        ]
    )
    agent = sa.Agent(model=model, tools=[lookup])
    async with sa.open_registry(agents={"support": agent}, telemetry=otel.telemetry) as registry:
        ref = await registry.spawn("s-1")
        with trio.fail_after(30):
            with app_tracer.start_as_current_span("caller"):  # not the turn's parent
                first = await ref.send("Where are A1 and B2?")
            second = await ref.send("Thanks")

    turns = [s for s in otel.spans() if s.name == "invoke_agent support"]
    assert [t.attributes["sessionactors.turn.id"] for t in turns] == [first.turn_id, second.turn_id]
    turn = turns[0]
    assert turn.parent is None
    assert turns[1].context.trace_id != turn.context.trace_id
    attributes = dict(turn.attributes)
    assert attributes.pop("sessionactors.turn.queue_wait") >= 0  # (its session woke first)
    assert attributes == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "support",
        "gen_ai.conversation.id": "s-1",
        "sessionactors.turn.id": first.turn_id,
        "sessionactors.turn.outcome": "finished",
    }
    in_first = [s for s in otel.spans() if s.context.trace_id == turn.context.trace_id]
    chats = [s for s in in_first if s.name == "chat ScriptedModel"]
    assert len(chats) == 2
    for chat, (i, o) in zip(chats, [(50, 7), (80, 3)], strict=True):
        assert parent_of(chat) == turn.context.span_id
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "ScriptedModel"
        assert chat.attributes["gen_ai.usage.input_tokens"] == i
        assert chat.attributes["gen_ai.usage.output_tokens"] == o
    tools = {
        s.attributes["gen_ai.tool.call.id"]: s for s in in_first if s.name == "execute_tool lookup"
    }
    assert sorted(tools) == ["c1", "c2"]
    for call_id, order in (("c1", "A1"), ("c2", "B2")):
        tool_span = tools[call_id]
        assert parent_of(tool_span) == turn.context.span_id
        assert tool_span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert tool_span.attributes["gen_ai.tool.name"] == "lookup"
        assert tool_span.status.status_code is StatusCode.UNSET
        assert parent_of(otel.span(f"db {order}")) == tool_span.context.span_id
    # the second turn reported no usage: its chat span says nothing of tokens
    [last_chat] = [
        s
        for s in otel.spans()
        if s.context.trace_id == turns[1].context.trace_id and s.name.startswith("chat")
    ]
    assert "gen_ai.usage.input_tokens" not in last_chat.attributes
    assert parent_of(otel.span("caller")) is None


async def test_failures_set_error_status_and_type(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """A model that raises marks its chat span and the turn's span ERROR with the exception's
    type; a tool that raises marks its execute_tool span only (the turn goes on)."""

    @sa.tool
    async def broken() -> str:
        """Always fails."""
        raise KeyError("gone")

    model = ScriptedModel(
        [ValueError("model down"), Scripted(tool_calls=[call("broken", "c9")]), "Sorry."]
    )
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[broken])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("hi")
            await ref.send("again")

    failed, finished = [s for s in otel.spans() if s.name == "invoke_agent a"]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "ValueError"
    assert failed.attributes["sessionactors.turn.outcome"] == "failed"
    [failed_chat] = [
        s for s in otel.spans() if s.parent and s.parent.span_id == failed.context.span_id
    ]
    assert failed_chat.status.status_code is StatusCode.ERROR
    assert failed_chat.attributes["error.type"] == "ValueError"
    tool_span = otel.span("execute_tool broken")
    assert tool_span.status.status_code is StatusCode.ERROR
    assert tool_span.attributes["error.type"] == "KeyError"
    assert finished.status.status_code is StatusCode.UNSET
    assert (
        otel.by("sessionactors.turns", "sessionactors.turn.outcome")["failed"].attributes[
            "error.type"
        ]
        == "ValueError"
    )


async def test_metrics_count_turns_tokens_sessions_store_writes_and_lagging_subscribers(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """Turns by outcome, turn and call durations, time to first chunk, token usage, live and
    hibernated sessions, mailbox depth, store writes and cut-off subscribers are recorded."""
    gate = trio.Event()
    model = ScriptedModel(
        [
            Scripted(
                text="one two three four five six",
                usage=sa.Usage(input_tokens=9, output_tokens=6),
                wait=gate,
                wait_after=0,
            ),
            Scripted(text="ok", usage=sa.Usage(input_tokens=20, output_tokens=1)),
            RuntimeError("boom"),
        ]
    )
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model)}, telemetry=otel.telemetry, subscriber_buffer=1
    ) as registry:
        ref = await registry.spawn("s")
        other = await registry.spawn("t")
        with trio.fail_after(10):
            async with ref.subscribe() as events:  # never read: cut off
                first = await ref.submit("hello")
                queued = [await ref.submit("again"), await ref.submit("fails")]
                await trio.testing.wait_all_tasks_blocked()
                assert otel.points("sessionactors.turns.running")[0].value == 1  # held
                gate.set()
                await first.reply()
                await queued[0].reply()
                with pytest.raises(sa.TurnFailedError):
                    await queued[1].reply()
                with pytest.raises(sa.SubscriberLaggedError):
                    async for _ in events:
                        pass
            await other.state()  # live, no turn
            assert otel.points("sessionactors.sessions.live")[0].value == 2
            assert otel.points("sessionactors.turns.running")[0].value == 0
            await ref.hibernate()

        turns = otel.by("sessionactors.turns", "sessionactors.turn.outcome")
        assert {k: p.value for k, p in turns.items()} == {"finished": 2, "failed": 1}
        assert turns["finished"].attributes["gen_ai.agent.name"] == "a"
        assert sum(p.count for p in otel.points("sessionactors.turn.duration")) == 3
        calls = otel.points("gen_ai.client.operation.duration")
        assert sum(p.count for p in calls) == 3
        assert {p.attributes.get("error.type") for p in calls} == {None, "RuntimeError"}
        assert sum(p.count for p in otel.points("gen_ai.client.operation.time_to_first_chunk")) == 2
        tokens = otel.by("gen_ai.client.token.usage", "gen_ai.token.type")
        assert (tokens["input"].sum, tokens["input"].count) == (29, 2)
        assert (tokens["output"].sum, tokens["output"].count) == (7, 2)
        assert tokens["input"].attributes["gen_ai.request.model"] == "ScriptedModel"
        [depth] = otel.points("sessionactors.mailbox.depth")
        assert (depth.count, depth.max) == (3, 2)  # the first turn saw two waiting behind it
        assert otel.points("sessionactors.subscribers.lagged")[0].value == 1
        writes = otel.by("sessionactors.store.write.duration", "sessionactors.store.operation")
        assert writes["append"].count >= 3
        assert writes["snapshot"].count >= 1
        assert otel.points("sessionactors.sessions.hibernations")[0].value >= 1
    # a closed registry is no longer observed
    assert otel.points("sessionactors.sessions.live")[0].value == 0


def test_every_metric_is_documented_in_the_how_to() -> None:
    """Each metric name the plug-in records appears in docs/howto/observability.md."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "howto" / "observability.md").read_text()
    assert [name for name in METRICS if f"`{name}`" not in page] == []


async def test_telemetry_must_be_a_telemetry() -> None:
    """open_registry refuses a telemetry that is not a sessionactors.Telemetry, naming it."""
    with pytest.raises(TypeError, match=r"telemetry must be a sessionactors\.Telemetry"):
        async with sa.open_registry(
            agents={"a": sa.Agent(model=ScriptedModel())}, telemetry=object()
        ):  # type: ignore[arg-type]
            pass


_WITHOUT_PLUGIN = textwrap.dedent(
    """
    import sys
    import trio
    {before}
    import sessionactors as sa
    from sessionactors.testing import EchoModel

    async def main():
        async with sa.open_registry(agents={{"a": sa.Agent(model=EchoModel())}}) as registry:
            ref = await registry.spawn("s")
            assert (await ref.send("hello there")).text == "hello there"

    trio.run(main)
    print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
    """
)


def modules_after_a_turn(before: str = "") -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PLUGIN.format(before=before)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    loaded: list[str] = json.loads(out.stdout.strip().replace("'", '"'))
    return loaded


def test_the_core_never_imports_opentelemetry() -> None:
    """Importing sessionactors and running a turn loads no opentelemetry module; the check
    sees one when the plug-in is imported (negative control)."""
    assert modules_after_a_turn() == []
    assert "opentelemetry.trace" in modules_after_a_turn("import sessionactors.otel")


#: Every hook of the telemetry seam, as ``Telemetry``'s or a trace's method name.
_HOOKS = [
    "registry_opened",
    "registry_closed",
    "turn",
    "store_write",
    "subscriber_lagged",
    "activate",
    "model_call",
    "first_chunk",
    "model_end",
    "tool_call",
    "tool_call_exit",
    "tool_failed",
    "turn_end",
]


class _Broken(sa.Telemetry):
    """A telemetry whose one hook ``where`` raises (as a buggy exporter would)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.called: set[str] = set()

    def hook(self, name: str) -> None:
        self.called.add(name)
        if name == self.where:
            raise RuntimeError(f"bug in the {name} hook")

    def registry_opened(self, registry: Any) -> None:
        self.hook("registry_opened")

    def registry_closed(self, registry: Any) -> None:
        self.hook("registry_closed")

    def store_write(self, *, operation: str, seconds: float, error: BaseException | None) -> None:
        self.hook("store_write")

    def subscriber_lagged(self, *, session_id: str) -> None:
        self.hook("subscriber_lagged")

    def turn(self, **_: Any) -> sa.TurnTrace:
        self.hook("turn")
        telemetry = self

        class Call(sa.ModelCallTrace):
            def first_chunk(self) -> None:
                telemetry.hook("first_chunk")

            def end(self, usage: sa.Usage | None, error: BaseException | None) -> None:
                telemetry.hook("model_end")

        class Tool(sa.ToolCallTrace):
            def failed(self, error: BaseException | None, message: str) -> None:
                telemetry.hook("tool_failed")

        class Trace(sa.TurnTrace):
            @contextlib.contextmanager
            def activate(self) -> Iterator[None]:
                telemetry.hook("activate")
                yield

            def model_call(self, model: sa.Model, request: sa.ModelRequest) -> sa.ModelCallTrace:
                telemetry.hook("model_call")
                return Call()

            @contextlib.contextmanager
            def tool_call(self, call: sa.ToolCall) -> Iterator[sa.ToolCallTrace]:
                telemetry.hook("tool_call")
                yield Tool()
                telemetry.hook("tool_call_exit")

            def end(self, outcome: str, error: BaseException | None) -> None:
                telemetry.hook("turn_end")

        return Trace()


@pytest.mark.parametrize("where", _HOOKS)
async def test_a_telemetry_hook_that_raises_is_logged_and_fails_nothing(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Telemetry watches the work and never fails it: a hook that raises is logged (once,
    naming the hook) and the turns, their tools, the store writes and the registry go on
    as without it."""

    async def failing(reason: str) -> str:
        raise ValueError(reason)

    tool = sa.Tool(name="failing", fn=failing, description="Fails.")
    model = ScriptedModel(
        [
            Scripted(tool_calls=[call("failing", "c1", reason="no")]),
            Scripted(text="one two three four"),
            Scripted(text="again"),
        ]
    )
    telemetry = _Broken(where)
    store = sa.MemoryStore()
    with trio.fail_after(10):
        async with sa.open_registry(
            agents={"a": sa.Agent(model=model, tools=[tool])},
            store=store,
            telemetry=telemetry,
            subscriber_buffer=1,
        ) as registry:
            ref = await registry.spawn("s")
            async with ref.subscribe() as events:  # never read: cut off
                assert (await ref.send("hello")).text == "one two three four"
                with pytest.raises(sa.SubscriberLaggedError):
                    async for _ in events:
                        pass
            assert (await ref.send("hi")).text == "again"
            assert (await ref.state()).status is sa.Status.IDLE
            await ref.hibernate()
        async with sa.open_registry(agents={"a": sa.Agent(model=model)}, store=store) as again:
            contents = [m.content for m in await again.ref("s").history()]
    assert where in telemetry.called, " ".join(sorted(telemetry.called))
    assert contents[0] == "hello"
    assert contents[-2:] == ["hi", "again"]
    assert len(contents) == 6
    reports = [
        r for r in caplog.records if r.exc_info and f"the {where} hook" in str(r.exc_info[1])
    ]
    assert len(reports) == 1, "a failing hook is logged once (not at every turn)"
    assert reports[0].levelname == "WARNING"
    assert not [r for r in caplog.records if "crashed" in r.getMessage()]


async def test_requests_refused_by_a_full_mailbox_are_counted(otel: Otel) -> None:
    """A request refused because its session's mailbox is full (MailboxFullError, the
    gateway's 429) is counted: ``statistics().requests_refused`` and the
    ``sessionactors.mailbox.refused`` counter, the back-pressure an operator alerts on
    (the mailbox depth, taken as each turn starts, cannot show a mailbox that is full)."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="one", wait=gate), Scripted(text="two")])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model)}, telemetry=otel.telemetry, mailbox_size=1
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            first = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()  # its turn runs: the mailbox is empty
            second = ref.submit_nowait("again")  # waits in the mailbox, which is full
            refused = 0
            for _ in range(3):
                with pytest.raises(sa.MailboxFullError):
                    ref.submit_nowait("refused")
                refused += 1
            assert registry.statistics().requests_refused == refused
            assert otel.points("sessionactors.mailbox.refused")[0].value == refused
            gate.set()
            await first.reply()
            await second.reply()
        assert registry.statistics().requests_refused == refused
    # the counter goes on from what a closed registry counted (never a reset)
    assert otel.points("sessionactors.mailbox.refused")[0].value == refused


async def test_the_time_a_turn_waited_in_the_mailbox_is_recorded(
    otel: Otel, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn queued behind another records how long it waited, from its acceptance into
    the mailbox to its start, in ``sessionactors.turn.queue_wait`` and on its span; a turn
    that found its session free waited nothing, and a review's continuation records no
    wait (its turn did not wait in the mailbox again)."""
    # Turn ids carry the wall-clock time they were issued: have it follow trio's clock,
    # which the autojump clock moves.
    real_time_ns = time.time_ns
    start = real_time_ns()

    def time_ns() -> int:
        try:
            return start + round(trio.current_time() * 1e9)
        except RuntimeError:  # (outside the run)
            return real_time_ns()

    monkeypatch.setattr(time, "time_ns", time_ns)

    @sa.tool(requires_review=True)
    async def refund(order_id: str) -> str:
        """Refund an order."""
        return "refunded"

    gate = trio.Event()
    model = ScriptedModel(
        [
            Scripted(text="one", wait=gate),
            "two",
            Scripted(tool_calls=[call("refund", "c1", order_id="A1")]),
            "Refunded.",
        ]
    )
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[refund])}, telemetry=otel.telemetry
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(1000):
            first = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()  # its turn runs, held by the gate
            second = await ref.submit("again")  # waits in the mailbox behind it
            await trio.sleep(30)
            gate.set()
            await first.reply()
            reply = await second.reply()
            await trio.sleep(60)  # the session is free again
            waiting = await ref.send("refund A1")
            await trio.sleep(60)  # the review waits: no mailbox wait
            await ref.review(waiting.reviews[0].id, approve=True)

    [point] = otel.points("sessionactors.turn.queue_wait")
    assert point.attributes["gen_ai.agent.name"] == "a"
    assert point.count == 3  # (the review's continuation records none)
    assert point.max == pytest.approx(30, abs=0.001)
    assert point.sum == pytest.approx(30, abs=0.003)  # the other two waited nothing
    spans = {}
    for span in otel.named("invoke_agent"):
        spans.setdefault(span.attributes["sessionactors.turn.id"], []).append(span)
    [queued] = spans[reply.turn_id]
    assert queued.attributes["sessionactors.turn.queue_wait"] == pytest.approx(30, abs=0.001)
    [free] = spans[(await first.reply()).turn_id]
    assert free.attributes["sessionactors.turn.queue_wait"] < 0.001
    paused, resumed = sorted(spans[waiting.turn_id], key=lambda s: s.start_time or 0)
    assert paused.attributes["sessionactors.turn.queue_wait"] < 0.001
    assert "sessionactors.turn.queue_wait" not in (resumed.attributes or {})


async def test_tool_calls_are_counted_by_tool_and_failure(otel: Otel) -> None:
    """Each tool call is counted in ``sessionactors.tool.calls`` by its tool's name, with
    ``error.type`` when it failed: a tool that fails on every call (its database down)
    leaves its turns finished (the model is told the error), and showed only on spans,
    with no signal to alert on."""

    @sa.tool
    async def lookup(order_id: str) -> str:
        """Look up an order."""
        if order_id == "down":
            raise ConnectionError("the orders database is down")
        return "shipped"

    model = ScriptedModel(
        [
            Scripted(tool_calls=[call("lookup", "c1", order_id="A1"), call("lookup", "c2", order_id="down")]),
            "One of them failed.",
        ]
    )  # fmt: skip
    agent = sa.Agent(model=model, tools=[lookup])
    async with sa.open_registry(agents={"support": agent}, telemetry=otel.telemetry) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            assert (await ref.send("Where are they?")).text == "One of them failed."
    calls = otel.points("sessionactors.tool.calls")
    counted = {
        (p.attributes["gen_ai.tool.name"], p.attributes.get("error.type")): p.value for p in calls
    }
    assert counted == {("lookup", None): 1, ("lookup", "ConnectionError"): 1}, counted


async def test_a_model_call_cut_short_says_its_finish_reason(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """A chat span whose answer the model cut short (a FinishChunk) carries
    ``gen_ai.response.finish_reasons``; one that ended of its own accord does not."""
    model = ScriptedModel([Scripted(text="The first", finish_reason="length"), "Whole."])
    agent = sa.Agent(model=model)
    async with sa.open_registry(agents={"a": agent}, telemetry=otel.telemetry) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send("List ten things.")
            await ref.send("Thanks")
    cut, whole = [s for s in otel.spans() if s.name.startswith("chat")]
    assert cut.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.response.finish_reasons" not in whole.attributes


async def test_exception_messages_can_be_kept_out_of_spans(
    otel: Otel, autojump_clock: trio.abc.Clock
) -> None:
    """``OpenTelemetry(exception_messages=False)``: what an exception says (a model's error
    quoting the user's words, a tool's failure) reaches no span, neither its status, its
    ``exception`` event nor the stack trace; its type, status and frames still do."""
    secret = "my card is 4111 1111 1111 1111"

    @sa.tool
    async def broken(text: str) -> str:
        """Always fails."""
        raise KeyError(text)

    model = ScriptedModel(
        [
            ValueError(f"the provider refused: {secret}"),
            Scripted(tool_calls=[call("broken", "c", text=secret)]),
            "Sorry.",
        ]
    )
    telemetry = OpenTelemetry(
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
        exception_messages=False,
    )
    agent = sa.Agent(model=model, tools=[broken])
    async with sa.open_registry(agents={"a": agent}, telemetry=telemetry) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError):
                await ref.send(secret)
            await ref.send("again")
    failing = [s for s in otel.spans() if s.status.status_code is StatusCode.ERROR]
    assert {s.attributes["error.type"] for s in failing} == {"ValueError", "KeyError"}
    for span in failing:
        assert "4111" not in (span.status.description or "")
        for event in span.events:
            assert all("4111" not in str(value) for value in event.attributes.values())
        [event] = [e for e in span.events if e.name == "exception"]
        stacktrace = str(event.attributes["exception.stacktrace"])
        assert 'File "' in stacktrace  # (its frames)
        assert stacktrace.endswith(str(span.attributes["error.type"]))
