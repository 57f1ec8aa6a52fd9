"""The wire format between workers: messages, replies, calls and errors, and the stamp
on the payloads of a session's event stream.

Messages are msgpack maps; a request's reply, result or error travels in the
codec's encoding, and an error is raised again on the requester's side as the same
sessionactors error. Wire tags are never reused.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Final

import attrs
import msgpack

from .._codec import MAX_ARRAY_LEN, MAX_MAP_LEN, dump_event, dump_events, load_event, load_events
from .._errors import (
    Advice,
    AdviceKind,
    Part,
    Private,
    SessionActorsError,
    SessionCrashedError,
    advised,
    python_told,
)
from .._events import MessageAdded, ReviewRequested
from .._records import Message, ReviewRequest, TurnOutcome, TurnStatus, storable
from .._requests import (
    AddMessages,
    Call,
    Cancel,
    Delete,
    Hibernate,
    ReplaceHistory,
    Reply,
    ResolveReview,
    Retry,
    Rewind,
    SetMetadata,
    SetSummary,
    Stop,
    Truncate,
)
from .._session import MAX_ERROR_CHARS

#: What a stamped stream payload starts with (0xc1 starts no msgpack value), then
#: the creation time of the session that published it, in microseconds since the
#: epoch (8 bytes, big-endian, signed): a subscriber tells a session deleted and made again
#: under its name from the one it follows, also when the end marked at the delete
#: was gone from the stream before it looked (the new session's spawn resets it).
_STAMPED: Final = b"\xc1"
_STAMP_LEN: Final = 9
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICROSECOND: Final = datetime.timedelta(microseconds=1)
#: The requests a worker forwards, by their wire tag (never reuse a retired tag).
_CALL_TAGS: Final[dict[str, type[Any]]] = {
    "truncate": Truncate,
    "rewind": Rewind,
    "set_summary": SetSummary,
    "set_metadata": SetMetadata,
    "review": ResolveReview,
    "hibernate": Hibernate,
    "cancel": Cancel,
    "stop": Stop,
    "delete": Delete,
    "retry": Retry,
    "add_messages": AddMessages,
    "replace_history": ReplaceHistory,
}
_TAG_OF: Final = {cls: tag for tag, cls in _CALL_TAGS.items()}
# Errors that are plain builtins when the owner raises them.
_BUILTIN_ERRORS: Final[dict[str, type[Exception]]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "LookupError": LookupError,
    "KeyError": KeyError,
    # (and those a model or tool commonly raises: a failed turn's cause)
    "RuntimeError": RuntimeError,
    "TimeoutError": TimeoutError,
    "OSError": OSError,
    "ConnectionError": ConnectionError,
    "NotImplementedError": NotImplementedError,
    "IndexError": IndexError,
    "AttributeError": AttributeError,
}
_ERROR_ATTRS: Final = ("turn_id", "last_seq", "oldest_seq", "status_code", "idempotency_key")
#: The attributes that errors of some classes have, with a default (``ModelError.public``,
#: ``FencedOutError.lost_data``, ``SessionStoppedError._reason``: "stop" for a stopped
#: session, which a gateway answers 409), by the type of their value: carried too, and
#: set on an error of a class that has them.
_ERROR_FLAGS: Final[dict[str, type]] = {"public": bool, "lost_data": bool, "_reason": str}
#: The largest integer msgpack carries either way: a caller's seq or count above it
#: travels as this one (every seq and count a record holds is far below it).
MAX_WIRE_INT: Final = 2**63 - 1


def creation_stamp(created: datetime.datetime) -> int:
    """A session's creation time, as its stream's payloads carry it (microseconds since
    the epoch; before 1970, below 0)."""
    return (created - _EPOCH) // _MICROSECOND


def birth(created: datetime.datetime | None) -> bytes:
    """The stamp of a session's stream payloads (b"" for one not live here: unstamped)."""
    if created is None:
        return b""
    return _STAMPED + creation_stamp(created).to_bytes(8, "big", signed=True)


def unstamp(payload: bytes) -> tuple[int | None, bytes]:
    """``(creation time of the session that published it or None, the payload)``."""
    if payload[:1] == _STAMPED and len(payload) >= _STAMP_LEN:
        return int.from_bytes(payload[1:_STAMP_LEN], "big", signed=True), payload[_STAMP_LEN:]
    return None, payload


def split_stamp(payload: bytes) -> tuple[bytes, bytes]:
    """``(the stamp's 8 bytes or b"", the rest)``: a store keeps the stamp apart, so that
    workers of an earlier version, which know no stamp, read the rest as before."""
    if payload[:1] == _STAMPED and len(payload) >= _STAMP_LEN:
        return payload[1:_STAMP_LEN], payload[_STAMP_LEN:]
    return b"", payload


