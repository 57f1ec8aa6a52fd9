"""Input limits: oversized input gets a clear error, never an actor crash."""

from __future__ import annotations

import pytest
import trio

import sessionactors as sa
from sessionactors import _ref, _tooling
from sessionactors._records import ToolCall
from sessionactors.testing import EchoModel, Scripted, ScriptedModel


async def test_an_oversized_message_is_refused_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message over the size limit raises ValueError naming the session, and the session goes on."""
    monkeypatch.setattr(_ref, "MAX_TEXT_CHARS", 100)
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("big")
        with trio.fail_after(5):
            with pytest.raises(ValueError, match=r"'big'.*over the limit"):
                await ref.send("x" * 101)
            assert (await ref.send("small")).text == "small"
        assert registry.statistics().crashes == 0


async def test_an_oversized_tool_result_is_cut_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool result over the limit reaches the model cut, with a note saying so."""
    monkeypatch.setattr(_tooling, "MAX_TOOL_RESULT_CHARS", 50)

    @sa.tool
    async def dump() -> str:
        """Return a lot of text."""
        return "y" * 500

    model = ScriptedModel(
        [Scripted(tool_calls=[ToolCall(id="c1", name="dump", arguments="{}")]), "done"]
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[dump])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            assert (await ref.send("go")).text == "done"
        result = next(m for m in await ref.history() if m.role is sa.Role.TOOL)
        assert result.content.startswith("y" * 50)
        assert "result cut: it was 500 characters" in result.content
        assert len(result.content) < 200
