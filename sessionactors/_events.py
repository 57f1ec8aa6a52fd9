"""Events: what a session's subscribers see, each numbered by ``seq``.

``seq`` rises by one per event per session and keeps rising across
hibernation and restarts. The message-level events (``MessageAdded``, the
turn outcomes, history edits, reviews, status changes to a final status) are
also the session's journal: folding them over a snapshot rebuilds its state.
"""

import datetime
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._records import (
    Message,
    ReviewRequest,
    Role,
    Status,
    ToolCall,
    Usage,
    make_message,
    maker,
)

__all__ = [
    "Delta",
    "Event",
    "HistoryEdited",
    "MessageAdded",
    "MetadataChanged",
    "ReviewRequested",
    "ReviewResolved",
    "StatusChanged",
    "ToolCallStarted",
    "ToolResult",
    "TurnCancelled",
    "TurnFailed",
    "TurnFinished",
    "TurnStarted",
    "erases",
    "make_delta",
    "make_message_added",
    "make_tool_call_started",
    "make_tool_result",
    "make_turn_finished",
    "make_turn_started",
]


@attrs.frozen(kw_only=True)
class Event:
    """Base class of every event."""

    session_id: str
    seq: int


#: ``created_at`` of events that carry no message (journals written by 0.1).
NO_TIME: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


@attrs.frozen(kw_only=True)
class TurnStarted(Event):
    """A turn left the mailbox and began; ``text`` is the user's input.

    The user's message (``message``: id ``message_id``, stamped ``created_at``)
    joins the history with this event. (Journals written by 0.1 carried it in a
    ``MessageAdded`` that followed, and left ``message_id`` empty.)

    ``retry_of``: this turn runs turn ``retry_of`` again (``ref.retry()``); its
    user message is that turn's, already in the history, so nothing joins it.
    """

    turn_id: str
    text: str = ""
    idempotency_key: str | None = None
    message_id: str = ""
    created_at: datetime.datetime = NO_TIME
    retry_of: str | None = None

    @property
    def message(self) -> Message | None:
        """The user's message this turn added to the history (None in 0.1 journals)."""
        if not self.message_id:
            return None
        return make_message(
            id=self.message_id, role=Role.USER, content=self.text, created_at=self.created_at
        )


@attrs.frozen(kw_only=True)
class Delta(Event):
    """A piece of the assistant's reply, as the model streamed it."""

    turn_id: str
    text: str


@attrs.frozen(kw_only=True)
class MessageAdded(Event):
    """A message joined the history."""

    turn_id: str | None = None
    message: Message


@attrs.frozen(kw_only=True)
class TurnFinished(Event):
    """The turn ended with a reply; ``message`` is the final assistant message.

    The message joins the history with this event (0.1 journals carried it in a
    ``MessageAdded`` just before).
    """

    turn_id: str
    message: Message
    idempotency_key: str | None = None


@attrs.frozen(kw_only=True)
class TurnFailed(Event):
    """The agent or its model raised; ``error`` describes it.

    The text that the failing model step streamed (its ``Delta`` events) is kept in the
    history, as a cancelled turn's is: an assistant message marked ``interrupted``,
    published as a ``MessageAdded`` just before this event (without the tool calls
    that step began: a half call cannot run). A step that streamed no text leaves
    the message "(no reply: this turn failed)" instead, so that the next user
    message never follows a user message. Steps that ended before it (a message
    that called tools, their results) stay as they were.

    A turn the session refused before it began (a review pending, its agent
    missing) ends with one too, published and never journaled: it left nothing
    in the history, and its caller got the same error. So does a turn still in the
    mailbox when its registry closes (``error_kind`` ``"SessionStoppedError"``, its
    public ``error`` saying that it never began and to send the message again; not
    one of a session still waking then, which had published nothing) or its
    session stops (the stop's error).

    A turn that its registry's close cut off while it ran (the ``shutdown_grace`` ran
    out, the registry was cancelled or interrupted: its worker stopped; a turn that a
    ``ref.stop()`` waited for too) ends with one too, not with a ``TurnCancelled``
    (which says that someone cancelled it: see there):
    ``error_kind`` is ``"SessionStoppedError"``, ``error`` (public) says that the worker
    running it stopped and to send the message again, and the turn is kept as any failed
    turn is. Its caller gets ``SessionStoppedError`` with its ``turn_id``.

    ``lost``: the session itself crashed during the turn and restarted from its
    durable state, which holds nothing of this turn: every event the turn
    published (its user message included) no longer holds. Such an outcome is
    published, never journaled.

    ``error_kind`` is the class name of the exception that failed the turn
    (``"ConnectionError"``, ``"ModelError"``; of a lost turn, the crash's cause).
    ``error_public`` says whether ``error`` is the library's own words, which a
    frontend may show the people it serves: an error of sessionactors (a
    ``MaxStepsError``, a refused turn's), decided by the exception's class, never by
    its name; or a ``ModelError`` its adapter raised with ``public=True``. It is False
    for any other exception (the app's, its model provider's, its store's), whose
    words may name files, hosts, keys or what the provider answered: they are for the
    server's log, and the HTTP gateway tells its clients ``error_kind`` instead.
    Journals written before these fields load with ``""`` and False.
    """

    turn_id: str
    error: str
    lost: bool = False
    error_kind: str = ""
    error_public: bool = False


