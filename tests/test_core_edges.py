"""Edges of the single-process core: cancellations and faults at awkward points."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel


async def test_a_cancel_while_an_approved_call_runs_leaves_the_call_answered(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelling a turn while its approved tool call runs records a result for the call,
    so the history the next turn sends never holds a call without its result."""
    release = trio.Event()
    started = trio.Event()

    async def refund(order_id: str) -> str:
        started.set()
        await release.wait()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    refund_call = sa.ToolCall(id="call_1", name="refund", arguments=json.dumps({"order_id": "A1"}))
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call]), "Next."])
    agent = sa.Agent(model=model, tools=[tool])
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            (review,) = waiting.reviews
            outcome: list[BaseException] = []

            async def approve() -> None:
                try:
                    await ref.review(review.id, approve=True)
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(approve)
                await started.wait()
                assert await ref.cancel()
            assert isinstance(outcome[0], sa.TurnCancelledError)
            history = await ref.history()
            assert tool_pairs_intact(history), [(m.role, m.content) for m in history]
            reply = await ref.send("And now?")
            assert reply.text == "Next."
            assert tool_pairs_intact(model.requests[-1].messages)
        await ref.hibernate()
        assert tool_pairs_intact(await registry.ref("s").history())


async def test_a_streamed_turn_refused_while_a_review_is_pending_ends_with_its_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``ref.stream`` of a turn the session refuses (a review is pending) ends with a
    ``TurnFailed`` saying why, instead of waiting forever for events that never come."""
    refund_call = sa.ToolCall(id="call_1", name="refund", arguments="{}")
    tool = sa.Tool(name="refund", fn=lambda: "done", requires_review=True, idempotent=False)
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call])])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            assert (await ref.send("Refund")).reviews
            async with ref.stream("And now?") as events:
                seen = [event async for event in events]
            assert [type(e) for e in seen] == [sa.TurnFailed]
            assert "SessionBusyError" in seen[0].error  # type: ignore[attr-defined]
            assert not seen[0].lost  # type: ignore[attr-defined]
            turn = await ref.submit("Again?")
            with pytest.raises(sa.SessionBusyError):
                await turn.reply()
            outcome = await ref.turn_outcome(turn.id)
            assert outcome.status is sa.TurnStatus.FAILED


async def test_a_request_whose_journal_write_fails_leaves_nothing_behind(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A metadata change, added messages or a history edit whose write fails (a journal
    append; for an edit that takes text out, its checkpoint's snapshot) raises to its
    caller and leaves no trace: not in the state, not written later by the next turn's
    commit, not after a wake."""
    store = FaultyStore()
    agents = {"a": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=store, agents=agents, max_restarts=10) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("hello there")
            kept = await ref.history()
            added = sa.Message.create(sa.Role.ASSISTANT, "a person's note")
            for request, write in (
                (lambda: ref.set_metadata({"tier": "gold"}), "append"),
                (lambda: ref.add_messages([added]), "append"),
                (lambda: ref.truncate(0), "write_snapshot"),
                (lambda: ref.set_summary("a summary"), "write_snapshot"),
            ):
                store.fail(write, session_id="s")
                with pytest.raises(sa.StoreError):
                    await request()
                assert store.injected
                store.injected = 0
                state = await ref.state()
                assert "tier" not in state.metadata
                assert [m.id for m in state.messages] == [m.id for m in kept]
                assert state.summary is None
            await ref.send("after")
            await ref.hibernate()
            state = await registry.ref("s").state()
            assert "tier" not in state.metadata
            assert added.id not in [m.id for m in state.messages]
            assert [m.id for m in state.messages[:2]] == [m.id for m in kept]
            assert state.summary is None
            await ref.add_messages([added])  # refused before, so not there: it joins now


