"""Reviews: a tool call that waits for a person, across hibernation, restarts and crashes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.stores import MemoryStore
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel


def call(name: str, arguments: object = None) -> sa.ToolCall:
    """A tool call with JSON ``arguments`` (``{}`` if None) and a fresh id."""
    return sa.ToolCall(
        id=f"call_{uuid.uuid4().hex}",
        name=name,
        arguments=json.dumps(arguments if arguments is not None else {}),
    )


class Refunds:
    """A non-idempotent ``refund`` that needs a review, and a plain ``lookup``; runs are counted."""

    def __init__(self) -> None:
        self.refunded: list[str] = []
        self.looked_up: list[str] = []

    async def _refund(self, order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        self.refunded.append(order_id)
        return f"refunded {order_id}"

    async def _lookup(self, order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        self.looked_up.append(order_id)
        return f"order {order_id}: paid"

    def tools(self) -> list[sa.Tool]:
        return [
            sa.Tool(
                name="refund",
                fn=self._refund,
                description="Refund an order.",
                requires_review=True,
                idempotent=False,
            ),
            sa.Tool(name="lookup", fn=self._lookup, description="Look up an order."),
        ]

    def agent(self, model: sa.Model) -> sa.Agent:
        return sa.Agent(model=model, system_prompt="You handle refunds.", tools=self.tools())


def refund_script(order_id: str = "A1") -> tuple[sa.ToolCall, ScriptedModel]:
    """A model that asks to refund ``order_id`` and then confirms it."""
    refund = call("refund", {"order_id": order_id})
    model = ScriptedModel(
        [Scripted(text="I will refund it.", tool_calls=[refund]), f"{order_id} is refunded."]
    )
    return refund, model


async def test_approved_call_runs_once_and_the_turn_finishes(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A turn waits on its review (status waiting); approving runs the tool once and replies."""
    tools = Refunds()
    refund, model = refund_script()
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
        assert waiting.message is None
        assert waiting.text == ""
        (review,) = waiting.reviews
        assert review.tool_call == refund
        assert review.session_id == "s"
        assert review.turn_id == waiting.turn_id
        assert await ref.pending_reviews() == [review]
        assert (await ref.state()).status is sa.Status.WAITING
        assert tools.refunded == []
        assert len(model.requests) == 1

        with trio.fail_after(5):
            reply = await ref.review(review.id, approve=True, note="ok by Ada")
        history = await ref.history()
        state = await ref.state()

    assert reply.text == "A1 is refunded."
    assert reply.reviews == ()
    assert reply.turn_id == waiting.turn_id
    assert tools.refunded == ["A1"]
    assert state.status is sa.Status.IDLE
    assert state.reviews == ()
    assert state.open_turn is None
    assert [(m.role, m.content) for m in history] == [
        (sa.Role.USER, "Refund A1"),
        (sa.Role.ASSISTANT, "I will refund it."),
        (sa.Role.TOOL, "refunded A1"),
        (sa.Role.ASSISTANT, "A1 is refunded."),
    ]
    assert history[2].tool_call_id == refund.id


