"""What an actor does beyond plain turns: tool calls, reviews, resumption,
compaction and history edits. Every change goes through durable events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from ._errors import (
    MessageNotFoundError,
    ReviewNotFoundError,
    SessionBusyError,
    TurnFailedError,
)
from ._events import HistoryEdited, ReviewRequested, ReviewResolved, ToolCallStarted, ToolResult
from ._history import rewind_end, split_for_keep_last
from ._model import ModelRequest, TextChunk
from ._records import Message, ReviewRequest, Role, Status, ToolCall, new_id, utcnow

if TYPE_CHECKING:
    from ._actor import Actor, Pending
    from ._agent import Agent

__all__ = [
    "maybe_compact",
    "resolve_review",
    "resume_tool_calls",
    "run_call",
    "run_tool_calls",
]


def _needs_review(agent: Agent, call: ToolCall) -> bool:
    tool = agent.find_tool(call.name)
    return tool is not None and bool(tool.requires_review)


def _idempotent(agent: Agent, call: ToolCall) -> bool:
    tool = agent.find_tool(call.name)
    return tool is None or bool(tool.idempotent)


#: Tool results longer than this many characters are cut (with a note for the model).
MAX_TOOL_RESULT_CHARS = 1024 * 1024


async def _invoke(agent: Agent, call: ToolCall) -> tuple[str, bool]:
    tool = agent.find_tool(call.name)
    if tool is None:
        names = ", ".join(t.name for t in agent.tools) or "none"
        return f"unknown tool {call.name!r}; the tools available are: {names}", True
    await trio.lowlevel.checkpoint_if_cancelled()
    outcome = await tool._run(call.arguments)
    content = outcome.content
    if len(content) > MAX_TOOL_RESULT_CHARS:
        content = (
            content[:MAX_TOOL_RESULT_CHARS]
            + f"\n[result cut: it was {len(outcome.content):,} characters, over the limit of "
            f"{MAX_TOOL_RESULT_CHARS:,}]"
        )
    return content, outcome.is_error


def _record_result(actor: Actor, call: ToolCall, content: str, is_error: bool) -> None:
    actor._emit(
        ToolResult(
            session_id=actor.session_id,
            seq=actor._seq(),
            turn_id=actor.turn_id,
            tool_call_id=call.id,
            content=content,
            is_error=is_error,
        )
    )
    actor.add_message(Message.create(Role.TOOL, content, tool_call_id=call.id, is_error=is_error))


def _start_calls(actor: Actor, agent: Agent, calls: Sequence[ToolCall]) -> bool:
    """Publish the calls' starts; whether one is not idempotent (then commit first).

    Only a non-idempotent call's start goes into the journal (and the open turn's
    ``started_calls``): a wake must not run it again. An idempotent call simply
    runs again after a crash, so its start is published and not journaled.
    """
    commit = False
    for call in calls:
        event = ToolCallStarted(
            session_id=actor.session_id, seq=actor._seq(), turn_id=actor.turn_id, tool_call=call
        )
        if _idempotent(agent, call):
            actor._emit(event)
        else:
            actor._durable(event)
            commit = True
    return commit


async def _run_batch(actor: Actor, agent: Agent, calls: Sequence[ToolCall]) -> None:
    """Run independent calls concurrently; record their results in call order."""
    if _start_calls(actor, agent, calls):
        # before a non-idempotent call runs, its start is durable
        with trio.CancelScope(shield=True):
            await actor.commit()
    if len(calls) == 1:
        _record_result(actor, calls[0], *await _invoke(agent, calls[0]))
        return
    results: list[tuple[str, bool]] = [("", False)] * len(calls)

    async def one(i: int, call: ToolCall) -> None:
        results[i] = await _invoke(agent, call)

    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    for call, (content, is_error) in zip(calls, results, strict=True):
        _record_result(actor, call, content, is_error)


def _request_review(actor: Actor, call: ToolCall) -> None:
    review = ReviewRequest(
        id=new_id("review"),
        session_id=actor.session_id,
        tool_call=call,
        created_at=utcnow(),
        turn_id=actor.turn_id,
    )
    actor._durable(
        ReviewRequested(
            session_id=actor.session_id, seq=actor._seq(), turn_id=actor.turn_id, review=review
        )
    )


async def run_tool_calls(actor: Actor, agent: Agent, calls: Sequence[ToolCall]) -> bool:
    """Run the calls in order, pausing at the first that needs a review (False)."""
    i = 0
    try:
        while i < len(calls):
            j = i
            while j < len(calls) and not _needs_review(agent, calls[j]):
                j += 1
            if j > i:
                await _run_batch(actor, agent, calls[i:j])
            if j < len(calls):
                _request_review(actor, calls[j])
                return False
            i = j
    except BaseException:
        # cancelled while tools ran: answer every open call, so that the history never
        # keeps a call without its result (the model would be sent a broken history)
        for call in _unanswered_calls(actor):
            _record_result(
                actor,
                call,
                "this call was cancelled before its result was recorded; it may or may "
                "not have taken effect: check before retrying",
                True,
            )
        raise
    return True


def _unanswered_calls(actor: Actor) -> tuple[ToolCall, ...]:
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


async def resume_tool_calls(actor: Actor, agent: Agent, *, interrupted: bool) -> bool:
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
            _record_result(
                actor,
                call,
                "this call was interrupted by a crash after it started; it was not run "
                "again, so it may or may not have taken effect: check before retrying",
                True,
            )
        else:
            rest.append(call)
    return await run_tool_calls(actor, agent, rest)


async def resolve_review(
    actor: Actor, pending: Pending, *, review_id: str, approve: bool, note: str | None
) -> None:
    """Approve (run the tool) or deny (tell the model), then let the turn go on."""
    session = actor.session
    review = session.reviews.get(review_id)
    if review is None:
        known = ", ".join(session.reviews) or "none"
        raise ReviewNotFoundError(
            f"session {actor.session_id!r} has no pending review {review_id!r} (pending: "
            f"{known}); list them with ref.pending_reviews()",
            session_id=actor.session_id,
        )
    try:
        agent = actor.host._agent_for(session)
    except LookupError as exc:
        raise TurnFailedError(
            f"{exc}; the review stays pending until the agent is back",
            session_id=actor.session_id,
            turn_id=review.turn_id,
        ) from exc
    actor.turn_id = review.turn_id
    actor._durable(
        ReviewResolved(
            session_id=actor.session_id,
            seq=actor._seq(),
            turn_id=review.turn_id,
            review_id=review_id,
            approved=approve,
            note=note,
        )
    )
    actor._set_status(Status.RUNNING)
    call = review.tool_call

    async def before(agent: Agent) -> bool:
        if approve:
            await _run_batch(actor, agent, [call])
        else:
            text = "a reviewer denied this call; it did not run"
            _record_result(actor, call, f"{text}: {note}" if note else text, True)
        return await resume_tool_calls(actor, agent, interrupted=False)

    key = session.open_turn.idempotency_key if session.open_turn is not None else None
    from ._actor import TurnRequest

    # the turn in flight is this review's: a crash fails its caller (the supervisor
    # fails actor.turn_request) instead of leaving ref.review() waiting forever
    actor.turn_request = TurnRequest(review.turn_id, "", key, pending)
    await actor._drive(agent, pending, key, before=before)


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


async def maybe_compact(actor: Actor, agent: Agent) -> None:
    """Summarize the older history when the next request would exceed the budget."""
    compaction = agent.compaction
    if compaction is None:
        return
    if compaction.estimate(actor.request_messages()) <= compaction.max_tokens:
        return
    history = actor.session.messages
    cut = split_for_keep_last(history, compaction.keep_last)
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
    chunks: list[str] = []
    async for chunk in summarizer.stream(request):
        if isinstance(chunk, TextChunk):
            chunks.append(chunk.text)
    summary = "".join(chunks).strip()
    if not summary:
        return
    actor._durable(
        HistoryEdited(
            session_id=actor.session_id,
            seq=actor._seq(),
            reason="compaction",
            removed=tuple(m.id for m in older),
            summary=summary,
        )
    )


def _refuse_while_reviewing(actor: Actor, what: str) -> None:
    if actor.session.reviews:
        review = next(iter(actor.session.reviews.values()))
        raise SessionBusyError(
            f"session {actor.session_id!r} cannot {what} while review {review.id!r} is "
            f"pending; resolve it with ref.review({review.id!r}, approve=...) first",
            session_id=actor.session_id,
        )


async def run_call(actor: Actor, kind: str, args: dict[str, Any]) -> Any:
    """Serve a history edit in mailbox order; returns how many messages were removed."""
    session = actor.session
    sid = actor.session_id
    removed: tuple[str, ...] = ()
    summary: str | None = None
    if kind == "truncate":
        _refuse_while_reviewing(actor, "truncate")
        keep_last = args["keep_last"]
        cut = split_for_keep_last(session.messages, keep_last)
        removed = tuple(m.id for m in session.messages[:cut])
    elif kind == "rewind":
        _refuse_while_reviewing(actor, "rewind")
        index = session.find(args["message_id"])
        if index < 0:
            raise MessageNotFoundError(
                f"session {sid!r} has no message {args['message_id']!r}; take ids from "
                "ref.history()",
                session_id=sid,
            )
        end = rewind_end(session.messages, index)
        removed = tuple(m.id for m in session.messages[end:])
    elif kind == "set_summary":
        summary = args["text"]
    else:
        raise ValueError(f"unknown request kind {kind!r} for session {sid!r}")
    actor._durable(
        HistoryEdited(
            session_id=sid, seq=actor._seq(), reason=kind, removed=removed, summary=summary
        )
    )
    await actor.commit()
    return len(removed)