async def test_pending_reviews_skip_a_session_deleted_while_they_are_gathered(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A session deleted while ``registry.pending_reviews()`` reads it drops out of the
    answer; the listing of the others does not fail."""
    store = FaultyStore()
    tool = sa.Tool(name="refund", fn=lambda: "done", requires_review=True, idempotent=False)

    def answer(request: sa.ModelRequest) -> Scripted | str:
        if request.messages[-1].role is sa.Role.USER:
            return Scripted(tool_calls=[sa.ToolCall(id="c", name="refund", arguments="{}")])
        return "ok"

    model = ScriptedModel([answer], repeat=True)
    async with sa.open_registry(
        store=store, agents={"a": sa.Agent(model=model, tools=[tool])}
    ) as registry:
        with trio.fail_after(5):
            for name in ["gone", "kept"]:
                ref = await registry.spawn(name)
                assert (await ref.send("Refund")).reviews
                await ref.hibernate()
            gate = store.hold("load", session_id="gone")
            found: list[list[sa.ReviewRequest]] = []

            async def gather() -> None:
                found.append(await registry.pending_reviews())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(gather)
                await trio.testing.wait_all_tasks_blocked()
                assert gate.waiting == 1  # the wake of "gone" waits on its load
                await registry.delete("gone")
                gate.open()
            assert [r.session_id for r in found[0]] == ["kept"]


async def test_a_review_whose_journal_write_fails_stays_pending(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A review answer whose turn cannot be journaled raises to the reviewer and leaves
    the review pending, so answering it again works."""
    store = FaultyStore()
    tool = sa.Tool(name="refund", fn=lambda: "done", requires_review=True, idempotent=False)
    call = sa.ToolCall(id="c", name="refund", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), "Not refunded.", "Not refunded."])
    agent = sa.Agent(model=model, tools=[tool])
    async with sa.open_registry(store=store, agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            (review,) = (await ref.send("Refund")).reviews
            store.fail("append", session_id="s")
            with pytest.raises(sa.StoreError):
                await ref.review(review.id, approve=False)
            assert store.injected == 1
            assert [r.id for r in await ref.pending_reviews()] == [review.id]
            reply = await ref.review(review.id, approve=False)
            assert reply.text == "Not refunded."
            assert tool_pairs_intact(await ref.history())


async def test_a_keyed_retry_during_a_resumed_turn_joins_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request whose idempotency key is the key of a turn a restart resumes joins that
    turn (its id, its events, its reply): ``ref.stream`` of it ends with the turn's
    outcome, and the turn runs once."""
    store = FaultyStore()
    go_on = trio.Event()
    runs: list[str] = []

    async def refund() -> str:
        runs.append("refund")
        store.fail("append", session_id="s")  # the turn's outcome cannot be written
        await trio.lowlevel.checkpoint()
        return "refunded"

    tool = sa.Tool(name="refund", fn=refund, idempotent=False)
    call = sa.ToolCall(id="c", name="refund", arguments="{}")
    model = ScriptedModel(
        [Scripted(tool_calls=[call]), "Refunded.", Scripted(text="Checked.", wait=go_on)]
    )
    agent = sa.Agent(model=model, tools=[tool])
    async with sa.open_registry(store=store, agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            with pytest.raises(sa.SessionCrashedError):
                await ref.send("Refund A1", idempotency_key="k1")
            seen: list[sa.Event] = []

            async def watch() -> None:
                async with ref.stream("Refund A1", idempotency_key="k1") as events:
                    seen.extend([event async for event in events])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()
                go_on.set()
            assert isinstance(seen[-1], sa.TurnFinished)
            assert seen[-1].message.content == "Checked."
            reply = await ref.send("Refund A1", idempotency_key="k1")
            assert reply.turn_id == seen[-1].turn_id
            assert reply.text == "Checked."
        assert runs == ["refund"]
        history = await ref.history()
        assert [m.content for m in history if m.role is sa.Role.USER] == ["Refund A1"]


async def test_a_subscription_opened_while_its_session_is_deleted_is_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Subscribing to a session while it is being deleted raises SessionNotFoundError,
    as a request does, instead of leaving a subscription to nothing open (one that
    would later carry the events of a new session of the same name)."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents={"a": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("hello")
            gate = store.hold("delete", session_id="s")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(registry.delete, "s")
                await trio.testing.wait_all_tasks_blocked()
                assert gate.waiting == 1
                with pytest.raises(sa.SessionNotFoundError, match="'s'"):
                    async with ref.subscribe():
                        pass
                gate.open()
            ref = await registry.spawn("s")
            await ref.send("a new conversation")


async def test_a_keyed_retry_of_an_open_turn_without_its_agent_is_told_so(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request joining by its key a turn left open by a crash, woken by a registry
    without the session's agent, fails with AgentNotFoundError instead of waiting."""
    store = FaultyStore()

    async def refund() -> str:
        store.fail("append", session_id="s")  # the turn's outcome cannot be written
        await trio.lowlevel.checkpoint()
        return "refunded"

    tool = sa.Tool(name="refund", fn=refund, idempotent=False)
    call = sa.ToolCall(id="c", name="refund", arguments="{}")
    model = ScriptedModel([Scripted(tool_calls=[call]), "Refunded."])
    agents = {"a": sa.Agent(model=model, tools=[tool])}
    with trio.fail_after(5):
        async with sa.open_registry(store=store, agents=agents, max_restarts=0) as registry:
            ref = await registry.spawn("s")
            with pytest.raises(sa.SessionCrashedError):  # marked failed: not resumed here
                await ref.send("Refund A1", idempotency_key="k1")
        other = {"b": sa.Agent(model=EchoModel())}
        async with sa.open_registry(store=store, agents=other) as registry:
            turn = await registry.ref("s").submit("Refund A1", idempotency_key="k1")
            with pytest.raises(sa.AgentNotFoundError, match="'a'"):
                await turn.reply()
            state = await registry.ref("s").state()
            assert state.status is not sa.Status.FAILED


async def test_a_request_s_messages_index_as_the_list_of_them() -> None:
    """Every index of ``request.messages`` (negative ones, the system prompt's, past either
    end, slices) reads what the same index of ``list(request.messages)`` read when the
    model was asked, also once the history has grown past the request."""
    asked: list[tuple[Sequence[sa.Message], list[sa.Message]]] = []

    class Keeping:
        async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
            asked.append((request.messages, list(request.messages)))
            yield sa.TextChunk("ok")

    agents = {"a": sa.Agent(model=Keeping(), system_prompt="be brief")}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s")
        for text in ("one", "two", "three"):
            await ref.send(text)
    assert [len(whole) for _, whole in asked] == [2, 4, 6]
    for view, whole in asked:
        n = len(whole)
        assert len(view) == n
        for i in range(-n - 2, n + 2):
            if -n <= i < n:
                assert view[i] is whole[i], i
            else:
                with pytest.raises(IndexError):
                    view[i]
        for part in (slice(None), slice(-2, None), slice(1, -1, 2), slice(5, 1)):
            assert list(view[part]) == whole[part]
