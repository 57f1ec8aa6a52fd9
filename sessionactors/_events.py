"""Events: what a session's subscribers see, each numbered by ``seq``.

``seq`` rises by one per event per session and keeps rising across
hibernation and restarts. The message-level events (``MessageAdded``, the
turn outcomes, history edits, reviews, status changes to a final status) are
also the session's journal: folding them over a snapshot rebuilds its state.
"""

from collections.abc import Mapping
from typing import Any

import attrs

from ._records import Message, ReviewRequest, Status, ToolCall

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
]


@attrs.frozen(kw_only=True)
class Event:
    """Base class of every event."""

    session_id: str
    seq: int


@attrs.frozen(kw_only=True)
class TurnStarted(Event):
    """A turn left the mailbox and began; ``text`` is the user's input."""

    turn_id: str
    text: str = ""
    idempotency_key: str | None = None


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
    """The turn ended with a reply; ``message`` is the final assistant message."""

    turn_id: str
    message: Message
    idempotency_key: str | None = None


@attrs.frozen(kw_only=True)
class TurnFailed(Event):
    """The agent or its model raised; ``error`` describes it."""

    turn_id: str
    error: str


@attrs.frozen(kw_only=True)
class TurnCancelled(Event):
    """The turn was cancelled; what it streamed was kept as an interrupted message."""

    turn_id: str


@attrs.frozen(kw_only=True)
class StatusChanged(Event):
    """The session's status changed."""

    status: Status


@attrs.frozen(kw_only=True)
class ToolCallStarted(Event):
    """A tool began to run."""

    turn_id: str
    tool_call: ToolCall


@attrs.frozen(kw_only=True)
class ToolResult(Event):
    """A tool finished; its result message is added right after."""

    turn_id: str
    tool_call_id: str
    content: str
    is_error: bool = False


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
    """Messages were removed (truncate, rewind, compaction) and/or the summary set.

    ``summary`` is ``None`` when the summary did not change.
    """

    reason: str
    removed: tuple[str, ...] = ()
    summary: str | None = None


@attrs.frozen(kw_only=True)
class MetadataChanged(Event):
    """The session's metadata was replaced."""

    metadata: Mapping[str, Any] = attrs.field(factory=dict)
