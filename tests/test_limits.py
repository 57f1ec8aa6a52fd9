"""Input limits: oversized input gets a clear error, never an actor crash."""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.stores import MAX_JOURNAL_ENTRY_BYTES, JournalEntry, dump_events, dump_info
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


def _over(content: str) -> list[sa.Message]:
    return [sa.Message.create(sa.Role.USER, content)]


def _answered(content: str, arguments: str) -> list[sa.Message]:
    """An assistant message calling one tool with ``arguments``, and the tool's result."""
    call = sa.ToolCall(id="c1", name="lookup", arguments=arguments)
    return [
        sa.Message.create(sa.Role.ASSISTANT, content, tool_calls=(call,)),
        sa.Message.create(sa.Role.TOOL, "found", tool_call_id="c1"),
    ]


LONG = "x" * (MAX_TEXT_CHARS + 1)
#: Messages over the limit, by how: ``add_messages`` and ``replace_history`` refuse each.
OVERSIZED: dict[str, Callable[[], list[sa.Message]]] = {
    "user": lambda: _over(LONG),
    "assistant": lambda: [sa.Message.create(sa.Role.ASSISTANT, LONG)],
    "system": lambda: [sa.Message.create(sa.Role.SYSTEM, LONG)],
    "tool result": lambda: [
        _answered("", "{}")[0],
        sa.Message.create(sa.Role.TOOL, LONG, tool_call_id="c1"),
    ],
    "tool call arguments": lambda: _answered("", LONG),
    "text and arguments together": lambda: _answered(
        "x" * (MAX_TEXT_CHARS // 2), "y" * (MAX_TEXT_CHARS // 2 + 1)
    ),
    "the second of two": lambda: _over("fine") + _over(LONG),
}


@pytest.mark.parametrize("case", sorted(OVERSIZED))
async def test_an_added_message_over_the_limit_is_refused_before_anything_is_written(
    case: str,
) -> None:
    """add_messages and replace_history refuse a message whose text (its content, and an
    assistant message's tool call arguments with it) is longer than a turn's message may
    be, with a ValueError naming the session, the message and what to do; nothing is
    written, and a message at the limit is accepted."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("big")
        with trio.fail_after(30):
            await ref.send("hello")
            before = await ref.state()
            for method in (ref.add_messages, ref.replace_history):
                with pytest.raises(ValueError, match=r"'big'.*over the limit of 1,048,576") as info:
                    await method(OVERSIZED[case]())
                message = str(info.value)
                assert "messages[" in message
                assert "in parts or by reference" in message
            assert await ref.state() == before
            # the control: at the limit, each way, it is accepted
            at_limit = "x" * MAX_TEXT_CHARS
            await ref.add_messages(_over(at_limit))
            await ref.add_messages(_answered("x" * 100, "y" * (MAX_TEXT_CHARS - 100)))
            assert len(await ref.history()) == len(before.messages) + 3
        assert registry.statistics().crashes == 0


async def test_every_message_a_turn_leaves_can_be_written_back() -> None:
    """A history of messages at their largest (a message and an answer at the limit, a tool
    result cut to it) is accepted whole by replace_history."""
    size = MAX_TOOL_RESULT_CHARS + 500

    @sa.tool
    async def dump() -> str:
        """Return a lot of text."""
        await trio.lowlevel.checkpoint()
        return "y" * size

    longest = "z" * MAX_TEXT_CHARS
    call = sa.ToolCall(id="c1", name="dump", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), longest])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[dump])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30):
            await ref.send("q" * MAX_TEXT_CHARS)
            history = await ref.history()
            assert [len(m.content) for m in history] == [MAX_TEXT_CHARS, 0] + [MAX_TEXT_CHARS] * 2
            await ref.replace_history(history)
            assert await ref.history() == history


async def test_a_history_stored_before_the_limits_is_written_back_unchanged(
    tmp_path: Path,
) -> None:
    """replace_history takes back the messages a session already holds, unchanged (same
    id and fields), though a session stored before the limits holds some that are refused
    as new ones (a tool result cut and then noted, a long review denial, metadata with a
    NaN); the same messages changed, or under a new id, are still refused."""
    path = tmp_path / "sessions.db"
    now = datetime.datetime.now(datetime.UTC)
    calls = (
        sa.ToolCall(id="c1", name="big", arguments="{}"),
        sa.ToolCall(id="c2", name="refund", arguments="{}"),
    )
    cut = "r" * MAX_TOOL_RESULT_CHARS + "\n[result cut: it was 2,000,000 characters]"
    messages = (
        sa.Message(id="m1", role=sa.Role.USER, content="go", created_at=now),
        sa.Message(id="m2", role=sa.Role.ASSISTANT, content="", created_at=now, tool_calls=calls),
        sa.Message(id="m3", role=sa.Role.TOOL, content=cut, created_at=now, tool_call_id="c1"),
        sa.Message(
            id="m4",
            role=sa.Role.TOOL,
            content="denied: " + "n" * MAX_TEXT_CHARS,
            created_at=now,
            tool_call_id="c2",
        ),
        sa.Message(
            id="m5",
            role=sa.Role.USER,
            content="scored",
            created_at=now,
            metadata={"score": math.nan},
        ),
    )
    state = sa.SessionState(
        session_id="old", agent="echo", created_at=now, updated_at=now, messages=messages
    )
    info = sa.SessionInfo(
        session_id="old", agent="echo", status=state.status, message_count=5, updated_at=now
    )
    store = sa.SQLiteStore(path)
    try:
        await store.create("old", sa.dump_snapshot(state), dump_info(info))
    finally:
        await store.aclose()
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        ref = registry.ref("old")
        with trio.fail_after(60):
            history = await ref.history()
            await ref.replace_history(history)
            await ref.replace_history([*history, sa.Message.create(sa.Role.USER, "new")])
            assert len(await ref.history()) == 6
            for index, pattern in ((2, "over the limit"), (3, "over the limit"), (4, "NaN")):
                changed = attrs.evolve(history[index], content=history[index].content + "!")
                for given in (changed, attrs.evolve(history[index], id="another")):
                    block = [*history[:index], given, *history[index + 1 :]]
                    with pytest.raises(ValueError, match=rf"'old'.*messages\[{index}\].*{pattern}"):
                        await ref.replace_history(block)
            assert len(await ref.history()) == 6
        assert registry.statistics().crashes == 0
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        assert [m.id for m in await registry.ref("old").history()][:5] == [m.id for m in history]


async def test_a_system_prompt_over_the_limit_is_refused_before_the_session_is_stored() -> None:
    """spawn and get_or_spawn refuse a system_prompt longer than a message may be, with a
    ValueError naming the session and what to do; nothing is stored, and a prompt at the
    limit is accepted."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        with trio.fail_after(30):
            for spawn in (registry.spawn, registry.get_or_spawn):
                with pytest.raises(ValueError, match=r"'big'.*over the limit of 1,048,576") as info:
                    await spawn("big", system_prompt=LONG)
                assert "system_prompt" in str(info.value)
                assert "by reference" in str(info.value)
            assert await registry.sessions() == []
            ref = await registry.spawn("big", system_prompt="p" * MAX_TEXT_CHARS)
            assert (await ref.send("hi")).text == "hi"


def test_asyncio_code_meets_the_same_limits() -> None:
    """Through sessionactors.aio, an added message and a system prompt over the limit are
    refused as through the trio API, and nothing is stored."""

    async def main() -> None:
        agents = {"echo": sa.Agent(model=EchoModel())}
        async with asyncio.timeout(30), aio.open_registry(agents=agents) as registry:
            with pytest.raises(ValueError, match=r"'big'.*over the limit of 1,048,576"):
                await registry.spawn("big", system_prompt="p" * 5_000_000)
            assert await registry.sessions() == []
            ref = await registry.spawn("big")
            with pytest.raises(ValueError, match=r"'big'.*over the limit of 1,048,576"):
                await ref.add_messages(_over("x" * 5_000_000))
            assert await ref.history() == []

    asyncio.run(main())


# ---- session metadata ---------------------------------------------------------------

#: The largest session metadata, encoded (msgpack, as the store writes it), in bytes.
MAX_METADATA_BYTES = 64 * 1024


def _metadata_of(size: int) -> dict[str, Any]:
    """Metadata of two keys whose encoded form is ``size`` bytes."""
    metadata = {"a": "", "b": ""}
    text = size - len(msgpack.packb(metadata)) - 2 * 2  # (each str grows a 2-byte length)
    metadata = {"a": "x" * (text // 2), "b": "y" * (text - text // 2)}
    assert len(msgpack.packb(metadata)) == size
    return metadata


async def _spawn(registry: sa.Registry, metadata: dict[str, Any]) -> object:
    return await registry.spawn("s", metadata=metadata)


async def _get_or_spawn(registry: sa.Registry, metadata: dict[str, Any]) -> object:
    return await registry.get_or_spawn("s", metadata=metadata)


async def _set(registry: sa.Registry, metadata: dict[str, Any]) -> object:
    return await registry.ref("s").set_metadata(metadata)


async def _merge(registry: sa.Registry, metadata: dict[str, Any]) -> object:
    """set_metadata in two changes, each within the limit, that merge into ``metadata``."""
    ref = registry.ref("s")
    await ref.set_metadata({"a": metadata["a"]})
    return await ref.set_metadata({"b": metadata["b"]})


#: Ways to set a session's metadata: (the session exists first, the way).
METADATA_WAYS: dict[
    str, tuple[bool, Callable[[sa.Registry, dict[str, Any]], Awaitable[object]]]
] = {
    "spawn": (False, _spawn),
    "get_or_spawn": (False, _get_or_spawn),
    "get_or_spawn of an existing session": (True, _get_or_spawn),
    "set_metadata": (True, _set),
    "set_metadata, merged": (True, _merge),
}


@pytest.mark.parametrize("way", sorted(METADATA_WAYS))
async def test_session_metadata_over_the_limit_is_refused_before_anything_is_written(
    way: str,
) -> None:
    """Metadata over MAX_METADATA_BYTES encoded (64 KiB), given whole or merged, is
    refused with a ValueError naming the session, its size and the limit, and saying to
    keep large data elsewhere; nothing is written, and metadata at the limit is kept
    whole across hibernation."""
    assert sa.MAX_METADATA_BYTES == MAX_METADATA_BYTES
    exists, set_it = METADATA_WAYS[way]
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        with trio.fail_after(30):
            if exists:
                await (await registry.spawn("s")).send("hi")
            before = await registry.sessions()
            with pytest.raises(ValueError, match=r"'s'") as info:
                await set_it(registry, _metadata_of(MAX_METADATA_BYTES + 1))
            message = str(info.value)
            assert f"{MAX_METADATA_BYTES + 1:,} bytes" in message, message
            assert "over the limit of 65,536" in message, message
            assert "MAX_METADATA_BYTES" in message, message
            assert "elsewhere" in message, message
            assert "history" not in message, message
            if way == "set_metadata, merged":  # (its first change was within the limit)
                [listed] = await registry.sessions()
                assert sorted(listed.metadata) == ["a"]
                await registry.ref("s").set_metadata({"a": None})
            else:
                assert await registry.sessions() == before
            # the control: at the limit, it is accepted
            at_limit = _metadata_of(MAX_METADATA_BYTES)
            await set_it(registry, at_limit)
            ref = registry.ref("s")
            assert (await ref.send("still here")).text == "still here"
            await ref.hibernate()
            kept = (await ref.state()).metadata
            assert kept == ({} if way == "get_or_spawn of an existing session" else at_limit)
        assert registry.statistics().crashes == 0


@pytest.mark.parametrize("way", ["spawn", "set_metadata", "dump_info"])
async def test_metadata_too_large_for_any_record_is_refused_with_advice_about_metadata(
    way: str,
) -> None:
    """Metadata larger than a journal entry or a session's info may be is refused with
    a ValueError that names the session and says to keep large data out of metadata,
    not to truncate or compact the history (which is not what is too large)."""
    huge = {"blob": "x" * (MAX_JOURNAL_ENTRY_BYTES + 1)}

    async def refuse(registry: sa.Registry) -> None:
        if way == "spawn":
            await registry.spawn("s", metadata=huge)
        elif way == "set_metadata":
            await registry.ref("s").set_metadata(huge)
        else:
            now = datetime.datetime.now(datetime.UTC)
            info = sa.SessionInfo(
                session_id="s",
                agent="echo",
                status=sa.Status.IDLE,
                message_count=0,
                updated_at=now,
                metadata=huge,
            )
            dump_info(info)

    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        if way == "set_metadata":
            await registry.spawn("s")
        with pytest.raises(ValueError, match=r"'s'") as refused:
            await refuse(registry)
    message = str(refused.value)
    assert "history" not in message, message
    assert "metadata" in message, message
    assert "elsewhere" in message, message


def test_asyncio_code_meets_the_metadata_limit() -> None:
    """Through sessionactors.aio, spawn, get_or_spawn and set_metadata refuse metadata
    over the limit as the trio API does, and nothing is stored."""

    async def main() -> None:
        agents = {"echo": sa.Agent(model=EchoModel())}
        over = _metadata_of(MAX_METADATA_BYTES + 1)
        async with asyncio.timeout(30), aio.open_registry(agents=agents) as registry:
            for spawn in (registry.spawn, registry.get_or_spawn):
                with pytest.raises(ValueError, match=r"'big'.*over the limit of 65,536"):
                    await spawn("big", metadata=over)
            assert await registry.sessions() == []
            ref = await registry.spawn("big")
            with pytest.raises(ValueError, match=r"'big'.*over the limit of 65,536"):
                await ref.set_metadata(over)
            assert (await ref.state()).metadata == {}

    asyncio.run(main())


async def test_a_session_stored_with_larger_metadata_before_the_limit_loads_and_runs(
    tmp_path: Path,
) -> None:
    """A session stored before the limit, whose snapshot and journal hold metadata of
    megabytes (as its info may, up to 16 MiB), is listed, wakes, runs turns, hibernates
    and is forked with it; a change that leaves it no larger is accepted (even a change
    over the limit by itself), one that makes it larger is refused with the size it
    would have, and once small it stays within the limit."""
    path = tmp_path / "sessions.db"
    now = datetime.datetime.now(datetime.UTC)
    first = {"blob": "o" * 3_000_000}
    then = {"a": "a" * 2_000_000, "b": "b" * 2_000_000, "tier": "gold"}
    state = sa.SessionState(
        session_id="old", agent="echo", created_at=now, updated_at=now, metadata=first
    )
    info = sa.SessionInfo(
        session_id="old",
        agent="echo",
        status=state.status,
        message_count=0,
        updated_at=now,
        metadata=then,
    )
    store = sa.SQLiteStore(path)
    try:
        await store.create("old", sa.dump_snapshot(state), dump_info(info))
        changed = sa.MetadataChanged(session_id="old", seq=1, metadata=then)
        await store.append(
            "old", [JournalEntry(seq=1, data=dump_events([changed]))], dump_info(info)
        )
    finally:
        await store.aclose()
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        with trio.fail_after(60):
            [listed] = await registry.sessions()
            assert listed.metadata == then
            ref = registry.ref("old")
            assert (await ref.send("hi")).text == "hi"
            assert (await ref.state()).metadata == then
            await ref.hibernate()
            assert (await ref.send("again")).text == "again"
            copy = await registry.fork("old", "copy")
            assert (await copy.state()).metadata == then
            with pytest.raises(ValueError, match=r"'old'.*over the limit of 65,536"):
                await ref.set_metadata({"more": 1})
            smaller = {"b": "b" * 2_000_000, "tier": "gold"}
            assert await ref.set_metadata({"a": None}) == smaller
            # a change over the limit by itself is taken when the metadata shrinks with it
            smaller = {"b": "c" * 1_000_000, "tier": "gold"}
            assert await ref.set_metadata({"b": "c" * 1_000_000}) == smaller
            # refused, the error gives the size the metadata would have, not the change's
            with pytest.raises(ValueError, match=r"'old' is 1,100,\d{3} bytes encoded"):
                await ref.set_metadata({"x": "x" * 100_000})
            assert await ref.set_metadata({"b": "small"}) == {"b": "small", "tier": "gold"}
            with pytest.raises(ValueError, match=r"'old'.*over the limit of 65,536"):
                await ref.set_metadata({"a": "x" * 40_000, "b": "y" * 40_000})
        assert registry.statistics().crashes == 0
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        state = await registry.ref("old").state()
        assert state.metadata == {"b": "small", "tier": "gold"}
        assert [m.content for m in state.messages] == ["hi", "hi", "again", "again"]


async def test_a_session_growing_past_what_a_snapshot_holds_is_told_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A session whose state nears the 64 MiB a snapshot holds is named in one WARNING,
    with what to do, once a snapshot of it passes three quarters of that (a compaction's);
    one past it (it can no longer hibernate, fork or compact its journal) in one more, the
    first time a snapshot of it fails, and not again while it stays that large."""
    caplog.set_level(logging.WARNING, logger="sessionactors")
    megabyte = "x" * (1024 * 1024 - 64)
    async with sa.open_registry(
        agents={"a": sa.Agent(model=EchoModel())}, snapshot_every=2
    ) as registry:
        ref = await registry.spawn("big")
        with trio.fail_after(120):
            for _ in range(70):
                await ref.add_messages([sa.Message.create(sa.Role.USER, megabyte)])
            with pytest.raises(sa.SnapshotError):
                await ref.hibernate()
            with pytest.raises(sa.SnapshotError):
                await ref.hibernate()
    said = [r.getMessage() for r in caplog.records if "'big'" in r.getMessage()]
    near = [m for m in said if "near" in m]
    past = [m for m in said if "until then it stays live" in m]
    assert len(near) == 1, said
    assert "truncate or compact" in near[0]
    assert len(past) == 1, said
    assert "cannot be written as a snapshot" in past[0]
    assert "journal grows without compaction" in past[0]
