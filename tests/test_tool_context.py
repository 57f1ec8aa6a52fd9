"""A tool learns which call, of which turn of which session, it runs for: a parameter
annotated ``sa.ToolContext`` is given the session's id and metadata, the turn's id and
the call's, and is not one of the arguments the model is told of."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.testing import Scripted, ScriptedModel


def call(call_id: str, name: str, **arguments: Any) -> sa.ToolCall:
    return sa.ToolCall(id=call_id, name=name, arguments=json.dumps(arguments))


def results(history: list[sa.Message]) -> dict[str, str]:
    return {m.tool_call_id or "": m.content for m in history if m.role is sa.Role.TOOL}


async def test_a_tool_is_given_its_session_turn_call_and_a_copy_of_the_metadata() -> None:
    seen: list[sa.ToolContext] = []

    @sa.tool
    async def my_orders(status: str, context: sa.ToolContext) -> str:
        """The orders of the session's user."""
        seen.append(context)
        context.metadata["tags"].append("changed by the tool")  # (its own copy)
        return f"{status} orders of {context.metadata['user']}"

    assert my_orders.spec.parameters["properties"] == {"status": {"type": "string"}}
    assert my_orders.spec.parameters["required"] == ["status"]
    model = ScriptedModel([Scripted(tool_calls=[call("c1", "my_orders", status="open")]), "ok"])
    agents = {"shop": sa.Agent(model=model, tools=[my_orders])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="shop", metadata={"user": "ada", "tags": ["vip"]})
        reply = await ref.send("my open orders?")

        assert seen == [
            sa.ToolContext(
                session_id="s",
                turn_id=reply.turn_id,
                call_id="c1",
                metadata={"user": "ada", "tags": ["vip", "changed by the tool"]},
            )
        ]
        assert results(await ref.history()) == {"c1": "open orders of ada"}
        assert (await ref.state()).metadata == {"user": "ada", "tags": ["vip"]}


async def test_each_call_of_a_step_is_given_its_own_context_in_every_kind_of_tool() -> None:
    """Calls of one step run concurrently: an async tool, a ``def`` tool (in a worker
    thread), a tool given its schema, and a tool that takes no context."""
    seen: dict[str, tuple[str, str]] = {}

    async def async_tool(context: sa.ToolContext) -> str:
        seen[context.call_id] = ("async", context.turn_id)
        return context.session_id

    def def_tool(n: int, context: sa.ToolContext) -> str:
        seen[context.call_id] = ("def", context.turn_id)
        return f"{context.session_id} {n}"

    async def schema_tool(ctx: sa.ToolContext, **arguments: Any) -> str:
        seen[ctx.call_id] = ("schema", ctx.turn_id)
        return f"{ctx.session_id} {arguments}"

    async def plain(n: int) -> int:
        return n + 1

    tools = [
        sa.Tool(name="async_tool", fn=async_tool),
        sa.Tool(name="def_tool", fn=def_tool),
        sa.Tool(name="schema_tool", fn=schema_tool, parameters={"type": "object"}),
        sa.Tool(name="plain", fn=plain),
    ]
    calls = [
        call("a", "async_tool"),
        call("d", "def_tool", n=1),
        call("e", "schema_tool", x=2),
        call("p", "plain", n=3),
    ]
    steps = [Scripted(tool_calls=calls), "ok", Scripted(tool_calls=calls[1:2]), "ok"]
    agents = {"a": sa.Agent(model=ScriptedModel(steps), tools=tools)}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="a")
        first = await ref.send("go")
        assert seen == {
            "a": ("async", first.turn_id),
            "d": ("def", first.turn_id),
            "e": ("schema", first.turn_id),
        }
        assert results(await ref.history()) == {"a": "s", "d": "s 1", "e": "s {'x': 2}", "p": "4"}

        second = await ref.send("again")  # one call: the step's other path
        assert seen["d"] == ("def", second.turn_id) != ("def", first.turn_id)


async def test_a_call_approved_by_a_review_is_given_the_turn_that_waited_for_it() -> None:
    seen: list[sa.ToolContext] = []

    @sa.tool(requires_review=True, idempotent=False)
    async def refund(order_id: str, context: sa.ToolContext) -> str:
        seen.append(context)
        return f"refunded {order_id}"

    model = ScriptedModel([Scripted(tool_calls=[call("r1", "refund", order_id="A1")]), "done"])
    agents = {"a": sa.Agent(model=model, tools=[refund])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="a", metadata={"user": "ada"})
        waiting = await ref.send("refund A1")
        [review] = waiting.reviews
        reply = await ref.review(review.id, approve=True)
        assert seen == [
            sa.ToolContext(
                session_id="s", turn_id=waiting.turn_id, call_id="r1", metadata={"user": "ada"}
            )
        ]
        assert reply.turn_id == waiting.turn_id


