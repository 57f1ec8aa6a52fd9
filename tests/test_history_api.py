"""History without a turn: ref.add_messages appends messages of any role, ref.replace_history
replaces the history whole; both journaled, published, checked before anything is written."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import sessionactors as sa
import sessionactors.aio as aio
from history_rules import tool_pairs_intact
from redis_workers import open_worker
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

User, Assistant, System, Tool = sa.Role.USER, sa.Role.ASSISTANT, sa.Role.SYSTEM, sa.Role.TOOL


def call(name: str, **arguments: object) -> sa.ToolCall:
    """A tool call with a fresh id."""
    return sa.ToolCall(
        id=f"call_{uuid.uuid4().hex[:12]}", name=name, arguments=json.dumps(arguments)
    )


def tool_group(*calls: sa.ToolCall) -> list[sa.Message]:
    """An assistant message making ``calls`` and one tool message answering each."""
    asking = sa.Message.create(Assistant, "Let me look.", tool_calls=calls)
    results = [sa.Message.create(Tool, f"{c.name}: ok", tool_call_id=c.id) for c in calls]
    return [asking, *results]


def every_role() -> list[sa.Message]:
    """A user, a system, an assistant message and a tool group of two calls."""
    return [
        sa.Message.create(User, "My order A1 has not arrived."),
        sa.Message.create(System, "A human agent joined the chat."),
        sa.Message.create(Assistant, "Hi, I am Ada from support."),
        *tool_group(call("lookup", order_id="A1"), call("track", order_id="A1")),
    ]


def brief(messages: Sequence[sa.Message]) -> list[tuple[str, str]]:
    """(role, content) of each message."""
    return [(m.role.value, m.content) for m in messages]


async def test_added_messages_of_every_role_reach_the_next_model_request() -> None:
    """Messages of every role, a tool call with its results among them, join the history in
    order without a model call, and the next turn's request holds them after the prompt."""
    model = ScriptedModel(["I see the parcel is on its way."])
    agent = sa.Agent(model=model, system_prompt="You are support.")
    async with sa.open_registry(agents={"a": agent}) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("support-1")
            added = every_role()
            assert await ref.add_messages(added) is None
            assert model.requests == []  # no model call
            assert await ref.history() == added
            more = [sa.Message.create(Assistant, "One moment please.")]
            await ref.add_messages(iter(more))  # any iterable
            reply = await ref.send("Where is it?")
            assert reply.text == "I see the parcel is on its way."
            [request] = model.requests
            assert brief(request.messages) == [
                ("system", "You are support."),
                *brief(added + more),
                ("user", "Where is it?"),
            ]
            assert list(request.messages)[1:-1] == added + more
            history = await ref.history()
            assert history[: len(added) + 1] == added + more
            assert tool_pairs_intact(history)
            assert (await ref.state()).status is sa.Status.IDLE


async def test_a_spawned_session_with_added_messages_is_idle_and_turns_go_on(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """A new session that got messages without a turn is idle, and an empty list adds nothing."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            await ref.add_messages([])
            seq = (await ref.state()).event_seq  # (the wake's status, journaled at once)
            await ref.replace_history([])
            await ref.add_messages([])
            assert (await ref.state()).event_seq == seq
            assert (await ref.state()).status is sa.Status.NEW
            await ref.add_messages([sa.Message.create(User, "hello")])
            assert (await ref.state()).status is sa.Status.IDLE
            assert (await ref.send("again")).text == "again"
            assert brief(await ref.history()) == [
                ("user", "hello"),
                ("user", "again"),
                ("assistant", "again"),
            ]


async def test_replace_history_replaces_every_message_and_keeps_the_rest(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """replace_history swaps the whole history (ids of old messages may come back, edited),
    keeps summary, metadata and turn outcomes, and [] clears it."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s", metadata={"tier": "gold"})
            first = await ref.send("one")
            await ref.send("two")
            await ref.set_summary("counting")
            old = await ref.history()
            edited = [*old[:2], attrs.evolve(old[2], content="TWO (redacted)")]
            await ref.replace_history(edited)
            assert await ref.history() == edited
            state = await ref.state()
            assert state.summary == "counting"
            assert state.metadata == {"tier": "gold"}
            assert (await ref.turn_outcome(first.turn_id)).status is sa.TurnStatus.FINISHED
            replacement = every_role()
            await ref.replace_history(replacement)
            assert await ref.history() == replacement
            await ref.replace_history([])
            assert await ref.history() == []
            assert (await ref.state()).status is sa.Status.IDLE
            assert (await ref.send("fresh")).text == "fresh"


