"""History edits: truncate, rewind, summary and fork, journaled, never splitting a tool call
from its results (checked by example and by property on the pure rules and a live registry)."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from history_rules import kept_by_compaction, kept_by_rewind, kept_by_truncate, tool_pairs_intact
from sessionactors.stores import MemoryStore
from sessionactors.testing import Gate, Scripted, ScriptedModel

# ---- a conversation with tool groups -------------------------------------------------------


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
        return Scripted(text=f"calling {n}", tool_calls=calls)
    return f"answer to {last.content if last.role is sa.Role.USER else 'tools'}"


def agent(
    *, system_prompt: str = "You are terse.", compaction: sa.Compaction | None = None
) -> tuple[sa.Agent, ScriptedModel]:
    model = ScriptedModel([answer], repeat=True)
    return (
        sa.Agent(model=model, system_prompt=system_prompt, tools=[echo], compaction=compaction),
        model,
    )


def roles(history: Sequence[sa.Message]) -> str:
    """The history as a string of role letters: u(ser), a(ssistant), c(alling assistant), t(ool)."""
    out = []
    for m in history:
        if m.role is sa.Role.ASSISTANT and m.tool_calls:
            out.append("c")
        else:
            out.append(m.role.value[0])
    return "".join(out)


async def converse(ref: sa.SessionRef, *texts: str) -> None:
    with trio.fail_after(10):
        for text in texts:
            await ref.send(text)


# ---- truncate -------------------------------------------------------------------------------


async def test_truncate_keeps_the_last_messages(autojump_clock: trio.abc.Clock) -> None:
    """truncate(n) keeps the last n messages and says how many it removed."""
    the_agent, model = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two", "three")
        before = await ref.history()
        with trio.fail_after(5):
            removed = await ref.truncate(2)
            after = await ref.history()
            await ref.send("four")

    assert removed == 4
    assert after == before[-2:]
    assert [m.content for m in model.requests[-1].messages[1:]] == [
        "three",
        "answer to three",
        "four",
    ]


async def test_truncate_keeps_more_rather_than_split_a_tool_group(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A cut that would fall inside a tool group moves before the group's call: back to the
    user message that began its turn, or to the call itself in a history written without one."""
    the_agent, _ = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "hello", "tools 3")
        full = await ref.history()
        assert roles(full) == "uaucttta"
        with trio.fail_after(5):
            removed = await ref.truncate(3)  # would keep "t t a": two results without the call
            history = await ref.history()
            await ref.replace_history(full[3:])  # no user message before the call
            removed_without_user = await ref.truncate(3)
            history_without_user = await ref.history()
            assert await ref.truncate(10) == 0
            assert await ref.truncate(0) == len(history_without_user)
            assert await ref.history() == []
            with pytest.raises(ValueError, match="keep_last must be >= 0"):
                await ref.truncate(-1)

    assert removed == 2
    assert roles(history) == "ucttta"
    assert tool_pairs_intact(history)
    assert removed_without_user == 0
    assert history_without_user == full[3:]


@pytest.mark.parametrize("keep_last", range(1, 10))
async def test_truncate_keeps_whole_turns_so_the_next_request_begins_with_a_user_message(
    keep_last: int, autojump_clock: trio.abc.Clock
) -> None:
    """A cut that falls on an answer, a tool call or a result moves back to the user message
    that began its turn: at least keep_last are kept, and the next model request begins with a
    user message after the system prompt."""
    the_agent, model = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "hello", "tools 2", "thanks")
        before = await ref.history()
        assert roles(before) == "uaucttaua"
        with trio.fail_after(5):
            removed = await ref.truncate(keep_last)
            after = await ref.history()
            await ref.send("next")

    request = model.requests[-1].messages
    assert request[0].role is sa.Role.SYSTEM
    assert request[1].role is sa.Role.USER, roles(request[1:])
    start = max(i for i, m in enumerate(before) if m.role is sa.Role.USER and i <= 9 - keep_last)
    assert after == before[start:]
    assert removed == start


# ---- rewind -----------------------------------------------------------------------------------


async def test_rewind_drops_what_follows_a_message(autojump_clock: trio.abc.Clock) -> None:
    """rewind(id) keeps the history up to that message; the model goes on from there."""
    the_agent, model = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two", "three")
        before = await ref.history()
        with trio.fail_after(5):
            removed = await ref.rewind(before[1].id)
            after = await ref.history()
            await ref.send("again")

    assert removed == 4
    assert after == before[:2]
    assert [m.content for m in model.requests[-1].messages[1:]] == ["one", "answer to one", "again"]


