"""Compaction: a long history is summarized before a turn, keeping the last messages whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from history_rules import kept_by_compaction, tool_pairs_intact
from sessionactors.stores import MemoryStore
from sessionactors.testing import Scripted, ScriptedModel
from strategies import chat_histories


@sa.tool
async def echo(text: str) -> str:
    """Say it back."""
    await trio.lowlevel.checkpoint()
    return f"echo {text}"


def answer(request: sa.ModelRequest) -> Scripted | str:
    """A user message ``tools N`` gets N tool calls, then a text answer; any other gets text."""
    last = request.messages[-1]
    if last.role is sa.Role.USER and last.content.startswith("tools "):
        n = int(last.content.split()[1])
        calls = [
            sa.ToolCall(
                id=f"call_{uuid.uuid4().hex}", name="echo", arguments=json.dumps({"text": str(i)})
            )
            for i in range(n)
        ]
        return Scripted(tool_calls=calls)
    return f"answer to {last.content if last.role is sa.Role.USER else 'tools'}"


def agent(compaction: sa.Compaction | None) -> tuple[sa.Agent, ScriptedModel]:
    model = ScriptedModel([answer], repeat=True)
    the_agent = sa.Agent(
        model=model, system_prompt="You are terse.", tools=[echo], compaction=compaction
    )
    return the_agent, model


def contents(messages: Sequence[sa.Message]) -> list[str]:
    return [m.content for m in messages]


async def converse(ref: sa.SessionRef, *texts: str) -> None:
    with trio.fail_after(10):
        for text in texts:
            await ref.send(text)


async def test_a_long_history_is_summarized_before_the_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Over max_tokens, all but the last keep_last messages become a summary the model then sees."""
    summarizer = ScriptedModel(["They said one.", "They said one and two."])
    the_agent, model = agent(sa.Compaction(max_tokens=1, keep_last=3, summarizer=summarizer))
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two")
        assert summarizer.requests == []  # nothing older than the last 3 messages yet
        full = await ref.history()
        edits: list[sa.HistoryEdited] = []
        async with ref.subscribe() as stream:
            with trio.fail_after(5):
                await ref.send("three")
                async for event in stream:
                    if isinstance(event, sa.HistoryEdited):
                        edits.append(event)
                    if isinstance(event, sa.TurnFinished):
                        break
        after_one = await ref.history()
        state = await ref.state()
        await converse(ref, "four")
        after_two = await ref.state()

    (edit,) = edits
    assert edit.reason == "compaction"
    assert edit.removed == (full[0].id, full[1].id)
    assert edit.summary == "They said one."
    assert state.summary == "They said one."
    assert contents(after_one) == ["two", "answer to two", "three", "answer to three"]

    # the model saw: system prompt, summary, then the last messages
    request = model.requests[2].messages
    assert request[0].role is sa.Role.SYSTEM
    assert request[0].content == "You are terse."
    assert request[1].role is sa.Role.SYSTEM
    assert "They said one." in request[1].content
    assert contents(request[2:]) == ["two", "answer to two", "three"]

    # the summarizer was given the older messages, then the earlier summary to fold in
    first = summarizer.requests[0]
    assert first.tools == ()
    assert first.messages[0].role is sa.Role.SYSTEM
    transcript = first.messages[-1].content
    assert "user: one" in transcript
    assert "assistant: answer to one" in transcript
    assert "two" not in transcript
    second = summarizer.requests[1]
    assert "They said one." in "\n".join(m.content for m in second.messages)
    assert after_two.summary == "They said one and two."
    assert contents(after_two.messages) == ["three", "answer to three", "four", "answer to four"]


