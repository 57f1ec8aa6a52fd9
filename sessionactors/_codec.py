"""The codec: snapshot, journal and info bytes to records and back.

Pure (no trio). Everything goes through one private cattrs converter, built
when the codec loads (``_codec_convert``), and msgpack. Every hook the
converter will ever use is made then too, and so are the checks of what is
dumped (``_codec_checks``) and the fast paths of the records written every
turn (``_codec_fast``), so decoding stored bytes never generates, compiles or
executes code. The limits and tags are in ``_codec_format``; this module
decodes, encodes and holds the public functions.

Formats (version 1):

* A snapshot is a msgpack map of the fields of :class:`SessionState`, among
  them ``schema_version``, the version of the format. Older versions are
  carried forward by :data:`MIGRATIONS`; newer ones raise
  :class:`SnapshotVersionError`. A completed idempotency key whose reply the
  history holds is written by the reply's id (``{"key", "turn_id",
  "reply_id"}``, also the form of a key whose reply an edit removed), which
  loading resolves to the history's message; other keys hold their reply
  whole (``{"key", "turn_id", "reply"}``, the only form of version 2). A
  snapshot is written at version 2 unless it holds a key by its reply's id
  (:data:`SCHEMA_VERSION`): a session without keys writes the bytes it wrote
  before version 3, which older sessionactors read.
* A journal entry holds the events of one commit, in the compact form
  (``_codec_compact``): the array ``[1, session_id, event, ...]``, each event
  the array of its tag from :data:`EVENT_TAGS` and its fields in their
  declared order (but ``session_id``), nested records as arrays of their
  fields. Entries written before it (and entries of events of more than one
  session) hold the map form: a msgpack map of an event's fields plus its tag
  under ``"type"``, or an array of such maps. Both load.
* A session info is a msgpack map of the fields of :class:`SessionInfo`.
* Datetimes are msgpack Timestamps (UTC, microseconds kept), enums their
  string values, tuples arrays. Every integer field of a record is a seq or
  a count: from 0 to :data:`MAX_SEQ` (2**53 - 1), so that arithmetic on it
  (a wake's seq jump) can never overflow a 64-bit store column, and a double
  (Lua, JSON) holds it exactly. Metadata is plain msgpack data: maps with
  string keys, arrays, strings, bytes, numbers, booleans, nil and
  timestamps, nested at most :data:`MAX_METADATA_DEPTH` deep. A tuple in
  metadata is written as an array and so comes back as a list.

Rules for changing a format: a new field gets a default (older bytes keep
loading), a field's type never changes, a tag is never reused. A new
snapshot field also bumps :data:`SCHEMA_VERSION` (its migration adds nothing:
the default fills it in), so that an older sessionactors refuses the newer
snapshot with :class:`SnapshotVersionError`: a reader takes fields it does
not know for damage (:class:`SnapshotCorruptError`), since one flipped bit in
a field's name looks just like them. Journal entries and infos carry no
version: a new event field comes with a new event tag, and an unknown tag is
:class:`SnapshotCorruptError` whose message says to upgrade if a newer
sessionactors wrote it. In the compact form a record's fields keep their
order and a new one goes last (see ``_codec_compact``).

Loading never trusts its input: the size is capped, msgpack runs with tight
limits and knows no extension but Timestamp, the number of maps and arrays
is capped by the size (:data:`CONTAINER_BYTES`), every value is checked
against its field's type without coercion (``"5"`` never becomes ``5`` nor
``True`` ``1``; an integer is accepted for a float field and becomes a
float) and every integer field against its range, and any failure is raised
as :class:`SnapshotCorruptError` or :class:`SnapshotVersionError`.

Memory: loading costs at most about 26 times the stored size, whatever the
bytes hold. Measured with tracemalloc (peak while loading, over the size):
the worst shapes found, short strings and small maps packed as densely as
the limits allow, or maps of many distinct short keys, peak at 25.6x at
4 MB and 25.4x at 64 MB (1.7 GB); refused data at most 12x before it is
refused; real histories at 1-11x (tool calls are the densest). A short
string is the floor: 3 bytes of msgpack, a 59-byte Python object. Without
the cap on maps and arrays, empty maps cost 73x (270 MB for a 3.8 MB
snapshot).

Dumping refuses what loading would refuse, before anything is written: a
value of the wrong type in any field (``TypeError``), an integer field out
of its range, a naive datetime, text that is not valid Unicode (a lone
surrogate), metadata that is not plain data, and output over the size
limit or with more maps and arrays than its size allows (``ValueError``);
every message names the session and the field. Whatever it writes loads
back equal (metadata as plain data: tuples come back as lists).
"""

import datetime
import io
import itertools
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import cattrs
import msgpack
from cattrs.v import format_exception as _cattrs_format_exception