@attrs.frozen(kw_only=True)
class TurnCancelled(Event):
    """The turn was cancelled: by ``ref.cancel()``, or, as it waited on a review, by
    the stop of its session (``ref.stop()``: a stopped session takes no review); what
    it streamed was kept as an interrupted message.

    A turn that its registry's close cut off (the shutdown grace ran out, a
    ``ref.stop()`` waiting for it or not) was not cancelled by anyone: it ends with a
    ``TurnFailed`` of kind ``SessionStoppedError``. What reached the turn first
    decides: a turn that ``ref.cancel()`` reached is cancelled even if the grace runs
    out while it lets go, and one that the grace cut stays failed.
    """

    turn_id: str


@attrs.frozen(kw_only=True)
class StatusChanged(Event):
    """The session's status changed.

    ``skipped_from``: on the status a session records as it wakes, when its seq jumped
    (every wake from the store does, see "the seq jump" in the explanation), the first
    seq it skipped: the seqs from there up to this event's are in no event of the
    session's history (a lost turn's, another history's). 0 otherwise (and in
    older journals).
    """

    status: Status
    skipped_from: int = 0


@attrs.frozen(kw_only=True)
class ToolCallStarted(Event):
    """A tool began to run."""

    turn_id: str
    tool_call: ToolCall


@attrs.frozen(kw_only=True)
class ToolResult(Event):
    """A tool finished; its result (``message``, a ``Role.TOOL`` message with id
    ``message_id``) joins the history with this event. (0.1 published it only and
    journaled a ``MessageAdded`` with the message after it, leaving ``message_id``
    empty.)"""

    turn_id: str
    tool_call_id: str
    content: str
    is_error: bool = False
    message_id: str = ""
    created_at: datetime.datetime = NO_TIME

    @property
    def message(self) -> Message | None:
        """The tool message this result added to the history (None before 0.2)."""
        if not self.message_id:
            return None
        return make_message(
            id=self.message_id,
            role=Role.TOOL,
            content=self.content,
            created_at=self.created_at,
            tool_call_id=self.tool_call_id,
            is_error=self.is_error,
        )


@attrs.frozen(kw_only=True)
class ReviewRequested(Event):
    """A tool call waits for a person's approval."""

    turn_id: str
    review: ReviewRequest


@attrs.frozen(kw_only=True)
class ReviewResolved(Event):
    """A review was approved or denied."""

    turn_id: str
    review_id: str
    approved: bool
    note: str | None = None


@attrs.frozen(kw_only=True)
class HistoryEdited(Event):
    """Messages were removed and/or the summary set; ``reason`` says by what:
    ``"truncate"``, ``"rewind"``, ``"set_summary"``, ``"compaction"``, ``"retry"``, or
    ``"replace_history"`` (every message goes; a ``MessageAdded`` per new one follows).

    ``summary`` is ``None`` when the summary did not change. ``usage``: for a
    compaction, the tokens its summarizer reported (added to the session's usage).
    """

    reason: str
    removed: tuple[str, ...] = ()
    summary: str | None = None
    usage: Usage | None = None


@attrs.frozen(kw_only=True)
class MetadataChanged(Event):
    """The session's metadata was replaced: ``metadata`` is the whole new metadata.

    ``replaced``: the keys whose value the change replaced by another or removed; such
    a change is a checkpoint (see ``SessionRef.set_metadata``): no event before it is
    replayed. Empty when it took no value out (it only added keys), and in older
    journals.
    """

    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    replaced: tuple[str, ...] = ()


def erases(event: Event) -> bool:
    """Whether ``event`` takes text out of what the session keeps: a ``HistoryEdited``
    that removes messages or sets the summary (replacing the one before), or a
    ``MetadataChanged`` that replaced or removed a key's value. Such an edit is a
    checkpoint: the session's snapshot is written with it, and no event before it is
    kept for replay any more (the journal, the hub's ring, other workers' copies)."""
    if event.__class__ is HistoryEdited:
        return bool(event.removed) or event.summary is not None
    return event.__class__ is MetadataChanged and bool(event.replaced)


#: Fast constructors of the events a turn makes (see ``_records.maker``).
make_turn_started: Final = maker(TurnStarted)
make_delta: Final = maker(Delta)
make_message_added: Final = maker(MessageAdded)
make_turn_finished: Final = maker(TurnFinished)
make_tool_call_started: Final = maker(ToolCallStarted)
make_tool_result: Final = maker(ToolResult)