async def next_event(events: AsyncIterator[sa.Event]) -> sa.Event:
    """The next event that is not a StatusChanged (a wake journals one)."""
    async for event in events:
        if not isinstance(event, sa.StatusChanged):
            return event
    raise AssertionError("the events ended")


async def test_subscribers_see_one_message_added_per_message_and_the_replacement() -> None:
    """add_messages publishes a MessageAdded (no turn_id) per message, replayed from the
    store with their seqs; replace_history a HistoryEdited removing every message, then a
    MessageAdded per new message, and nothing before it is replayed any more."""
    async with sa.open_registry(agents={"a": sa.Agent(model=ScriptedModel())}) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            async with ref.subscribe() as events:
                added = every_role()
                await ref.add_messages(added)
                seen = [await next_event(events) for _ in added]
                assert all(isinstance(e, sa.MessageAdded) for e in seen)
                assert [e.message for e in seen if isinstance(e, sa.MessageAdded)] == added
                assert {e.turn_id for e in seen if isinstance(e, sa.MessageAdded)} == {None}
                seqs = [e.seq for e in seen]
                assert seqs == list(range(seqs[0], seqs[0] + len(added)))
                # replayed from the store with their seqs, like a turn's messages
                await ref.hibernate()
                async with registry.ref("s").subscribe(after=seqs[0] - 1) as replay:
                    assert [(await next_event(replay)).seq for _ in added] == seqs

                new = [sa.Message.create(User, "hi"), sa.Message.create(Assistant, "hello")]
                await ref.replace_history(new)
                edited = await next_event(events)
                assert isinstance(edited, sa.HistoryEdited)
                assert edited.reason == "replace_history"
                assert edited.removed == tuple(m.id for m in added)
                assert edited.summary is None
                replaced = [await next_event(events) for _ in new]
                assert [e.message for e in replaced if isinstance(e, sa.MessageAdded)] == new
                assert [e.seq for e in (edited, *replaced)] == list(
                    range(edited.seq, edited.seq + 3)
                )
            # the replacement is a checkpoint: what it removed is replayed no more
            await ref.hibernate()
            with pytest.raises(sa.EventsExpiredError) as expired:
                async with registry.ref("s").subscribe(after=seqs[0] - 1):
                    pass
            assert expired.value.oldest_seq == replaced[-1].seq + 1


