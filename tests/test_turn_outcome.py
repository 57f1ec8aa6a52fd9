"""What became of a turn, by its id (finished, failed, cancelled, queued, running, lost),
after hibernation and restarts; the history a failed or cancelled turn leaves; retry()."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import (
    EchoModel,
    FaultyStore,
    Scripted,
    ScriptedModel,
    crash,
    journal_events,
)

NO_REPLY_FAILED = "(no reply: this turn failed)"
NO_REPLY_CANCELLED = "(no reply: this turn was cancelled)"


def agents_of(model: sa.Model) -> dict[str, sa.Agent]:
    return {"a": sa.Agent(model=model, system_prompt="Be brief.")}


def alternates(messages: Sequence[sa.Message]) -> bool:
    """Whether no user message follows a user message (what every model API accepts)."""
    roles = [m.role for m in messages if m.role is not sa.Role.SYSTEM]
    return all(not (a is sa.Role.USER and b is sa.Role.USER) for a, b in itertools.pairwise(roles))


async def test_finished_failed_and_cancelled_turns_answer_by_id() -> None:
    """Each settled turn answers its outcome: the reply, the error, or cancelled."""
    hold = trio.Event()
    model = ScriptedModel(["hello there", ValueError("the model broke"), Scripted(wait=hold)])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            reply = await ref.send("hi")
            failing = await ref.submit("break")
            with pytest.raises(sa.TurnFailedError):
                await failing.reply()
            held = await ref.submit("wait")
            await trio.testing.wait_all_tasks_blocked()
            assert (await ref.turn_outcome(held.id)).status is sa.TurnStatus.RUNNING
            assert await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await held.reply()

            finished = await ref.turn_outcome(reply.turn_id)
            failed = await ref.turn_outcome(failing.id)
            cancelled = await ref.turn_outcome(held.id)

    assert finished.status is sa.TurnStatus.FINISHED
    assert finished.message == reply.message
    assert (finished.session_id, finished.turn_id) == ("s", reply.turn_id)
    assert failed.status is sa.TurnStatus.FAILED
    assert failed.error is not None
    assert "the model broke" in failed.error
    assert failed.message is None
    assert cancelled.status is sa.TurnStatus.CANCELLED


async def test_a_queued_turn_reads_queued_then_finished() -> None:
    """A turn behind another in the mailbox reads queued, then its outcome."""
    hold = trio.Event()
    model = ScriptedModel([Scripted(text="first", wait=hold), "second"])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("q")
        with trio.fail_after(10):
            first = await ref.submit("one")
            second = await ref.submit("two")
            await trio.testing.wait_all_tasks_blocked()
            assert (await ref.turn_outcome(first.id)).status is sa.TurnStatus.RUNNING
            assert (await ref.turn_outcome(second.id)).status is sa.TurnStatus.QUEUED
            hold.set()
            reply = await second.reply()
            outcome = await ref.turn_outcome(second.id)
    assert outcome.status is sa.TurnStatus.FINISHED
    assert outcome.message == reply.message


async def test_outcomes_survive_hibernation_and_a_restart_on_sqlite(tmp_path: Path) -> None:
    """Outcomes are durable: they answer after hibernation and in a new registry."""
    path = tmp_path / "s.db"
    hold = trio.Event()
    model = ScriptedModel(
        ["fine", RuntimeError("no"), Scripted(chunks=["part", " more"], wait=hold, wait_after=1)]
    )
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(model)) as registry:
        ref = await registry.spawn("r")
        with trio.fail_after(10):
            ok = await ref.send("a")
            bad = await ref.submit("b")
            with pytest.raises(sa.TurnFailedError):
                await bad.reply()
            cut = await ref.submit("c")
            await trio.testing.wait_all_tasks_blocked()
            await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await cut.reply()
            await ref.hibernate()
            assert "r" not in registry.live()
            after_hibernation = [
                (await ref.turn_outcome(t)).status for t in (ok.turn_id, bad.id, cut.id)
            ]
    expected = [sa.TurnStatus.FINISHED, sa.TurnStatus.FAILED, sa.TurnStatus.CANCELLED]
    assert after_hibernation == expected

    echo = EchoModel()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(echo)) as registry:
        ref = registry.ref("r")
        with trio.fail_after(10):
            outcomes = [await ref.turn_outcome(t) for t in (ok.turn_id, bad.id, cut.id)]
            history = await ref.history()
    assert [o.status for o in outcomes] == expected
    assert outcomes[0].message is not None
    assert outcomes[0].message.content == "fine"
    assert outcomes[1].error is not None
    assert "RuntimeError: no" in outcomes[1].error
    # the failed turn left a marked "no reply"; the cancelled one its partial reply
    assert [(m.role.value, m.content, m.interrupted) for m in history] == [
        ("user", "a", False),
        ("assistant", "fine", False),
        ("user", "b", False),
        ("assistant", NO_REPLY_FAILED, True),
        ("user", "c", False),
        ("assistant", "part", True),
    ]


async def test_failed_and_cancelled_turns_leave_a_history_that_alternates(tmp_path: Path) -> None:
    """After a failed turn and a cancelled one that streamed nothing, the next model
    request holds no user message after a user message, also after a restart."""
    path = tmp_path / "alt.db"
    hold = trio.Event()
    model = ScriptedModel([ValueError("boom"), Scripted(wait=hold), "third"])
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(model)) as registry:
        ref = await registry.spawn("alt")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("one")
            held = await ref.submit("two")
            await trio.testing.wait_all_tasks_blocked()
            await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await held.reply()
            await ref.send("three")
    assert alternates(model.requests[-1].messages)
    assert [m.content for m in model.requests[-1].messages if m.role is sa.Role.ASSISTANT] == [
        NO_REPLY_FAILED,
        NO_REPLY_CANCELLED,
    ]

    after = ScriptedModel(["four"])
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(after)) as registry:
        with trio.fail_after(10):
            await registry.ref("alt").send("four?")
    assert alternates(after.requests[0].messages)


def history_of(messages: Sequence[sa.Message]) -> list[tuple[str, str, bool]]:
    return [(m.role.value, m.content, m.interrupted) for m in messages]


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_a_failed_turn_keeps_the_text_its_model_streamed(
    tmp_path: Path, durability: sa.Durability
) -> None:
    """A turn whose model fails after streaming text keeps that text, marked interrupted,
    as a cancelled turn does: subscribers see the deltas, that message, then TurnFailed;
    the journal holds it, and a wake (from the journal after a crash, from the closing
    snapshot) folds to the same history."""
    path = tmp_path / "failed.db"
    broken = Scripted(chunks=["Half ", "an ", "answer"], error=ConnectionError("reset by peer"))
    agents = agents_of(ScriptedModel([broken]))
    kept = [
        ("user", "tell me", False),
        ("assistant", "Half an answer", True),
    ]
    with trio.fail_after(10):
        with trio.CancelScope() as process:
            async with sa.open_registry(
                store=sa.SQLiteStore(path), agents=agents, durability=durability
            ) as registry:
                ref = await registry.spawn("f")
                async with ref.stream("tell me") as events:
                    seen = [event async for event in events]
                history = await ref.history()
                outcome = await ref.turn_outcome(seen[0].turn_id or "")
                if durability == "turn":  # the journal alone holds it: a crash keeps it
                    crash(registry)
                    process.cancel()
        assert [type(e).__name__ for e in seen] == [
            "TurnStarted",
            "Delta",
            "Delta",
            "Delta",
            "MessageAdded",
            "TurnFailed",
        ]
        added = seen[4]
        assert isinstance(added, sa.MessageAdded)
        assert "".join(e.text for e in seen if isinstance(e, sa.Delta)) == added.message.content
        assert history_of(history) == kept
        assert added.message == history[-1]
        assert outcome.status is sa.TurnStatus.FAILED
        assert outcome.error == "ConnectionError: reset by peer"
        assert outcome.message is None
        store = sa.SQLiteStore(path)
        async with sa.open_registry(store=store, agents=agents, durability=durability) as again:
            woken = await again.ref("f").history()
            if durability == "turn":  # (with "hibernate" only the snapshot is written)
                replayed: list[sa.Event] = []
                async with again.ref("f").subscribe(after=seen[0].seq) as stored:
                    async for event in stored:  # (the deltas were never stored)
                        replayed.append(event)
                        if isinstance(event, sa.TurnFailed):
                            break
                assert replayed == seen[-2:]
            if durability == "turn":
                journal = await journal_events(store, "f")
                journaled = [e.message for e in journal if isinstance(e, sa.MessageAdded)]
                assert history_of(journaled) == kept[1:]  # (the user's: in TurnStarted)
                # the outcome follows the message under the same turn: it tells a
                # reader of the history (or a resumed stream) that the turn failed
                assert [(type(e).__name__, e.turn_id) for e in journal[-2:]] == [
                    ("MessageAdded", added.turn_id),
                    ("TurnFailed", added.turn_id),
                ]
    assert woken == history


async def test_a_failed_step_after_a_tool_step_keeps_only_its_own_text() -> None:
    """In a turn whose tool step succeeded and whose next model step streams text and
    fails, the tool step's messages stay as they were and the failing step's text
    follows them, marked interrupted; the calls that step streamed before it failed
    are not kept and never run."""
    ran: list[str] = []

    async def lookup(order_id: str) -> str:
        """Look up an order."""
        ran.append(order_id)
        return f"order {order_id}: shipped"

    def call(call_id: str, order_id: str) -> sa.ToolCall:
        return sa.ToolCall(id=call_id, name="lookup", arguments=f'{{"order_id": "{order_id}"}}')

    model = ScriptedModel(
        [
            Scripted(text="Let me check.", tool_calls=[call("c1", "A1")]),
            Scripted(
                text="A1 shipped; checking A2",
                tool_calls=[call("c2", "A2")],
                error=sa.ModelError("the server closed the stream", session_id="t"),
            ),
        ]
    )
    agent = sa.Agent(model=model, tools=[sa.tool(lookup)])
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("t")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("Where are A1 and A2?")
            history = await ref.history()
    assert ran == ["A1"]
    assert [(m.role.value, m.content, m.interrupted, m.tool_calls) for m in history] == [
        ("user", "Where are A1 and A2?", False, ()),
        ("assistant", "Let me check.", False, (call("c1", "A1"),)),
        ("tool", "order A1: shipped", False, ()),
        ("assistant", "A1 shipped; checking A2", True, ()),
    ]


async def test_a_failed_step_that_streamed_only_a_call_leaves_the_no_reply_message() -> None:
    """A failing step that streamed no text, only part of a tool call, leaves the
    "no reply" message: the half call is not kept."""
    half = Scripted(
        tool_calls=[sa.ToolCall(id="c1", name="lookup", arguments='{"order_id": "A1"}')],
        error=ConnectionError("reset"),
    )
    async with sa.open_registry(agents=agents_of(ScriptedModel([half]))) as registry:
        ref = await registry.spawn("h")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send("go")
            history = await ref.history()
    assert "kept" not in str(failed.value)
    assert [(m.content, m.interrupted, m.tool_calls) for m in history[1:]] == [
        (NO_REPLY_FAILED, True, ())
    ]


async def test_a_turn_past_max_steps_leaves_its_steps_and_the_no_reply_message() -> None:
    """A turn that fails at max_steps (its last step's tools ran; no step was streaming)
    keeps that step's messages and leaves the "no reply" message after them."""

    async def lookup() -> str:
        """Look something up."""
        return "found"

    again = Scripted(text="Looking.", tool_calls=[sa.ToolCall(id="c1", name="lookup")])
    agent = sa.Agent(model=ScriptedModel([again]), tools=[sa.tool(lookup)], max_steps=1)
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("m")
        with trio.fail_after(10):
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send("go")
            history = await ref.history()
    assert isinstance(failed.value.__cause__, sa.MaxStepsError)
    assert history_of(history) == [
        ("user", "go", False),
        ("assistant", "Looking.", False),
        ("tool", "found", False),
        ("assistant", NO_REPLY_FAILED, True),
    ]


async def test_retry_of_a_failed_turn_drops_the_text_it_kept() -> None:
    """retry() removes the text a failed turn kept, as it removes the "no reply"
    message, and the failed turn still reads failed."""
    broken = Scripted(chunks=["par", "tial"], error=RuntimeError("provider unavailable"))
    model = ScriptedModel([broken, "whole"])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("r")
        with trio.fail_after(10):
            turn = await ref.submit("go")
            with pytest.raises(sa.TurnFailedError, match="what it streamed is kept, marked"):
                await turn.reply()
            assert history_of(await ref.history()) == [
                ("user", "go", False),
                ("assistant", "partial", True),
            ]
            reply = await ref.retry()
            history = history_of(await ref.history())
            outcome = await ref.turn_outcome(turn.id)
    assert reply.text == "whole"
    assert history == [("user", "go", False), ("assistant", "whole", False)]
    assert [m.role for m in model.requests[1].messages] == [sa.Role.SYSTEM, sa.Role.USER]
    assert outcome.status is sa.TurnStatus.FAILED


class OwnChunk(sa.TextChunk):
    """A model's own kind of text chunk."""


@attrs.define
class OverLong:
    """Streams a whole answer's worth of text but a character, then two more."""

    chunk: type[sa.TextChunk]

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await trio.lowlevel.checkpoint()
        yield self.chunk("x" * (1024 * 1024 - 1))
        yield self.chunk("yz")


@pytest.mark.parametrize("chunk", [sa.TextChunk, OwnChunk])
async def test_an_answer_stopped_at_the_limit_keeps_text_within_it(
    tmp_path: Path, chunk: type[sa.TextChunk]
) -> None:
    """A model answer stopped for going over the limit fails its turn and keeps what it
    streamed up to the limit, no more, which reloads from the store."""
    path = tmp_path / "long.db"
    agents = agents_of(OverLong(chunk))
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        ref = await registry.spawn("long")
        with trio.fail_after(30):
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send("go on")
            history = await ref.history()
    assert isinstance(failed.value.__cause__, sa.ModelError)
    assert history[-1].interrupted
    assert history[-1].content == "x" * (1024 * 1024 - 1)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        assert await registry.ref("long").history() == history


def test_the_alternation_check_catches_two_user_messages_in_a_row() -> None:
    """The check above fails on the history a failed turn used to leave (negative control)."""
    user = sa.Message.create(sa.Role.USER, "x")
    assert not alternates([user, user])
    assert alternates([user, sa.Message.create(sa.Role.ASSISTANT, NO_REPLY_FAILED), user])


async def test_a_turn_lost_before_it_was_durable_reads_lost_also_after_a_restart() -> None:
    """A turn whose journal write failed (the session restarted without it) reads lost."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=agents_of(EchoModel())) as registry:
        ref = await registry.spawn("l")
        with trio.fail_after(10):
            await ref.send("kept")
            store.fail("append", session_id="l")
            turn = await ref.submit("lost")
            with pytest.raises(sa.SessionCrashedError):
                await turn.reply()
            assert store.injected == 1
            outcome = await ref.turn_outcome(turn.id)
            history = [m.content for m in await ref.history()]
            after = await ref.send("after")
            assert (await ref.turn_outcome(after.turn_id)).status is sa.TurnStatus.FINISHED
    assert outcome.status is sa.TurnStatus.LOST
    assert "lost" not in history
    async with sa.open_registry(store=store.store, agents=agents_of(EchoModel())) as registry:
        with trio.fail_after(10):
            again = await registry.ref("l").turn_outcome(turn.id)
    assert again.status is sa.TurnStatus.LOST


async def test_turns_left_in_the_mailbox_of_a_crashed_session_read_lost() -> None:
    """Turns queued behind a turn whose write failed are lost with it, not queued forever."""
    store = FaultyStore()
    hold = trio.Event()
    model = ScriptedModel([Scripted(text="x", wait=hold), "y", "z"])
    async with sa.open_registry(store=store, agents=agents_of(model)) as registry:
        ref = await registry.spawn("m")
        with trio.fail_after(10):
            first = await ref.submit("one")
            second = await ref.submit("two")
            await trio.testing.wait_all_tasks_blocked()
            assert (await ref.turn_outcome(second.id)).status is sa.TurnStatus.QUEUED
            store.fail("append", session_id="m", times=None)
            hold.set()
            for turn in (first, second):
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
            store.fail("append", session_id="m", times=0)
            statuses = [(await ref.turn_outcome(t.id)).status for t in (first, second)]
    assert statuses == [sa.TurnStatus.LOST, sa.TurnStatus.LOST]


async def test_an_id_never_issued_for_the_session_is_a_typed_error() -> None:
    """Garbage, and another session's turn id, raise TurnNotFoundError naming the session."""
    async with sa.open_registry(agents=agents_of(EchoModel())) as registry:
        a = await registry.spawn("a")
        b = await registry.spawn("b")
        with trio.fail_after(10):
            reply = await a.send("hi")
            for bad in ("nonsense", reply.turn_id):
                with pytest.raises(sa.TurnNotFoundError, match="session 'b' never issued"):
                    await b.turn_outcome(bad)
            with pytest.raises(TypeError, match="turn_id for session 'a' must be str"):
                await a.turn_outcome(5)  # type: ignore[arg-type]


async def test_an_id_of_the_sessions_form_it_could_not_have_issued_is_a_typed_error() -> None:
    """An id of the session's form that it could not have issued (stamped before it was
    created or days from now, or longer than any turn id) raises TurnNotFoundError saying
    that it never issued it, the id cut to 64 characters, rather than reading lost."""
    async with sa.open_registry(agents=agents_of(EchoModel())) as registry:
        ref = await registry.spawn("f")
        with trio.fail_after(10):
            reply = await ref.send("hi")
            _, tag, stamp, process = reply.turn_id.split("_")  # turn_<tag>_<time>_<process>
            days_later = f"{int(stamp, 16) + 3 * 86_400 * 10**6:x}"
            for forged in (
                f"turn_{tag}_0_{process}",
                f"turn_{tag}_{days_later}_{process}",
                f"turn_{tag}_{'f' * 3000}_{process}",
                f"turn_{tag}_{stamp}_{'Z' * 8000}",
            ):
                with pytest.raises(sa.TurnNotFoundError, match="session 'f' never issued") as e:
                    await ref.turn_outcome(forged)
                assert len(str(e.value)) < 300, str(e.value)
            kept = await ref.turn_outcome(reply.turn_id)
    assert kept.status is sa.TurnStatus.FINISHED


async def test_outcomes_are_kept_for_the_last_256_turns() -> None:
    """Retention is bounded: the oldest outcome is forgotten with a clear error."""
    async with sa.open_registry(agents=agents_of(EchoModel())) as registry:
        ref = await registry.spawn("many")
        with trio.fail_after(60):
            first = await ref.send("0")
            second = await ref.send("1")
            for i in range(255):
                await ref.send(str(i))
            state = await ref.state()
            with pytest.raises(sa.TurnNotFoundError, match="last 256 turns"):
                await ref.turn_outcome(first.turn_id)
            kept = await ref.turn_outcome(second.turn_id)
    assert len(state.turns) == 256
    assert kept.status is sa.TurnStatus.FINISHED


async def test_retry_runs_the_failed_turn_again_without_a_second_user_message(
    tmp_path: Path,
) -> None:
    """retry() replaces what the failed turn left and answers the same user message,
    also after a restart; it refuses when the last turn did not fail."""
    path = tmp_path / "retry.db"
    model = ScriptedModel([ValueError("flaky")])
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(model)) as registry:
        ref = await registry.spawn("t")
        with trio.fail_after(10):
            failing = await ref.submit("question")
            with pytest.raises(sa.TurnFailedError):
                await failing.reply()

    model = ScriptedModel(["answer"])
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents_of(model)) as registry:
        ref = registry.ref("t")
        with trio.fail_after(10):
            async with ref.subscribe() as events:
                reply = await ref.retry()
                started = None
                async for event in events:
                    if isinstance(event, sa.TurnStarted):
                        started = event
                    if isinstance(event, sa.TurnFinished):
                        break
            history = await ref.history()
            outcomes = [await ref.turn_outcome(t) for t in (failing.id, reply.turn_id)]
            with pytest.raises(sa.NothingToRetryError, match="session 't' has nothing to retry"):
                await ref.retry()
    assert reply.text == "answer"
    assert reply.turn_id != failing.id
    assert [(m.role.value, m.content) for m in history] == [
        ("user", "question"),
        ("assistant", "answer"),
    ]
    assert [m.role for m in model.requests[0].messages] == [sa.Role.SYSTEM, sa.Role.USER]
    assert started is not None
    assert started.retry_of == failing.id
    assert [o.status for o in outcomes] == [sa.TurnStatus.FAILED, sa.TurnStatus.FINISHED]


