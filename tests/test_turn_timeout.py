"""An agent's ``turn_timeout``: a turn that runs past it fails, keeping what it streamed,
and the session goes on; the wait in the mailbox and on a review is not counted."""

from __future__ import annotations

import math

import pytest
import trio

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel


async def test_a_turn_past_its_timeout_fails_and_the_session_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model that streams two words and then hangs fails its turn when the agent's
    turn_timeout passes: the caller gets TurnFailedError caused by TurnTimeoutError
    (naming the session, the turn and the limit), subscribers see a public TurnFailed of
    that kind, the words streamed are kept, marked interrupted, the outcome reads failed,
    and the next turn runs."""
    never = trio.Event()
    model = ScriptedModel([Scripted(text="two words and more", wait=never, wait_after=2), "next"])
    agent = sa.Agent(model=model, turn_timeout=5)
    seen: list[sa.Event] = []
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        async with ref.subscribe() as events:
            start = trio.current_time()
            with trio.fail_after(60), pytest.raises(sa.TurnFailedError) as info:
                await ref.send("hello")
            took = trio.current_time() - start
            async for event in events:
                seen.append(event)
                if isinstance(event, sa.TurnFailed):
                    break
        after = await ref.send("again")
        history = await ref.history()
        outcome = await ref.turn_outcome(info.value.turn_id)

    assert 5 <= took < 6
    cause = info.value.__cause__
    assert isinstance(cause, sa.TurnTimeoutError), repr(cause)
    assert isinstance(cause, TimeoutError)
    assert cause.session_id == "s"
    assert info.value.session_id == "s"
    for text in ("turn_timeout=5", "'s'", info.value.turn_id):
        assert text in str(cause), str(cause)
    (failed,) = [e for e in seen if isinstance(e, sa.TurnFailed)]
    assert failed.turn_id == info.value.turn_id
    assert failed.error_kind == "TurnTimeoutError"
    assert failed.error_public
    assert outcome.status is sa.TurnStatus.FAILED
    assert outcome.error is not None
    assert "TurnTimeoutError" in outcome.error
    assert [(m.role, m.content, m.interrupted) for m in history] == [
        (sa.Role.USER, "hello", False),
        (sa.Role.ASSISTANT, "two words", True),
        (sa.Role.USER, "again", False),
        (sa.Role.ASSISTANT, "next", False),
    ]
    assert after.text == "next"


async def test_each_turn_has_its_own_time_and_the_queue_is_not_counted(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Three turns of 3 s each, sent together to an agent with turn_timeout=5, all
    finish: the limit counts each turn from its start, not its wait in the mailbox, and
    not the turns before it."""
    model = ScriptedModel([Scripted(text="one two three", delay=1.0)] * 3)
    agent = sa.Agent(model=model, turn_timeout=5)
    replies: list[str] = []
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        turns = [await ref.submit(f"turn {i}") for i in range(3)]
        with trio.fail_after(60):
            for turn in turns:
                replies.append((await turn.reply()).text)
    assert replies == ["one two three"] * 3


async def test_a_turn_waiting_on_a_review_is_not_timed(autojump_clock: trio.abc.Clock) -> None:
    """A turn paused on a review (for a person, for as long as it takes) is not cut by
    the agent's turn_timeout; once approved, the rest of the turn has the limit anew."""

    async def launch() -> str:
        await trio.sleep(4)
        return "launched"

    tool = sa.Tool(name="launch", fn=launch, requires_review=True)
    model = ScriptedModel(
        [Scripted(tool_calls=[sa.ToolCall(id="c1", name="launch")], delay=1.0), "done"]
    )
    agent = sa.Agent(model=model, tools=[tool], turn_timeout=5)
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(600):
            paused = await ref.send("launch it")
            (review,) = paused.reviews
            await trio.sleep(100)  # a person takes their time
            reply = await ref.review(review.id, approve=True)
    assert reply.text == "done"


async def test_a_tool_running_past_the_timeout_is_cut_and_the_history_stays_valid(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A tool that never returns is cut by the turn's timeout: the turn fails, the call
    gets an error result (every call keeps its result), and the next turn runs."""

    async def stuck() -> str:
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    model = ScriptedModel([Scripted(tool_calls=[sa.ToolCall(id="c1", name="stuck")]), "next"])
    agent = sa.Agent(model=model, tools=[sa.Tool(name="stuck", fn=stuck)], turn_timeout=5)
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(60):
            with pytest.raises(sa.TurnFailedError) as info:
                await ref.send("go")
            reply = await ref.send("and now?")
        history = await ref.history()
    assert isinstance(info.value.__cause__, sa.TurnTimeoutError)
    assert tool_pairs_intact(history)
    (result,) = [m for m in history if m.role is sa.Role.TOOL]
    assert result.is_error
    assert reply.text == "next"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
def test_turn_timeout_must_be_a_finite_positive_number(value: object, error: type) -> None:
    """An agent refuses a turn_timeout that is not a finite number of seconds above 0,
    when it is made, naming the option."""
    with pytest.raises(error, match="turn_timeout"):
        sa.Agent(model=ScriptedModel(), turn_timeout=value)  # type: ignore[arg-type]


async def test_the_limit_ends_with_its_turn(autojump_clock: trio.abc.Clock) -> None:
    """A request served after a turn (a metadata change) whose store write lasts past the
    moment that turn's limit would have passed is not cut by it."""
    store = FaultyStore()
    model = ScriptedModel([Scripted(text="one two three", delay=1.0), "again"])
    agent = sa.Agent(model=model, turn_timeout=5)
    async with sa.open_registry(store=store, agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(60):
            await ref.send("hi")  # 3 s of its 5
            loads = store.calls["load"]
            gate = store.hold("append", session_id="s")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ref.set_metadata, {"k": "v"})
                await trio.sleep(10)  # the write waits, past the turn's 5 s
                gate.open()
            reply = await ref.send("and?")
        state = await ref.state()
        assert store.calls["load"] == loads  # never restarted
    assert state.metadata == {"k": "v"}
    assert reply.text == "again"


async def test_a_turn_cut_by_its_limit_runs_again_with_retry(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``ref.retry()`` runs a turn that its limit cut again, in its place: the history
    holds the user's message and the new reply, not the interrupted one."""
    never = trio.Event()
    model = ScriptedModel([Scripted(text="two words and more", wait=never, wait_after=2), "done"])
    agent = sa.Agent(model=model, turn_timeout=5)
    async with sa.open_registry(agents={"a": agent}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(60):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("hello")
            reply = await ref.retry()
        history = await ref.history()
    assert reply.text == "done"
    assert [(m.role, m.content) for m in history] == [
        (sa.Role.USER, "hello"),
        (sa.Role.ASSISTANT, "done"),
    ]