async def test_the_metadata_cannot_change_under_a_call_that_waits_on_its_review() -> None:
    """While a call waits on its review, a metadata change is refused (as a history edit
    is): approved, the call acts for the customer whose turn made it (the change was
    taken, and bob's refund ran for ada)."""
    ran: list[tuple[str, str]] = []

    @sa.tool(requires_review=True, idempotent=False)
    async def refund(order_id: str, context: sa.ToolContext) -> str:
        ran.append((context.metadata["customer"], order_id))
        return "refunded"

    model = ScriptedModel([Scripted(tool_calls=[call("r1", "refund", order_id="B2")]), "done"])
    agents = {"a": sa.Agent(model=model, tools=[refund])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s", agent="a", metadata={"customer": "bob"})
        [review] = (await ref.send("refund B2")).reviews
        with pytest.raises(sa.SessionBusyError, match="cannot change its metadata while review"):
            await ref.set_metadata({"customer": "ada"})
        await ref.review(review.id, approve=True)
        assert ran == [("bob", "B2")]
        assert await ref.set_metadata({"customer": "ada"}) == {"customer": "ada"}


async def test_invoke_gives_a_context_to_a_tool_that_takes_one_and_requires_it() -> None:
    @sa.tool
    async def whose(context: sa.ToolContext) -> str:
        return f"{context.session_id}/{context.turn_id}/{context.call_id} {context.metadata}"

    context = sa.ToolContext(session_id="s", turn_id="t", call_id="c", metadata={"user": "ada"})
    assert await whose.invoke("{}", context=context) == sa.ToolOutcome(
        content="s/t/c {'user': 'ada'}"
    )
    with pytest.raises(TypeError, match=r"tool 'whose' takes a ToolContext \(its parameter "):
        await whose.invoke("{}")
    with pytest.raises(TypeError, match=r"context must be a sessionactors\.ToolContext"):
        await whose.invoke("{}", context={"session_id": "s"})  # type: ignore[arg-type]
    # a tool that takes none is given none
    assert await sa.Tool(name="x", fn=lambda: "x").invoke("{}", context=context) == sa.ToolOutcome(
        content="x"
    )


def test_a_tool_with_two_context_parameters_is_refused_when_made() -> None:
    async def both(a: sa.ToolContext, b: sa.ToolContext) -> str:
        return ""

    with pytest.raises(TypeError, match="parameters 'a' and 'b' are both annotated ToolContext"):
        sa.tool(both)
    with pytest.raises(TypeError, match="parameters 'a' and 'b' are both annotated ToolContext"):
        sa.Tool(name="both", fn=both, parameters={"type": "object"})


def test_an_asyncio_tool_is_given_its_context() -> None:
    seen: list[sa.ToolContext] = []

    async def lookup(context: sa.ToolContext) -> str:
        await asyncio.sleep(0)
        seen.append(context)
        return context.metadata["user"]

    model = ScriptedModel([Scripted(tool_calls=[call("c1", "lookup")]), "ok"])
    agents = {"a": sa.Agent(model=model, tools=[sa.tool(lookup)])}

    async def main() -> None:
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("s", agent="a", metadata={"user": "ada"})
            reply = await ref.send("who?")
            assert seen == [
                sa.ToolContext(
                    session_id="s", turn_id=reply.turn_id, call_id="c1", metadata={"user": "ada"}
                )
            ]
            assert results(await ref.history()) == {"c1": "ada"}

    asyncio.run(main())


class Traced(sa.Telemetry):
    """Telemetry that follows every turn, noting the tool calls it wraps."""

    def __init__(self) -> None:
        self.wrapped: list[str] = []

    def turn(self, **_: Any) -> sa.TurnTrace:
        wrapped = self.wrapped

        class Trace(sa.TurnTrace):
            @contextlib.contextmanager
            def tool_call(self, call: sa.ToolCall) -> Iterator[sa.ToolCallTrace]:
                wrapped.append(call.id)
                yield sa.ToolCallTrace()

        return Trace()


async def test_a_traced_turn_gives_the_context_too() -> None:
    seen: list[str] = []

    @sa.tool
    async def tagged(context: sa.ToolContext) -> str:
        seen.append(context.call_id)
        return "ok"

    model = ScriptedModel([Scripted(tool_calls=[call("c1", "tagged")]), "ok"])
    telemetry = Traced()
    agents = {"a": sa.Agent(model=model, tools=[tagged])}
    async with sa.open_registry(agents=agents, telemetry=telemetry) as registry:
        ref = await registry.spawn("s", agent="a")
        await ref.send("go")
    assert seen == telemetry.wrapped == ["c1"]


def test_a_tool_given_its_schema_reads_no_annotation_but_its_context_parameters() -> None:
    """With ``parameters=``, annotations are not evaluated (free-form text is fine); a
    context parameter is found as a class or as its name in text (an annotation under
    ``from __future__ import annotations`` whose ToolContext is imported for type
    checkers only); a schema that names it, and a context parameter that is optional or
    ``**kwargs``, are refused when the tool is made."""

    async def free(order: str) -> str:
        return order

    free.__annotations__["order"] = "the order's id, as the customer wrote it"  # (free text)

    schema = {"type": "object", "properties": {"order": {"type": "string"}}}
    assert sa.Tool(name="free", fn=free, parameters=schema).spec.parameters == schema

    async def named_in_text(order: str, context: "sa.ToolContext") -> str:  # noqa: UP037
        return f"{order} {context.call_id}"

    async def named_bare(order: str, context: sa.ToolContext) -> str:
        return f"{order} {context.call_id}"

    named_bare.__annotations__["context"] = "ToolContext"  # (imported for type checkers only)

    context = sa.ToolContext(session_id="s", turn_id="t", call_id="c")
    for fn in (named_in_text, named_bare):
        t = sa.Tool(name="t", fn=fn, parameters=schema)
        assert trio.run(functools.partial(t.invoke, '{"order": "A1"}', context=context)) == (
            sa.ToolOutcome(content="A1 c")
        )

    async def told(order: str, context: sa.ToolContext) -> str:
        return order

    naming = {"type": "object", "properties": {"context": {"type": "string"}}}
    with pytest.raises(TypeError, match="'context' is the tool's ToolContext: the model"):
        sa.Tool(name="told", fn=told, parameters=naming)

    async def optional(context: sa.ToolContext | None = None) -> str:
        return ""

    async def keywords(**context: sa.ToolContext) -> str:
        return ""

    with pytest.raises(TypeError, match="annotate it ToolContext: a tool is always given one"):
        sa.tool(optional)
    with pytest.raises(TypeError, match=r"'context' \(a ToolContext\) is given by name"):
        sa.Tool(name="keywords", fn=keywords, parameters={"type": "object"})


class Lookup:
    """A tool that is an object (its ``__call__``), as a class of tools with state."""

    def __init__(self, seen: list[sa.ToolContext]) -> None:
        self.seen = seen

    async def __call__(self, order: str, context: sa.ToolContext) -> str:
        self.seen.append(context)
        await asyncio.sleep(0)
        return f"{order} for {context.metadata['user']}"


async def _lookup(seen: list[str], order: str, context: sa.ToolContext) -> str:
    seen.append(context.call_id)
    await asyncio.sleep(0)
    return order


def test_an_asyncio_tool_that_is_an_object_or_a_partial_is_given_its_context() -> None:
    """Under ``sessionactors.aio``, a tool whose function is a callable object or a
    ``functools.partial`` works as under trio, its context given (the adapter that runs
    it on the loop read its own annotations instead: the registry did not open)."""
    seen: list[sa.ToolContext] = []
    called: list[str] = []
    tools = [
        sa.tool(name="lookup")(Lookup(seen)),
        sa.tool(name="partial")(functools.partial(_lookup, called)),
    ]
    calls = [call("c1", "lookup", order="A1"), call("c2", "partial", order="B2")]
    model = ScriptedModel([Scripted(tool_calls=calls), "ok"])
    agents = {"a": sa.Agent(model=model, tools=tools)}

    async def main() -> None:
        async with aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("s", agent="a", metadata={"user": "ada"})
            reply = await ref.send("go")
            assert [c.turn_id for c in seen] == [reply.turn_id]
            assert called == ["c2"]
            assert results(await ref.history()) == {"c1": "A1 for ada", "c2": "B2"}

    asyncio.run(main())


def test_invoke_outside_trio_says_how_to_test_a_tool_of_an_asyncio_app() -> None:
    """``Tool.invoke`` is trio code: awaited in asyncio (a test of an asyncio app) it
    says so and how to call the tool there (it raised "Task got bad yield")."""

    @sa.tool
    async def whose(context: sa.ToolContext) -> str:
        await asyncio.sleep(0)
        return context.session_id

    context = sa.ToolContext(session_id="s", turn_id="t", call_id="c")

    async def main() -> None:
        with pytest.raises(RuntimeError, match=r"Tool\.invoke runs in trio .* tool\.fn\("):
            await whose.invoke("{}", context=context)
        assert await whose.fn(context=context) == "s"  # (as the message says)

    asyncio.run(main())
