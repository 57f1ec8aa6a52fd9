"""The JSON forms of events, records and errors, and the status code of each error."""

import base64
import datetime
import enum
import json
from collections.abc import Mapping
from typing import Any, Final

import cattrs

import sessionactors as sa

__all__ = [
    "dumps",
    "error_json",
    "error_status",
    "event_to_json",
    "reply_to_json",
    "state_to_json",
    "to_json",
]


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter()
    converter.register_unstructure_hook(datetime.datetime, lambda d: d.isoformat())
    converter.register_unstructure_hook(bytes, lambda b: base64.b64encode(b).decode("ascii"))
    converter.register_unstructure_hook(enum.Enum, lambda e: e.value)
    return converter


_CONVERTER: Final = _converter()


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
    """
    fields = _CONVERTER.unstructure(event, unstructure_as=type(event))
    if isinstance(event, sa.TurnStarted | sa.ToolResult):
        # the message that joined the history with the event (null in 0.1 journals)
        message = event.message
        fields["message"] = to_json(message) if message is not None else None
    return {"type": type(event).__name__, **fields}


def to_json(record: Any) -> Any:
    """A record (``Message``, ``ReviewRequest``, ``SessionInfo`` ...) as JSON-ready data."""
    return _CONVERTER.unstructure(record, unstructure_as=type(record))


def reply_to_json(reply: sa.Reply) -> dict[str, Any]:
    """A turn's reply: its turn id, text, final message (or null) and pending reviews."""
    return {
        "turn_id": reply.turn_id,
        "text": reply.text,
        "message": to_json(reply.message) if reply.message is not None else None,
        "reviews": [to_json(r) for r in reply.reviews],
    }


def state_to_json(state: sa.SessionState) -> dict[str, Any]:
    """What ``GET /sessions/{name}`` answers: the state a client shows."""
    return {
        "session_id": state.session_id,
        "agent": state.agent,
        "status": state.status.value,
        "metadata": _CONVERTER.unstructure(dict(state.metadata)),
        "event_seq": state.event_seq,
        "created_at": state.created_at.isoformat(),
        "updated_at": state.updated_at.isoformat(),
        "summary": state.summary,
        "messages": [to_json(m) for m in state.messages],
        "pending_reviews": [to_json(r) for r in state.reviews],
    }


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON (never a raw newline: SSE ``data:`` lines stay one line)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


# The status of each library error; the first class that matches wins.
_STATUSES: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (sa.SessionNotFoundError, 404),
    (sa.ReviewNotFoundError, 404),
    (sa.MessageNotFoundError, 404),
    (sa.EventsExpiredError, 410),
    (sa.SessionExistsError, 409),
    (sa.SessionBusyError, 409),
    (sa.TurnCancelledError, 409),
    (sa.SessionStoppedError, 409),
    (sa.InvalidSessionNameError, 422),
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
    error carries (``session_id``, ``oldest_seq``, ``last_seq``)."""
    body: dict[str, Any] = {
        "error": type(error).__name__,
        "message": str(error),
        "status": status if status is not None else error_status(error),
    }
    if isinstance(error, sa.SessionActorsError) and error.session_id is not None:
        body["session_id"] = error.session_id
    for name in ("oldest_seq", "last_seq", "turn_id"):
        value = getattr(error, name, None)
        if value is not None and value != "":
            body[name] = value
    return body


def plain_error(name: str, message: str, status: int, **extra: Any) -> dict[str, Any]:
    """An error of the gateway itself (``Unauthorized``, ``InvalidRequest`` ...)."""
    body: dict[str, Any] = {"error": name, "message": message, "status": status}
    body.update(extra)
    return body


def metadata_json(metadata: Mapping[str, Any]) -> Any:
    """Metadata as JSON-ready data (bytes as base64 strings)."""
    return _CONVERTER.unstructure(dict(metadata))