async def test_added_and_replaced_histories_survive_hibernation_and_a_sqlite_restart(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """What add_messages and replace_history wrote reloads identical after hibernation,
    after a restart on SQLite, read without waking, and exported."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("imported")
            await ref.send("before")
            at = datetime.datetime(2024, 5, 1, 9, 30, 0, 123456, tzinfo=datetime.UTC)
            imported = [
                sa.Message(id="ext-1", role=User, content="from elsewhere", created_at=at),
                attrs.evolve(every_role()[2], metadata={"agent": "ada", "n": [1, 2]}),
            ]
            await ref.add_messages(imported)
            expected = await ref.history()
            await ref.hibernate()
            assert await registry.ref("imported").history() == expected
            other = await registry.spawn("replaced")
            await other.send("old")
            replacement = every_role()
            await other.replace_history(replacement)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            assert await registry.ref("imported").history() == expected
            assert await registry.ref("replaced").history() == replacement
            infos = {i.session_id: i for i in await registry.sessions()}
            assert infos["replaced"].message_count == len(replacement)
            reply = await registry.ref("replaced").send("next")
            assert (await registry.ref("replaced").history())[:-2] == replacement
            assert reply.text == "next"
    store = sa.SQLiteStore(path, readonly=True)
    try:
        assert list((await sa.read_session(store, "imported")).messages) == expected
        assert list((await sa.read_session(store, "replaced")).messages)[:-2] == replacement
    finally:
        await store.aclose()


# Aware times whose UTC time is outside datetime's range (the codec stores UTC times).
EARLY = datetime.datetime(1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=5)))
LATE = datetime.datetime(9999, 12, 31, 23, tzinfo=datetime.timezone(datetime.timedelta(hours=-5)))


def refusals(
    existing: sa.Message,
) -> list[tuple[str, object, type[Exception], str]]:
    """(case, messages, error, message pattern) that both methods refuse (add_messages
    also refuses ``existing``'s id)."""
    lookup = call("lookup")
    asking, answer = tool_group(lookup)
    naive = datetime.datetime(2024, 1, 1)
    m = sa.Message.create(User, "hi")
    return [
        ("a str", "hello", TypeError, "list of sa.Message records"),
        ("a dict", {"role": "user", "content": "hi"}, TypeError, "not dict"),
        ("one message", m, TypeError, "not Message"),
        ("not iterable", 5, TypeError, "not int"),
        ("a dict inside", [{"role": "user"}], TypeError, r"messages\[0\] is dict"),
        ("content int", [attrs.evolve(m, content=5)], TypeError, "content"),
        ("role str", [attrs.evolve(m, role="user")], TypeError, "role"),
        ("naive time", [attrs.evolve(m, created_at=naive)], ValueError, "naive"),
        (
            "before UTC's years",
            [attrs.evolve(m, created_at=EARLY)],
            ValueError,
            "in UTC is outside",
        ),
        ("after UTC's years", [attrs.evolve(m, created_at=LATE)], ValueError, "in UTC is outside"),
        ("bad metadata", [attrs.evolve(m, metadata={"x": object()})], TypeError, "metadata"),
        (
            "not finite metadata",
            [attrs.evolve(m, metadata={"score": [math.nan]})],
            ValueError,
            r"messages\[0\].*'score'.*not finite",
        ),
        ("twice", [m, m], sa.InvalidHistoryError, "appears twice"),
        ("empty id", [attrs.evolve(m, id="")], sa.InvalidHistoryError, "empty id"),
        ("call alone", [asking], sa.InvalidHistoryError, "has no result"),
        ("result alone", [answer], sa.InvalidHistoryError, "did not make"),
        ("between", [asking, m, answer], sa.InvalidHistoryError, "no result before"),
        (
            "answered twice",
            [asking, answer, attrs.evolve(answer, id="2")],
            sa.InvalidHistoryError,
            "answered already",
        ),
        ("user calls", [attrs.evolve(m, tool_calls=(lookup,))], sa.InvalidHistoryError, "only"),
        ("stray id", [attrs.evolve(m, tool_call_id="c")], sa.InvalidHistoryError, "only tool"),
    ]


async def test_refused_messages_leave_the_session_unchanged_after_a_restart(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """Wrong types, what the codec refuses, empty or repeated ids and a tool call separated
    from its results raise a typed error naming the session, and nothing is written: the
    stored session and its seq are unchanged after a restart (an accepted add would show)."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(20):
            ref = await registry.spawn("s")
            await ref.send("hello")
            before = await ref.state()
            existing = before.messages[0]
            cases = refusals(existing)
            cases.append(("known id", [existing], sa.InvalidHistoryError, "already has"))
            for case, messages, error, pattern in cases:
                methods = [ref.add_messages, ref.replace_history]
                if case == "known id":
                    methods = [ref.add_messages]  # a replacement may reuse an old id
                for method in methods:
                    with pytest.raises(error, match=pattern) as info:
                        await method(messages)  # type: ignore[arg-type]
                    assert "'s'" in str(info.value), (case, str(info.value))
                    if isinstance(info.value, sa.SessionActorsError):
                        assert isinstance(info.value, ValueError)
                        assert info.value.session_id == "s"
            assert await ref.state() == before
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = registry.ref("s")
            assert await ref.history() == list(before.messages)
            after_restart = await ref.state()
            assert (
                after_restart.event_seq == before.event_seq + 1
            )  # (the hibernation status published on closing)
            # the control: an accepted add shows in both
            await ref.add_messages([sa.Message.create(User, "accepted")])
            assert len(await ref.history()) == len(before.messages) + 1
            assert (await ref.state()).event_seq > after_restart.event_seq


async def test_a_batch_too_large_to_journal_is_refused_whole() -> None:
    """Messages that fit one by one but not together in one journal entry are refused
    with ValueError naming the session, and nothing joins the history."""
    async with sa.open_registry(agents={"a": sa.Agent(model=ScriptedModel())}) as registry:
        with trio.fail_after(20):
            ref = await registry.spawn("big")
            text = "x" * (1024 * 1024)
            many = [sa.Message.create(User, text) for _ in range(20)]
            with pytest.raises(ValueError, match=r"'big'.*smaller batches"):
                await ref.add_messages(many)
            with pytest.raises(ValueError, match=r"'big'.*smaller batches"):
                await ref.replace_history(many)
            assert await ref.history() == []
            await ref.add_messages(many[:2])
            assert len(await ref.history()) == 2


async def test_history_writes_are_refused_while_a_review_is_pending(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While a turn waits on a review, add_messages and replace_history raise
    SessionBusyError naming the review; once it is resolved they go through."""
    refund = call("refund", order_id="A1")

    async def do_refund(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=do_refund, requires_review=True)
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund]), "Done."])
    agent = sa.Agent(model=model, tools=[tool])
    async with sa.open_registry(agents={"a": agent}) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            waiting = await ref.send("Refund A1")
            [review] = waiting.reviews
            before = await ref.state()
            note = [sa.Message.create(System, "note")]
            for method in (ref.add_messages, ref.replace_history):
                with pytest.raises(sa.SessionBusyError, match=rf"'s'.*{review.id}"):
                    await method(note)
            assert await ref.state() == before
            assert (await ref.review(review.id, approve=True)).text == "Done."
            await ref.add_messages(note)
            history = await ref.history()
            assert history[-1] == note[0]
            assert tool_pairs_intact(history)