from ._codec_checks import CHECKS, FieldError, check_info, check_message, check_state
from ._codec_compact import CompactError, from_compact, to_compact
from ._codec_convert import (
    EVENT_HOOKS,
    Extension,
    InvalidValueError,
    datetime_problem,
    structure_event,
    structure_info,
    structure_state,
    type_name,
    unstructure_event,
    unstructure_info,
    unstructure_message,
    unstructure_metadata,
    unstructure_state,
)
from ._codec_fast import (
    COMPACT_EVENTS,
    Slow,
    fast_info,
    fast_live_info,
    fast_message,
    fast_state,
)
from ._codec_format import (
    COMPACT_ENTRY,
    CONTAINER_BYTES,
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_SNAPSHOT_BYTES,
    EVENT_TAGS,
    EVENT_UNION,
    FREE_CONTAINERS,
    KEYS_WHOLE_VERSION,
    MAX_ARRAY_LEN,
    MAX_EXT_LEN,
    MAX_INFO_BYTES,
    MAX_JOURNAL_ENTRY_BYTES,
    MAX_MAP_LEN,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_SEQ,
    MAX_SNAPSHOT_BYTES,
    MAX_TEXT_CHARS,
    MIGRATIONS,
    RETIRED_EVENT_TAGS,
    TAG_KEY,
    TAG_OF,
    VERSION_KEY,
)
from ._errors import (
    Advice,
    AdviceKind,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotVersionError,
    advised,
    shown,
)
from ._events import Event
from ._records import SCHEMA_VERSION, CompletedTurn, Message, SessionInfo, SessionState

__all__ = [
    "CONTAINER_BYTES",
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "EVENT_TAGS",
    "FREE_CONTAINERS",
    "MAX_ARRAY_LEN",
    "MAX_INFO_BYTES",
    "MAX_JOURNAL_ENTRY_BYTES",
    "MAX_MAP_LEN",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "MAX_SEQ",
    "MAX_SNAPSHOT_BYTES",
    "MAX_TEXT_CHARS",
    "MIGRATIONS",
    "RETIRED_EVENT_TAGS",
    "SnapshotWriter",
    "dump_event",
    "dump_events",
    "dump_info",
    "dump_live_info",
    "dump_snapshot",
    "load_event",
    "load_events",
    "load_info",
    "load_journal_entry",
    "load_snapshot",
    "metadata_size",
]


def _raise(error: Exception) -> int:
    raise error


def _check(check: Callable[[Any], int], record: Any, what: str, session_id: object) -> int:
    """Run ``check`` on ``record``; a refusal names the session and the field."""
    try:
        return check(record)
    except FieldError as exc:
        where = "$" + "".join(reversed(exc.path))
        raise exc.error(
            f"cannot encode the {what} of session {session_id!r}: {where} {exc.problem}"
        ) from None


# -- decoding ----------------------------------------------------------------------

#: What goes wrong while decoding untrusted bytes.
_DECODE_ERRORS: Final = (
    ValueError,  # msgpack: truncated, extra data, bad format, too deep, bad UTF-8, limits
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,  # a Timestamp outside the datetime range
    RecursionError,
    cattrs.BaseValidationError,
    msgpack.UnpackException,
)
_MAX_DETAIL: Final = 300


def _describe(exc: BaseException) -> str:
    """A short account of what is wrong, never quoting untrusted values at length."""
    if isinstance(exc, cattrs.BaseValidationError):
        lines = cattrs.transform_error(exc, format_exception=_format_exception)
        detail = "; ".join(lines[:3]) + ("; ..." if len(lines) > 3 else "")
    elif isinstance(exc, msgpack.ExtraData):
        detail = "extra bytes after the data"
    elif isinstance(exc, msgpack.FormatError):
        detail = "not valid msgpack"
    elif isinstance(exc, msgpack.StackError):
        detail = "nested too deeply"
    elif isinstance(exc, _OverBudgetError):
        detail = str(exc)
    elif isinstance(exc, UnicodeDecodeError):
        detail = "a string is not valid UTF-8"
    elif exc.__class__ is ValueError and "incomplete" in str(exc):
        detail = "the data is truncated"
    elif isinstance(exc, OverflowError):
        detail = "a timestamp is out of range"
    elif isinstance(exc, RecursionError):
        detail = "nested too deeply"
    else:
        detail = str(exc) or type_name(exc)
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    return detail


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, InvalidValueError):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required field missing"
    return _cattrs_format_exception(exc, type_)


def _corrupt(what: str, session_id: str | None, detail: str) -> SnapshotCorruptError:
    if session_id is None:
        return advised(
            SnapshotCorruptError,
            f"the {what} of an unknown session is corrupt: {detail}; restore the session"
            " from a backup or delete it with ",
            Advice(kind=AdviceKind.DELETE),
        )
    return advised(
        SnapshotCorruptError,
        f"the {what} of session {session_id!r} is corrupt: {detail}; restore the session"
        " from a backup or delete it with ",
        Advice(kind=AdviceKind.DELETE),
        session_id=session_id,
    )