async def test_denied_call_never_runs_and_the_model_reads_the_note(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Denying with a note skips the tool; the model's next request has a tool message saying so."""
    tools = Refunds()
    refund, model = refund_script()
    model.steps[1] = "Sorry, the refund was not allowed."
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            reply = await ref.review(waiting.reviews[0].id, approve=False, note="over the limit")
        history = await ref.history()

    assert tools.refunded == []
    assert reply.text == "Sorry, the refund was not allowed."
    denial = model.requests[1].messages[-1]
    assert denial.role is sa.Role.TOOL
    assert denial.tool_call_id == refund.id
    assert denial.is_error
    assert "denied" in denial.content
    assert "over the limit" in denial.content
    assert history[2] == denial
    assert tool_pairs_intact(history)


async def test_review_events_carry_the_turn_id(autojump_clock: trio.abc.Clock) -> None:
    """ReviewRequested and ReviewResolved are published with the turn's id and the decision."""
    tools = Refunds()
    _, model = refund_script()
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        events: list[sa.Event] = []
        async with ref.subscribe() as stream:
            with trio.fail_after(5):
                waiting = await ref.send("Refund A1")
                await ref.review(waiting.reviews[0].id, approve=True, note="fine")
                async for event in stream:
                    events.append(event)
                    if isinstance(event, sa.TurnFinished):
                        break

    requested = [e for e in events if isinstance(e, sa.ReviewRequested)]
    resolved = [e for e in events if isinstance(e, sa.ReviewResolved)]
    assert [e.review for e in requested] == list(waiting.reviews)
    assert [(e.review_id, e.approved, e.note) for e in resolved] == [
        (waiting.reviews[0].id, True, "fine")
    ]
    assert {e.turn_id for e in [*requested, *resolved]} == {waiting.turn_id}
    tool_events = [e for e in events if isinstance(e, sa.ToolCallStarted | sa.ToolResult)]
    assert [type(e) for e in tool_events] == [sa.ToolCallStarted, sa.ToolResult]
    assert {e.turn_id for e in tool_events} == {waiting.turn_id}


async def test_a_new_turn_while_a_review_is_pending_is_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A new message while a review is pending raises SessionBusyError naming the review,
    and the turn it refused (whose outcome says it failed so)."""
    tools = Refunds()
    _, model = refund_script()
    model.add("second answer")
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            review_id = waiting.reviews[0].id
            with pytest.raises(sa.SessionBusyError, match=review_id) as info:
                await ref.send("hello?")
            assert "'refund'" in str(info.value)
            refused = await ref.turn_outcome(info.value.turn_id)
            assert refused.status is sa.TurnStatus.FAILED
            assert review_id in str(refused.error)
            reply = await ref.review(review_id, approve=True)
            after = await ref.send("thanks")

    assert reply.text == "A1 is refunded."
    assert after.text == "second answer"
    assert tools.refunded == ["A1"]


async def test_history_edits_while_a_review_is_pending_are_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Truncating or rewinding while a review is pending raises SessionBusyError naming it."""
    tools = Refunds()
    _, model = refund_script()
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            review_id = waiting.reviews[0].id
            before = await ref.history()
            with pytest.raises(sa.SessionBusyError, match=review_id):
                await ref.truncate(1)
            with pytest.raises(sa.SessionBusyError, match=review_id):
                await ref.rewind(before[0].id)
            assert await ref.history() == before
            reply = await ref.review(review_id, approve=True)

    assert reply.text == "A1 is refunded."


async def test_unknown_review_id_is_a_clear_lookup_error(autojump_clock: trio.abc.Clock) -> None:
    """Resolving a review id that is not pending raises a LookupError naming the pending ones."""
    tools = Refunds()
    _, model = refund_script()
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            with pytest.raises(LookupError, match=r"no pending review 'review_nope'.*none"):
                await ref.review("review_nope", approve=True)
            waiting = await ref.send("Refund A1")
            review_id = waiting.reviews[0].id
            with pytest.raises(sa.SessionActorsError, match=review_id) as info:
                await ref.review("review_nope", approve=True)
            assert isinstance(info.value, LookupError)
            reply = await ref.review(review_id, approve=True)

    assert reply.text == "A1 is refunded."
    assert tools.refunded == ["A1"]


async def test_a_resolved_review_answers_its_decision_again_and_refuses_the_other(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Resolving a review again with the same decision (a retry) answers the turn's reply
    again without running anything, also after hibernation; the other decision is refused
    with ReviewResolvedError (a ReviewNotFoundError) saying what was decided, by which turn."""
    tools = Refunds()
    model = ScriptedModel(
        [
            Scripted(tool_calls=[call("refund", {"order_id": "A1"})]),
            "A1 is refunded.",
            Scripted(tool_calls=[call("refund", {"order_id": "B2"})]),
            "B2 stays as it is.",
        ]
    )
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            approved = (await ref.send("Refund A1")).reviews[0].id
            reply = await ref.review(approved, approve=True)
            assert await ref.review(approved, approve=True) == reply
            with pytest.raises(sa.ReviewResolvedError) as info:
                await ref.review(approved, approve=False, note="no")
            denied = (await ref.send("Refund B2")).reviews[0].id
            no = await ref.review(denied, approve=False)
            await ref.hibernate()
            again = registry.ref("s")
            assert await again.review(approved, approve=True) == reply
            assert await again.review(denied, approve=False) == no
            with pytest.raises(sa.ReviewNotFoundError, match="already denied") as other:
                await again.review(denied, approve=True)

    assert reply.text == "A1 is refunded."
    assert no.text == "B2 stays as it is."
    error = info.value
    assert str(error).startswith(f"session 's' review {approved!r} was already approved")
    assert reply.turn_id in str(error)
    assert error.turn_id == reply.turn_id
    assert other.value.turn_id == no.turn_id
    assert tools.refunded == ["A1"]


async def test_two_approvals_of_one_review_at_once_run_its_call_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two callers approving the same review at once both get the turn's reply; the call runs once."""
    tools = Refunds()
    _, model = refund_script()
    replies: list[sa.Reply] = []
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            review_id = (await ref.send("Refund A1")).reviews[0].id

            async def approve() -> None:
                replies.append(await ref.review(review_id, approve=True))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(approve)
                nursery.start_soon(approve)

    assert len(replies) == 2
    assert replies[0] == replies[1]
    assert replies[0].text == "A1 is refunded."
    assert tools.refunded == ["A1"]


async def test_a_review_pending_across_hibernation_is_approved_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A session waiting on a review hibernates; approving wakes it and runs the tool once."""
    tools = Refunds()
    _, model = refund_script()
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            await ref.hibernate()
        assert "s" not in registry.live()
        (info,) = await registry.sessions()
        assert info.status is sa.Status.WAITING  # what it waits for, hibernated or not
        assert info.pending_reviews == 1
        with trio.fail_after(5):
            assert await registry.ref("s").pending_reviews() == list(waiting.reviews)
            reply = await registry.ref("s").review(waiting.reviews[0].id, approve=True)
        history = await ref.history()

    assert reply.text == "A1 is refunded."
    assert tools.refunded == ["A1"]
    assert tool_pairs_intact(history)
    assert len(history) == 4


async def test_a_review_pending_across_a_registry_restart_is_approved_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A review outlives its registry: a new one on the same store approves it; the tool runs once."""
    store = MemoryStore()
    tools = Refunds()
    _, model = refund_script()
    agents = {"a": tools.agent(model)}
    async with sa.open_registry(agents=agents, store=store) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
    async with sa.open_registry(agents=agents, store=store) as registry:
        with trio.fail_after(5):
            assert await registry.pending_reviews() == list(waiting.reviews)
            ref = registry.ref("s")
            assert (await ref.state()).status is sa.Status.WAITING
            with pytest.raises(sa.SessionBusyError):
                await ref.send("hello?")
            await trio.testing.wait_all_tasks_blocked()
            assert tools.refunded == []  # waking does not run it
            reply = await ref.review(waiting.reviews[0].id, approve=True)
        history = await ref.history()
    async with sa.open_registry(agents=agents, store=store) as registry:
        assert await registry.pending_reviews() == []
        assert await registry.ref("s").history() == history

    assert reply.text == "A1 is refunded."
    assert tools.refunded == ["A1"]
    assert [m.role for m in history] == [
        sa.Role.USER,
        sa.Role.ASSISTANT,
        sa.Role.TOOL,
        sa.Role.ASSISTANT,
    ]


async def test_a_review_pending_across_a_restart_on_sqlite_is_approved_once(
    tmp_path: Path,
) -> None:
    """With a SQLite file, a review survives closing the store and is approved once on reopening."""
    path = tmp_path / "reviews.db"
    tools = Refunds()
    _, model = refund_script()
    agents = {"a": tools.agent(model)}
    async with sa.open_registry(agents=agents, store=sa.SQLiteStore(path)) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            waiting = await ref.send("Refund A1")
    async with sa.open_registry(agents=agents, store=sa.SQLiteStore(path)) as registry:
        with trio.fail_after(10):
            assert await registry.pending_reviews() == list(waiting.reviews)
            reply = await registry.ref("s").review(waiting.reviews[0].id, approve=True)
    async with sa.open_registry(agents=agents, store=sa.SQLiteStore(path)) as registry:
        with trio.fail_after(10):
            history = await registry.ref("s").history()
            state = await registry.ref("s").state()

    assert reply.text == "A1 is refunded."
    assert tools.refunded == ["A1"]
    assert state.reviews == ()
    assert state.open_turn is None
    assert [m.content for m in history] == [
        "Refund A1",
        "I will refund it.",
        "refunded A1",
        "A1 is refunded.",
    ]


async def test_registry_lists_the_pending_reviews_of_live_and_hibernated_sessions(
    autojump_clock: trio.abc.Clock,
) -> None:
    """registry.pending_reviews() gathers every session's pending reviews, oldest first."""
    tools = Refunds()

    def answer(request: sa.ModelRequest) -> Scripted | str:
        last = request.messages[-1]
        if last.role is sa.Role.USER and last.content.startswith("Refund "):
            order_id = last.content.removeprefix("Refund ")
            return Scripted(tool_calls=[call("refund", {"order_id": order_id})])
        return "ok"

    model = ScriptedModel([answer], repeat=True)
    store = MemoryStore()
    async with sa.open_registry(agents={"a": tools.agent(model)}, store=store) as registry:
        waits = {}
        with trio.fail_after(5):
            for name in ["live", "sleeping", "calm", "later"]:
                ref = await registry.spawn(name)
                text = "hi" if name == "calm" else f"Refund {name}"
                waits[name] = await ref.send(text)
            await registry.ref("sleeping").hibernate()
        assert sorted(registry.live()) == ["calm", "later", "live"]
        assert waits["calm"].reviews == ()

        with trio.fail_after(5):
            pending = await registry.pending_reviews()
        assert pending == [waits[n].reviews[0] for n in ["live", "sleeping", "later"]]
        assert [r.session_id for r in pending] == ["live", "sleeping", "later"]

        with trio.fail_after(5):
            await registry.ref("later").review(pending[2].id, approve=False)
            assert [r.session_id for r in await registry.pending_reviews()] == ["live", "sleeping"]
            await registry.ref("sleeping").review(pending[1].id, approve=True)
            await registry.ref("live").review(pending[0].id, approve=True)
            assert await registry.pending_reviews() == []

    assert sorted(tools.refunded) == ["live", "sleeping"]


async def test_two_reviewed_calls_in_one_step_pause_twice_in_call_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two calls that need review in one step ask for one review at a time, in call order."""
    tools = Refunds()
    first = call("refund", {"order_id": "A1"})
    second = call("refund", {"order_id": "B2"})
    model = ScriptedModel([Scripted(tool_calls=[first, second]), "A1 refunded, B2 not."])
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            one = await ref.send("Refund A1 and B2")
            assert [r.tool_call for r in one.reviews] == [first]
            assert [r.tool_call for r in await ref.pending_reviews()] == [first]
            two = await ref.review(one.reviews[0].id, approve=True)
            assert tools.refunded == ["A1"]
            assert two.message is None
            assert [r.tool_call for r in two.reviews] == [second]
            assert two.turn_id == one.turn_id
            assert (await ref.state()).status is sa.Status.WAITING
            assert len(model.requests) == 1  # the model waits for both results
            done = await ref.review(two.reviews[0].id, approve=False, note="not this one")
        history = await ref.history()

    assert done.text == "A1 refunded, B2 not."
    assert tools.refunded == ["A1"]
    results = [m for m in history if m.role is sa.Role.TOOL]
    assert [m.tool_call_id for m in results] == [first.id, second.id]
    assert [m.is_error for m in results] == [False, True]
    assert "not this one" in results[1].content
    assert len(model.requests) == 2


async def test_calls_before_a_reviewed_one_run_before_the_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    """In one step, calls without review before a reviewed one run first; the step then pauses."""
    tools = Refunds()
    look = call("lookup", {"order_id": "A1"})
    refund = call("refund", {"order_id": "A1"})
    look_again = call("lookup", {"order_id": "A1"})
    model = ScriptedModel([Scripted(tool_calls=[look, refund, look_again]), "done"])
    async with sa.open_registry(agents={"a": tools.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            assert tools.looked_up == ["A1"]
            assert [m.tool_call_id for m in await ref.history() if m.role is sa.Role.TOOL] == [
                look.id
            ]
            reply = await ref.review(waiting.reviews[0].id, approve=True)
        history = await ref.history()

    assert reply.text == "done"
    assert tools.looked_up == ["A1", "A1"]
    assert tools.refunded == ["A1"]
    results = [m for m in history if m.role is sa.Role.TOOL]
    assert [m.tool_call_id for m in results] == [look.id, refund.id, look_again.id]


async def test_a_crash_while_an_approved_call_runs_fails_the_review_and_is_not_run_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A crash while an approved non-idempotent call runs fails the review's caller; on recovery
    the call is not run again and the model is told it was interrupted."""
    store = FaultyStore()
    refunded: list[str] = []

    async def refund(order_id: str) -> str:
        refunded.append(order_id)
        if not store.injected:  # the next append fails: the actor crashes mid-call
            store.fail("append", error=OSError("injected store fault"))
        await trio.lowlevel.checkpoint()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    the_call = call("refund", {"order_id": "A1"})
    model = ScriptedModel([Scripted(tool_calls=[the_call]), "lost", "Please check A1."])
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=[tool])}, store=store
    ) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            with pytest.raises(sa.SessionCrashedError, match="injected"):
                await ref.review(waiting.reviews[0].id, approve=True)
            await trio.testing.wait_all_tasks_blocked()
        history = await ref.history()
        state = await ref.state()

    assert refunded == ["A1"]
    assert state.reviews == ()
    assert state.open_turn is None
    assert history[2].tool_call_id == the_call.id
    assert "interrupted" in history[2].content
    assert history[-1].content == "Please check A1."
    assert tool_pairs_intact(history)


async def test_a_review_without_its_agent_fails_clearly_and_stays_pending() -> None:
    """Resolving a review of a session whose agent is missing raises TurnFailedError and keeps the review."""
    from sessionactors.testing import Scripted, ScriptedModel

    async def act() -> str:
        return "done"

    risky = sa.Tool(name="risky", fn=act, requires_review=True)
    model = ScriptedModel(
        [Scripted(tool_calls=[sa.ToolCall(id="c", name="risky", arguments="{}")])]
    )
    store = sa.MemoryStore()
    async with sa.open_registry(
        store=store, agents={"a": sa.Agent(model=model, tools=[risky])}
    ) as r:
        reply = await (await r.spawn("s", agent="a")).send("go")
        review_id = reply.reviews[0].id
    other = {"b": sa.Agent(model=ScriptedModel([]))}
    async with sa.open_registry(store=store, agents=other) as r:
        with trio.fail_after(5), pytest.raises(sa.TurnFailedError, match="agent 'a'"):
            await r.ref("s").review(review_id, approve=True)
        assert [x.id for x in await r.ref("s").pending_reviews()] == [review_id]
        assert r.statistics().crashes == 0
