"""What a turn publishes and what it journals, event by event, and journals written by
0.1 (a MessageAdded for every message) folding to the same state as today's."""

from __future__ import annotations

import datetime

import attrs
import pytest
import trio

import sessionactors as sa
from entry_forms import map_form, pack_maps
from sessionactors.stores import JournalEntry, MemoryStore, dump_events
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, journal_events

ECHO = {"echo": sa.Agent(model=EchoModel())}


async def send_and_watch(ref: sa.SessionRef, text: str) -> tuple[sa.Reply, list[sa.Event]]:
    """Send ``text``; its reply and the events a subscriber saw up to its TurnFinished."""
    async with ref.subscribe() as events:
        reply = await ref.send(text)
        published: list[sa.Event] = []
        with trio.fail_after(5):
            async for event in events:
                published.append(event)
                if isinstance(event, sa.TurnFinished):
                    break
    return reply, published


async def test_a_turn_publishes_its_start_deltas_and_outcome_and_journals_two_events() -> None:
    """A plain turn publishes TurnStarted (with the user's message), one Delta a word and
    TurnFinished (with the reply); it journals TurnStarted and TurnFinished only."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("contract")
        await ref.send("warm up")  # the wake's own status event comes first
        first = (await ref.state()).event_seq
        reply, published = await send_and_watch(ref, "hello brave world")
        history = await ref.history()
    kinds = [type(e) for e in published]
    assert kinds == [sa.TurnStarted, sa.Delta, sa.Delta, sa.Delta, sa.TurnFinished]
    assert [e.seq for e in published] == list(range(first + 1, first + 6))
    started, finished = published[0], published[-1]
    assert isinstance(started, sa.TurnStarted)
    assert isinstance(finished, sa.TurnFinished)
    assert started.message == history[-2]
    assert started.message.role is sa.Role.USER
    assert finished.message == history[-1] == reply.message
    assert "".join(e.text for e in published if isinstance(e, sa.Delta)) == reply.text
    journaled = await journal_events(store, "contract", after=first)
    assert journaled == [started, finished]


def _v01(entry: bytes) -> bytes:
    """The entry as 0.1 wrote it: in the map form, without the fields 0.2 added."""
    classes = {"turn_started": sa.TurnStarted, "message_added": sa.MessageAdded}
    classes |= {"turn_finished": sa.TurnFinished}
    events = map_form(entry, classes)
    for event in events:
        for added in ("message_id", "created_at", "lost"):
            event.pop(added, None)
    return pack_maps(events)


async def test_a_journal_written_by_0_1_folds_to_the_state_of_today() -> None:
    """The same conversation journaled as 0.1 did (MessageAdded for the user's message,
    the reply and tool results) and as today loads to the same state."""
    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    sid = "old"
    user = sa.Message(id="m1", role=sa.Role.USER, content="refund A1", created_at=at)
    call = sa.ToolCall(id="c1", name="refund", arguments='{"order": "A1"}')
    asks = sa.Message(
        id="m2", role=sa.Role.ASSISTANT, content="", created_at=at, tool_calls=(call,)
    )
    result = sa.Message(
        id="m3", role=sa.Role.TOOL, content="done", created_at=at, tool_call_id="c1"
    )
    final = sa.Message(id="m4", role=sa.Role.ASSISTANT, content="Refunded.", created_at=at)

    def started(seq: int, **new: object) -> sa.TurnStarted:
        return sa.TurnStarted(session_id=sid, seq=seq, turn_id="t1", text=user.content, **new)

    finished = sa.TurnFinished(session_id=sid, seq=9, turn_id="t1", message=final)
    old_style = [
        started(1),
        sa.MessageAdded(session_id=sid, seq=2, turn_id="t1", message=user),
        sa.MessageAdded(session_id=sid, seq=3, turn_id="t1", message=asks),
        sa.MessageAdded(session_id=sid, seq=5, turn_id="t1", message=result),
        sa.MessageAdded(session_id=sid, seq=8, turn_id="t1", message=final),
        finished,
    ]
    new_style = [
        started(1, message_id=user.id, created_at=at),
        sa.MessageAdded(session_id=sid, seq=3, turn_id="t1", message=asks),
        sa.ToolResult(
            session_id=sid,
            seq=5,
            turn_id="t1",
            tool_call_id="c1",
            content="done",
            message_id="m3",
            created_at=at,
        ),
        finished,
    ]
    states = []
    for events, v01 in ((old_style, True), (new_style, False)):
        store = MemoryStore()
        state = sa.SessionState(session_id=sid, agent="echo", created_at=at, updated_at=at)
        await store.create(sid, sa.dump_snapshot(state), b"")
        data = dump_events(events)
        await store.append(sid, [JournalEntry(9, _v01(data) if v01 else data)], b"")
        async with sa.open_registry(store=store, agents=ECHO) as registry:
            states.append(await registry.ref(sid).state())
    old, new = states
    assert list(old.messages) == [user, asks, result, final]
    assert old.messages == new.messages
    assert (old.turn_count, old.open_turn, old.summary) == (new.turn_count, new.open_turn, None)


async def test_the_records_a_turn_makes_are_whole_frozen_values() -> None:
    """Every event a turn with a tool call publishes, the messages it adds and the model
    request it makes are frozen values of the public class itself (not a subclass),
    with every field set, equal to themselves rebuilt through their class."""

    @sa.tool
    async def lookup(order: str) -> str:
        """Look an order up."""
        return f"{order} shipped"

    model = ScriptedModel(
        [
            Scripted(
                text="Checking.",
                tool_calls=[sa.ToolCall(id="call-1", name="lookup", arguments='{"order": "A1"}')],
            ),
            "It shipped.",
        ]
    )
    agents = {"tools": sa.Agent(model=model, tools=[lookup])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("records", agent="tools")
        reply, published = await send_and_watch(ref, "where is A1?")
        history = await ref.history()
    values: list[object] = [*published, *history, *model.requests, reply]
    values += [c for m in history for c in m.tool_calls]
    kinds = {type(e) for e in published}
    assert {sa.TurnStarted, sa.Delta, sa.MessageAdded, sa.ToolCallStarted, sa.ToolResult} <= kinds
    for value in values:
        assert getattr(sa, type(value).__name__) is type(value), value
        fields = attrs.fields(type(value))
        assert all(hasattr(value, f.name) for f in fields), value
        assert attrs.evolve(value) == value  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            value.seq = 0  # type: ignore[attr-defined]
