"""Token usage: kept on each assistant message, summed per session in its state and listing."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


def usage(i: int, o: int) -> sa.Usage:
    return sa.Usage(input_tokens=i, output_tokens=o)


@sa.tool
async def lookup(order_id: str) -> str:
    """Look up an order by its id."""
    return f"order {order_id}: shipped"


def scripted_with_tool() -> ScriptedModel:
    call = sa.ToolCall(id="call_1", name="lookup", arguments='{"order_id": "A1"}')
    return ScriptedModel(
        [
            Scripted(text="Checking.", tool_calls=[call], usage=usage(100, 10)),
            Scripted(text="It shipped.", usage=usage(130, 5)),
            Scripted(text="No usage reported."),
        ]
    )


async def test_each_answer_keeps_its_usage_and_the_session_sums_them(tmp_path: Path) -> None:
    """Every assistant message carries its model call's usage; state and listing hold the sum,
    which survives hibernation, a restart and a truncation of the history."""
    agent = sa.Agent(model=scripted_with_tool(), tools=[lookup])
    db = tmp_path / "s.db"
    with trio.fail_after(10):
        async with sa.open_registry(store=sa.SQLiteStore(db), agents={"a": agent}) as registry:
            ref = await registry.spawn("s")
            reply = await ref.send("Where is A1?")
            plain = await ref.send("Thanks")
            history = await ref.history()
            assert (await ref.state()).usage == usage(230, 15)
            await ref.hibernate()
            [info] = await registry.sessions()
            assert info.usage == usage(230, 15)

        async with sa.open_registry(store=sa.SQLiteStore(db), agents={"a": agent}) as registry:
            ref = registry.ref("s")
            assert (await ref.state()).usage == usage(230, 15)
            await ref.truncate(keep_last=1)
            state = await ref.state()
            [info] = await registry.sessions()

    assert reply.message is not None
    assert reply.message.usage == usage(130, 5)
    assert plain.message is not None
    assert plain.message.usage is None
    assistant = [m.usage for m in history if m.role is sa.Role.ASSISTANT]
    assert assistant == [usage(100, 10), usage(130, 5), None]
    assert all(m.usage is None for m in history if m.role is not sa.Role.ASSISTANT)
    assert len(state.messages) == 2  # the last turn: "Thanks" and its answer
    assert state.usage == info.usage == usage(230, 15)
    assert state.usage.total_tokens == 245


async def test_a_session_without_usage_counts_zero(autojump_clock: trio.abc.Clock) -> None:
    """A model that reports nothing leaves every message's usage None and the session's at zero."""
    async with sa.open_registry(agents={"a": sa.Agent(model=ScriptedModel(["hi"]))}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("hello")
            state = await ref.state()
    assert reply.message is not None
    assert reply.message.usage is None
    assert state.usage == sa.Usage()
    assert state.usage.total_tokens == 0


async def test_several_usage_chunks_of_one_answer_add_up(autojump_clock: trio.abc.Clock) -> None:
    """A model that streams its counts in parts (input first, output last) gets their sum."""

    class PartsModel:
        async def stream(self, request: sa.ModelRequest):  # type: ignore[no-untyped-def]
            yield sa.UsageChunk(input_tokens=40)
            yield sa.TextChunk("hi")
            yield sa.UsageChunk(output_tokens=2)

    async with sa.open_registry(agents={"a": sa.Agent(model=PartsModel())}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("hello")
    assert reply.message is not None
    assert reply.message.usage == usage(40, 2)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None, 2**53])
async def test_a_usage_chunk_with_a_bad_count_fails_the_turn_only(
    bad: object, autojump_clock: trio.abc.Clock
) -> None:
    """A UsageChunk whose count is not an integer from 0 fails that turn, never the session."""
    model = ScriptedModel([Scripted(text="x", usage=sa.Usage(input_tokens=bad)), "fine"])  # type: ignore[arg-type]
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            with pytest.raises(sa.TurnFailedError, match="UsageChunk whose input_tokens") as info:
                await ref.send("hello")
            assert isinstance(info.value.__cause__, TypeError)
            assert (await ref.send("again")).text == "fine"
            assert (await ref.state()).usage == sa.Usage()


def test_usages_add() -> None:
    """Two usages add field by field; adding anything else is a TypeError."""
    assert usage(1, 2) + usage(10, 20) == usage(11, 22)
    with pytest.raises(TypeError):
        usage(1, 2) + 3  # type: ignore[operator]