def _refusal(what: str, session_id: str | None, exc: BaseException) -> SnapshotError:
    """The error for a map that does not structure: corruption.

    Fields this version does not know are taken for damage too: one flipped
    bit in a field's name makes an unknown field, and a newer sessionactors
    that adds a snapshot field raises ``schema_version`` (see the module's rules).
    """
    return _corrupt(what, session_id, _describe(exc))


def _foreign_ext(code: int, data: bytes) -> Extension:
    # Not refused here, so that the error can name the session and the field.
    return Extension(code)


def _unpack_map(data: bytes, what: str, session_id: str | None, max_size: int) -> dict[str, Any]:
    """Size check, then msgpack with tight limits; the result is a map."""
    raw = _unpack(data, what, session_id, max_size)
    if raw.__class__ is not dict:
        raise _corrupt(what, session_id, f"expected a map, got {type_name(raw)}")
    result: dict[str, Any] = raw
    return result


def _unpack(data: bytes, what: str, session_id: str | None, max_size: int) -> Any:
    """Size check, then msgpack with tight limits."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{what} data must be bytes, not {type_name(data)}")
    size = len(data)
    if size > max_size:
        raise _corrupt(what, session_id, f"{size} bytes is over the limit of {max_size} bytes")
    try:
        raw = msgpack.unpackb(data, **_limits(size))
    except _DECODE_ERRORS as exc:
        raise _corrupt(what, session_id, _describe(exc)) from exc
    return raw


def _limits(size: int) -> dict[str, Any]:
    """msgpack's options for decoding ``size`` bytes of stored data: its tight limits."""
    # Data this small cannot hold more maps and arrays than the budget allows:
    # no hooks (a call per map and array) for it.
    hook = None if size <= FREE_CONTAINERS else _container_budget(_container_limit(size))
    return {
        "timestamp": 3,
        "strict_map_key": True,
        "ext_hook": _foreign_ext,
        "list_hook": hook,
        "object_hook": hook,
        "max_str_len": size,
        "max_bin_len": size,
        "max_array_len": min(size, MAX_ARRAY_LEN),
        "max_map_len": min(size, MAX_MAP_LEN),
        "max_ext_len": MAX_EXT_LEN,
    }


class _OverBudgetError(ValueError):
    """Data with more maps and arrays than its size allows."""


def _container_budget(limit: int) -> Callable[[Any], Any]:
    """msgpack's list and object hook: counts the maps and arrays as they are made,
    and stops the decoding once there are more than ``limit``.

    msgpack calls it as each one is complete, so at most one map or array more
    than the limit is ever made (its length is capped by the data's size).
    """
    count = itertools.count(1).__next__

    def hook(value: Any) -> Any:
        if count() > limit:
            raise _OverBudgetError(
                f"more maps and arrays than {limit} (one per {CONTAINER_BYTES} bytes"
                f" beyond {FREE_CONTAINERS})"
            )
        return value

    return hook


def _session_id_in(raw: dict[str, Any], session_id: str | None) -> str | None:
    """The session to name in errors: the caller's, else the one in the data."""
    if session_id is not None:
        return session_id
    found = raw.get("session_id")
    return found[:256] if found.__class__ is str else None


def _migrate(raw: dict[str, Any], version: int, session_id: str | None) -> dict[str, Any]:
    if version > SCHEMA_VERSION:
        name = "an unknown session" if session_id is None else f"session {session_id!r}"
        raise SnapshotVersionError(
            f"the snapshot of {name} has schema version {version}: it was written by a newer"
            f" sessionactors (this one reads versions up to {SCHEMA_VERSION}); upgrade"
            " sessionactors to load it",
            session_id=session_id,
        )
    if version < 1:
        raise _corrupt("snapshot", session_id, f"there is no {VERSION_KEY} {version}")
    while version < SCHEMA_VERSION:
        migrate = MIGRATIONS.get(version)
        if migrate is None:
            raise SnapshotVersionError(
                f"the snapshot of session {session_id!r} has schema version {version}, which"
                " this sessionactors cannot migrate; load it with the version that wrote it",
                session_id=session_id,
            )
        try:
            raw = migrate(raw)
        except SnapshotError:
            raise
        except Exception as exc:
            detail = f"migrating from version {version} failed: {_describe(exc)}"
            raise _corrupt("snapshot", session_id, detail) from exc
        version += 1
        if raw.__class__ is not dict:
            raise _corrupt("snapshot", session_id, f"migration to version {version} gave no map")
        raw[VERSION_KEY] = version
    return raw


# -- encoding ----------------------------------------------------------------------


_PACKERS: Final = threading.local()
#: A packer that packed more bytes than this at once is dropped after it: a Packer
#: keeps its buffer as large as the largest record it packed (twice its size, say), for
#: as long as it lives, and a new one costs less than that record's encoding did.
_BIG_PACK: Final = 1 << 20


