"""Messages a caller puts into a history: the checks behind ``ref.add_messages`` and
``ref.replace_history``.

Pure (no trio). The messages are checked as the events that will journal them
(one ``MessageAdded`` each), with the codec's own checks, so that what is
refused here is what the store would refuse, before anything is written; and
as a history: unique ids, every tool call followed by its results.
"""

from collections.abc import Iterable, Mapping, Sequence

from ._codec import MAX_TEXT_CHARS, dump_event, dump_events, load_events
from ._errors import InvalidHistoryError, shown
from ._events import Event, MessageAdded
from ._history import broken_rule
from ._metadata import non_finite
from ._records import Message, ToolCall

__all__ = ["KnownIds", "check_content", "check_entry", "check_messages", "check_new_ids"]


def check_messages(session_id: str, messages: object, what: str) -> tuple[Message, ...]:
    """``messages`` as a tuple of the session's own copies, if they can join a history as
    one block (their content is checked by :func:`check_content`, where the history is).

    ``TypeError`` for anything but an iterable of :class:`Message` records or a
    field of the wrong type, ``ValueError`` for what the codec refuses (a batch too
    long for one journal entry, a naive datetime), :class:`InvalidHistoryError` for
    an empty or repeated id and a tool call separated from its results. Every
    message names the session and ``what`` was called.
    """
    if isinstance(messages, str | bytes | Mapping | Message) or not isinstance(messages, Iterable):
        raise TypeError(
            f"{what} for session {session_id!r} takes a list of sa.Message records "
            f"(sa.Message.create(role, content)), not {type(messages).__name__}"
        )
    given = tuple(messages)
    for index, message in enumerate(given):
        if not isinstance(message, Message):
            raise TypeError(
                f"{what} for session {session_id!r}: messages[{index}] is "
                f"{type(message).__name__}, not an sa.Message; make one with "
                "sa.Message.create(role, content)"
            )
    if given:
        # the session's own copies, as a restart will read them: nothing the caller
        # still holds (a metadata dict, a list in it) is shared with the history
        entry = check_entry(session_id, [_added(session_id, m) for m in given], what)
        given = tuple(e.message for e in load_events(entry) if isinstance(e, MessageAdded))
    problem = broken_rule(given)
    if problem is not None:
        raise _invalid(session_id, what, problem)
    return given


def check_content(
    session_id: str, messages: Sequence[Message], what: str, held: Sequence[Message]
) -> None:
    """``ValueError`` for a message of ``messages`` longer than a turn's may be (its
    content, with an assistant message's tool call arguments, over MAX_TEXT_CHARS) or
    whose metadata holds a float that is not finite, as a session's metadata may not,
    unless ``held`` (the history) holds it unchanged: what a session holds, stored
    before these limits, can always be written back."""
    by_id: dict[str, Message] | None = None
    for index, message in enumerate(messages):
        refusal = _refusal(session_id, what, index, message)
        if refusal is None:
            continue
        if by_id is None:
            by_id = {m.id: m for m in held}
        kept = by_id.get(message.id)
        if kept is None or _encoded(session_id, kept) != _encoded(session_id, message):
            raise ValueError(refusal)


class KnownIds:
    """The ids of a session's history, kept up to date cheaply: the fold only appends to
    its list of messages, or replaces the list whole (an edit), so what was appended
    since the last look is added, and a new list is indexed afresh."""

    __slots__ = ("_count", "_ids", "_of")

    def __init__(self) -> None:
        self._of: list[Message] | None = None
        self._count = 0
        self._ids: set[str] = set()

    def of(self, messages: list[Message]) -> set[str]:
        """The ids of ``messages`` (the session's list)."""
        if messages is not self._of or len(messages) < self._count:
            self._of, self._count, self._ids = messages, 0, set()
        ids = self._ids
        for i in range(self._count, len(messages)):
            ids.add(messages[i].id)
        self._count = len(messages)
        return ids


def check_new_ids(session_id: str, known: set[str], messages: Sequence[Message], what: str) -> None:
    """:class:`InvalidHistoryError` if a message of ``messages`` has an id in ``known``
    (the ids of the history)."""
    for message in messages:
        if message.id in known:
            raise _invalid(
                session_id,
                what,
                f"the session already has a message with id {shown(message.id)}",
            )


def check_entry(session_id: str, events: Sequence[Event], what: str) -> bytes:
    """Encode ``events`` as the journal entry they will be; ``TypeError`` /
    ``ValueError`` naming the session (and the message at fault) if the codec refuses."""
    try:
        return dump_events(events)
    except (TypeError, ValueError) as exc:
        for index, event in enumerate(events):  # which message? (only on a refusal)
            if isinstance(event, MessageAdded):
                try:
                    dump_event(event)
                except (TypeError, ValueError) as one:
                    # a message too long for an entry is told the limit a message has
                    refusal = _too_long(session_id, what, index, event.message)
                    raise type(one)(
                        refusal
                        or f"{what} for session {session_id!r}: messages[{index}] cannot be "
                        f"stored ({one})"
                    ) from None
        raise type(exc)(
            f"{what} for session {session_id!r}: the messages cannot be stored together "
            f"({exc}); give them in smaller batches"
        ) from None


def _refusal(session_id: str, what: str, index: int, message: Message) -> str | None:
    """Why ``message`` is refused as new content (see :func:`check_content`), or None."""
    refusal = _too_long(session_id, what, index, message)
    if refusal is None:
        problem = non_finite(message.metadata)  # (refused as a session's metadata is)
        if problem is not None:
            refusal = (
                f"{what} for session {session_id!r}: messages[{index}] cannot be stored ({problem})"
            )
    return refusal


def _too_long(session_id: str, what: str, index: int, message: Message) -> str | None:
    """Why ``message`` holds more text than a turn's message may, or None: its content,
    with an assistant message's tool call arguments, over MAX_TEXT_CHARS (a user's
    message, a model's answer and a tool result are bounded so)."""
    size = len(message.content) if isinstance(message.content, str) else 0
    calls = message.tool_calls if isinstance(message.tool_calls, tuple | list) else ()
    for call in calls:
        if isinstance(call, ToolCall) and isinstance(call.arguments, str):
            size += len(call.arguments)
    if size <= MAX_TEXT_CHARS:
        return None
    held = "its content and tool call arguments hold" if calls else "its content holds"
    return (
        f"{what} for session {session_id!r}: messages[{index}] is too long: {held} "
        f"{size:,} characters, over the limit of {MAX_TEXT_CHARS:,} that every message "
        "has; add large documents in parts or by reference"
    )


def _encoded(session_id: str, message: Message) -> bytes:
    """``message`` as its journal entry holds it (equal for equal messages, NaN included)."""
    return dump_event(_added(session_id, message))


def _added(session_id: str, message: Message) -> MessageAdded:
    return MessageAdded(session_id=session_id, seq=0, message=message)


def _invalid(session_id: str, what: str, problem: str) -> InvalidHistoryError:
    return InvalidHistoryError(
        f"{what} for session {session_id!r} refused, nothing was written: {problem}",
        session_id=session_id,
    )