async def test_history_writes_wait_behind_a_running_turn_in_mailbox_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    """add_messages sent while a turn runs is served after it: the added message comes
    after the turn's reply, and the turn's model request does not hold it."""
    go = trio.Event()
    model = ScriptedModel([Scripted(text="the reply", wait=go)])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            turn = await ref.submit("question")
            added = sa.Message.create(Assistant, "a person's answer")
            done = trio.Event()

            async def add() -> None:
                await ref.add_messages([added])
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(add)
                await trio.testing.wait_all_tasks_blocked()
                assert not done.is_set()
                assert brief(await ref.history()) == [("user", "question")]
                go.set()
                assert (await turn.reply()).text == "the reply"
            assert brief(await ref.history()) == [
                ("user", "question"),
                ("assistant", "the reply"),
                ("assistant", "a person's answer"),
            ]
            assert added.id not in {m.id for m in model.requests[0].messages}


def test_asyncio_code_adds_and_replaces_messages() -> None:
    """sessionactors.aio offers add_messages and replace_history with the same checks."""

    async def main() -> list[sa.Message]:
        agents = {"a": sa.Agent(model=ScriptedModel(["ok"]))}
        async with asyncio.timeout(20), aio.open_registry(agents=agents) as registry:
            ref = await registry.spawn("aio")
            await ref.add_messages(every_role())
            with pytest.raises(sa.InvalidHistoryError, match="'aio'"):
                await ref.add_messages(tool_group(call("lookup"))[:1])
            replacement = [sa.Message.create(User, "imported")]
            await ref.replace_history(replacement)
            assert await ref.history() == replacement
            await ref.send("and now?")
            return await ref.history()

    history = asyncio.run(main())
    assert brief(history) == [("user", "imported"), ("user", "and now?"), ("assistant", "ok")]