def _pack(raw: Any) -> bytes:
    """``raw`` packed by this thread's packer (a Packer is not thread-safe; making one
    per call is slow)."""
    try:
        packer: msgpack.Packer = _PACKERS.packer
    except AttributeError:
        packer = _PACKERS.packer = msgpack.Packer(datetime=True)
    data: bytes = packer.pack(raw)
    if len(data) > _BIG_PACK:
        del _PACKERS.packer
    return data


def _exact_packer() -> msgpack.Packer:
    """This thread's packer of exact types only (``strict_types``: no subclass checks,
    about a third faster), for the maps the fast paths build, which hold only exact
    dicts, lists, str, int, float, bool, bytes, None and aware datetimes. The same
    bytes as :func:`_pack`'s; anything else raises TypeError (the general path then
    says what is wrong, if anything is). Whoever packs more than ``_BIG_PACK`` bytes
    at once with it drops it (``_drop_exact_packer``)."""
    try:
        packer: msgpack.Packer = _PACKERS.exact
    except AttributeError:
        packer = _PACKERS.exact = msgpack.Packer(datetime=True, strict_types=True)
    return packer


def _drop_exact_packer() -> None:
    _PACKERS.__dict__.pop("exact", None)


def _pack_exact(raw: Any) -> bytes:
    """``raw`` packed by :func:`_exact_packer`."""
    data: bytes = _exact_packer().pack(raw)
    if len(data) > _BIG_PACK:
        _drop_exact_packer()
    return data


def _encode(
    unstructure: Callable[[Any], Any],
    record: Any,
    what: str,
    session_id: object,
    max_size: int,
    containers: int,
    form: Callable[[Any], Any] | None = None,
) -> bytes:
    """Pack a checked record (``containers``: the maps and arrays it makes), in the
    ``form`` made of its unstructured data if given (errors name the unstructured data's
    places)."""
    try:
        raw = unstructure(record)
        data = _pack(raw if form is None else form(raw))
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        # Only the unstructured data can say where the problem is.
        try:
            problem = _find_unencodable(unstructure(record), "$") or str(exc)
        except (ValueError, TypeError, AttributeError):
            problem = str(exc)
        error = ValueError if isinstance(exc, ValueError | OverflowError) else TypeError
        raise error(f"cannot encode the {what} of session {session_id!r}: {problem}") from exc
    _check_size(data, containers, what, session_id, max_size)
    return data


def _container_limit(size: int) -> int:
    """The most maps and arrays that ``size`` bytes may hold (loading refuses more)."""
    return size // CONTAINER_BYTES + FREE_CONTAINERS


def _check_size(data: bytes, containers: int, what: str, session_id: object, max_size: int) -> None:
    size = len(data)
    if size > max_size:
        raise ValueError(
            f"the {what} of session {session_id!r} would be {size} bytes, over the limit"
            f" of {max_size} bytes; {_SMALLER.get(what, _SMALLER_HISTORY)}"
        )
    if containers > _container_limit(size):
        raise ValueError(
            f"the {what} of session {session_id!r} would hold {containers} maps and arrays"
            f" in {size} bytes, more than loading accepts ({_container_limit(size)}: one per"
            f" {CONTAINER_BYTES} bytes beyond {FREE_CONTAINERS}); metadata holds too many"
            " small maps or lists: flatten it"
        )


_SMALLER_HISTORY: Final = "make it smaller (truncate or compact the history)"
#: What to do about a record too large, by what it is (the history, by default).
_SMALLER: Final = {
    # (an info holds no history: only its metadata can be large)
    "info": "keep large values out of the session's metadata: store them elsewhere, and "
    "ids or references to them in the metadata",
}


_PACKABLE: Final = (
    type(None),
    bool,
    int,
    float,
    str,
    bytes,
    bytearray,
    memoryview,
    datetime.datetime,
    msgpack.ExtType,
    msgpack.Timestamp,
)


def _find_unencodable(value: Any, path: str, depth: int = 0) -> str | None:
    """Where msgpack failed, for the error message (run only after a failure)."""
    if depth > 2 * MAX_METADATA_DEPTH:
        return f"{path} is nested too deeply"
    if isinstance(value, dict):
        for key, item in value.items():
            # a key is quoted with repr: a lone surrogate in it is escaped, not printed
            shown_key = shown(key) if isinstance(key, str) else f"{key!r:.60}"
            found = _find_unencodable(key, f"{path} key {shown_key}", depth + 1)
            if not found:
                name = key if isinstance(key, str) and key.isidentifier() else f"[{shown_key}]"
                found = _find_unencodable(item, f"{path}.{name}", depth + 1)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find_unencodable(item, f"{path}[{index}]", depth + 1)
            if found:
                return found
    elif isinstance(value, datetime.datetime) and (problem := datetime_problem(value)):
        return f"{path} {problem}"
    elif isinstance(value, int) and not -(2**63) <= value < 2**64:
        return f"{path} is an integer out of the 64-bit range"
    elif isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return (
                f"{path} is a string that is not valid unicode (a lone surrogate); decode "
                "the input with errors='replace' first"
            )
    elif not isinstance(value, _PACKABLE):
        return f"{path} is a {type_name(value)}, which has no msgpack form"
    return None