def join_stamp(stamp: bytes, rest: bytes) -> bytes:
    """The payload that :func:`split_stamp` split."""
    return _STAMPED + stamp + rest if stamp else rest


def stamp_of(answer: Mapping[str, Any]) -> int | None:
    """The creation time in a watch's answer (None from a worker that sends none)."""
    born = answer.get("born")
    return born if isinstance(born, int) else None


def pack(body: Mapping[str, Any]) -> bytes:
    # (datetimes: metadata may hold them, and set_metadata carries metadata)
    data: bytes = msgpack.packb(body, use_bin_type=True, datetime=True)
    return data


def unpack(data: bytes) -> dict[str, Any] | None:
    # (the codec's bounds: metadata, which set_metadata carries and answers with, may
    # hold as many keys and items as the store keeps)
    try:
        body = msgpack.unpackb(
            data, raw=False, timestamp=3, max_map_len=MAX_MAP_LEN, max_array_len=MAX_ARRAY_LEN
        )
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def dump_reply(name: str, reply: Reply) -> dict[str, Any]:
    turn_id, message, reviews = reply.turn_id, reply.message, reply.reviews
    return {
        "turn_id": turn_id,
        "message": (
            None
            if message is None
            else dump_event(MessageAdded(session_id=name, seq=0, turn_id=turn_id, message=message))
        ),
        "reviews": [
            dump_event(ReviewRequested(session_id=name, seq=0, turn_id=turn_id, review=r))
            for r in reviews
        ],
    }


def load_reply(name: str, body: Any) -> Reply:
    turn_id = str(body["turn_id"])
    message: Message | None = None
    if body["message"] is not None:
        event = load_event(bytes(body["message"]), session_id=name)
        assert isinstance(event, MessageAdded)
        message = event.message
    reviews: list[ReviewRequest] = []
    for data in body["reviews"]:
        event = load_event(bytes(data), session_id=name)
        assert isinstance(event, ReviewRequested)
        reviews.append(event.review)
    return Reply(turn_id=turn_id, message=message, reviews=tuple(reviews))


def dump_outcome(outcome: TurnOutcome) -> dict[str, Any]:
    message = outcome.message
    return {
        "status": outcome.status.value,
        "error": outcome.error,
        "reply": None
        if message is None
        else dump_reply(outcome.session_id, Reply(turn_id=outcome.turn_id, message=message)),
    }


def load_outcome(name: str, turn_id: str, body: Any) -> TurnOutcome:
    reply = body["reply"]
    error = body["error"]
    return TurnOutcome(
        session_id=name,
        turn_id=turn_id,
        status=TurnStatus(str(body["status"])),
        message=None if reply is None else load_reply(name, reply).message,
        error=None if error is None else str(error),
    )


def dump_call(name: str, request: Call | Cancel | Stop | Delete) -> dict[str, Any]:
    if isinstance(request, AddMessages | ReplaceHistory):  # records: the codec's bytes
        added = [MessageAdded(session_id=name, seq=0, message=m) for m in request.messages]
        return {"t": _TAG_OF[type(request)], "m": dump_events(added) if added else None}
    if isinstance(request, Truncate):  # (past 64 bits: all the same, every message kept)
        request = Truncate(keep_last=min(request.keep_last, MAX_WIRE_INT))
    fields = attrs.asdict(request)
    if isinstance(request, Cancel) and request.turn_id is None:
        # (a cancel of whatever turn is in flight, in the form a worker without turn ids
        # reads; one with a turn id is refused there, never taken for any turn)
        del fields["turn_id"]
    return {"t": _TAG_OF[type(request)], "f": fields}


def load_call(name: str, body: Any) -> Call | Cancel | Stop | Delete:
    cls = _CALL_TAGS[str(body["t"])]
    request: Call | Cancel | Stop | Delete
    if cls is AddMessages or cls is ReplaceHistory:
        data = body["m"]
        events = [] if data is None else load_events(bytes(data), session_id=name)
        messages = tuple(e.message for e in events if isinstance(e, MessageAdded))
        request = cls(messages=messages)
    else:
        request = cls(**dict(body["f"]))
    return request


def _error_classes() -> dict[str, type[SessionActorsError]]:
    found: dict[str, type[SessionActorsError]] = {}
    todo: list[type[SessionActorsError]] = [SessionActorsError]
    while todo:
        cls = todo.pop()
        if not cls.__name__.startswith("_"):  # (a private base is no error told)
            found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def dump_error(exc: BaseException) -> dict[str, Any]:
    body = _dump_one(exc)
    cause = exc.__cause__
    if isinstance(cause, Exception):  # (a failed turn's: the model's or a tool's error)
        body["cause"] = _dump_one(cause, MAX_ERROR_CHARS)
    return body


