"""The JSON forms of events, records and errors, and the status code of each error."""

import re
from typing import Any, Final

import sessionactors as sa

from .._actor import LOST_PREFIX
from .._errors import Private, stopped_for_good
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
    "metadata_json",
    "outcome_to_json",
    "private_told",
    "reply_to_json",
    "state_to_json",
    "to_json",
    "unmarked_told",
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

    A ``TurnFailed`` whose ``error`` is not public (``error_public`` is false: the
    turn raised an exception that is not the library's own, or a ``ModelError`` its
    adapter did not mark public) tells its kind, not its message, in ``"error"``
    (``"the turn failed with RuntimeError; the server's log has the details"``): what
    an app's or a model's exception says (file paths, keys, database URLs, a model
    provider's address and answer) is for the server's log, where the
    ``sessionactors`` logger writes it once, when the turn fails.
    ``TurnFailed.error`` keeps the whole text for Python subscribers."""
    data = _event_json(event)
    if isinstance(event, sa.TurnFailed) and not event.error_public:
        data["error"] = failure_told(event)
    return data


def failure_told(event: sa.TurnFailed) -> str:
    """The ``error`` of a ``TurnFailed`` that is not public, as HTTP clients are told
    it: by its kind (see ``event_to_json``)."""
    kind = event.error_kind or "an exception"  # (a journal written before the kind)
    if event.lost:
        return f"{LOST_PREFIX}{kind}; {LOGGED})"
    return f"the turn failed with {kind}; {LOGGED}"


def private_told(part: Private) -> str:
    """The server's own account of a failure in an error's message (an exception's
    words), as HTTP clients are told it: by its kind."""
    return f"{part.kind}; {LOGGED}"


def unmarked_told(error: sa.TurnFailedError | sa.SessionCrashedError) -> str:
    """A failure that does not mark the server's own account in its message (see
    ``unmarked``), as HTTP clients are told it: by its kind, its session and its turn,
    never its text (which may quote its cause whole)."""
    turn = error.turn_id
    about = f"session {error.session_id!r}"
    about = f"turn {turn} of {about}" if turn else about
    return f"{about} failed with {type(error).__name__}; {LOGGED}"


def reply_to_json(reply: sa.Reply) -> dict[str, Any]:
    """A turn's reply: its turn id, text, final message (or null) and pending reviews."""
    return {
        "turn_id": reply.turn_id,
        "text": reply.text,
        "message": to_json(reply.message) if reply.message is not None else None,
        "reviews": [to_json(r) for r in reply.reviews],
    }


#: The kind at the start of a failed turn's error, as ``describe`` writes it ("Kind: ...",
#: or the kind alone for an exception with no message). (An outcome keeps no kind of its
#: own: its error is the text its turn record stores.)
_KIND: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)(?:: |$)")

#: What a failed turn's kind says to HTTP clients, where the kind has advice of its own: a
#: turn fails with SessionStoppedError when its registry's close cut it off.
_ADVICE: Final = {"SessionStoppedError": "the worker running it stopped; send the message again"}


def outcome_to_json(outcome: sa.TurnOutcome) -> dict[str, Any]:
    """What became of a turn (``GET /sessions/{name}/turns/{turn_id}``): its session, turn
    id, ``"status"`` (a ``TurnStatus`` value), ``"message"`` (the reply of a finished turn,
    or null) and ``"error"`` (why a failed turn failed, or null).

    A failed turn's error is told by its kind (``"the turn failed with RuntimeError;
    the server's log has the details"``), whatever it was: an outcome does not keep
    whether its error's words are public, and an app's or a model's exception may name
    files, keys or a provider's answer. Its ``TurnFailed`` event, which the events
    routes replay, tells a public error whole. A turn that its registry's close cut off
    (its worker stopped while the turn ran) is told by its kind's own advice: ``"the
    turn failed with SessionStoppedError: the worker running it stopped; send the
    message again"``, whatever words the worker that cut it stored."""
    error = outcome.error
    if error is not None:
        match = _KIND.match(error)
        kind = match[1] if match else "an error"
        advice = _ADVICE.get(kind)
        error = (
            f"the turn failed with {kind}: {advice}"
            if advice is not None
            else f"the turn failed with {kind}; {LOGGED}"
        )
    return {
        "session_id": outcome.session_id,
        "turn_id": outcome.turn_id,
        "status": outcome.status.value,
        "message": to_json(outcome.message) if outcome.message is not None else None,
        "error": error,
    }


# The status of each library error; the first class that matches wins (a
# SessionStoppedError answers 503 but for a session that is stopped: see
# ``error_status``). The status also sets how the gateway logs a request's error
# (``SessionsApp._error_json``): a 4xx is the client's, told to it and not logged; a
# library error answered 503 (a store's failure or a worker that gave no word at WARNING,
# a turn cut off by the shutdown or a session fenced out at INFO) in one line; a 500 at
# ERROR with its traceback.
_STATUSES: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (sa.SessionNotFoundError, 404),
    (sa.ReviewResolvedError, 409),
    (sa.ReviewNotFoundError, 404),
    (sa.MessageNotFoundError, 404),
    (sa.TurnNotFoundError, 404),
    (sa.EventsExpiredError, 410),
    (sa.ReplyRemovedError, 410),
    (sa.SessionExistsError, 409),
    (sa.SessionBusyError, 409),
    (sa.TurnCancelledError, 409),
    (sa.SessionStoppedError, 409),
    # (only ever in an event stream's or a WebSocket's error frame, the stream begun: the
    # client resumes after its last seq; nothing failed on the server)
    (sa.SubscriberLaggedError, 409),
    (sa.InvalidSessionNameError, 422),
    (sa.IdempotencyKeyReusedError, 422),
    (sa.MailboxFullError, 429),
    (sa.FencedOutError, 503),
    (sa.StoreError, 503),
    (sa.WorkerUnreachableError, 503),
    (sa.SessionActorsError, 500),
    (ValueError, 422),
    (TypeError, 422),
)


def failed_told(error: BaseException) -> str:
    """What a client is told of a failure that is not the library's (a bug): its kind."""
    return f"the server failed with {type(error).__name__}; {LOGGED}"


def error_status(error: BaseException) -> int:
    """The HTTP status for ``error`` (500 for anything unexpected).

    A ``SessionStoppedError`` tells of one of two things: a session that is stopped
    (``ref.stop()``: it takes no more requests, ever; its advice is to go on in a session
    of another name), 409; or a worker, or its registry, that stopped under the request
    (a turn its shutdown cut off, a request it did not run, a session changing hands),
    503, whichever worker's gateway answers: sent again, the request reaches the
    session's next worker, and a client's or a proxy's retries on 503 apply to it."""
    if isinstance(error, sa.SessionStoppedError) and not stopped_for_good(error):
        return 503
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