@pytest.mark.parametrize(
    ("keep_last", "summarized"), [(1, 8), (2, 8), (4, 8), (6, 8), (7, 2), (8, 2), (9, 0)]
)
async def test_compaction_never_splits_a_tool_group(
    keep_last: int, summarized: int, autojump_clock: trio.abc.Clock
) -> None:
    """A group is summarized whole or kept whole: a cut inside it (or on its call) moves on to
    the next user message, so the group goes into the summary with its results."""
    summarizer = ScriptedModel(["summary"], repeat=True)
    over = False
    the_agent, model = agent(
        sa.Compaction(
            max_tokens=1,
            keep_last=keep_last,
            summarizer=summarizer,
            estimate=lambda _: 10**9 if over else 0,
        )
    )
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "hello", "tools 3")
        full = await ref.history()  # user, answer, user, call, 3 results, answer
        over = True
        await converse(ref, "next")  # compacts the 9 messages (with "next") before asking
        history = await ref.history()

    if not summarized:
        assert summarizer.requests == []
        assert history[:-2] == full
        return
    assert len(summarizer.requests) == 1
    transcript = summarizer.requests[0].messages[-1].content.splitlines()
    assert len(transcript) == summarized
    assert transcript[0] == "user: hello"
    if summarized > 2:
        assert "[called: echo" in transcript[3]
        for call in full[3].tool_calls:
            assert any(line.startswith(f"tool result ({call.id})") for line in transcript)
    assert history[: 8 - summarized] == full[summarized:]
    assert contents(history[-2:]) == ["next", "answer to next"]
    assert tool_pairs_intact(history)
    request = model.requests[-1].messages
    assert "summary" in request[1].content
    assert request[2].role is sa.Role.USER
    assert tool_pairs_intact(request[2:])


def after_the_system_messages(request: sa.ModelRequest) -> list[sa.Message]:
    """The request's messages after its system prompt and summary."""
    messages = list(request.messages)
    while messages and messages[0].role is sa.Role.SYSTEM:
        del messages[0]
    return messages


@pytest.mark.parametrize("keep_last", range(1, 11))
async def test_every_request_after_a_compaction_begins_with_a_user_message(
    keep_last: int, autojump_clock: trio.abc.Clock
) -> None:
    """Wherever keep_last falls (on an assistant reply, a tool call, a tool result), the
    messages a compaction keeps begin with a user message, and so does every later model
    request after the system prompt and summary."""
    summarizer = ScriptedModel(["summary"], repeat=True)
    the_agent, model = agent(
        sa.Compaction(max_tokens=1, keep_last=keep_last, summarizer=summarizer)
    )
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "hello", "tools 2", "thanks", "tools 1", "more", "bye")
        history = await ref.history()

    assert summarizer.requests  # (compacted at least once)
    assert history[0].role is sa.Role.USER
    for request in model.requests:
        kept = after_the_system_messages(request)
        assert kept[0].role is sa.Role.USER, [m.content for m in request.messages]
        assert tool_pairs_intact(kept)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=chat_histories(), keep_last=st.integers(1, 16))
def test_a_compaction_of_any_history_keeps_a_tail_that_begins_with_a_user_message(
    history: list[sa.Message], keep_last: int
) -> None:
    """On any history (replies, interrupted replies, system notes, tool groups, in any order),
    a compaction keeps the longest tail of at most keep_last messages that begins with a user
    message (the turn's new one at least), so the model's request after the system prompt and
    summary begins with a user message and holds every tool call with its results."""

    async def main() -> None:
        summarizer = ScriptedModel(["summary"], repeat=True)
        the_agent, model = agent(
            sa.Compaction(max_tokens=1, keep_last=keep_last, summarizer=summarizer)
        )
        async with sa.open_registry(agents={"a": the_agent}) as registry:
            ref = await registry.spawn("s")
            with trio.fail_after(10):
                await ref.replace_history(history)
                await ref.send("next")
                after = await ref.history()
        (request,) = model.requests
        new = after[-2]  # the turn's user message, before the answer
        assert new.content == "next"
        kept = kept_by_compaction([*history, new], keep_last)
        if len(kept) == len(history) + 1:  # nothing to summarize
            assert summarizer.requests == []
            assert request.messages[1:] == [*history, new]
            return
        assert len(summarizer.requests) == 1
        assert [m.role for m in request.messages[:2]] == [sa.Role.SYSTEM, sa.Role.SYSTEM]
        assert request.messages[2].role is sa.Role.USER
        assert request.messages[2:] == kept
        assert len(kept) <= keep_last
        assert tool_pairs_intact(kept)
        assert after[:-1] == kept

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_custom_estimate_decides(autojump_clock: trio.abc.Clock) -> None:
    """The Compaction's estimate is asked about the whole request and compaction runs only above
    max_tokens."""
    seen: list[list[str]] = []
    tokens = 100

    def estimate(messages: Sequence[sa.Message]) -> int:
        seen.append(contents(messages))
        return tokens

    summarizer = ScriptedModel(["summary"], repeat=True)
    the_agent, _ = agent(
        sa.Compaction(max_tokens=100, keep_last=1, summarizer=summarizer, estimate=estimate)
    )
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two")
        assert summarizer.requests == []  # 100 is not above max_tokens=100
        assert seen[-1] == ["You are terse.", "one", "answer to one", "two"]
        tokens = 101
        await converse(ref, "three")
        history = await ref.history()

    assert len(summarizer.requests) == 1
    assert contents(history) == ["three", "answer to three"]