def _dump_one(exc: BaseException, limit: int | None = None) -> dict[str, Any]:
    extra: dict[str, object] = {}
    for name in _ERROR_ATTRS:
        value = getattr(exc, name, None)
        if isinstance(value, str | int) and not isinstance(value, bool):
            extra[name] = storable(value) if isinstance(value, str) else value
    for name, kind in _ERROR_FLAGS.items():
        value = getattr(exc, name, None)
        if type(value) is kind:
            extra[name] = storable(value) if isinstance(value, str) else value
    try:  # (an agent's exception may say anything: a str() that raises, lone surrogates)
        message = storable(str(exc))
    except Exception:
        message = "(its message could not be read)"
    if limit is not None and len(message) > limit:
        message = message[:limit] + "..."
    body = {"err": type(exc).__name__, "msg": message, "attrs": extra}
    session_id = getattr(exc, "session_id", None)
    if isinstance(session_id, str):
        body["sid"] = session_id
    if isinstance(exc, SessionActorsError) and exc._told and limit is None:
        body["told"] = [_dump_told(part) for part in exc._told]
    return body


def _dump_told(part: Part) -> Any:
    """A part of an error's message: its text, an advice record, or the server's own
    account of a failure (a frontend words them its own way: the gateway of the worker
    that answers the client)."""
    if isinstance(part, str):
        return storable(part)
    if isinstance(part, Private):
        return {"p": storable(part.kind), "x": storable(part.text)}
    return {"k": part.kind.value, "r": part.review_id, "t": part.turn_id, "s": part.seq}


def _load_told(body: Mapping[str, Any], session_id: str | None) -> tuple[Part, ...]:
    """The parts of a message ``_dump_told`` wrote; none unless they are well formed,
    of kinds known here (not a newer worker's), and tell the message itself as it
    reads (``msg``): else the message is told as it reads (a worker without accounts,
    ``Private``, sent its whole text as text)."""
    parts = body.get("told")
    if not isinstance(parts, list):
        return ()
    told: list[Part] = []
    for part in parts:
        if isinstance(part, str):
            told.append(part)
            continue
        if not isinstance(part, dict):
            return ()
        if "p" in part:
            kind, text = part["p"], part.get("x")
            if not (isinstance(kind, str) and isinstance(text, str)):
                return ()
            told.append(Private(kind=kind, text=text))
            continue
        review_id, turn_id, seq = part.get("r", ""), part.get("t", ""), part.get("s", 0)
        if not (
            isinstance(review_id, str)
            and isinstance(turn_id, str)
            and type(seq) is int
            and part.get("k") in _KINDS
        ):
            return ()
        told.append(
            Advice(kind=AdviceKind(part["k"]), review_id=review_id, turn_id=turn_id, seq=seq)
        )
    return tuple(told) if python_told(tuple(told), session_id) == body.get("msg") else ()


#: The advice kinds' values, as ``_dump_told`` writes them.
_KINDS: Final = frozenset(kind.value for kind in AdviceKind)


def load_error(body: Mapping[str, Any], name: str, owner: str) -> Exception:
    kind = str(body["err"])
    message = str(body.get("msg", ""))
    error = _rebuilt(body, name)
    if error is None:  # (the owner's own account: told by its kind)
        error = advised(
            SessionCrashedError,
            f"session {name!r}: its owner, worker {owner!r}, failed with ",
            Private(kind=kind, text=f"{kind}: {message}"),
            session_id=name,
        )
    cause = body.get("cause")
    if isinstance(cause, Mapping):
        # The original of a failed turn, as the owner's caller has it: a sessionactors
        # error (ModelError, with its status_code) or a builtin; another kind is named
        # in the error's own message.
        sid = cause.get("sid")
        error.__cause__ = _rebuilt(cause, sid if isinstance(sid, str) else None)
    error.add_note(f"raised by worker {owner!r}, which runs session {name!r}")
    return error


def _rebuilt(body: Mapping[str, Any], name: str | None) -> Exception | None:
    """The error ``body`` describes, about session ``name``, if it is of a kind known
    here (else None)."""
    kind = str(body.get("err"))
    message = str(body.get("msg", ""))
    builtin = _BUILTIN_ERRORS.get(kind)
    if builtin is not None:
        return builtin(message)
    cls = _error_classes().get(kind)
    if cls is None:
        return None
    rebuilt = cls.__new__(cls)  # its own __init__ may want more than a message
    Exception.__init__(rebuilt, message)
    rebuilt.session_id = name
    sid = body.get("sid")
    rebuilt._told = _load_told(body, sid if isinstance(sid, str) else None)
    for attr, value in dict(body.get("attrs") or {}).items():
        if attr in _ERROR_ATTRS or (
            type(value) is _ERROR_FLAGS.get(attr) and hasattr(rebuilt, attr)
        ):
            setattr(rebuilt, attr, value)
    return rebuilt