async def test_rewind_to_a_tool_call_keeps_its_results(autojump_clock: trio.abc.Clock) -> None:
    """Rewinding to a calling message or to one of its results keeps the whole tool group."""
    the_agent, _ = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "tools 2", "after")
        history = await ref.history()
        assert roles(history) == "uctta" + "ua"
        with trio.fail_after(5):
            assert await ref.rewind(history[2].id) == 3  # the first result
            assert roles(await ref.history()) == "uctt"
            assert await ref.rewind(history[1].id) == 0  # the call: its results stay
            assert await ref.history() == history[:4]
            assert await ref.rewind(history[0].id) == 3
            assert roles(await ref.history()) == "u"


async def test_rewind_to_an_unknown_message_is_a_lookup_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Rewinding to an id the history does not hold raises a LookupError and changes nothing."""
    the_agent, _ = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two")
        before = await ref.history()
        with trio.fail_after(5):
            with pytest.raises(LookupError, match="'msg_nope'") as info:
                await ref.rewind("msg_nope")
            assert await ref.truncate(2) == 2
            with pytest.raises(sa.MessageNotFoundError, match=r"ref\.history"):
                await ref.rewind(before[0].id)  # removed by the truncate
            after = await ref.history()

    assert isinstance(info.value, sa.SessionActorsError)
    assert info.value.session_id == "s"
    assert after == before[2:]


# ---- summary ------------------------------------------------------------------------------------


async def test_the_summary_reaches_the_model_after_the_system_prompt(
    autojump_clock: trio.abc.Clock,
) -> None:
    """set_summary puts the summary right after the system prompt; "" clears it."""
    the_agent, model = agent(system_prompt="You are terse.")
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one")
        with trio.fail_after(5):
            assert await ref.set_summary("The user likes trains.") is None
            assert (await ref.state()).summary == "The user likes trains."
            await ref.send("two")
            with_summary = model.requests[-1].messages
            await ref.set_summary("")
            await ref.send("three")
            without = model.requests[-1].messages

    assert [m.role for m in with_summary[:2]] == [sa.Role.SYSTEM, sa.Role.SYSTEM]
    assert with_summary[0].content == "You are terse."
    assert "The user likes trains." in with_summary[1].content
    assert [m.content for m in with_summary[2:]] == ["one", "answer to one", "two"]
    assert [m.role for m in without].count(sa.Role.SYSTEM) == 1
    assert not any("trains" in m.content for m in without)


async def test_edits_publish_history_edited_events(autojump_clock: trio.abc.Clock) -> None:
    """Each edit publishes a HistoryEdited event naming its reason and the removed messages."""
    the_agent, _ = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two", "three")
        history = await ref.history()
        async with ref.subscribe() as stream:
            with trio.fail_after(5):
                await ref.truncate(4)
                await ref.rewind(history[3].id)
                await ref.set_summary("counted")
                edits = []
                async for event in stream:
                    if isinstance(event, sa.HistoryEdited):
                        edits.append(event)
                        if len(edits) == 3:
                            break

    assert [(e.reason, e.removed, e.summary) for e in edits] == [
        ("truncate", tuple(m.id for m in history[:2]), None),
        ("rewind", tuple(m.id for m in history[4:]), None),
        ("set_summary", (), "counted"),
    ]


# ---- fork -------------------------------------------------------------------------------------


async def test_fork_copies_the_history_up_to_a_message(autojump_clock: trio.abc.Clock) -> None:
    """A fork gets the history up to a message (a call with its results), the prompt and summary."""
    the_agent, model = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s", system_prompt="Be brief.", metadata={"team": "blue"})
        await converse(ref, "one", "tools 2", "three")
        await ref.set_summary("earlier: nothing")
        history = await ref.history()
        assert roles(history) == "ua" + "uctta" + "ua"
        with trio.fail_after(5):
            fork = await registry.fork("s", "s-fork", at=history[3].id)
            forked = await fork.history()
            state = await fork.state()
            whole = await registry.fork("s", "s-whole")
            assert await whole.history() == history

    assert forked == history[:6]  # the call at index 3 keeps both its results
    assert state.system_prompt == "Be brief."
    assert state.summary == "earlier: nothing"
    assert state.metadata == {"team": "blue"}
    assert state.agent == "a"
    assert state.status is sa.Status.IDLE
    assert len(model.requests) == 4  # forking asks the model nothing


async def test_a_fork_and_its_source_are_independent(autojump_clock: trio.abc.Clock) -> None:
    """After a fork, turns and edits on either session leave the other unchanged."""
    the_agent, model = agent()
    async with sa.open_registry(agents={"a": the_agent}) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "two")
        history = await ref.history()
        with trio.fail_after(5):
            fork = await registry.fork("s", "f", at=history[1].id)
            await fork.send("fork only")
            assert model.requests[-1].session_id == "f"
            assert [m.content for m in model.requests[-1].messages[1:]] == [
                "one",
                "answer to one",
                "fork only",
            ]
            await ref.send("source only")
            await fork.truncate(1)  # keeps the turn: its user message and answer
            await ref.set_summary("source summary")
            source_after = await ref.history()
            fork_after = await fork.history()
            fork_state = await fork.state()

    assert [m.content for m in source_after] == [m.content for m in history] + [
        "source only",
        "answer to source only",
    ]
    assert [m.content for m in fork_after] == ["fork only", "answer to fork only"]
    assert fork_state.summary is None


async def test_fork_refusals(autojump_clock: trio.abc.Clock) -> None:
    """Fork refuses an unknown message, an existing name, and a call still waiting for review."""

    async def refunded() -> str:  # (async: a sync tool's thread would let the clock jump)
        return "refunded"

    refund = sa.Tool(name="refund", fn=refunded, requires_review=True)
    call = sa.ToolCall(id="call_r", name="refund")
    model = ScriptedModel(["hi", Scripted(tool_calls=[call]), "done"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[refund])}) as registry:
        ref = await registry.spawn("s")
        await registry.spawn("taken")
        with trio.fail_after(5):
            await ref.send("hello")
            with pytest.raises(LookupError, match="'msg_nope'"):
                await registry.fork("s", "f1", at="msg_nope")
            for at in (3, b"msg", ["msg"]):  # a message's id is a str
                with pytest.raises(TypeError, match="at for session 's' must be str"):
                    await registry.fork("s", "f1", at=at)  # type: ignore[arg-type]
            with pytest.raises(sa.SessionExistsError, match="'taken'"):
                await registry.fork("s", "taken")
            waiting = await ref.send("refund")
            history = await ref.history()
            with pytest.raises(sa.SessionBusyError, match="without its result"):
                await registry.fork("s", "f2")
            with pytest.raises(sa.SessionBusyError):
                await registry.fork("s", "f3", at=history[-1].id)
            early = await registry.fork("s", "f4", at=history[1].id)
            assert await early.history() == history[:2]
            await ref.review(waiting.reviews[0].id, approve=True)
            late = await registry.fork("s", "f5")
            late_history = await late.history()

    assert roles(late_history) == "uaucta"
    assert tool_pairs_intact(late_history)


async def test_fork_refuses_a_turn_under_way_and_forks_before_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A fork of a session whose text turn is under way would copy the turn's user
    message without its reply, and the fork's next turn would send the model two user
    messages in a row: refused with SessionBusyError naming the turn, also at the
    turn's message; a fork at an earlier message, or after the turn, is whole."""
    gate = Gate()
    model = ScriptedModel(["hi", Scripted(text="slow words", wait=gate, wait_after=1), "more"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("hello")
            turn = await ref.submit("slow")
            await trio.testing.wait_all_tasks_blocked()
            history = await ref.history()
            assert roles(history) == "uau"
            for at in (None, history[-1].id):
                with pytest.raises(sa.SessionBusyError, match=turn.id) as info:
                    await registry.fork("s", "f1", at=at)
                assert "after the turn ends" in str(info.value)
            early = await registry.fork("s", "f2", at=history[1].id)
            assert roles(await early.history()) == "ua"
            gate.open()
            await turn.reply()
            late = await registry.fork("s", "f3")
            assert roles(await late.history()) == "uaua"
            await late.send("next")
            assert roles(model.requests[-1].messages) == "uauau"


# ---- durability -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["hibernate", "restart"])
async def test_edits_survive_hibernation_and_restart(
    how: str, autojump_clock: trio.abc.Clock
) -> None:
    """Truncate, rewind, summary and fork are journaled: they survive hibernation and restarts."""
    store = MemoryStore()
    the_agent, _ = agent()
    agents = {"a": the_agent}
    async with sa.open_registry(agents=agents, store=store) as registry:
        ref = await registry.spawn("s")
        await converse(ref, "one", "tools 2", "three", "four")
        history = await ref.history()
        with trio.fail_after(5):
            await ref.truncate(len(history) - 2)  # drops "one" and its answer
            await ref.rewind(history[-3].id)  # drops "four" and its answer
            await ref.set_summary("it began with one")
            fork = await registry.fork("s", "f", at=history[5].id)
            await fork.set_summary("forked")
        expected = {
            "s": (await ref.history(), "it began with one"),
            "f": (await fork.history(), "forked"),
        }
        if how == "hibernate":
            with trio.fail_after(5):
                await ref.hibernate()
                await fork.hibernate()
            assert registry.live() == []
            got = {n: await registry.ref(n).state() for n in expected}
    if how == "restart":
        async with sa.open_registry(agents=agents, store=store) as registry:
            got = {n: await registry.ref(n).state() for n in expected}

    assert expected["s"][0] == history[2:-2]
    assert expected["f"][0] == history[2:6]  # forked from the edited source
    for name, (messages, summary) in expected.items():
        assert list(got[name].messages) == messages
        assert got[name].summary == summary


# ---- properties: the reference rules (tests/history_rules.py) -----------------------------------

_T0 = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)


class HistoryBuilder:
    """Makes messages with readable, unique ids."""

    def __init__(self) -> None:
        self.n = 0

    def message(
        self,
        role: sa.Role,
        *,
        tool_calls: tuple[sa.ToolCall, ...] = (),
        tool_call_id: str | None = None,
    ) -> sa.Message:
        self.n += 1
        return sa.Message(
            id=f"m{self.n}",
            role=role,
            content=f"{role.value} {self.n}",
            created_at=_T0,
            tool_calls=tool_calls,
            tool_call_id=tool_call_id,
        )

    def block(self, kind: int, order: Sequence[int]) -> list[sa.Message]:
        """A text turn (kind 0) or a tool group with ``kind`` calls answered in ``order``."""
        if kind == 0:
            return [self.message(sa.Role.USER), self.message(sa.Role.ASSISTANT)]
        calls = tuple(sa.ToolCall(id=f"c{self.n}_{i}", name="echo") for i in range(kind))
        out = [self.message(sa.Role.ASSISTANT, tool_calls=calls)]
        for i in order:
            out.append(self.message(sa.Role.TOOL, tool_call_id=calls[i].id))
        return out


@st.composite
def blocks(draw: st.DrawFn) -> tuple[int, list[int]]:
    """One block: (0, []) for a text turn, or (k, an order of k results) for a tool group."""
    kind = draw(st.integers(0, 3))
    return kind, draw(st.permutations(range(kind)))


def build(builder: HistoryBuilder, drawn: Sequence[tuple[int, list[int]]]) -> list[sa.Message]:
    out: list[sa.Message] = []
    for kind, order in drawn:
        out.extend(builder.block(kind, order))
    return out


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_reference_cuts_never_split_a_tool_group(data: st.DataObject) -> None:
    """Any sequence of truncate, rewind, compaction and fork by the rules the live test
    checks against leaves every call with its results, on any history of text turns and
    tool groups."""
    builder = HistoryBuilder()
    messages = build(builder, data.draw(st.lists(blocks(), max_size=12), label="history"))
    assert tool_pairs_intact(messages)
    for _ in range(data.draw(st.integers(0, 8), label="operations")):
        op = data.draw(st.sampled_from(["truncate", "rewind", "compact", "fork", "grow"]))
        before = messages
        if op == "truncate":
            keep = data.draw(st.integers(0, len(messages) + 2), label="keep_last")
            messages = kept_by_truncate(messages, keep)
            assert len(messages) >= min(keep, len(before))  # at least keep_last are kept
            assert messages == before[len(before) - len(messages) :]  # a suffix
        elif op == "compact":
            keep = data.draw(st.integers(1, len(messages) + 2), label="keep_last")
            kept = kept_by_compaction(messages, keep)
            if len(kept) == len(messages):
                continue  # compaction summarizes only when something is cut
            messages = kept
            assert messages[0].role is sa.Role.USER  # what the model reads first
            assert messages == before[len(before) - len(messages) :]  # a suffix
        elif op in ("rewind", "fork"):
            if not messages:
                continue
            index = data.draw(st.integers(0, len(messages) - 1), label="at")
            kept = kept_by_rewind(messages, index)
            assert before[index] in kept
            assert kept == before[: len(kept)]  # a prefix
            if op == "fork" and data.draw(st.booleans(), label="continue on the fork"):
                assert tool_pairs_intact(messages)  # the source is untouched
                messages = kept
            elif op == "rewind":
                messages = kept
            else:
                assert tool_pairs_intact(kept)
        else:
            messages = messages + build(builder, data.draw(st.lists(blocks(), max_size=3)))
        assert tool_pairs_intact(messages), (op, [m.id for m in messages])


def test_tool_pairs_intact_catches_broken_histories() -> None:
    """Negative control: the invariant fails for every way of separating calls and results."""
    b = HistoryBuilder()
    text = b.block(0, [])
    group = b.block(2, [0, 1])  # c t t
    later = b.block(0, [])
    whole = [*text, *group, *later]
    assert tool_pairs_intact(whole)
    assert not tool_pairs_intact(whole[:3] + whole[4:])  # a result missing
    assert not tool_pairs_intact(whole[3:])  # results without their call
    assert not tool_pairs_intact(whole[:4])  # a call without all results
    assert not tool_pairs_intact([*text, group[0], later[0], *group[1:]])  # results too late
    assert not tool_pairs_intact([*text, group[1], group[0], group[2]])  # result before call
    assert not tool_pairs_intact([*whole, group[1]])  # a duplicated result
    # the naive cut (len - keep_last) would split the group; the rule moves the cut earlier,
    # to the user message that began the turn, or to the call when no user message came before
    naive = whole[len(whole) - 4 :]
    assert not tool_pairs_intact(naive)
    assert kept_by_truncate(whole, 4) == whole
    assert kept_by_truncate(whole[2:], 4) == whole[2:]
    assert kept_by_truncate(whole[2:], 2) == later


# ---- properties: through a live registry --------------------------------------------------------


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_live_edits_never_split_a_tool_group(data: st.DataObject) -> None:
    """Through a live registry, turns with tool calls mixed with truncate, rewind, compaction and
    fork keep every call with its results, exactly as the reference rules predict."""
    keep_last = data.draw(st.integers(1, 6), label="compaction keep_last")

    async def main() -> None:
        compact_now = False

        def estimate(messages: Sequence[sa.Message]) -> int:
            return 10**9 if compact_now else 0

        summarizer = ScriptedModel(["summary"], repeat=True)
        compaction = sa.Compaction(
            max_tokens=100, keep_last=keep_last, summarizer=summarizer, estimate=estimate
        )
        the_agent, _ = agent(compaction=compaction)
        async with sa.open_registry(agents={"a": the_agent}) as registry:
            refs = [await registry.spawn("s")]
            ref = refs[0]

            def turn_text() -> str:
                n = data.draw(st.integers(0, 3), label="calls")
                return f"tools {n}" if n else "hi"

            with trio.fail_after(60):
                for _ in range(data.draw(st.integers(1, 5), label="first turns")):
                    await ref.send(turn_text())
                for step in range(data.draw(st.integers(1, 8), label="operations")):
                    ref = data.draw(st.sampled_from(refs), label="session")
                    history = await ref.history()
                    op = data.draw(
                        st.sampled_from(["truncate", "rewind", "compact", "fork", "send"])
                    )
                    if op == "truncate":
                        keep = data.draw(st.integers(0, len(history) + 1), label="keep_last")
                        removed = await ref.truncate(keep)
                        assert await ref.history() == kept_by_truncate(history, keep)
                        assert removed == len(history) - len(kept_by_truncate(history, keep))
                    elif op in ("rewind", "fork") and history:
                        index = data.draw(st.integers(0, len(history) - 1), label="at")
                        if op == "rewind":
                            await ref.rewind(history[index].id)
                        else:
                            fork = await registry.fork(
                                ref.session_id, f"fork{step}", at=history[index].id
                            )
                            refs.append(fork)
                            assert await ref.history() == history
                            ref = fork
                        assert await ref.history() == kept_by_rewind(history, index)
                    elif op == "compact":
                        compact_now = True
                        summaries = len(summarizer.requests)
                        await ref.send(turn_text())
                        compact_now = False
                        if len(summarizer.requests) > summaries:
                            event("compacted")
                            assert (await ref.state()).summary == "summary"
                            assert (await ref.history())[0].role is sa.Role.USER
                    else:
                        await ref.send(turn_text())
                    assert tool_pairs_intact(await ref.history()), op
                for r in refs:
                    await r.hibernate()
                for r in refs:
                    assert tool_pairs_intact(await r.history())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
