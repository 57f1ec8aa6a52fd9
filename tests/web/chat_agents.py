"""Agents for the gateway tests: one behaviour, written as trio code and as asyncio code.

The model echoes the user's words one at a time (``DELAY`` seconds apart), except
"refund ORDER", which calls the ``refund`` tool; that tool needs a person's
review, and after it ran the model answers "Refunded: <the tool's result>"; and
"fail WORDS", whose WORDS it streams before it fails (:data:`DROPPED`, a
connection dropped mid-answer); and "cut WORDS", whose WORDS it streams as an
answer cut short by its output limit (finish reason "length").
``python -m sessionactors serve --agent chat_agents:agents`` serves the trio version.
"""

import asyncio
import re
from collections.abc import AsyncIterator, Sequence

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

#: Seconds between two streamed words.
DELAY = 0.05

_WORD = re.compile(r"\s*\S+")

#: What the model of "fail WORDS" raises after it streamed WORDS.
DROPPED = "the model's connection dropped"


def _decide(messages: Sequence[sa.Message]) -> tuple[str, str]:
    """("text", reply), ("call", order id), ("fail", what is streamed first) or ("cut",
    what is streamed) for the conversation so far."""
    last = messages[-1]
    if last.role is sa.Role.TOOL:
        return "text", f"Refunded: {last.content}"
    text = last.content
    if text.startswith("refund "):
        return "call", text.removeprefix("refund ").strip()
    if text.startswith("fail "):
        return "fail", text.removeprefix("fail ")
    if text.startswith("cut "):
        return "cut", text.removeprefix("cut ")
    return "text", text


def _call(order_id: str) -> sa.ToolCall:
    return sa.ToolCall(
        id=f"call-{order_id}", name="refund", arguments=f'{{"order_id": "{order_id}"}}'
    )


def trio_agents(delay: float = DELAY) -> dict[str, sa.Agent]:
    """The agents as trio code: a ScriptedModel and a trio tool."""

    def step(request: sa.ModelRequest) -> Scripted:
        kind, value = _decide(request.messages)
        if kind == "call":
            return Scripted(tool_calls=[_call(value)])
        error = ConnectionError(DROPPED) if kind == "fail" else None
        reason = "length" if kind == "cut" else None
        return Scripted(text=value, delay=delay, error=error, finish_reason=reason)

    async def refund(order_id: str) -> str:
        await trio.sleep(0)
        return f"order {order_id} refunded"

    tool = sa.Tool(name="refund", fn=refund, description="Refund an order.", requires_review=True)
    return {"shop": sa.Agent(model=ScriptedModel([step], repeat=True), tools=[tool])}


class AsyncioModel:
    """The same model, as asyncio code (what an asyncio app's model looks like)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.tasks: list[bool] = []  # whether each stream ran in an asyncio task

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.tasks.append(asyncio.current_task() is not None)
        kind, value = _decide(request.messages)
        if kind == "call":
            await asyncio.sleep(0)
            call = _call(value)
            yield sa.ToolCallChunk(0, id=call.id, name=call.name, arguments=call.arguments)
            return
        for word in _WORD.findall(value):
            await asyncio.sleep(self.delay)
            yield sa.TextChunk(word)
        if kind == "fail":
            raise ConnectionError(DROPPED)
        if kind == "cut":
            yield sa.FinishChunk("length")


def asyncio_agents(delay: float = DELAY) -> dict[str, sa.Agent]:
    """The agents as asyncio code: an asyncio model and an asyncio tool."""

    async def refund(order_id: str) -> str:
        await asyncio.sleep(0)
        assert asyncio.current_task() is not None
        return f"order {order_id} refunded"

    tool = sa.Tool(name="refund", fn=refund, description="Refund an order.", requires_review=True)
    return {"shop": sa.Agent(model=AsyncioModel(delay), tools=[tool])}


#: What ``serve --agent chat_agents:agents`` serves.
agents = trio_agents()

#: An agent that echoes at once, a word per chunk (``serve --agent chat_agents:echo``).
echo = {"echo": sa.Agent(model=EchoModel())}

#: Two agents, so that a new session's first message must name one
#: (``serve --agent chat_agents:two``).
two = {**agents, **echo}
