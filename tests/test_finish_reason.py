"""An answer the model cut short (its output limit, its content filter) says so on its message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


async def test_a_reply_cut_short_carries_its_finish_reason(tmp_path: Path) -> None:
    """The reply, the history and the TurnFinished event say why the answer stopped; it is
    kept through hibernation and a restart; an answer that ended of its own accord carries
    no metadata."""
    model = ScriptedModel(
        [Scripted(text="The first three of the ten", finish_reason="length"), "Done."]
    )
    agent = sa.Agent(model=model)
    db = tmp_path / "s.db"
    with trio.fail_after(10):
        async with sa.open_registry(store=sa.SQLiteStore(db), agents={"a": agent}) as registry:
            ref = await registry.spawn("s")
            async with ref.subscribe() as events:
                cut = await ref.send("List ten things.")
                async for event in events:
                    if isinstance(event, sa.TurnFinished):
                        finished = event
                        break
            whole = await ref.send("Thanks")
            await ref.hibernate()
            woken = await ref.history()
        async with sa.open_registry(store=sa.SQLiteStore(db), agents={"a": agent}) as registry:
            restarted = await registry.ref("s").history()

    assert cut.message is not None
    assert whole.message is not None
    assert cut.message.content == "The first three of the ten"
    assert cut.message.metadata == {"finish_reason": "length"}
    assert not cut.message.interrupted  # (the turn finished: the model ended it)
    assert finished.message == cut.message
    assert whole.message.metadata == {}
    for history in (woken, restarted):
        assert [m.metadata for m in history] == [{}, {"finish_reason": "length"}, {}, {}]


async def test_a_tool_step_cut_short_says_so_on_its_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The finish reason belongs to the answer that streamed it: a tool-calling step's."""
    call = sa.ToolCall(id="c1", name="echo", arguments='{"text": "x"}')

    @sa.tool
    async def echo(text: str) -> str:
        """Echo."""
        return text

    model = ScriptedModel(
        [Scripted(tool_calls=[call], finish_reason="content_filter"), "after the tool"]
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[echo])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
            history = await ref.history()
    assert reply.message is not None
    assert reply.message.metadata == {}
    [step] = [m for m in history if m.tool_calls]
    assert step.metadata == {"finish_reason": "content_filter"}


class _Finishing:
    def __init__(self, reason: object) -> None:
        self.reason = reason

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("partial")
        yield sa.FinishChunk(self.reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (None, "not a str"),
        (7, "not a str"),
        ("", "empty"),
        ("x" * 101, "over 100 characters"),
        ("len\ngth", "whose reason 'len\\ngth' contains the control character"),
        ("\ud800", "whose reason '\\ud800' is not valid Unicode: it holds a lone surrogate"),
    ],
)
async def test_a_finish_reason_that_cannot_be_kept_fails_the_turn(
    autojump_clock: trio.abc.Clock, reason: object, said: str
) -> None:
    """A reason no store could keep, or no person read, fails its turn, saying so."""
    async with sa.open_registry(agents={"a": sa.Agent(model=_Finishing(reason))}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5), pytest.raises(sa.TurnFailedError) as failed:
            await ref.send("go")
        history = await ref.history()
    assert "FinishChunk" in str(failed.value)
    assert said in str(failed.value)
    assert history[-1].interrupted
    assert history[-1].content == "partial"


async def test_the_last_of_several_finish_reasons_is_kept(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model that says more than once why it stopped: the last word is the reason."""

    class Twice:
        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            yield sa.TextChunk("a")
            yield sa.FinishChunk("content_filter")
            yield sa.FinishChunk("length")

    async with sa.open_registry(agents={"a": sa.Agent(model=Twice())}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("go")
    assert reply.message is not None
    assert reply.message.metadata == {"finish_reason": "length"}
