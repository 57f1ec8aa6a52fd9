"""Pure rules for cutting a history without separating tool calls from their results.

A "tool group" is an assistant message with tool calls followed by the tool
messages that answer them. Every cut keeps or drops a group whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._errors import SessionBusyError, shown
from ._records import Message, OpenTurn, Role

__all__ = [
    "check_before_open_turn",
    "check_copyable",
    "default_estimate",
    "rewind_end",
    "separated_pair",
    "split_for_compaction",
    "split_for_keep_last",
    "tool_pairs_intact",
]


def _group_start(messages: Sequence[Message], index: int) -> int:
    """The index where the tool group containing ``index`` starts (itself if none)."""
    i = index
    while i > 0 and messages[i].role is Role.TOOL:
        i -= 1
    if i != index and messages[i].role is Role.ASSISTANT and messages[i].tool_calls:
        return i
    return index if messages[index].role is not Role.TOOL else i


def split_for_keep_last(messages: Sequence[Message], keep_last: int) -> int:
    """The index of the first message kept when keeping (at least) the last ``keep_last``.

    The cut moves back to the user message that began the turn it falls in, so
    that what is kept (and the next model request, after the system prompt and
    summary) begins with a user message, as every chat API wants; a user message
    never sits inside a tool group. When no user message comes at or before the
    cut (a history written to begin otherwise), it moves back only as far as the
    start of the tool group it would split.
    """
    if keep_last <= 0:
        return len(messages)
    cut = max(0, len(messages) - keep_last)
    if cut >= len(messages):
        return len(messages)
    for i in range(cut, -1, -1):
        if messages[i].role is Role.USER:
            return i
    return _group_start(messages, cut)


def split_for_compaction(messages: Sequence[Message], keep_last: int) -> int:
    """The index of the first message a compaction keeps (``len(messages)`` if none; 0
    if it summarizes nothing): the first user message among the last ``keep_last``, or,
    when they hold none, the last user message before them.

    Every chat API wants the first message after the system prompt and summary to be
    the user's (Anthropic's Messages API requires it; Gemini wants a function call to
    follow a user turn), so the kept messages begin with one. Keeping at most
    ``keep_last`` summarizes at least as much as asked: a long turn of tool calls
    before the cut is summarized whole, not kept whole. A user message never sits
    inside a tool group, so no call is parted from its results. A history without a
    user message (never at a turn's start, which has the turn's) is not cut.
    """
    cut = max(0, len(messages) - keep_last)
    last_user = -1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role is Role.USER:
            if i < cut:
                return i if last_user < 0 else last_user
            last_user = i
    return max(last_user, 0)


def rewind_end(messages: Sequence[Message], index: int) -> int:
    """The end (exclusive) of the history kept when rewinding to ``messages[index]``.

    Keeping an assistant message with tool calls keeps its results too; keeping
    one tool result keeps the rest of its group.
    """
    end = index + 1
    start = _group_start(messages, index)
    if messages[start].role is Role.ASSISTANT and messages[start].tool_calls:
        while end < len(messages) and messages[end].role is Role.TOOL:
            end += 1
    return end


def tool_pairs_intact(messages: Sequence[Message]) -> bool:
    """Whether every tool result follows its call and every call has its result."""
    return separated_pair(messages) is None


def check_copyable(name: str, messages: Sequence[Message], refused: str, instead: str) -> None:
    """Refuse to copy session ``name``'s ``messages`` (a fork, an import under another
    name) while a tool call in them has no result yet: a review waits on it, or its tool
    runs. The copy would hold the call too, and run it a second time.

    Raises SessionBusyError saying that ``refused`` and what to do ``instead``.
    """
    if not tool_pairs_intact(messages):
        raise SessionBusyError(
            f"session {name!r} has a tool call without its result yet (a pending review "
            f"or a running tool), so {refused}; {instead}",
            session_id=name,
        )


def check_before_open_turn(
    name: str, history: Sequence[Message], open_turn: OpenTurn | None, kept: int
) -> None:
    """Refuse to fork the first ``kept`` messages of session ``name``'s ``history`` if
    they reach into ``open_turn``, a turn under way (or waiting on a review, or left
    open by a process that died): the fork would hold its user message without the
    reply, and its next turn would send the model two user messages in a row.

    Raises SessionBusyError naming the turn.
    """
    if open_turn is None:
        return
    ids = [m.id for m in history]
    if open_turn.message_id in ids:
        start = ids.index(open_turn.message_id)
    else:  # (a state written before 0.3: its turn is the last user message's)
        users = [i for i, m in enumerate(history) if m.role is Role.USER]
        start = users[-1] if users else len(history)
    if kept > start:
        raise SessionBusyError(
            f"session {name!r} has a turn under way ({open_turn.turn_id}): a fork holding "
            "its message without the reply would send the model two user messages in a "
            "row; fork at a message before the turn's, or after the turn ends",
            session_id=name,
        )


def separated_pair(messages: Sequence[Message], *, calls_may_wait: bool = False) -> str | None:
    """What separates a tool call from its results in ``messages``, in words (None if
    nothing): each assistant message with tool calls (each with an id of its own) must
    be followed at once by one tool message per call, and a tool message must answer a
    call just made.

    ``calls_may_wait``: a call may also be left without a result (a stored session's
    call that waits for its review, or was cut short), but a result still only
    answers a call just made."""
    open_calls: dict[str, str] = {}  # call id -> the id of the message that made it
    for index, m in enumerate(messages):
        if m.role is Role.TOOL:
            if m.tool_call_id is None or m.tool_call_id not in open_calls:
                call = None if m.tool_call_id is None else shown(m.tool_call_id)
                return (
                    f"messages[{index}] is a tool result for call {call}, which "
                    "the assistant message just before it did not make (or was answered already)"
                )
            del open_calls[m.tool_call_id]
            continue
        if open_calls and not calls_may_wait:
            call_id, by = next(iter(open_calls.items()))
            return (
                f"tool call {shown(call_id)} of message {shown(by)} has no result before "
                f"messages[{index}]; give each call's tool message right after it"
            )
        open_calls = {c.id: m.id for c in m.tool_calls} if m.role is Role.ASSISTANT else {}
        if open_calls and (len(open_calls) < len(m.tool_calls) or "" in open_calls):
            # one result cannot answer two calls: the other would be left without one
            return (
                f"messages[{index}] makes several tool calls with one id (or one with an "
                "empty id); give each call an id of its own"
            )
    if open_calls and not calls_may_wait:
        call_id, by = next(iter(open_calls.items()))
        return (
            f"tool call {shown(call_id)} of message {shown(by)} has no result; give each call's "
            "tool message right after it"
        )
    return None


def broken_rule(messages: Sequence[Message], *, calls_may_wait: bool = False) -> str | None:
    """What breaks the rules of every history in ``messages``, in words (None if
    nothing): unique, non-empty ids; tool calls only on assistant messages, a
    ``tool_call_id`` only on tool messages; each call's result right after it (see
    :func:`separated_pair`)."""
    seen: set[str] = set()
    for index, message in enumerate(messages):
        if not message.id:
            return f"messages[{index}] has an empty id"
        if message.id in seen:
            return f"message id {shown(message.id)} appears twice"
        seen.add(message.id)
        if message.tool_calls and message.role is not Role.ASSISTANT:
            return (
                f"messages[{index}] is a {message.role.value} message with tool calls; "
                "only assistant messages call tools"
            )
        if message.tool_call_id is not None and message.role is not Role.TOOL:
            return (
                f"messages[{index}] is a {message.role.value} message with a tool_call_id; "
                "only tool messages answer a call"
            )
    return separated_pair(messages, calls_may_wait=calls_may_wait)


def default_estimate(messages: Sequence[Message]) -> int:
    """A rough token count: about four characters a token, plus a few per message."""
    total = 0
    for m in messages:
        total += 4 + len(m.content) // 4
        for call in m.tool_calls:
            total += 4 + (len(call.name) + len(call.arguments)) // 4
    return total


Estimator = Callable[[Sequence[Message]], int]
