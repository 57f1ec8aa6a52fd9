"""Input limits: oversized input gets a clear error, never an actor crash."""

from __future__ import annotations

import pytest
import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

#: The longest message a turn accepts, and the longest tool result kept whole, in characters
#: (as their error message and note say).
MAX_TEXT_CHARS = 1024 * 1024
MAX_TOOL_RESULT_CHARS = 1024 * 1024


async def test_an_oversized_message_is_refused_with_a_clear_error() -> None:
    """A message over the size limit raises ValueError naming the session and the limit, and
    the session goes on."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("big")
        with trio.fail_after(30):
            with pytest.raises(ValueError, match=r"'big' is over the limit of 1,048,576"):
                await ref.send("x" * (MAX_TEXT_CHARS + 1))
            assert (await ref.send("small")).text == "small"
        assert registry.statistics().crashes == 0


async def test_an_oversized_tool_result_is_cut_with_a_note() -> None:
    """A tool result over the limit reaches the model cut, with a note saying so."""
    size = MAX_TOOL_RESULT_CHARS + 500

    @sa.tool
    async def dump() -> str:
        """Return a lot of text."""
        await trio.lowlevel.checkpoint()
        return "y" * size

    model = ScriptedModel(
        [Scripted(tool_calls=[sa.ToolCall(id="c1", name="dump", arguments="{}")]), "done"]
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[dump])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30):
            assert (await ref.send("go")).text == "done"
        result = next(m for m in await ref.history() if m.role is sa.Role.TOOL)
    kept, _, note = result.content.partition("\n")
    assert kept == "y" * MAX_TOOL_RESULT_CHARS
    assert note == (
        f"[result cut: it was {size:,} characters, over the limit of {MAX_TOOL_RESULT_CHARS:,}]"
    )
    assert model.requests[-1].messages[-1].content == result.content