@pytest.mark.redis
async def test_history_writes_through_another_worker_reach_the_owner(redis_url: str) -> None:
    """add_messages and replace_history through a worker that does not run the session are
    forwarded to its owner (records and refusals alike) and journaled there."""
    prefix = f"history-{uuid.uuid4().hex}"

    # (the session stays with the worker that spawned it, as open_worker's do, where a
    # balancing worker would hand it over to the other if its shard prefers that one;
    # leases of the registry's default length)
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, None, lease_ttl=30.0) as owner,
            open_worker(redis_url, prefix, None, lease_ttl=30.0) as other,
        ):
            await owner.spawn("s")
            await owner.ref("s").send("hello")  # live on the owner
            ref = other.ref("s")
            added = every_role()
            added[2] = attrs.evolve(
                added[2], metadata={"when": datetime.datetime.now(datetime.UTC)}
            )
            await ref.add_messages(added)
            assert other.live() == []
            assert (await owner.ref("s").history())[2:] == added
            with pytest.raises(sa.InvalidHistoryError, match=r"'s'.*already has") as info:
                await ref.add_messages(added[:1])
            assert info.value.session_id == "s"
            await ref.replace_history(added[:3])
            assert await owner.ref("s").history() == added[:3]
            await ref.replace_history([])
            assert await ref.history() == []
            assert other.live() == []
        async with open_worker(redis_url, prefix, None, lease_ttl=30.0) as again:
            assert await again.ref("s").history() == []


@st.composite
def loose_messages(draw: st.DrawFn) -> list[sa.Message]:
    """Messages in any order: text, assistant messages calling tools c0-c2, tool results
    for c0-c2 or for no call; every id unique."""
    ids = (f"m{i}" for i in range(1000))
    at = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    call_ids = st.sampled_from(["c0", "c1", "c2"])
    out = []
    for kind in draw(st.lists(st.sampled_from(["user", "text", "asks", "result"]), max_size=8)):
        if kind == "user":
            out.append(sa.Message(id=next(ids), role=User, content="u", created_at=at))
        elif kind == "text":
            out.append(sa.Message(id=next(ids), role=Assistant, content="a", created_at=at))
        elif kind == "asks":
            made = draw(st.lists(call_ids, min_size=1, max_size=3, unique=True))
            calls = tuple(sa.ToolCall(id=c, name="t") for c in made)
            message = sa.Message(id=next(ids), role=Assistant, content="", created_at=at)
            out.append(attrs.evolve(message, tool_calls=calls))
        else:
            answers = draw(st.one_of(st.none(), call_ids))
            message = sa.Message(id=next(ids), role=Tool, content="r", created_at=at)
            out.append(attrs.evolve(message, tool_call_id=answers))
    return out


@settings(max_examples=150, deadline=None)
@given(messages=loose_messages(), replace=st.booleans())
def test_a_block_is_accepted_exactly_when_no_tool_call_is_separated_from_its_results(
    messages: list[sa.Message], replace: bool
) -> None:
    """Any block of messages is taken whole when every call is answered right after it (by
    the tests' own rule), and refused whole with InvalidHistoryError otherwise."""

    async def main() -> None:
        async with sa.open_registry(agents={"a": sa.Agent(model=ScriptedModel())}) as registry:
            ref = await registry.spawn("s")
            write = ref.replace_history if replace else ref.add_messages
            if tool_pairs_intact(messages):
                await write(messages)
                assert await ref.history() == messages
            else:
                with pytest.raises(sa.InvalidHistoryError, match="'s'"):
                    await write(messages)
                assert await ref.history() == []

    trio.run(main)