# -- the public functions ------------------------------------------------------------


def dump_snapshot(state: SessionState, *, max_size: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> bytes:
    """Encode a session's state as snapshot bytes at :data:`SCHEMA_VERSION`.

    Refuses, before writing anything, whatever :func:`load_snapshot` would
    refuse: ``TypeError`` for a value of the wrong type in any field, and
    ``ValueError`` for an integer field out of its range (0 to
    :data:`MAX_SEQ`), a naive datetime, text that is not valid Unicode,
    metadata that is not plain data, and output over ``max_size`` bytes or
    with more maps and arrays than its size allows. The message names the
    session and the field.
    """
    if not isinstance(state, SessionState):
        raise TypeError(f"expected a SessionState, got {type_name(state)}")
    if state.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"session {state.session_id!r} has schema_version {state.schema_version!r}, but"
            f" snapshots are written at version {SCHEMA_VERSION}; leave the default"
        )
    if not state.completed:  # (no key to write by reference: most states)
        try:
            raw, containers = fast_state(state)
            data: bytes = _pack_exact(_keys_whole(raw))
        except (Slow, ValueError, TypeError, AttributeError, OverflowError):
            pass  # the general path says what is wrong, if anything is
        else:
            if len(data) > max_size or containers > _container_limit(len(data)):
                _check_size(data, containers, "snapshot", state.session_id, max_size)
            return data
    containers = _check(check_state, state, "snapshot", state.session_id)
    try:
        stored, saved = _by_reference(state)
    except FieldError as exc:
        _check(_raise, exc, "snapshot", state.session_id)
    form = _keys_whole if stored is state else None
    return _encode(
        unstructure_state, stored, "snapshot", state.session_id, max_size, containers - saved, form
    )


def _by_reference(state: SessionState) -> tuple[SessionState, int]:
    """``state`` as its snapshot holds it, and the maps and arrays that saves: each
    completed idempotency key whose reply the history holds (that message, or one equal
    to it) by its reply's id, without the reply (loading resolves it), at the oldest
    schema version that holds that (version 2 when no key is written so). Raises
    FieldError for a key that would not load back as it is (a ``reply_id`` that is not
    its reply's; no reply, but a ``reply_id`` the history holds).

    A state without completed keys is given back as it is (no copy: this runs for
    every snapshot), to be written at version 2 by :func:`_keys_whole`."""
    completed = state.completed
    if not completed:
        return state, 0
    held = {m.id: m for m in state.messages}
    stored: list[CompletedTurn] = []
    saved = 0
    for index, turn in enumerate(completed):
        reply = turn.reply
        problem = None
        if reply is None:
            if turn.reply_id in held:
                problem = "is held by the history, but the key has no reply; give it that message"
        elif turn.reply_id != reply.id:
            problem = f"is not its reply's id ({shown(reply.id)}); leave it out"
        if problem is not None:
            error = FieldError(ValueError, f"{shown(turn.reply_id)} {problem}")
            error.path += (".reply_id", f"[{index}]", ".completed")
            raise error
        if reply is not None:
            found = held.get(reply.id)
            if found is reply or (found is not None and found == reply):
                saved += check_message(reply)
                turn = CompletedTurn(
                    key=turn.key, turn_id=turn.turn_id, reply=None, reply_id=reply.id
                )
        stored.append(turn)
    written = any(turn.reply is None for turn in stored)
    version = SCHEMA_VERSION if written else KEYS_WHOLE_VERSION
    return attrs.evolve(state, completed=tuple(stored), schema_version=version), saved


def _keys_whole(raw: dict[str, Any]) -> dict[str, Any]:
    """The unstructured ``raw`` of a state without completed keys, at the version that
    holds them whole (version 2: what ``_by_reference`` writes for such a state)."""
    raw["schema_version"] = KEYS_WHOLE_VERSION
    return raw


