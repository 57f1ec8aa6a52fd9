"""The JSON forms of events, records and errors, and the status code of each error."""

from typing import Any, Final

import sessionactors as sa

from .._json import dumps as dumps
from .._json import event_to_json as event_to_json
from .._json import metadata_json as metadata_json
from .._json import state_to_json as state_to_json
from .._json import to_json as to_json

__all__ = [
    "dumps",
    "error_json",
    "error_status",
    "event_to_json",
    "metadata_json",
    "reply_to_json",
    "state_to_json",
    "to_json",
]


def reply_to_json(reply: sa.Reply) -> dict[str, Any]:
    """A turn's reply: its turn id, text, final message (or null) and pending reviews."""
    return {
        "turn_id": reply.turn_id,
        "text": reply.text,
        "message": to_json(reply.message) if reply.message is not None else None,
        "reviews": [to_json(r) for r in reply.reviews],
    }


# The status of each library error; the first class that matches wins.
_STATUSES: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (sa.SessionNotFoundError, 404),
    (sa.ReviewResolvedError, 409),
    (sa.ReviewNotFoundError, 404),
    (sa.MessageNotFoundError, 404),
    (sa.EventsExpiredError, 410),
    (sa.ReplyRemovedError, 410),
    (sa.SessionExistsError, 409),
    (sa.SessionBusyError, 409),
    (sa.TurnCancelledError, 409),
    (sa.SessionStoppedError, 409),
    (sa.InvalidSessionNameError, 422),
    (sa.IdempotencyKeyReusedError, 422),
    (sa.MailboxFullError, 429),
    (sa.FencedOutError, 503),
    (sa.StoreError, 503),
    (sa.SessionActorsError, 500),
    (ValueError, 422),
    (TypeError, 422),
)


def error_status(error: BaseException) -> int:
    """The HTTP status for ``error`` (500 for anything unexpected)."""
    for cls, status in _STATUSES:
        if isinstance(error, cls):
            return status
    return 500


def error_json(error: BaseException, *, status: int | None = None) -> dict[str, Any]:
    """``{"error": class name, "message": ..., "status": ...}`` and the fields the
    error carries (``session_id``, ``oldest_seq``, ``last_seq``, ``turn_id``,
    ``idempotency_key``)."""
    body: dict[str, Any] = {
        "error": type(error).__name__,
        "message": str(error),
        "status": status if status is not None else error_status(error),
    }
    if isinstance(error, sa.SessionActorsError) and error.session_id is not None:
        body["session_id"] = error.session_id
    for name in ("oldest_seq", "last_seq", "turn_id", "idempotency_key"):
        value = getattr(error, name, None)
        if value is not None and value != "":
            body[name] = value
    return body


def plain_error(name: str, message: str, status: int, **extra: Any) -> dict[str, Any]:
    """An error of the gateway itself (``Unauthorized``, ``InvalidRequest`` ...)."""
    body: dict[str, Any] = {"error": name, "message": message, "status": status}
    body.update(extra)
    return body