async def test_retry_after_a_cancel_drops_the_partial_reply() -> None:
    """A cancelled turn is retried too; its interrupted partial reply goes."""
    hold = trio.Event()
    model = ScriptedModel([Scripted(chunks=["par", "tial"], wait=hold, wait_after=1), "whole"])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("c")
        with trio.fail_after(10):
            with pytest.raises(sa.NothingToRetryError, match="no turn yet"):
                await ref.retry()
            turn = await ref.submit("go")
            await trio.testing.wait_all_tasks_blocked()
            await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            assert [m.content for m in await ref.history()] == ["go", "par"]
            reply = await ref.retry()
            history = [m.content for m in await ref.history()]
    assert reply.text == "whole"
    assert history == ["go", "whole"]


async def test_an_id_the_live_session_never_queued_never_reads_queued() -> None:
    """A made-up id of the session's form (or a real id altered) is not in its mailbox:
    it reads lost, never queued, so a caller polling for its end is not kept waiting."""
    hold = trio.Event()
    model = ScriptedModel([Scripted(text="held", wait=hold), "next"])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            running = await ref.submit("one")
            queued = await ref.submit("two")
            await trio.testing.wait_all_tasks_blocked()
            assert (await ref.turn_outcome(queued.id)).status is sa.TurnStatus.QUEUED
            for forged in (queued.id + "x", running.id[:-1] + "z"):
                outcome = await ref.turn_outcome(forged)
                assert outcome.status is sa.TurnStatus.LOST, forged
            hold.set()
            await queued.reply()
            assert (await ref.turn_outcome(queued.id)).status is sa.TurnStatus.FINISHED
