"""Running the model's tool calls inside a turn, and the actor's other requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from ._events import ToolCallStarted, ToolResult
from ._records import Message, Role, ToolCall

if TYPE_CHECKING:
    from ._actor import Actor
    from ._agent import Agent

__all__ = ["run_call", "run_tool_calls"]


async def _invoke(agent: Agent, call: ToolCall) -> tuple[str, bool]:
    tool = agent.find_tool(call.name)
    if tool is None:
        names = ", ".join(t.name for t in agent.tools) or "none"
        return f"unknown tool {call.name!r}; the tools available are: {names}", True
    outcome = await tool.invoke(call.arguments)
    return outcome.content, outcome.is_error


async def run_tool_calls(actor: Actor, agent: Agent, calls: Sequence[ToolCall]) -> bool:
    """Run the calls (concurrently), then add one tool message per call, in call order."""
    sid = actor.session_id
    results: list[tuple[str, bool]] = [("", False)] * len(calls)
    for call in calls:
        actor._emit(
            ToolCallStarted(session_id=sid, seq=actor._seq(), turn_id=actor.turn_id, tool_call=call)
        )

    async def one(i: int, call: ToolCall) -> None:
        results[i] = await _invoke(agent, call)

    if len(calls) == 1:
        await one(0, calls[0])
    else:
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
    for call, (content, is_error) in zip(calls, results, strict=True):
        actor._emit(
            ToolResult(
                session_id=sid,
                seq=actor._seq(),
                turn_id=actor.turn_id,
                tool_call_id=call.id,
                content=content,
                is_error=is_error,
            )
        )
        actor.add_message(
            Message.create(Role.TOOL, content, tool_call_id=call.id, is_error=is_error)
        )
    return True


async def run_call(actor: Actor, kind: str, args: dict[str, Any]) -> Any:
    """Serve a non-turn request in mailbox order."""
    raise ValueError(f"unknown request kind {kind!r} for session {actor.session_id!r}")
