"""The JSON forms of events, records and errors, and the status code of each error."""

from typing import Any, Final

import sessionactors as sa

from .._actor import FAILED_KEPT, FAILED_TAIL, LOST_PREFIX
from .._errors import SessionActorsError
from .._json import dumps as dumps
from .._json import event_to_json as _event_json
from .._json import metadata_json as metadata_json
from .._json import state_to_json as state_to_json
from .._json import to_json as to_json

__all__ = [
    "dumps",
    "error_json",
    "error_status",
    "event_to_json",
    "failure_told",
    "foreign_kind",
    "metadata_json",
    "reply_to_json",
    "state_to_json",
    "to_json",
]


#: Where HTTP clients are sent for what the gateway does not tell them.
LOGGED: Final = "the server's log has the details"


def event_to_json(event: sa.Event) -> dict[str, Any]:
    """The one JSON form of an event: a dict ready for ``json.dumps``.

    ``"type"`` is the event's class name (``"Delta"``, ``"TurnFinished"``),
    followed by ``"session_id"``, ``"seq"`` and the event's own fields, each under
    its attribute name: records (a ``Message``, a ``ToolCall``, a
    ``ReviewRequest``) become objects of their fields, enums their values
    (``"assistant"``), datetimes ISO 8601 strings with their UTC offset, tuples
    arrays, and bytes in metadata base64 strings. ``TurnStarted`` and ``ToolResult``
    also carry ``"message"``: the user's or the tool's message that joined the
    history with them. The SSE ``id:`` of an event
    is its ``seq``; the HTTP routes and the WebSocket send exactly this form.

    A ``TurnFailed`` whose turn raised an exception that is not the library's own
    tells its kind, not its message, in ``"error"`` (``"the turn failed with
    RuntimeError; the server's log has the details"``): what an app's or a model's
    exception says (file paths, keys, database URLs) is for the server's log, where
    the ``sessionactors`` logger writes it once, when the turn fails.
    ``TurnFailed.error`` keeps the whole text for Python subscribers."""
    data = _event_json(event)
    if isinstance(event, sa.TurnFailed):
        data["error"] = failure_told(event.error)
    return data


def failure_told(reason: str) -> str:
    """A failed turn's reason (``TurnFailed.error``, ``"Kind: message"``) as HTTP
    clients are told it: whole if the library raised it (``MaxStepsError``,
    ``ModelError`` ...), else its kind only (see ``event_to_json``)."""
    if reason.startswith(LOST_PREFIX) and reason.endswith(")"):
        cause = reason[len(LOST_PREFIX) : -1]
        kind = foreign_kind(cause)
        return reason if kind is None else f"{LOST_PREFIX}{kind}; {LOGGED})"
    kind = foreign_kind(reason)
    return reason if kind is None else f"the turn failed with {kind}; {LOGGED}"


def turn_failure_told(error: sa.TurnFailedError, message: str) -> str:
    """The message of a ``TurnFailedError`` (``message``: as told so far) with its
    reason told as ``failure_told`` tells it."""
    head = f"turn {error.turn_id} of session {error.session_id!r} failed: "
    if not (message.startswith(head) and message.endswith(FAILED_TAIL)):
        return message  # (not a raising turn's: the library's own words)
    reason = message[len(head) : -len(FAILED_TAIL)]
    kept = FAILED_KEPT if reason.endswith(FAILED_KEPT) else ""
    reason = reason.removesuffix(FAILED_KEPT)
    return f"{head}{failure_told(reason)}{kept}{FAILED_TAIL}"


def foreign_kind(reason: str) -> str | None:
    """The kind of the exception ``reason`` describes (``"Kind: message"``, or
    ``"Kind"``), or None if it is the library's own: an error of sessionactors other
    than a store's (which names the server's files and hosts) or a crash's (which
    repeats its cause)."""
    kind = reason.partition(": ")[0]
    if not kind.isidentifier():
        return "an exception"
    return None if kind in _library_kinds() else kind


def _library_kinds() -> frozenset[str]:
    kinds: set[str] = set()
    todo: list[type[BaseException]] = [SessionActorsError]
    while todo:
        cls = todo.pop()
        if issubclass(cls, sa.StoreError | sa.SessionCrashedError):
            continue
        kinds.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(kinds)


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