class SnapshotWriter:
    """Encodes one session's successive snapshots; the same bytes as :func:`dump_snapshot`.

    A snapshot holds the whole history, so writing one costs as much as the
    history is long. This keeps the packed bytes of the messages the previous
    snapshot held, and packs only the messages added since, as long as the
    history still starts with the very same message objects (an edit that drops
    or replaces any of them means a full encoding). Short histories are packed
    afresh each time and keep nothing: they are cheap, and the saved bytes cost
    memory (about as much as the snapshot itself).
    """

    #: By default, histories shorter than this are packed afresh.
    MIN_MESSAGES: Final = 128

    __slots__ = ("_body", "_containers", "_messages", "_min_messages")

    def __init__(self, min_messages: int = MIN_MESSAGES) -> None:
        self._min_messages = min_messages
        self._messages: tuple[Message, ...] = ()
        self._body = b""
        self._containers = 0  # the maps and arrays of the saved messages

    def clear(self) -> None:
        """Forget the saved bytes (the session hibernates: nothing to reuse)."""
        self._messages = ()
        self._body = b""
        self._containers = 0

    def dump(self, state: SessionState, *, max_size: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> bytes:
        """Encode ``state``; raises like :func:`dump_snapshot`."""
        if (
            state.__class__ is not SessionState
            or state.schema_version != SCHEMA_VERSION
            or len(state.messages) < self._min_messages
        ):
            self.clear()
            return dump_snapshot(state, max_size=max_size)
        try:
            data, containers = self._dump(state, state.messages)
        except (ValueError, TypeError, AttributeError, OverflowError, FieldError):
            data, containers = None, 0
        if data is None or len(data) > max_size or containers > _container_limit(len(data)):
            # dump_snapshot says what is wrong
            self.clear()
            return dump_snapshot(state, max_size=max_size)
        return data

    def _dump(self, state: SessionState, messages: tuple[Message, ...]) -> tuple[bytes, int]:
        """The snapshot's bytes and the maps and arrays in it; checks what it packs."""
        previous = self._messages
        if (
            previous
            and len(previous) <= len(messages)
            and all(map(operator.is_, previous, messages))  # (in C: no call a message)
        ):
            new = messages[len(previous) :]
            body = self._body
            containers = self._containers
        else:
            new, body, containers = messages, b"", 0
        if messages.__class__ is not tuple:
            raise TypeError("messages is not a tuple")
        if new:
            # each message packed as it is built: a long history's maps are never all
            # alive at once (thousands of them would set the garbage collector going)
            parts = [body]
            count = 0
            exact = _exact_packer()  # (the fast maps hold exact types only)
            try:
                for message in new:
                    raw, n = fast_message(message)
                    parts.append(exact.pack(raw))
                    count += n
                if max(map(len, parts[1:])) > _BIG_PACK:
                    _drop_exact_packer()
            except Slow:  # something unusual: the checker refuses it, or it is fine
                count = sum(map(check_message, new))
                parts[1:] = [_pack(unstructure_message(m)) for m in new]
            containers += count
            body = b"".join(parts)
        # Every field but the messages, packed as the state's own map would be.
        stored, _ = _by_reference(state)
        rest = attrs.evolve(stored, messages=())
        total = check_state(rest) + containers  # the empty tuple counted the array
        raw = unstructure_state(rest)
        if stored is state:
            _keys_whole(raw)
        keys = list(raw)
        at = keys.index("messages")
        # (both parts have fewer than 16 fields: each packs with a one-byte header)
        head = _pack({k: raw[k] for k in keys[:at]})[1:]
        tail = _pack({k: raw[k] for k in keys[at + 1 :]})[1:]
        data = b"".join(
            (
                _map_header(len(keys)),
                head,
                _pack("messages"),
                _array_header(len(messages)),
                body,
                tail,
            )
        )
        self._messages, self._body, self._containers = messages, body, containers
        return data, total


def _map_header(count: int) -> bytes:
    """The msgpack header of a map of ``count`` entries (as msgpack packs it)."""
    return bytes((0x80 | count,)) if count <= 15 else b"\xde" + count.to_bytes(2, "big")


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def load_snapshot(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_SNAPSHOT_BYTES
) -> SessionState:
    """Decode snapshot bytes, migrating an older format.

    ``session_id`` names the session in error messages (by default the name
    found in the data). Raises :class:`SnapshotCorruptError` for anything that
    is not a valid snapshot and :class:`SnapshotVersionError` for one written
    by a newer sessionactors.
    """
    raw = _unpack_map(data, "snapshot", session_id, max_size)
    session_id = _session_id_in(raw, session_id)
    version = raw.get(VERSION_KEY)
    if version.__class__ is not int:
        raise _corrupt("snapshot", session_id, f"{VERSION_KEY} is missing or not an integer")
    if version != SCHEMA_VERSION:
        raw = _migrate(raw, version, session_id)
    try:
        state: SessionState = structure_state(raw, SessionState)
    except _DECODE_ERRORS as exc:
        raise _refusal("snapshot", session_id, exc) from exc
    return state


def load_snapshot_head(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_SNAPSHOT_BYTES
) -> SessionState:
    """The snapshot's state without its history (``messages`` empty, and so a
    completed key's reply that the history holds is None): for a reader of a
    session's status, seqs and open turn, at a cost that does not grow with its
    history. The messages are skipped unread, so damage in them goes unnoticed here;
    the rest is decoded, migrated and checked as :func:`load_snapshot` does (which
    says what is wrong when anything is)."""
    raw = _unpack_head(data, max_size)
    if raw is not None:
        version = raw.get(VERSION_KEY)
        if version.__class__ is int and 1 <= version <= SCHEMA_VERSION:
            try:
                state: SessionState = structure_state(
                    _migrate(raw, version, session_id), SessionState
                )
            except (SnapshotError, *_DECODE_ERRORS):
                pass
            else:
                return state
    return attrs.evolve(load_snapshot(data, session_id=session_id, max_size=max_size), messages=())


#: How much of a snapshot ``_unpack_head`` reads at a time.
_HEAD_READ_SIZE: Final = 64 * 1024


def _unpack_head(data: bytes, max_size: int) -> dict[str, Any] | None:
    """The snapshot's map with its messages skipped (an empty list), under the limits
    ``_unpack`` sets; None if it is not a map of string keys or breaks a limit."""
    size = len(data) if isinstance(data, bytes) else 0
    if not 0 < size <= max_size:
        return None
    unpacker = msgpack.Unpacker(
        io.BytesIO(data),  # (which shares the bytes: no copy)
        read_size=min(size, _HEAD_READ_SIZE),
        max_buffer_size=size,
        **_limits(size),
    )
    try:
        raw: dict[str, Any] = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key.__class__ is not str:
                return None
            if key == "messages":
                unpacker.skip()
                raw[key] = []
            else:
                raw[key] = unpacker.unpack()
        if unpacker.tell() != size:
            return None  # (extra data)
    except (msgpack.OutOfData, *_DECODE_ERRORS):
        return None
    return raw


def dump_event(event: Event, *, max_size: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode one event as a journal entry, tagged with its name in :data:`EVENT_TAGS`.

    Raises ``TypeError`` for an event class without a tag, otherwise as
    :func:`dump_snapshot` does.
    """
    if event.__class__ not in TAG_OF:
        raise TypeError(f"{type_name(event)} has no journal tag; give it one in EVENT_TAGS")
    containers = _check(CHECKS[event.__class__], event, "journal entry", event.session_id)
    return _encode(
        unstructure_event, event, "journal entry", event.session_id, max_size, containers
    )


def load_event(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_EVENT_BYTES
) -> Event:
    """Decode one journal entry; raises :class:`SnapshotCorruptError` if it is not valid."""
    return _structure_event_map(
        _unpack_map(data, "journal entry", session_id, max_size), session_id
    )


def dump_events(events: Sequence[Event], *, max_size: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode the events of one commit as one journal entry, in the compact form
    (``[1, session_id, [tag, seq, field, ...], ...]``; events of more than one session
    as an array of tagged maps).

    Raises ``TypeError`` for an event class without a journal tag, and refuses
    whatever :func:`load_events` would refuse, as :func:`dump_snapshot` does,
    naming the session and the field (``$[1].message.content``).
    """
    if not events:
        raise ValueError("a journal entry holds at least one event")
    session_id = events[0].session_id
    try:
        if session_id.__class__ is not str:
            raise Slow
        arrays: list[Any] = [COMPACT_ENTRY, session_id]
        for event in events:
            fast = COMPACT_EVENTS.get(event.__class__)
            if fast is None or event.session_id != session_id:
                raise Slow
            arrays.append(fast(event))
        data: bytes = _pack_exact(arrays)
    except (Slow, ValueError, TypeError, AttributeError, OverflowError):
        pass  # the general path says what is wrong, if anything is
    else:
        # (at most one map or array a byte: data this small holds no more than loading
        # takes whatever their count; only larger data has them counted)
        if len(data) > FREE_CONTAINERS or len(data) > max_size:
            containers = 1 + sum(CHECKS[event.__class__](event) for event in events)
            _check_size(data, containers, "journal entry", session_id, max_size)
        return data
    containers = 1
    for index, event in enumerate(events):
        check = CHECKS.get(event.__class__) if event.__class__ in TAG_OF else None
        if check is None:
            raise TypeError(f"{type_name(event)} has no journal tag; give it one in EVENT_TAGS")
        try:
            containers += check(event)
        except FieldError as exc:
            exc.path.append(f"[{index}]")
            _check(_raise, exc, "journal entry", session_id)
    form = _compact_form if all(e.session_id == session_id for e in events) else None
    return _encode(
        _unstructure_events, events, "journal entry", session_id, max_size, containers, form
    )


def _compact_form(maps: list[dict[str, Any]]) -> list[Any]:
    """The compact entry of one session's events, from their tagged maps."""
    return to_compact(maps[0]["session_id"], maps)


def load_events(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_EVENT_BYTES
) -> list[Event]:
    """Decode a journal entry: one event (a map), a commit's events (an array of maps),
    or a commit's events in the compact form.

    Raises :class:`SnapshotCorruptError` if it is not valid.
    """
    raw = _unpack(data, "journal entry", session_id, max_size)
    if raw.__class__ is dict:
        return [_structure_event_map(raw, session_id)]
    if raw.__class__ is not list or not raw:
        raise _corrupt(
            "journal entry",
            session_id,
            f"expected a map or a non-empty array, got {type_name(raw)}",
        )
    if raw[0].__class__ is int:
        try:
            name, maps = from_compact(raw)
            named = session_id or name[:256]
            # each event is built before the next map is drawn (see from_compact)
            return [_structure_event_map(item, named) for item in maps]
        except CompactError as exc:
            found = raw[1][:256] if len(raw) > 1 and raw[1].__class__ is str else None
            raise _corrupt("journal entry", session_id or found, str(exc)) from exc
    events = []
    for item in raw:
        if item.__class__ is not dict:
            raise _corrupt("journal entry", session_id, f"expected maps, got {type_name(item)}")
        events.append(_structure_event_map(item, session_id))
    return events


def load_journal_entry(data: bytes, session_id: str) -> list[Event]:
    """The events of one of ``session_id``'s journal entries, as :func:`load_events`
    decodes them; ``SnapshotCorruptError`` if any belongs to another session (the store
    is inconsistent: they must be neither folded into its state nor replayed)."""
    events = load_events(data, session_id=session_id)
    for event in events:
        if event.session_id != session_id:
            raise advised(
                SnapshotCorruptError,
                f"the journal of session {session_id!r} holds an event of session "
                f"{event.session_id[:256]!r} (seq {event.seq}); the store is inconsistent: "
                "restore it from a backup or delete the session with ",
                Advice(kind=AdviceKind.DELETE),
                session_id=session_id,
            )
    return events


def _unstructure_events(events: Sequence[Event]) -> list[Any]:
    out = []
    for event in events:
        tag, hook = EVENT_HOOKS[event.__class__]
        raw = hook(event)
        raw[TAG_KEY] = tag
        out.append(raw)
    return out


def _structure_event_map(raw: dict[str, Any], session_id: str | None) -> Event:
    session_id = _session_id_in(raw, session_id)
    tag = raw.get(TAG_KEY)
    if tag.__class__ is not str:
        raise _corrupt("journal entry", session_id, "the event type is missing or not a string")
    if tag not in EVENT_TAGS:
        raise _corrupt(
            "journal entry",
            session_id,
            f"unknown event type {tag[:64]!r} (if a newer sessionactors wrote it, upgrade)",
        )
    try:
        event: Event = structure_event(raw, EVENT_UNION)
    except _DECODE_ERRORS as exc:
        raise _refusal("journal entry", session_id, exc) from exc
    return event


def dump_info(info: SessionInfo) -> bytes:
    """Encode a session's short description; raises as :func:`dump_snapshot` does."""
    try:
        raw, containers = fast_info(info)
        data: bytes = _pack_exact(raw)
    except (Slow, ValueError, TypeError, AttributeError, OverflowError):
        pass  # the general path says what is wrong, if anything is
    else:
        if len(data) > MAX_INFO_BYTES or containers > FREE_CONTAINERS:
            _check_size(data, containers, "info", info.session_id, MAX_INFO_BYTES)
        return data
    if not isinstance(info, SessionInfo):
        raise TypeError(f"expected a SessionInfo, got {type_name(info)}")
    containers = _check(check_info, info, "info", info.session_id)
    return _encode(unstructure_info, info, "info", info.session_id, MAX_INFO_BYTES, containers)


def metadata_size(metadata: Mapping[str, Any]) -> int:
    """The bytes ``metadata`` takes encoded, as the codec writes it in a session's info
    (and in the ``MetadataChanged`` event that journals it), whatever its size;
    ``TypeError`` or ``ValueError`` naming the key for what is not plain data."""
    try:
        return len(_pack(unstructure_metadata(metadata)))
    except OverflowError as exc:  # (an integer beyond 64 bits)
        raise ValueError(f"metadata holds an integer out of the 64-bit range: {exc}") from None


def dump_live_info(session: Any) -> bytes:
    """``dump_info(session.info())`` for a live session (any object with the fields of
    :class:`SessionInfo` as attributes, and ``info()``), without making the record."""
    try:
        raw, containers = fast_live_info(session)
        data: bytes = _pack_exact(raw)
    except (Slow, ValueError, TypeError, AttributeError, OverflowError):
        return dump_info(session.info())  # the general path says what is wrong
    if len(data) > MAX_INFO_BYTES or containers > FREE_CONTAINERS:
        _check_size(data, containers, "info", session.session_id, MAX_INFO_BYTES)
    return data


def load_info(data: bytes, *, session_id: str | None = None) -> SessionInfo:
    """Decode a session's short description; raises :class:`SnapshotCorruptError` if invalid."""
    raw = _unpack_map(data, "info", session_id, MAX_INFO_BYTES)
    session_id = _session_id_in(raw, session_id)
    try:
        info: SessionInfo = structure_info(raw, SessionInfo)
    except _DECODE_ERRORS as exc:
        raise _refusal("info", session_id, exc) from exc
    return info