async def test_the_default_estimate_counts_characters(autojump_clock: trio.abc.Clock) -> None:
    """With the default estimate, long messages trigger compaction and short ones do not."""
    summarizer = ScriptedModel(["summary"], repeat=True)
    the_agent, _ = agent(sa.Compaction(max_tokens=200, keep_last=2, summarizer=summarizer))
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "short", "short too", "still short")
        assert summarizer.requests == []
        await converse(ref, "x" * 1000)
        state = await ref.state()

    assert len(summarizer.requests) == 1
    assert state.summary == "summary"
    # the long message and its answer: the one before is an answer, which cannot begin
    # what is kept (the user message that began its turn would make three)
    assert contents(state.messages) == ["x" * 1000, "answer to " + "x" * 1000]


async def test_the_agents_model_summarizes_by_default(autojump_clock: trio.abc.Clock) -> None:
    """Without a summarizer, the agent's own model writes the summary (asked without tools)."""
    model = ScriptedModel(["a1", "a2", "the summary", "a3"])
    the_agent = sa.Agent(model=model, compaction=sa.Compaction(max_tokens=1, keep_last=3))
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two", "three")
        state = await ref.state()

    assert state.summary == "the summary"
    assert model.requests[2].tools == ()
    assert "user: one" in model.requests[2].messages[-1].content
    assert contents(state.messages) == ["two", "a2", "three", "a3"]


async def long_conversation(
    compaction: sa.Compaction | None,
) -> tuple[list[sa.Event], sa.SessionState, ScriptedModel]:
    """Six long messages and a tool turn: the events, the final state, and the model."""
    the_agent, model = agent(compaction)
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        texts = [f"message {i} " + "x" * 500 for i in range(6)]
        events: list[sa.Event] = []
        async with ref.subscribe() as stream:
            await converse(ref, *texts, "tools 2")
            with trio.fail_after(5):
                async for event in stream:
                    events.append(event)
                    if sum(isinstance(e, sa.TurnFinished) for e in events) == len(texts) + 1:
                        break
        return events, await ref.state(), model


async def test_without_compaction_nothing_changes(autojump_clock: trio.abc.Clock) -> None:
    """An agent without compaction keeps and sends the whole history of a conversation that an
    agent with compaction compacts."""
    events, state, model = await long_conversation(None)
    assert not any(isinstance(e, sa.HistoryEdited) for e in events)
    assert state.summary is None
    assert len(state.messages) == 2 * 6 + 5
    assert model.requests[-1].messages[1:] == list(state.messages[:-1])

    summarizer = ScriptedModel(["summary"], repeat=True)
    compaction = sa.Compaction(max_tokens=300, keep_last=2, summarizer=summarizer)
    events, state, _ = await long_conversation(compaction)
    assert any(isinstance(e, sa.HistoryEdited) for e in events)
    assert state.summary == "summary"
    assert len(state.messages) < 2 * 6 + 5


async def test_compaction_survives_a_restart(autojump_clock: trio.abc.Clock) -> None:
    """The compacted history and its summary are journaled and come back after a restart."""
    store = MemoryStore()
    summarizer = ScriptedModel(["summary"], repeat=True)
    the_agent, model = agent(sa.Compaction(max_tokens=1, keep_last=2, summarizer=summarizer))
    async with sa.open_registry(agents={"a": the_agent}, store=store) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two")
        before = await ref.state()
    async with sa.open_registry(agents={"a": the_agent}, store=store) as registry:
        ref = registry.ref("s")
        after = await ref.state()
        await converse(ref, "three")

    assert before.summary == "summary"
    assert after.summary == "summary"
    assert after.messages == before.messages
    assert "summary" in model.requests[-1].messages[1].content


def test_compaction_keeps_at_least_the_new_message() -> None:
    """A Compaction must keep at least one message (the user's new one) and a positive budget."""
    with pytest.raises(ValueError, match="keep_last"):
        sa.Compaction(max_tokens=100, keep_last=0)
    with pytest.raises(ValueError, match="max_tokens"):
        sa.Compaction(max_tokens=0)
