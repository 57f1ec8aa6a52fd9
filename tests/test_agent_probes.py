"""The turn loop at its edges: what models stream, tools, compaction, cancellation, retry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.testing import Scripted, ScriptedModel


class ChunkModel:
    """Streams scripted chunk lists, one per request; records how many chunks it gave
    and whether each stream was closed."""

    def __init__(self, *answers: Sequence[sa.ModelChunk]) -> None:
        self.answers = list(answers)
        self.requests: list[sa.ModelRequest] = []
        self.yielded = 0
        self.closed = 0

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.requests.append(request)
        chunks = self.answers.pop(0)
        try:
            for chunk in chunks:
                await trio.lowlevel.checkpoint()
                self.yielded += 1
                yield chunk
        finally:
            self.closed += 1


@sa.tool
async def lookup(order_id: str) -> str:
    """Look an order up."""
    await trio.lowlevel.checkpoint()
    return f"paid {order_id}"


async def test_fragments_repeating_their_calls_id_stay_one_call(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model that repeats a call's id on every fragment of it streams one call (only a
    different id at an index begins another)."""
    model = ChunkModel(
        [
            sa.ToolCallChunk(0, id="c1", name="lookup", arguments='{"order_id"'),
            sa.ToolCallChunk(0, id="c1", arguments=': "A1"}'),
        ],
        [sa.TextChunk("done")],
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("go")
        history = await ref.history()
    assert [(c.id, c.arguments) for c in history[1].tool_calls] == [("c1", '{"order_id": "A1"}')]
    assert history[2].content == "paid A1"


#: 256 Ki characters of four UTF-8 bytes each: 1 MiB; twenty of them are over what one
#: journal entry holds
WIDE = "\N{GRINNING FACE}" * (256 * 1024)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param([sa.TextChunk(WIDE)] * 20, id="text"),
        pytest.param(
            [sa.ToolCallChunk(0, id="c1", name="lookup", arguments='{"order_id": "')]
            + [sa.ToolCallChunk(0, arguments=WIDE)] * 20,
            id="tool-call-arguments",
        ),
    ],
)
async def test_an_answer_too_long_to_store_fails_the_turn_not_the_session(
    autojump_clock: trio.abc.Clock, answer: list[sa.ModelChunk]
) -> None:
    """A model that streams more than a turn can store (a runaway answer) fails its turn
    with a ModelError as soon as it is over the limit, and its stream is closed; the
    session did not crash, keeps the user's message and goes on."""
    model = ChunkModel(answer, [sa.TextChunk("short")])
    store = sa.MemoryStore()
    agent = sa.Agent(model=model, tools=[lookup])
    async with sa.open_registry(agents={"a": agent}, store=store) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30), pytest.raises(sa.TurnFailedError) as failed:
            await ref.send("Write forever")
        assert isinstance(failed.value.__cause__, sa.ModelError)
        assert "'s'" in str(failed.value.__cause__)
        assert model.yielded < len(answer)  # stopped reading at the limit
        assert model.closed == 1
        history = await ref.history()
        assert [(m.role, m.interrupted) for m in history] == [
            (sa.Role.USER, False),
            (sa.Role.ASSISTANT, True),
        ]
        assert registry.statistics().restarts == 0
        with trio.fail_after(5):
            assert (await ref.send("Now briefly")).text == "short"
        before = await ref.state()
        await ref.hibernate()
    async with sa.open_registry(agents={"a": agent}, store=store) as registry:
        after = await registry.ref("s").state()
    assert after.messages == before.messages


def compacting_agent(summarizer: sa.Model) -> sa.Agent:
    """An agent that summarizes all but the last two messages once a request is over 30
    tokens (about two turns of this file's messages)."""
    model = ScriptedModel([Scripted(text="fine", usage=sa.Usage(input_tokens=10, output_tokens=1))])
    model.repeat = True
    return sa.Agent(
        model=model, compaction=sa.Compaction(max_tokens=30, keep_last=2, summarizer=summarizer)
    )


LONG = "a message long enough to fill the budget of a few turns quickly"


