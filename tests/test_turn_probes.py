"""Turn semantics at the edges: tool calls, reviews, idempotency keys, usage."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from history_rules import tool_pairs_intact
from sessionactors.testing import EchoModel, Scripted, ScriptedModel


def call(name: str, arguments: object = None, *, id: str) -> sa.ToolCall:
    return sa.ToolCall(id=id, name=name, arguments=json.dumps(arguments or {}))


class Shop:
    """A reviewed, non-idempotent ``refund`` and a plain ``lookup``; runs are logged."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str]] = []

    async def _refund(self, order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        self.runs.append(("refund", order_id))
        return f"refunded {order_id}"

    async def _lookup(self, order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        self.runs.append(("lookup", order_id))
        return f"paid {order_id}"

    def agent(self, model: sa.Model) -> sa.Agent:
        return sa.Agent(
            model=model,
            tools=[
                sa.Tool(name="refund", fn=self._refund, requires_review=True, idempotent=False),
                sa.Tool(name="lookup", fn=self._lookup),
            ],
        )


async def test_calls_of_one_step_sharing_an_id_each_run_and_get_a_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model that gives two calls of one step the same id (some servers repeat ids):
    each call runs and the history holds one result per call. Without distinct ids the
    call after a reviewed one was taken as answered by the reviewed call's result: it
    never ran, and the model was sent a call without its result."""
    shop = Shop()
    refund = call("refund", {"order_id": "A1"}, id="call_0")
    lookup = call("lookup", {"order_id": "A1"}, id="call_0")
    model = ScriptedModel([Scripted(tool_calls=[refund, lookup]), "Done."])
    async with sa.open_registry(agents={"a": shop.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1")
            reply = await ref.review(waiting.reviews[0].id, approve=True)
        history = await ref.history()
        # what the model was sent is a history every chat API accepts
        sent = list(model.requests[-1].messages)
    assert reply.text == "Done."
    assert shop.runs == [("refund", "A1"), ("lookup", "A1")]
    assert tool_pairs_intact(history)
    assert tool_pairs_intact([m for m in sent if m.role is not sa.Role.SYSTEM])
    ids = [c.id for c in history[1].tool_calls]
    assert len(set(ids)) == 2
    # the history a turn made is one that replace_history takes back as it is
    async with sa.open_registry(agents={"a": shop.agent(ScriptedModel([]))}) as registry:
        other = await registry.spawn("t")
        await other.replace_history(history)


async def test_replace_history_with_the_sessions_own_messages_counts_no_tokens_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``SessionState.usage`` is the tokens the session's model calls reported. Putting
    messages back with ``replace_history`` (the redaction of the how-to) or
    ``add_messages`` calls no model: the usage they carry was counted (it doubled), and
    stays the same after a wake, which replays the journal."""
    once = sa.Usage(input_tokens=10, output_tokens=5)
    model = ScriptedModel([Scripted(text="Hi.", usage=once)])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("Hello")
            history = await ref.history()
            await ref.replace_history(history)
            await ref.add_messages([sa.Message.create(sa.Role.ASSISTANT, "P.S.", usage=once)])
            live = (await ref.state()).usage
            await ref.hibernate()
            woken = (await ref.state()).usage
            (info,) = await registry.sessions()
    assert live == woken == info.usage == once


async def test_a_keyed_retry_of_a_turn_waiting_on_a_review_joins_it_after_a_wake(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A client that sent a turn with a key and lost the answer retries with the key: while
    the turn waits on a review, the retry joins it (its id, its reviews), as it does
    before the session hibernates. After a wake it was refused with SessionBusyError
    ("resolve it before sending a new message"), by ``send``, ``submit`` and a
    ``submit_nowait`` queued while the session woke alike; the turn still runs once."""
    shop = Shop()
    refund = call("refund", {"order_id": "A1"}, id="call_r")
    model = ScriptedModel([Scripted(tool_calls=[refund]), "Refunded."])
    async with sa.open_registry(agents={"a": shop.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            first = await ref.send("Refund A1", idempotency_key="req-1")
            (review,) = first.reviews
            again = await ref.send("Refund A1", idempotency_key="req-1")
            assert (again.turn_id, again.reviews) == (first.turn_id, first.reviews)

            await ref.hibernate()
            nowait = ref.submit_nowait("Refund A1", idempotency_key="req-1")  # while it wakes
            woken = await ref.send("Refund A1", idempotency_key="req-1")
            queued = await nowait.reply()
            for reply in (woken, queued):
                assert (reply.turn_id, reply.reviews, reply.message) == (
                    first.turn_id,
                    (review,),
                    None,
                )
            assert (await ref.turn_outcome(nowait.id)).status is sa.TurnStatus.WAITING

            done = await ref.review(review.id, approve=True)
            retried = await ref.send("Refund A1", idempotency_key="req-1")
        history = await ref.history()
    assert done.text == retried.text == "Refunded."
    assert retried.turn_id == first.turn_id
    assert shop.runs == [("refund", "A1")]
    assert [m.content for m in history if m.role is sa.Role.USER] == ["Refund A1"]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_turn_whose_tool_results_outweigh_one_journal_entry_is_journaled(
    kind: str, tmp_path: Path
) -> None:
    """Each tool result is bounded (``MAX_TOOL_RESULT_CHARS``), but a turn's results add
    up: six steps of a tool reading 1 Mi characters of CJK text (3 MiB each) came to more
    than one journal entry holds (16 MiB). The turn's commit was refused, the session
    crashed and restarted without the turn (told to "truncate or compact the history",
    which was empty), and every retry did the same. Now the turn is journaled in several
    entries of one append, and a new registry on the store reads it back the same."""

    async def read(part: int) -> str:
        await trio.lowlevel.checkpoint()
        return "文" * (1024 * 1024)

    tool = sa.Tool(name="read", fn=read)
    steps = [Scripted(tool_calls=[call("read", {"part": i}, id=f"c{i}")]) for i in range(6)]
    agents = {"a": sa.Agent(model=ScriptedModel([*steps, "Read it all."]), tools=[tool])}

    def store() -> sa.MemoryStore | sa.SQLiteStore:
        return shared if kind == "memory" else sa.SQLiteStore(str(tmp_path / "s.db"))

    shared = sa.MemoryStore()
    async with sa.open_registry(store=store(), agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30):
            reply = await ref.send("Read the six parts.")
        live = await ref.history()
        assert registry.statistics().crashes == 0
    assert reply.text == "Read it all."
    assert len(live) == 14
    async with sa.open_registry(store=store(), agents=agents) as registry:
        with trio.fail_after(30):
            assert await registry.ref("s").history() == live
            outcome = await registry.ref("s").turn_outcome(reply.turn_id)
    assert outcome.status is sa.TurnStatus.FINISHED


class SplitSurrogateSummarizer:
    """A summarizer whose text holds a lone surrogate: what ``json.loads`` makes of an
    emoji an OpenAI-compatible server split across two stream chunks, one of them lost."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await trio.lowlevel.checkpoint()
        yield sa.TextChunk("The user counts \ud83d")
        yield sa.TextChunk(" words.")


async def test_a_summary_with_a_lone_surrogate_is_stored_like_a_reply(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model's reply is made storable (a lone surrogate becomes U+FFFD); a summary from
    the compaction's summarizer was not: its journal entry was refused, the session
    crashed, and every later turn compacted and crashed again (each one lost)."""
    store = sa.MemoryStore()
    compaction = sa.Compaction(max_tokens=5, keep_last=1, summarizer=SplitSurrogateSummarizer())
    agents = {"a": sa.Agent(model=EchoModel(), compaction=compaction)}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            await ref.send("one two three four five six")
            reply = await ref.send("seven eight nine ten")
            state = await ref.state()
        assert registry.statistics().crashes == 0
    assert reply.text == "seven eight nine ten"
    assert state.summary == "The user counts \ufffd words."
    async with sa.open_registry(store=store, agents=agents) as registry:
        assert (await registry.ref("s").state()).summary == state.summary


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("the server said: \ud83d"),
        RuntimeError("x" * (17 * 1024 * 1024)),
        UnprintableError(),
    ],
    ids=["lone-surrogate", "over-an-entry", "str-raises"],
)
async def test_a_model_error_of_any_text_fails_the_turn_not_the_session(
    error: Exception, autojump_clock: trio.abc.Clock
) -> None:
    """An exception from the model fails its turn (TurnFailedError, a TurnFailed outcome),
    never the session. One whose message the store cannot hold (a lone surrogate, more
    than a journal entry) or cannot be read crashed the session as it wrote the turn's
    outcome: the caller got SessionCrashedError and the failed turn was lost."""
    model = ScriptedModel([Scripted(text="Partly", error=error), "Fine."])
    store = sa.MemoryStore()
    agents = {"a": sa.Agent(model=model)}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            turn = await ref.submit("Hello")
            with pytest.raises(sa.TurnFailedError) as failed:
                await turn.reply()
            assert failed.value.__cause__ is error
            outcome = await ref.turn_outcome(turn.id)
            assert (await ref.send("Again")).text == "Fine."
            history = await ref.history()
        assert registry.statistics().crashes == 0
    assert outcome.status is sa.TurnStatus.FAILED
    assert outcome.error is not None
    assert outcome.error.startswith(type(error).__name__)
    assert len(outcome.error) <= 2003
    async with sa.open_registry(store=store, agents=agents) as registry:
        assert await registry.ref("s").history() == history
        assert await registry.ref("s").turn_outcome(turn.id) == outcome


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (lambda: nested(100_000), "cannot be encoded as JSON (RecursionError"),
        (lambda: {"order": Unprintable()}, "cannot be encoded as JSON: it holds a Unprintable"),
        (lambda: (_ for _ in ()).throw(UnprintableError()), "UnprintableError"),
    ],
    ids=["too-deep", "str-raises", "error-str-raises"],
)
async def test_a_tool_whose_result_or_error_cannot_be_told_reports_an_error_result(
    result: object, expected: str, autojump_clock: trio.abc.Clock
) -> None:
    """What a tool returns goes to the model as JSON, and what it raises as an error
    result; neither fails the turn. A result too deep for JSON, one holding an object
    whose str() raises, or an exception whose str() raises failed the whole turn."""

    async def lookup() -> object:
        await trio.lowlevel.checkpoint()
        return result()  # type: ignore[operator]

    tool = sa.Tool(name="lookup", fn=lookup)
    model = ScriptedModel([Scripted(tool_calls=[call("lookup", id="c1")]), "Checked."])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            reply = await ref.send("Look it up")
        history = await ref.history()
    assert reply.text == "Checked."
    assert history[2].is_error
    assert expected in history[2].content


async def test_retry_keeps_a_message_added_after_the_failed_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``retry()`` removes what the failed turn left after its user message (its marked
    reply, its tool calls and results). A message added since with ``add_messages`` (a
    person's note in a support chat) is not the turn's: retry deleted it as well, an
    acknowledged write lost without a word."""
    shop = Shop()
    model = ScriptedModel(
        [
            Scripted(tool_calls=[call("lookup", {"order_id": "A1"}, id="c1")]),
            RuntimeError("provider down"),
            "A1 is paid.",
        ]
    )
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents={"a": shop.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("Is A1 paid?")
            note = sa.Message.create(sa.Role.ASSISTANT, "Ada here, I am looking into it.")
            await ref.add_messages([note])
            reply = await ref.retry()
            history = await ref.history()
    assert reply.text == "A1 is paid."
    assert [(m.role, m.content) for m in history] == [
        (sa.Role.USER, "Is A1 paid?"),
        (sa.Role.ASSISTANT, "Ada here, I am looking into it."),
        (sa.Role.ASSISTANT, "A1 is paid."),
    ]
    assert history[1].id == note.id
    async with sa.open_registry(store=store, agents={"a": shop.agent(model)}) as registry:
        assert await registry.ref("s").history() == history


@pytest.mark.parametrize("hibernated", [False, True], ids=["live", "hibernated"])
async def test_stopping_a_session_whose_turn_waits_on_a_review_ends_that_turn(
    hibernated: bool, autojump_clock: trio.abc.Clock
) -> None:
    """A stopped session takes no review. Its turn that waited on one read ``waiting``
    forever, ``registry.pending_reviews()`` listed a review that ``ref.review`` can only
    refuse (SessionStoppedError), the history kept a tool call without its result, and
    ``fork`` refused the conversation for that pending call. Now the stop denies the
    review and ends the turn as cancelled, durably."""
    shop = Shop()
    model = ScriptedModel([Scripted(tool_calls=[call("refund", {"order_id": "A1"}, id="c1")])])
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents={"a": shop.agent(model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(5):
            waiting = await ref.send("Refund A1", idempotency_key="req-1")
            if hibernated:
                await ref.hibernate()
            await ref.stop()
            outcome = await ref.turn_outcome(waiting.turn_id)
            assert await registry.pending_reviews() == []
            state = await ref.state()
            fork = await registry.fork("s", "s-again")
            assert await fork.history() == list(state.messages)
    assert outcome.status is sa.TurnStatus.CANCELLED
    assert state.status is sa.Status.STOPPED
    assert state.reviews == ()
    assert state.open_turn is None
    assert tool_pairs_intact(state.messages)
    assert "stopped" in state.messages[2].content
    assert state.messages[2].is_error
    assert state.messages[-1].interrupted
    assert shop.runs == []
    async with sa.open_registry(store=store, agents={"a": shop.agent(model)}) as registry:
        assert await registry.ref("s").state() == state
