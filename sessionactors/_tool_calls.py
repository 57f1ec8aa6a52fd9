"""A turn's tool calls, their reviews and resumption, and compaction.

Every change goes through durable events that the actor folds into its state;
these functions reach the actor only through :class:`TurnHost`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

import trio

from ._agent import MAX_ANSWER_CHARS, Agent, answer_too_long, close_stream, usage_of
from ._codec import MAX_TEXT_CHARS
from ._errors import ModelError
from ._events import (
    Event,
    HistoryEdited,
    ReviewRequested,
    ReviewResolved,
    make_tool_call_started,
    make_tool_result,
)
from ._history import split_for_compaction
from ._model import Model, ModelRequest, TextChunk, UsageChunk
from ._nesting import WITHIN, Frame, Within
from ._records import Message, ReviewRequest, Role, ToolCall, Usage, new_id, storable, utcnow
from ._session import LiveSession
from ._telemetry import TurnTrace
from ._tools import Tool, ToolContext, ToolOutcome, describe_exception

__all__ = [
    "TurnHost",
    "deny_for_stop",
    "kept_on_retry",
    "maybe_compact",
    "record_result",
    "resume_tool_calls",
    "run_batch",
    "run_tool_calls",
]

_T = TypeVar("_T")


class TurnHost(Protocol):
    """What the tool-call steps of a turn may do to their session (the actor)."""

    session_id: str
    turn_id: str
    session: LiveSession
    trace: TurnTrace | None

    def next_seq(self) -> int: ...
    def emit(self, event: Event) -> None: ...
    def durable(self, event: Event, *, publish: bool = True) -> Event: ...
    def add_message(self, message: Message) -> None: ...
    def request_messages(self, agent: Agent | None = None) -> Sequence[Message]: ...
    def commit(self, *, compact: bool = True) -> Awaitable[None]: ...
    def bounded(self, write: Awaitable[_T]) -> Awaitable[_T]: ...
    async def compact(self) -> None: ...
    def chain(self) -> Within: ...


def _needs_review(agent: Agent, call: ToolCall) -> bool:
    tool = agent.find_tool(call.name)
    return tool is not None and bool(tool.requires_review)


def _idempotent(agent: Agent, call: ToolCall) -> bool:
    tool = agent.find_tool(call.name)
    return tool is None or bool(tool.idempotent)


#: The longest tool message a turn records, in characters: a longer result (or a
#: reviewer's denial with its note) is cut, with a note for the model within the
#: bound. As long as a message may be (``MAX_TEXT_CHARS``), so that a history read
#: back can be written again (``ref.replace_history``).
MAX_TOOL_RESULT_CHARS = MAX_TEXT_CHARS


async def _invoke(actor: TurnHost, agent: Agent, call: ToolCall) -> tuple[str, bool]:
    tool = agent.find_tool(call.name)
    if tool is None:
        names = ", ".join(t.name for t in agent.tools) or "none"
        return f"unknown tool {call.name!r}; the tools available are: {names}", True
    await trio.lowlevel.checkpoint_if_cancelled()
    context = _context_of(actor, tool, call)
    trace = actor.trace
    if trace is None:
        return _result(await tool._run(call.arguments, None, context))
    errors: list[BaseException] = []
    with trace.tool_call(call) as traced:  # current in this task: the tool's spans nest
        outcome = await tool._run(call.arguments, errors.append, context)
        if outcome.is_error:
            traced.failed(errors[0] if errors else None, outcome.content)
    return _result(outcome)


def _context_of(actor: TurnHost, tool: Tool, call: ToolCall) -> ToolContext | None:
    """What ``call`` of ``tool`` is given of its turn (None: the tool takes nothing)."""
    return tool._context_for(actor.session_id, actor.turn_id, call.id, actor.session.metadata)


def _result(outcome: ToolOutcome) -> tuple[str, bool]:
    """What of a tool's outcome joins the history: its text, storable (record_result
    cuts it to its bound)."""
    return storable(outcome.content), outcome.is_error


def _bounded(content: str) -> str:
    """``content`` cut, with a note saying so, to at most MAX_TOOL_RESULT_CHARS."""
    if len(content) <= MAX_TOOL_RESULT_CHARS:
        return content
    note = (
        f"\n[result cut: it was {len(content):,} characters, over the limit of "
        f"{MAX_TOOL_RESULT_CHARS:,}]"
    )
    return content[: MAX_TOOL_RESULT_CHARS - len(note)] + note


def record_result(actor: TurnHost, call: ToolCall, content: str, is_error: bool) -> None:
    """The call's result joins the history (as a tool message, cut to its bound) with
    its ToolResult."""
    actor.durable(
        make_tool_result(
            session_id=actor.session_id,
            seq=actor.next_seq(),
            turn_id=actor.turn_id,
            tool_call_id=call.id,
            content=_bounded(content),
            is_error=is_error,
            message_id=new_id("msg"),
            created_at=utcnow(),
        )
    )


def _start_calls(actor: TurnHost, agent: Agent, calls: Sequence[ToolCall]) -> bool:
    """Publish the calls' starts; whether one is not idempotent (then commit first).

    Only a non-idempotent call's start goes into the journal (and the open turn's
    ``started_calls``): a wake must not run it again. An idempotent call simply
    runs again after a crash, so its start is published and not journaled.
    """
    commit = False
    for call in calls:
        event = make_tool_call_started(
            session_id=actor.session_id, seq=actor.next_seq(), turn_id=actor.turn_id, tool_call=call
        )
        if _idempotent(agent, call):
            actor.emit(event)
        else:
            actor.durable(event)
            commit = True
    return commit


async def run_batch(actor: TurnHost, agent: Agent, calls: Sequence[ToolCall]) -> None:
    """Run independent calls concurrently; record their results in call order.

    Cancelled (or failing) while they run, it answers every call of the step that
    has no result yet before it raises: the history never keeps a call without its
    result (the model would be sent a broken history). Every call runs here, an
    approved one (``ref.review``) included.
    """
    try:
        if len(calls) == 1:
            call = calls[0]
            await _run_one(actor, agent, call, agent.find_tool(call.name))
        else:
            await _run_many(actor, agent, calls)
    except BaseException:
        _answer_unanswered(actor, calls)
        raise


def _answer_unanswered(actor: TurnHost, ran: Sequence[ToolCall]) -> None:
    """Give every call of the step without a result one that says it was cut short
    (a call of ``ran``, which may have taken effect) or did not run (any other)."""
    for call in _unanswered_calls(actor):
        if call in ran:
            text = (
                "this call was cancelled before its result was recorded; it may or may "
                "not have taken effect: check before retrying"
            )
        else:
            text = "this call did not run: its turn was cancelled before the call started"
        record_result(actor, call, text, True)


async def _run_one(actor: TurnHost, agent: Agent, call: ToolCall, tool: Tool | None) -> None:
    """One call (``tool`` is the agent's tool of its name, or None), as ``_run_many``
    runs each: its start published, and journaled first if it is not idempotent."""
    event = make_tool_call_started(
        session_id=actor.session_id, seq=actor.next_seq(), turn_id=actor.turn_id, tool_call=call
    )
    if tool is None or tool.idempotent:
        actor.emit(event)
    else:
        actor.durable(event)
        # before it runs, its start is durable (and only that write is bounded: the
        # snapshot that may follow it is optional)
        await actor.bounded(actor.commit(compact=False))
        await actor.compact()
    frame: Frame = [actor]  # (it tells the turns its requests would wait on: _nesting)
    entered = WITHIN.set(frame)
    try:
        if tool is not None and actor.trace is None:  # _invoke's common case, inline
            await trio.lowlevel.checkpoint_if_cancelled()
            context = _context_of(actor, tool, call)
            content, is_error = _result(await tool._run(call.arguments, None, context))
        else:
            content, is_error = await _invoke(actor, agent, call)
    finally:
        frame[0] = None  # (a task the tool started may outlive it)
        WITHIN.reset(entered)
    record_result(actor, call, content, is_error)


async def _run_many(actor: TurnHost, agent: Agent, calls: Sequence[ToolCall]) -> None:
    if _start_calls(actor, agent, calls):
        # before a non-idempotent call runs, its start is durable (see _run_one)
        await actor.bounded(actor.commit(compact=False))
        await actor.compact()
    results: list[tuple[str, bool] | None] = [None] * len(calls)

    async def one(i: int, call: ToolCall) -> None:
        results[i] = await _invoke(actor, agent, call)

    frame: Frame = [actor]  # (as _run_one's)
    entered = WITHIN.set(frame)
    try:
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
    finally:
        frame[0] = None
        WITHIN.reset(entered)
        # (cut short, too: a call that finished keeps its result; run_batch answers the rest)
        for call, result in zip(calls, results, strict=True):
            if result is not None:
                record_result(actor, call, *result)


def _request_review(actor: TurnHost, call: ToolCall) -> None:
    review = ReviewRequest(
        id=new_id("review"),
        session_id=actor.session_id,
        tool_call=call,
        created_at=utcnow(),
        turn_id=actor.turn_id,
    )
    actor.durable(
        ReviewRequested(
            session_id=actor.session_id, seq=actor.next_seq(), turn_id=actor.turn_id, review=review
        )
    )


async def run_tool_calls(actor: TurnHost, agent: Agent, calls: Sequence[ToolCall]) -> bool:
    """Run the calls in order, pausing at the first that needs a review (False)."""
    if len(calls) == 1:  # the common step: one call, its tool looked up once
        call = calls[0]
        tool = agent.find_tool(call.name)
        if tool is not None and tool.requires_review:
            _request_review(actor, call)
            return False
        try:
            await _run_one(actor, agent, call, tool)
        except BaseException:  # (as run_batch does)
            _answer_unanswered(actor, calls)
            raise
        return True
    i = 0
    while i < len(calls):
        j = i
        while j < len(calls) and not _needs_review(agent, calls[j]):
            j += 1
        if j > i:
            await run_batch(actor, agent, calls[i:j])  # (answers every call if cut)
        if j < len(calls):
            _request_review(actor, calls[j])
            return False
        i = j
    return True


def deny_for_stop(actor: TurnHost) -> None:
    """A session stopped while its turn waits on a review: the reviews are denied and
    the calls that did not run are answered so (nothing can resolve them any more)."""
    session = actor.session
    for review in list(session.reviews.values()):
        actor.durable(
            ReviewResolved(
                session_id=actor.session_id,
                seq=actor.next_seq(),
                turn_id=review.turn_id,
                review_id=review.id,
                approved=False,
                note="the session was stopped",
            )
        )
    for call in _unanswered_calls(actor):
        record_result(
            actor,
            call,
            "the session was stopped before this call was reviewed; it did not run",
            True,
        )


def kept_on_retry(agent: Agent, left: Sequence[Message]) -> set[str]:
    """Of what a failed or cancelled turn ``left``, the ids of the messages its retry
    keeps: each assistant message that called a tool that must not run twice
    (``idempotent=False``), with its results, so that the model sees what ran (or may
    have) and does not run it again."""
    kept: set[str] = set()
    for i, message in enumerate(left):
        calls = message.tool_calls
        if calls and not all(_idempotent(agent, call) for call in calls):
            ids = {call.id for call in calls}
            kept.add(message.id)
            kept.update(m.id for m in left[i + 1 :] if m.tool_call_id in ids)
    return kept


def _unanswered_calls(actor: TurnHost) -> tuple[ToolCall, ...]:
    """The calls of the last assistant message that have no result yet, in order."""
    messages = actor.session.messages
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role is Role.ASSISTANT and m.tool_calls:
            answered = {r.tool_call_id for r in messages[i + 1 :] if r.role is Role.TOOL}
            return tuple(c for c in m.tool_calls if c.id not in answered)
        if m.role is not Role.TOOL:
            return ()
    return ()


async def resume_tool_calls(actor: TurnHost, agent: Agent, *, interrupted: bool) -> bool:
    """Answer the open turn's remaining calls; False if it pauses for a review again.

    After a crash (``interrupted``), a non-idempotent call that had started
    is not run again: the model gets a result saying it was interrupted.
    """
    calls = _unanswered_calls(actor)
    open_turn = actor.session.open_turn
    started = set(open_turn.started_calls) if open_turn is not None else set()
    rest: list[ToolCall] = []
    for call in calls:
        # every started non-idempotent call, even after one that runs again (its result
        # then comes before theirs: results are matched to calls by id)
        if interrupted and call.id in started and not _idempotent(agent, call):
            record_result(
                actor,
                call,
                "this call was interrupted by a crash after it started; it was not run "
                "again, so it may or may not have taken effect: check before retrying",
                True,
            )
        else:
            rest.append(call)
    return await run_tool_calls(actor, agent, rest)


def _transcript(messages: Sequence[Message]) -> str:
    lines = []
    for m in messages:
        if m.role is Role.TOOL:
            lines.append(f"tool result ({m.tool_call_id}): {m.content}")
        elif m.tool_calls:
            calls = "; ".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
            lines.append(f"assistant: {m.content} [called: {calls}]")
        else:
            lines.append(f"{m.role.value}: {m.content}")
    return "\n".join(lines)


async def maybe_compact(actor: TurnHost, agent: Agent) -> None:
    """Summarize the older history when the next request would exceed the budget."""
    compaction = agent.compaction
    if compaction is None:
        return
    if compaction.estimate(actor.request_messages(agent)) <= compaction.max_tokens:
        return
    history = actor.session.messages
    cut = split_for_compaction(history, compaction.keep_last)
    if cut <= 0:
        return
    older = history[:cut]
    parts = [compaction.instructions]
    if actor.session.summary:
        parts.append(f"Earlier summary:\n{actor.session.summary}")
    request = ModelRequest(
        session_id=actor.session_id,
        messages=(
            Message(
                id="compaction", role=Role.SYSTEM, content="\n\n".join(parts), created_at=utcnow()
            ),
            Message(
                id="compaction-input",
                role=Role.USER,
                content=_transcript(older),
                created_at=utcnow(),
            ),
        ),
    )
    summarizer = compaction.summarizer or agent.model
    try:
        summary, usage = await _summarize(actor, summarizer, request)
    except Exception as exc:  # the summarizer's: this turn fails, and says why
        said = describe_exception(exc)
        if len(said) > 500:  # (the advice after it must survive the outcome's bound)
            said = said[:500] + "..."
        raise ModelError(
            f"session {actor.session_id!r}: compaction failed, so the turn did not run: its "
            f"summarizer raised {said}; fix the summarizer (or raise "
            "Compaction.max_tokens) and send the message again",
            session_id=actor.session_id,
        ) from exc
    if not summary:  # (blanks, nothing, or only tool calls: nothing to keep in place)
        raise ModelError(
            f"session {actor.session_id!r}: compaction failed, so the turn did not run: its "
            "summarizer answered with no summary (no text; a summary is text, not tool "
            "calls); fix the summarizer (or raise Compaction.max_tokens) and send the "
            "message again",
            session_id=actor.session_id,
        )
    actor.durable(
        HistoryEdited(
            session_id=actor.session_id,
            seq=actor.next_seq(),
            reason="compaction",
            removed=tuple(m.id for m in older),
            summary=summary,
            usage=usage,
        )
    )


async def _summarize(
    actor: TurnHost, summarizer: Model, request: ModelRequest
) -> tuple[str, Usage | None]:
    """The summarizer's answer to ``request`` (stripped) and the tokens it reported,
    traced as one of the turn's model calls; its stream is closed if it is abandoned."""
    chunks: list[str] = []
    size = 0
    usage: Usage | None = None
    trace = actor.trace
    call = trace.model_call(summarizer, request) if trace is not None else None
    try:
        stream = summarizer.stream(request)
    except BaseException as exc:  # (a model may connect before it returns its stream)
        if call is not None:
            call.end(None, exc)
        raise
    try:
        async for chunk in stream:
            if isinstance(chunk, TextChunk):
                text = chunk.text
                if text.__class__ is not str:
                    raise TypeError(f"the summarizer streamed a TextChunk whose text is {text!r}")
                size += len(text)
                if size > MAX_ANSWER_CHARS:
                    raise answer_too_long(actor.session_id)
                chunks.append(text)
            elif isinstance(chunk, UsageChunk):
                counts = usage_of(chunk)
                usage = counts if usage is None else usage + counts
    except BaseException as exc:
        if call is not None:
            call.end(usage, exc)
        await close_stream(stream)
        raise
    if call is not None:
        call.end(usage, None)
    return storable("".join(chunks)).strip(), usage  # (as a model's reply: valid unicode)