async def test_ids_are_checked_against_the_history_as_it_is_after_turns_and_edits(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """add_messages refuses the id of any message in the history now (one a turn added
    after the last add included) and takes the id of one an edit removed."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            first = sa.Message.create(User, "first")
            await ref.add_messages([first])
            reply = await ref.send("a turn")
            assert reply.message is not None
            for taken in (first, reply.message):
                with pytest.raises(sa.InvalidHistoryError, match="already has"):
                    await ref.add_messages([attrs.evolve(taken, role=Assistant)])
            assert await ref.truncate(keep_last=1) == 1  # first goes; the turn stays whole
            await ref.add_messages([first])
            with pytest.raises(sa.InvalidHistoryError, match="already has"):
                await ref.add_messages([first])
            await ref.replace_history([reply.message])
            await ref.add_messages([first])
            assert await ref.history() == [reply.message, first]


async def test_added_messages_are_the_sessions_own_not_the_callers() -> None:
    """What add_messages accepted is what a restart reads: the caller changing its
    message's metadata afterwards changes nothing in the session."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents={"a": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("own", agent="a")
        kept = {"k": "v", "list": [1, 2], "pair": (3, 4)}
        message = attrs.evolve(sa.Message.create(sa.Role.USER, "hi"), metadata=kept)
        await ref.add_messages([message])
        kept["k"] = "changed"
        kept["list"].append(object())  # type: ignore[attr-defined]
        live = (await ref.history())[-1].metadata
        await ref.hibernate()
        stored = (await ref.history())[-1].metadata
    assert live == stored == {"k": "v", "list": [1, 2], "pair": [3, 4]}


async def test_a_state_handed_out_cannot_change_the_session() -> None:
    """Changing the metadata of a SessionState or SessionInfo the session handed out
    changes nothing in the session (nothing journaled could say so)."""
    async with sa.open_registry(agents={"a": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("own", agent="a", metadata={"tenant": "acme"})
        (await ref.state()).metadata["tenant"] = "evil"
        (await reg.sessions())[0].metadata["tenant"] = "evil"
        assert (await ref.state()).metadata == {"tenant": "acme"}
        assert (await reg.sessions())[0].metadata == {"tenant": "acme"}


async def test_a_history_handed_out_cannot_change_the_session() -> None:
    """Changing the metadata of a message that ref.history() handed out changes nothing
    in the session."""
    async with sa.open_registry(agents={"a": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("own", agent="a")
        message = attrs.evolve(sa.Message.create(sa.Role.USER, "hi"), metadata={"k": [1]})
        await ref.add_messages([message])
        handed = (await ref.history())[-1].metadata
        handed["k"].append(2)  # type: ignore[index]
        assert (await ref.history())[-1].metadata == {"k": [1]}


async def test_message_create_takes_a_role_by_its_name_and_refuses_another(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``sa.Message.create("user", ...)`` (a role as a client's JSON names it) makes a
    message of ``Role.USER``, which a session takes; a name that is no role is refused
    when the message is made, saying which roles there are."""
    message = sa.Message.create("user", "hi")
    assert message.role is sa.Role.USER
    async with sa.open_registry(agents={"a": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.add_messages([message])
            assert [m.role for m in await ref.history()] == [sa.Role.USER]
    for wrong in ("usr", 5, None):
        with pytest.raises(ValueError, match="'system', 'user', 'assistant', 'tool'"):
            sa.Message.create(wrong, "hi")  # type: ignore[arg-type]
