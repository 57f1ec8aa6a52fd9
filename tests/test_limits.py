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


async def test_an_oversized_tool_result_is_cut_with_a_note_within_the_limit() -> None:
    """A tool result over the limit reaches the model cut, with a note saying so, and the
    result with its note is no longer than the limit."""
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
    assert note == (
        f"[result cut: it was {size:,} characters, over the limit of {MAX_TOOL_RESULT_CHARS:,}]"
    )
    assert kept == "y" * (MAX_TOOL_RESULT_CHARS - len(note) - 1)
    assert len(result.content) == MAX_TOOL_RESULT_CHARS
    assert model.requests[-1].messages[-1].content == result.content


async def test_a_denial_with_the_longest_note_tells_the_model_within_the_limit() -> None:
    """A review denied with a note as long as a message may be answers the call with a
    tool message no longer than the limit, cut with a note saying so."""

    async def refund() -> str:
        await trio.lowlevel.checkpoint()
        return "refunded"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True)
    call = sa.ToolCall(id="c1", name="refund", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), "not refunded"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30):
            waiting = await ref.send("refund it")
            note = "n" * MAX_TEXT_CHARS
            reply = await ref.review(waiting.reviews[0].id, approve=False, note=note)
            assert reply.text == "not refunded"
        result = next(m for m in await ref.history() if m.role is sa.Role.TOOL)
    assert result.content.startswith("a reviewer denied this call; it did not run: nnn")
    assert result.content.endswith("over the limit of 1,048,576]")
    assert len(result.content) == MAX_TOOL_RESULT_CHARS
