"""The JSON forms of events and records: one documented form for each, used by the
HTTP gateway and the command line alike.

Pure (no trio, no I/O).
"""

import base64
import datetime
import enum
import json
import math
from collections.abc import Mapping
from typing import Any, Final

import cattrs

from ._events import Event, ToolResult, TurnStarted
from ._records import CompletedTurn, OpenTurn, SessionState, TurnStatus
from ._turns import turn_id_time

__all__ = [
    "dumps",
    "event_to_json",
    "finite",
    "json_text",
    "metadata_json",
    "state_to_json",
    "to_json",
]


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter()
    converter.register_unstructure_hook(datetime.datetime, lambda d: d.isoformat())
    converter.register_unstructure_hook(bytes, lambda b: base64.b64encode(b).decode("ascii"))
    converter.register_unstructure_hook(enum.Enum, lambda e: e.value)
    converter.register_unstructure_hook(CompletedTurn, _completed_json)
    return converter


def _completed_json(turn: CompletedTurn) -> dict[str, Any]:
    """A completed idempotency key: ``{"key", "turn_id", "reply"}``, and ``"reply_id"``
    once an edit removed the reply (``"reply": null``)."""
    reply = turn.reply
    out = {"key": turn.key, "turn_id": turn.turn_id, "reply": None}
    if reply is None:
        out["reply_id"] = turn.reply_id
    else:
        out["reply"] = _CONVERTER.unstructure(reply, unstructure_as=type(reply))
    return out


_CONVERTER: Final = _converter()


def event_to_json(event: Event) -> dict[str, Any]:
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
    if isinstance(event, TurnStarted | ToolResult):
        # the message that joined the history with the event (null in 0.1 journals)
        message = event.message
        fields["message"] = to_json(message) if message is not None else None
    return {"type": type(event).__name__, **fields}


def to_json(record: Any) -> Any:
    """A record (``Message``, ``ReviewRequest``, ``SessionInfo`` ...) as JSON-ready data."""
    return _CONVERTER.unstructure(record, unstructure_as=type(record))


def state_to_json(state: SessionState) -> dict[str, Any]:
    """What ``GET /sessions/{name}`` answers: the state a client shows, and the turn
    under way (see :func:`_open_turn_json`)."""
    return {
        "session_id": state.session_id,
        "agent": state.agent,
        "status": state.status.value,
        "metadata": metadata_json(state.metadata),
        "event_seq": state.event_seq,
        "created_at": state.created_at.isoformat(),
        "updated_at": state.updated_at.isoformat(),
        "summary": state.summary,
        "messages": [to_json(m) for m in state.messages],
        "pending_reviews": [to_json(r) for r in state.reviews],
        "usage": to_json(state.usage),
        "open_turn": _open_turn_json(state),
    }


def _open_turn_json(state: SessionState) -> dict[str, Any] | None:
    """The turn under way in ``state`` (null when none): its ``turn_id``; its
    ``status``, ``"waiting"`` while it waits on a review and ``"running"`` otherwise (as
    ``ref.turn_outcome`` tells it); ``started_at``, when it began; and the fields of its
    ``OpenTurn``: the user's ``message_id`` it answers, its ``idempotency_key`` and the
    ``started_calls`` of tools that must not run twice.

    A turn begins as its user message joins the history, stamped then. A turn of
    ``ref.retry()`` answers the user message of the turn it runs again (whose outcome
    names that message): it began when it was issued, as its id says. ``started_at`` is
    null if the state does not tell (written before 0.3)."""
    turn: OpenTurn | None = state.open_turn
    if turn is None:
        return None
    started: datetime.datetime | None = None
    asked = turn.message_id
    if asked and any(record.message_id == asked for record in state.turns):
        issued = turn_id_time(turn.turn_id)
        if issued is not None:
            started = _EPOCH + datetime.timedelta(microseconds=issued)
    elif asked:
        started = next((m.created_at for m in reversed(state.messages) if m.id == asked), None)
    waiting = TurnStatus.WAITING if state.reviews else TurnStatus.RUNNING
    return {
        "turn_id": turn.turn_id,
        "status": waiting.value,
        "started_at": started.isoformat() if started is not None else None,
        "message_id": asked,
        "idempotency_key": turn.idempotency_key,
        "started_calls": list(turn.started_calls),
    }


_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON (never a raw newline: SSE ``data:`` lines stay one line).

    Always valid JSON: a float that is not finite (in metadata stored before such
    values were refused) is written as ``null``, not as ``NaN``, which no JSON
    reader takes.
    """
    return json_text(data, separators=(",", ":")).encode()


def json_text(
    data: Any, *, indent: int | None = None, separators: tuple[str, str] | None = None
) -> str:
    """JSON text of ``data`` (non-ASCII kept), by the rule of :func:`dumps`: a float that
    is not finite is written as ``null``. The command line prints with it."""
    try:
        return json.dumps(
            data, ensure_ascii=False, indent=indent, separators=separators, allow_nan=False
        )
    except ValueError:
        return json.dumps(finite(data), ensure_ascii=False, indent=indent, separators=separators)


def finite(data: Any) -> Any:
    """``data`` with every float that is not finite replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite(value) for value in data]
    return data


def metadata_json(metadata: Mapping[str, Any]) -> Any:
    """Metadata as JSON-ready data (bytes as base64 strings)."""
    return _CONVERTER.unstructure(dict(metadata))