async def test_the_summarizers_tokens_count_in_the_sessions_usage(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The tokens a compaction's summarizer reports are added to the session's usage (as
    the compaction's HistoryEdited says), and stay counted after a restart."""
    summarizer = ScriptedModel(
        [Scripted(text="They talked.", usage=sa.Usage(input_tokens=100, output_tokens=3))],
        repeat=True,
    )
    store = sa.MemoryStore()
    agent = compacting_agent(summarizer)
    async with sa.open_registry(agents={"a": agent}, store=store) as registry:
        ref = await registry.spawn("s")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                for _ in range(3):
                    await ref.send(LONG)
            compactions = []
            with trio.move_on_after(1):
                async for event in events:
                    if isinstance(event, sa.HistoryEdited):
                        compactions.append(event)
        state = await ref.state()
    assert len(summarizer.requests) == len(compactions) >= 1
    summarized = sa.Usage(input_tokens=100 * len(compactions), output_tokens=3 * len(compactions))
    assert all(e.usage == sa.Usage(input_tokens=100, output_tokens=3) for e in compactions)
    assert state.usage == sa.Usage(input_tokens=30, output_tokens=3) + summarized
    async with sa.open_registry(agents={"a": agent}, store=store) as registry:
        assert (await registry.ref("s").state()).usage == state.usage
        [info] = await registry.sessions()
        assert info.usage == state.usage


async def test_a_failing_summarizer_fails_the_turn_saying_compaction_failed(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A summarizer that fails (here: streams text that is not a str) fails the turn with
    a ModelError that names the compaction, its cause the summarizer's error; the
    summarizer's stream is closed at once, and nothing of the history is removed."""
    summarizer = ChunkModel([sa.TextChunk("They"), sa.TextChunk(b" talked"), sa.TextChunk(".")])  # type: ignore[arg-type]
    error = await compaction_failure(summarizer)
    assert isinstance(error.__cause__, TypeError)
    assert summarizer.closed == 1


async def compaction_failure(summarizer: ChunkModel) -> sa.ModelError:
    """The error of a turn whose compaction by ``summarizer`` fails (the turn after a
    long one), once checked: a ModelError that names the session and the compaction,
    the history as it was."""
    async with sa.open_registry(agents={"a": compacting_agent(summarizer)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send(LONG)
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send(LONG)
        error = failed.value.__cause__
        assert isinstance(error, sa.ModelError)
        assert "compaction failed" in str(error)
        assert "'s'" in str(error)
        state = await ref.state()
    assert state.summary is None
    assert len(state.messages) == 4
    return error


@pytest.mark.parametrize(
    "answer",
    [
        [],
        [sa.TextChunk("   ")],
        [sa.ToolCallChunk(index=0, id="c1", name="search", arguments="{}")],
    ],
    ids=["nothing", "blank", "a tool call"],
)
async def test_a_summarizer_that_answers_no_summary_fails_the_turn_saying_compaction_failed(
    autojump_clock: trio.abc.Clock, answer: list[sa.ModelChunk]
) -> None:
    """A summarizer that answers with no text (nothing, blanks, only a tool call) fails
    the turn with a ModelError that names the compaction, as one that raises does: the
    turn never went on in silence with the whole history over its budget (the summarizer
    asked again at every turn)."""
    error = await compaction_failure(ChunkModel(answer, answer))
    assert "no summary" in str(error)


async def test_a_cancelled_step_keeps_the_results_of_its_calls_that_finished(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelling a turn while one of a step's concurrent calls still runs answers that
    call as cut short, but a call that had finished keeps its real result: the model is
    told the payment was made, not that it may or may not have been."""
    paid: list[str] = []
    hanging = trio.Event()

    async def pay(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        paid.append(order_id)
        return f"paid {order_id}"

    async def ship(order_id: str) -> str:
        hanging.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    tools = [sa.Tool(name="pay", fn=pay, idempotent=False), sa.Tool(name="ship", fn=ship)]
    calls = [
        sa.ToolCall(id="c1", name="pay", arguments='{"order_id": "A1"}'),
        sa.ToolCall(id="c2", name="ship", arguments='{"order_id": "A1"}'),
    ]
    model = ScriptedModel([Scripted(tool_calls=calls), "ok"])
    store = sa.MemoryStore()
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=tools)}, store=store
    ) as registry:
        ref = await registry.spawn("s")
        turn = await ref.submit("Pay and ship A1")
        with trio.fail_after(5):
            await hanging.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
        history = await ref.history()
        await ref.hibernate()
    assert paid == ["A1"]
    assert tool_pairs_intact(history)
    results = {m.tool_call_id: m.content for m in history if m.role is sa.Role.TOOL}
    assert results["c1"] == "paid A1"
    assert "cancelled" in results["c2"]
    async with sa.open_registry(
        agents={"a": sa.Agent(model=model, tools=tools)}, store=store
    ) as registry:
        assert await registry.ref("s").history() == history


@pytest.mark.parametrize("operation", ["add_messages", "replace_history"])
@pytest.mark.parametrize("ids", [("x1", "x1"), ("", "x2")], ids=["repeated", "empty"])
async def test_a_message_whose_tool_calls_share_an_id_is_refused(
    autojump_clock: trio.abc.Clock, operation: str, ids: tuple[str, str]
) -> None:
    """Messages put into a history whose assistant message makes two calls with one id
    (or a call with an empty id) are refused with InvalidHistoryError and nothing is
    written: one result cannot answer two calls, and the next model request would hold
    a call without its result."""
    calls = tuple(sa.ToolCall(id=i, name="lookup", arguments="{}") for i in ids)
    messages = [
        sa.Message.create(sa.Role.USER, "Look up A1 and A2"),
        sa.Message.create(sa.Role.ASSISTANT, "", tool_calls=calls),
        *(
            sa.Message.create(sa.Role.TOOL, f"result {i}", tool_call_id=i)
            for i in dict.fromkeys(ids)
        ),
    ]
    model = ScriptedModel(["fine"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        with pytest.raises(sa.InvalidHistoryError, match="'s'"):
            await getattr(ref, operation)(messages)
        assert await ref.history() == []


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: sa.Agent(model=ScriptedModel(), max_steps=2.5), "max_steps"),
        (lambda: sa.Agent(model=ScriptedModel(), system_prompt=5), "system_prompt"),
        (lambda: sa.Agent(model=ScriptedModel(), compaction={"max_tokens": 5}), "compaction"),
        (lambda: sa.Compaction(max_tokens=50, keep_last=1.5), "keep_last"),
        (lambda: sa.Compaction(max_tokens="50"), "max_tokens"),
        (lambda: sa.Compaction(max_tokens=50, summarizer="gpt-4o-mini"), "summarizer"),
        (lambda: sa.Compaction(max_tokens=50, estimate=4), "estimate"),
        (lambda: sa.Compaction(max_tokens=50, instructions=None), "instructions"),
    ],
)
def test_an_agent_refuses_settings_its_turns_cannot_use(make: object, words: str) -> None:
    """Settings of the wrong type are refused when the agent (or its compaction) is made,
    with a TypeError naming the setting, instead of failing every turn later (or, for a
    system prompt that is not text, sending the model a broken request)."""
    with pytest.raises(TypeError, match=words):
        make()  # type: ignore[operator]


async def test_a_summary_too_long_to_store_fails_the_turn_not_the_session(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A summarizer that streams more than a turn can store fails the turn (a ModelError
    naming the compaction) and is stopped at the limit; the session did not crash."""
    summarizer = ChunkModel([sa.TextChunk(WIDE)] * 20)
    async with sa.open_registry(agents={"a": compacting_agent(summarizer)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send(LONG)
            with pytest.raises(sa.TurnFailedError) as failed:
                await ref.send(LONG)
        assert isinstance(failed.value.__cause__, sa.ModelError)
        assert "compaction" in str(failed.value.__cause__)
        assert summarizer.yielded < 20
        assert registry.statistics().restarts == 0
        assert (await ref.state()).summary is None


@pytest.mark.parametrize("name_on_each", [False, True], ids=["name-first", "name-on-each"])
async def test_fragments_of_one_call_with_changing_ids_stay_one_call(
    autojump_clock: trio.abc.Clock, name_on_each: bool
) -> None:
    """Servers whose call id changes from one fragment of a call to the next (a new id on
    each, with or without the name) still stream one call: a different id begins a new
    call only once the call before it is whole (named, its arguments complete JSON)."""
    pieces = ['{"order', '_id": ', '"A1"}']
    model = ChunkModel(
        [
            sa.ToolCallChunk(
                0, id=f"id{i}", name="lookup" if i == 0 or name_on_each else None, arguments=piece
            )
            for i, piece in enumerate(pieces)
        ],
        [sa.TextChunk("done")],
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            assert (await ref.send("go")).text == "done"
        history = await ref.history()
    [call] = history[1].tool_calls
    assert (call.name, json.loads(call.arguments)) == ("lookup", {"order_id": "A1"})
    assert history[2].content == "paid A1"
    assert tool_pairs_intact(history)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"idempotent": "false"}, "idempotent"),
        ({"idempotent": None}, "idempotent"),
        ({"requires_review": "no"}, "requires_review"),
        ({"description": 5}, "description"),
    ],
)
def test_a_tool_refuses_flags_that_are_not_bools(options: dict[str, object], words: str) -> None:
    """A tool's idempotent and requires_review must be bools and its description text: a
    flag read from a config file as the string "false" was taken as true, so a tool
    meant not to run twice ran again after a crash."""

    async def refund(order_id: str) -> str:
        return order_id

    with pytest.raises(TypeError, match=words):
        sa.Tool(name="refund", fn=refund, **options)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=words):
        sa.tool(**options)(refund)  # type: ignore[call-overload]


class StuckCleanup:
    """A model whose stream, once abandoned at a chunk, never finishes closing (a
    connection whose close hangs); it streams ``first`` then text that is not a str."""

    def __init__(self, first: sa.ModelChunk) -> None:
        self.first = first
        self.closing = trio.Event()

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[object]:
        try:
            yield self.first
            yield sa.TextChunk(b"not text")  # type: ignore[arg-type]  # the turn gives up
        finally:
            self.closing.set()
            await trio.sleep_forever()


@pytest.mark.parametrize("where", ["model", "summarizer"])
async def test_a_stream_whose_close_hangs_does_not_hold_the_turn_forever(
    autojump_clock: trio.abc.Clock, where: str
) -> None:
    """A model (or summarizer) stream that hangs while it is closed after the turn gave
    up on it holds the turn only for a bounded time: the turn fails, the session goes on
    and the registry closes."""
    stuck = StuckCleanup(sa.TextChunk("They talked."))
    agent = sa.Agent(model=stuck) if where == "model" else compacting_agent(stuck)
    with trio.fail_after(600):
        async with sa.open_registry(agents={"a": agent}, shutdown_grace=5) as registry:
            ref = await registry.spawn("s")
            if where == "summarizer":
                await ref.send(LONG)
            with pytest.raises(sa.TurnFailedError):
                await ref.send(LONG)
            assert stuck.closing.is_set()
            assert (await ref.state()).status is sa.Status.IDLE


async def test_calls_a_cancelled_turn_never_started_are_told_they_did_not_run(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelling a turn while an approved call runs answers that call as cut short (it
    may have taken effect), and the calls after it, which never started, as not run:
    the model is not told that a refund nobody approved may have been made."""
    started = trio.Event()
    refunded: list[str] = []

    async def refund(order_id: str) -> str:
        refunded.append(order_id)
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    tools = [
        sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False),
        lookup,
    ]
    calls = [
        sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}'),
        sa.ToolCall(id="c2", name="lookup", arguments='{"order_id": "A1"}'),
        sa.ToolCall(id="c3", name="refund", arguments='{"order_id": "A2"}'),
    ]
    model = ScriptedModel([Scripted(tool_calls=calls)])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=tools)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1 and A2")
            async with trio.open_nursery() as nursery:

                async def approve() -> None:
                    with pytest.raises(sa.TurnCancelledError):
                        await ref.review(waiting.reviews[0].id, approve=True)

                nursery.start_soon(approve)
                await started.wait()
                assert await ref.cancel()
        history = await ref.history()
    assert refunded == ["A1"]
    assert tool_pairs_intact(history)
    results = {m.tool_call_id: m.content for m in history if m.role is sa.Role.TOOL}
    assert "may or may not have taken effect" in results["c1"]
    assert "did not run" in results["c2"]
    assert "did not run" in results["c3"]


@pytest.mark.parametrize("how", ["failed", "cancelled"])
async def test_retry_keeps_the_calls_of_a_tool_that_must_not_run_twice(how: str) -> None:
    """A turn that paid (a tool marked ``idempotent=False``) and then failed, or was
    cancelled, is retried with the payment's call and result still in the history: the
    model sees that it ran and does not pay again. Calls of idempotent tools are removed
    with the rest of what the turn left, as before."""
    paid: list[str] = []
    gate = trio.Event()

    async def pay(order_id: str) -> str:
        paid.append(order_id)
        return f"paid {order_id}"

    def pay_call(call_id: str) -> sa.ToolCall:
        return sa.ToolCall(id=call_id, name="pay", arguments='{"order_id": "A1"}')

    def look_call(call_id: str) -> sa.ToolCall:
        return sa.ToolCall(id=call_id, name="lookup", arguments='{"order_id": "A1"}')

    def answer(request: sa.ModelRequest) -> Scripted:
        # pays only if the history shows no payment (what a model does)
        if any(m.role is sa.Role.TOOL and m.tool_call_id == "c2" for m in request.messages):
            return Scripted(text="Paid.")
        return Scripted(tool_calls=[pay_call("c3")])

    second = (
        RuntimeError("the model is down") if how == "failed" else Scripted(text="...", wait=gate)
    )
    model = ScriptedModel(
        [
            Scripted(tool_calls=[look_call("c1")]),
            Scripted(tool_calls=[pay_call("c2")]),
            second,
            answer,
            answer,
        ]
    )
    tool = sa.Tool(name="pay", fn=pay, description="Pay an order.", idempotent=False)
    agents = {"a": sa.Agent(model=model, tools=[tool, lookup])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            turn = await ref.submit("pay A1")
            if how == "cancelled":
                await trio.testing.wait_all_tasks_blocked()
                assert await ref.cancel()
            with pytest.raises(sa.TurnFailedError if how == "failed" else sa.TurnCancelledError):
                await turn.reply()
            assert paid == ["A1"]
            reply = await ref.retry()
        history = await ref.history()
    assert reply.text == "Paid."
    assert paid == ["A1"]  # not twice
    calls = [c.id for m in history for c in m.tool_calls]
    assert "c2" in calls  # the payment's call and result stay
    assert "c1" not in calls  # the lookup's went, as what the turn left does
    assert tool_pairs_intact(history)
    assert [m.content for m in history if m.role is sa.Role.USER] == ["pay A1"]
