"""The typed messages a caller's request becomes, and the records that answer them.

A closed set of values: the dispatcher routes them (here, or to the worker that
runs the session), the actor serves them in mailbox order, and a worker that
forwards them encodes exactly these. No ``kind`` strings, no argument dicts,
no bare tuples. Pure values: no trio here.
"""

from collections.abc import Mapping
from typing import Any

import attrs

from ._records import Message, ReviewRequest

__all__ = [
    "AddMessages",
    "Call",
    "Cancel",
    "Delete",
    "Edit",
    "Hibernate",
    "ReadState",
    "ReplaceHistory",
    "Reply",
    "Request",
    "ResolveReview",
    "Retry",
    "Rewind",
    "SetMetadata",
    "SetSummary",
    "Stop",
    "SubmitTurn",
    "Truncate",
]


@attrs.frozen(kw_only=True)
class Reply:
    """The answer to one turn.

    ``message`` is the final assistant message (``None`` while the turn waits
    on ``reviews``, the reviews it is waiting on).
    """

    turn_id: str
    message: Message | None
    reviews: tuple[ReviewRequest, ...] = ()

    @property
    def text(self) -> str:
        """The reply's text ("" while waiting on a review)."""
        return self.message.content if self.message is not None else ""


# ---- requests served in mailbox order ---------------------------------------------------


@attrs.frozen(kw_only=True)
class SubmitTurn:
    """Run one turn with the user's ``text``."""

    text: str
    idempotency_key: str | None = None


@attrs.frozen(kw_only=True)
class Truncate:
    """Drop all but the last ``keep_last`` messages; answered with how many went."""

    keep_last: int


@attrs.frozen(kw_only=True)
class Rewind:
    """Drop every message after ``message_id``; answered with how many went."""

    message_id: str


@attrs.frozen(kw_only=True)
class SetSummary:
    """Set the summary the model sees after the system prompt; answered with 0."""

    text: str


Edit = Truncate | Rewind | SetSummary


@attrs.frozen(kw_only=True)
class SetMetadata:
    """Merge ``changes`` into the metadata (a key set to None goes); answered with
    the metadata as it now is."""

    changes: Mapping[str, Any]


@attrs.frozen(kw_only=True)
class AddMessages:
    """Append ``messages`` (checked) to the history without a turn; answered with None."""

    messages: tuple[Message, ...]


@attrs.frozen(kw_only=True)
class ReplaceHistory:
    """Replace the whole history with ``messages`` (checked); answered with None."""

    messages: tuple[Message, ...]


@attrs.frozen(kw_only=True)
class ResolveReview:
    """Approve or deny a pending review; answered with the turn's :class:`Reply`."""

    review_id: str
    approve: bool
    note: str | None = None


@attrs.frozen(kw_only=True)
class Hibernate:
    """Snapshot and leave once idle; answered with whether the session left."""


@attrs.frozen(kw_only=True)
class Retry:
    """Run the last turn again if it failed or was cancelled; answered with its :class:`Reply`."""


#: What the actor serves in mailbox order, behind the turns queued before it.
Call = Edit | SetMetadata | AddMessages | ReplaceHistory | ResolveReview | Hibernate | Retry

# ---- requests served out of band ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReadState:
    """The session's state now, not waiting behind queued turns."""


@attrs.frozen(kw_only=True)
class Cancel:
    """Cancel the turn in flight (only if it is turn ``turn_id``, when given); answered
    with whether it was cancelled."""

    turn_id: str | None = None


@attrs.frozen(kw_only=True)
class Stop:
    """Finish the session after the turn in flight."""


@attrs.frozen(kw_only=True)
class Delete:
    """Remove the session everywhere."""


Request = SubmitTurn | Call | ReadState | Cancel | Stop | Delete
