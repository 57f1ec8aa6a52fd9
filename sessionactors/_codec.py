"""The codec: snapshot, journal and info bytes to records and back.

Pure (no trio). Everything goes through one private cattrs converter, built
by :func:`_make_converter`, and msgpack.

Formats (version 1):

* A snapshot is a msgpack map of the fields of :class:`SessionState`, among
  them ``schema_version``, the version of the format. Older versions are
  carried forward by :data:`MIGRATIONS`; newer ones raise
  :class:`SnapshotVersionError`.
* A journal entry is one event: a msgpack map of the event's fields plus its
  tag from :data:`EVENT_TAGS` under ``"type"``.
* A session info is a msgpack map of the fields of :class:`SessionInfo`.
* Datetimes are msgpack Timestamps (UTC, microseconds kept), enums their
  string values, tuples arrays. Metadata is plain msgpack data: maps with
  string keys, arrays, strings, bytes, numbers, booleans, nil and timestamps,
  nested at most :data:`MAX_METADATA_DEPTH` deep. A tuple in metadata is
  written as an array and so comes back as a list.

Rules for changing a format: a new field gets a default (older bytes keep
loading), a field's type never changes, a tag is never reused; a change that
older bytes cannot simply default bumps :data:`SCHEMA_VERSION` and adds a
migration. A reader never drops what it does not understand: fields it does
not know, like a newer ``schema_version``, raise :class:`SnapshotVersionError`
(a newer sessionactors wrote them: upgrade); an unknown event tag raises
:class:`SnapshotCorruptError`.

Loading never trusts its input: the size is capped, msgpack runs with tight
limits and knows no extension but Timestamp, every value is checked against
its field's type without coercion (``"5"`` never becomes ``5`` nor ``True``
``1``; an integer is accepted for a float field and becomes a float), and any
failure is raised as :class:`SnapshotCorruptError` or
:class:`SnapshotVersionError`. Dumping trusts the record's field types (mypy
checks them) but refuses naive datetimes, unencodable metadata and output
over the size limit, so whatever it writes loads again.
"""

import datetime
import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Union, get_args, get_origin

import attrs
import cattrs
import msgpack
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.fns import identity
from cattrs.gen import make_dict_structure_fn
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception as _cattrs_format_exception

from ._errors import SnapshotCorruptError, SnapshotError, SnapshotVersionError
from ._events import (
    Delta,
    Event,
    HistoryEdited,
    MessageAdded,
    MetadataChanged,
    ReviewRequested,
    ReviewResolved,
    StatusChanged,
    ToolCallStarted,
    ToolResult,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)
from ._records import NO_METADATA, SCHEMA_VERSION, Message, SessionInfo, SessionState, ToolCall

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "EVENT_TAGS",
    "MAX_INFO_BYTES",
    "MAX_METADATA_DEPTH",
    "MIGRATIONS",
    "RETIRED_EVENT_TAGS",
    "dump_event",
    "dump_events",
    "dump_info",
    "dump_snapshot",
    "load_event",
    "load_events",
    "load_info",
    "load_snapshot",
]

#: The largest snapshot written or read by default (64 MiB).
DEFAULT_MAX_SNAPSHOT_BYTES: Final = 64 * 1024 * 1024
#: The largest journal entry written or read by default (16 MiB).
DEFAULT_MAX_EVENT_BYTES: Final = 16 * 1024 * 1024
#: The largest session info written or read (it carries the session's metadata).
MAX_INFO_BYTES: Final = DEFAULT_MAX_EVENT_BYTES
#: How deeply metadata may nest: the metadata map is level 1, a list in it level 2.
MAX_METADATA_DEPTH: Final = 32

# msgpack limits on top of the size cap: no session holds more entries in one
# array (messages) or one map (metadata), and a Timestamp is at most 12 bytes.
# Dumping checks metadata against them too; records reach the size cap first.
_MAX_ARRAY_LEN: Final = 1_000_000
_MAX_MAP_LEN: Final = 100_000
_MAX_EXT_LEN: Final = 12

#: Migrations of the raw snapshot map: ``MIGRATIONS[n]`` turns a version ``n``
#: map into a version ``n + 1`` map. :func:`load_snapshot` applies them in turn.
MIGRATIONS: Final[dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {}

#: The tag of every event class in the journal. A tag, once used, is never
#: given to another class, even after its class is gone (see RETIRED_EVENT_TAGS).
EVENT_TAGS: Final[Mapping[str, type[Event]]] = {
    "turn_started": TurnStarted,
    "delta": Delta,
    "message_added": MessageAdded,
    "turn_finished": TurnFinished,
    "turn_failed": TurnFailed,
    "turn_cancelled": TurnCancelled,
    "status_changed": StatusChanged,
    "tool_call_started": ToolCallStarted,
    "tool_result": ToolResult,
    "review_requested": ReviewRequested,
    "review_resolved": ReviewResolved,
    "history_edited": HistoryEdited,
    "metadata_changed": MetadataChanged,
}
#: Tags of event classes that no longer exist: never to be used again.
RETIRED_EVENT_TAGS: Final[frozenset[str]] = frozenset()

_TAG_KEY: Final = "type"
_VERSION_KEY: Final = "schema_version"
_TAG_OF: Final[dict[type[Event], str]] = {cls: tag for tag, cls in EVENT_TAGS.items()}
_EventUnion: Any = Union[tuple(EVENT_TAGS.values())]  # noqa: UP007 (built at runtime)


class _InvalidValueError(ValueError):
    """A value of the wrong type or shape; the message never quotes the value."""


class _UnknownFieldsError(_InvalidValueError):
    """A map has keys its record does not know: likely from a newer sessionactors."""


class _Extension:
    """What a msgpack extension other than Timestamp decodes to: valid nowhere."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


def _type_name(value: object) -> str:
    if isinstance(value, _Extension):
        return f"msgpack extension type {value.code}"
    return type(value).__name__


# -- strict structure hooks: check, never coerce ------------------------------------


def _structure_str(value: Any, _: object) -> str:
    if value.__class__ is str:
        return value
    raise _InvalidValueError(f"expected a string, got {_type_name(value)}")


def _structure_optional_str(value: Any, _: object) -> str | None:
    if value is None or value.__class__ is str:
        return value
    raise _InvalidValueError(f"expected a string or nil, got {_type_name(value)}")


def _structure_int(value: Any, _: object) -> int:
    if value.__class__ is int:
        return value
    raise _InvalidValueError(f"expected an integer, got {_type_name(value)}")


def _structure_float(value: Any, _: object) -> float:
    # An integer is a valid float: msgpack writers may store 1.0 as 1.
    if value.__class__ is float:
        return value
    if value.__class__ is int:
        return float(value)
    raise _InvalidValueError(f"expected a number, got {_type_name(value)}")


def _structure_bool(value: Any, _: object) -> bool:
    if value.__class__ is bool:
        return value
    raise _InvalidValueError(f"expected a boolean, got {_type_name(value)}")


def _structure_bytes(value: Any, _: object) -> bytes:
    if value.__class__ is bytes:
        return value
    raise _InvalidValueError(f"expected bytes, got {_type_name(value)}")


def _structure_datetime(value: Any, _: object) -> datetime.datetime:
    # msgpack turns every Timestamp into an aware UTC datetime (timestamp=3).
    if value.__class__ is datetime.datetime and value.tzinfo is datetime.UTC:
        return value
    raise _InvalidValueError(f"expected a timestamp, got {_type_name(value)}")


def _is_enum(type_: Any) -> bool:
    return isinstance(type_, type) and issubclass(type_, enum.Enum)


class _EnumValues(dict[Any, Any]):
    """An enum's members to their values; anything else is a TypeError, which the
    encoder reports as it does every value of a wrong type."""

    __slots__ = ("_cls",)

    def __init__(self, cls: type[enum.Enum]) -> None:
        super().__init__((member, member.value) for member in cls)
        self._cls = cls

    def __missing__(self, key: Any) -> Any:
        raise TypeError(f"{key!r} is not a {self._cls.__name__}")


def _enum_unstructure_factory(cls: type[enum.Enum]) -> Callable[[enum.Enum], Any]:
    return _EnumValues(cls).__getitem__  # the dict's own lookup: no Python frame


def _enum_structure_factory(cls: type[enum.Enum]) -> Callable[[Any, object], enum.Enum]:
    members = {member.value: member for member in cls}
    value_types = frozenset(type(value) for value in members)
    name = cls.__name__

    def structure_enum(value: Any, _: object) -> enum.Enum:
        # The type check first: True would find a member whose value is 1.
        if value.__class__ in value_types:
            member = members.get(value)
            if member is not None:
                return member
        raise _InvalidValueError(f"not a {name} value")

    return structure_enum


def _is_homogeneous_tuple(type_: Any) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_structure_factory(
    type_: Any, converter: cattrs.Converter
) -> Callable[[Any, object], tuple[Any, ...]]:
    # cattrs makes a tuple of any iterable (of a string, its characters): only
    # a msgpack array will do.
    elem_type = get_args(type_)[0]
    structure_elem = converter.get_structure_hook(elem_type)

    def structure_tuple(value: Any, _: object) -> tuple[Any, ...]:
        if value.__class__ is not list:
            raise _InvalidValueError(f"expected an array, got {_type_name(value)}")
        try:
            return tuple([structure_elem(item, elem_type) for item in value])
        except Exception:
            _explain_element(value, structure_elem, elem_type, type_)
            raise

    return structure_tuple


def _explain_element(
    items: list[Any], structure: Callable[[Any, Any], Any], elem_type: Any, type_: Any
) -> None:
    """Raise the first element's error with its index (for the error's path).

    Only the first: a crafted array of a million wrong values must not make
    a million exceptions.
    """
    for index, item in enumerate(items):
        try:
            structure(item, elem_type)
        except Exception as exc:
            note = IterableValidationNote(f"Structuring {type_} @ index {index}", index, elem_type)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            raise IterableValidationError(f"While structuring {type_!r}", [exc], type_) from None


def _attrs_structure_factory(
    cls: type[Any], converter: cattrs.Converter
) -> Callable[[Any, object], Any]:
    # cattrs' generated hook, behind a check for a map without unknown keys
    # (cheaper than cattrs' own forbid_extra_keys). An event's map also holds
    # its tag.
    structure = make_dict_structure_fn(cls, converter)
    allowed = frozenset(field.name for field in attrs.fields(cls))
    if issubclass(cls, Event):
        allowed |= {_TAG_KEY}
    name = cls.__name__

    def structure_attrs(value: Any, _: object) -> Any:
        if value.__class__ is not dict:
            raise _InvalidValueError(f"expected a map for {name}, got {_type_name(value)}")
        if allowed.issuperset(value):
            return structure(value, cls)
        # Whatever else is wrong comes first: unknown fields alone suggest a
        # newer format, unknown fields beside wrong ones corruption.
        structure({key: item for key, item in value.items() if key in allowed}, cls)
        unknown = ", ".join(sorted(repr(key)[:40] for key in value.keys() - allowed))
        raise _UnknownFieldsError(f"unknown fields in {name} ({unknown})")

    return structure_attrs


# -- metadata: plain msgpack data ------------------------------------------------

_SCALARS: Final = frozenset({str, int, float, bool, bytes, type(None)})


def _is_metadata(type_: Any) -> bool:
    return get_origin(type_) is Mapping and get_args(type_) == (str, Any)


_LOADED_SCALARS: Final = _SCALARS | {datetime.datetime}


def _check_loaded(value: Any, depth: int) -> None:
    """Check a loaded metadata container: string keys, no extensions, bounded depth."""
    if depth > MAX_METADATA_DEPTH:
        raise _InvalidValueError(f"metadata nested deeper than {MAX_METADATA_DEPTH} levels")
    if value.__class__ is dict:
        for key, item in value.items():
            if key.__class__ is not str:
                raise _InvalidValueError(f"metadata key is {_type_name(key)}, not a string")
            _check_loaded_item(item, depth)
    else:
        for item in value:
            _check_loaded_item(item, depth)


def _check_loaded_item(item: Any, depth: int) -> None:
    cls = item.__class__
    if cls is dict or cls is list:
        _check_loaded(item, depth + 1)
    elif cls not in _LOADED_SCALARS:
        raise _InvalidValueError(f"metadata holds a {_type_name(item)}")


def _structure_metadata(value: Any, _: object) -> dict[str, Any]:
    if value.__class__ is not dict:
        raise _InvalidValueError(f"expected a map, got {_type_name(value)}")
    if value:
        _check_loaded(value, 1)
        return value
    return NO_METADATA


class _PlainError(Exception):
    """Metadata that cannot be dumped; ``path`` is filled in on the way out."""

    def __init__(self, error: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.error = error
        self.problem = problem
        self.path: list[str] = []


def _plain(value: Any, depth: int) -> Any:
    """A checked copy of metadata for dumping: mappings become dicts, tuples lists."""
    cls = value.__class__
    if cls in _SCALARS:
        return value
    if depth > MAX_METADATA_DEPTH:
        raise _PlainError(ValueError, f"is nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, Mapping):
        if len(value) > _MAX_MAP_LEN:
            raise _PlainError(ValueError, f"has more than {_MAX_MAP_LEN} entries")
        out = {}
        for key, item in value.items():
            if key.__class__ is not str:
                raise _PlainError(TypeError, f"has a {_type_name(key)} key; keys must be str")
            try:
                out[key] = _plain(item, depth + 1)
            except _PlainError as exc:
                exc.path.append(f"[{key!r}]")
                raise
        return out
    if cls is list or cls is tuple:
        if len(value) > _MAX_ARRAY_LEN:
            raise _PlainError(ValueError, f"has more than {_MAX_ARRAY_LEN} items")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(_plain(item, depth + 1))
            except _PlainError as exc:
                exc.path.append(f"[{index}]")
                raise
        return items
    if cls is datetime.datetime:
        if value.tzinfo is None:
            raise _PlainError(ValueError, "is a naive datetime; use an aware one such as utcnow()")
        return value
    raise _PlainError(
        TypeError,
        f"is a {cls.__name__}; metadata holds plain data (dict with str keys, list,"
        " tuple, str, bytes, int, float, bool, None, aware datetime)",
    )


def _unstructure_metadata(value: Mapping[str, Any]) -> dict[str, Any]:
    if value is NO_METADATA or (value.__class__ is dict and not value):
        return value
    try:
        out: dict[str, Any] = _plain(value, 1)
    except _PlainError as exc:
        where = "metadata" + "".join(reversed(exc.path))
        raise exc.error(f"{where} {exc.problem}") from None
    return out


# -- the converter -----------------------------------------------------------------


def _register_tuple_unstructure(conv: cattrs.Converter, item: type[Any]) -> None:
    hook = conv.get_unstructure_hook(item)

    def unstructure(values: tuple[Any, ...]) -> list[Any]:
        return [hook(v) for v in values] if values else []

    target = tuple[item, ...]  # type: ignore[valid-type]
    conv.register_unstructure_hook_func(lambda t: t == target, unstructure)


def _make_converter() -> cattrs.Converter:
    """Build the codec's converter; every hook is registered before first use."""
    conv = cattrs.Converter(detailed_validation=True)

    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(bytes, _structure_bytes)
    conv.register_structure_hook(str | None, _structure_optional_str)
    conv.register_structure_hook(datetime.datetime, _structure_datetime)
    conv.register_structure_hook_factory(_is_enum, _enum_structure_factory)
    conv.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_structure_factory)
    conv.register_structure_hook_func(_is_metadata, _structure_metadata)
    conv.register_structure_hook_factory(attrs.has, _attrs_structure_factory)

    # Passed through for msgpack itself to write (datetimes as Timestamps):
    # the generated hooks then read these fields inline, with no call.
    conv.register_unstructure_hook(datetime.datetime, identity)
    # an enum's value from a dict: the ``.value`` property is a slow descriptor
    conv.register_unstructure_hook_factory(_is_enum, _enum_unstructure_factory)
    conv.register_unstructure_hook(str | None, identity)
    conv.register_unstructure_hook_func(_is_metadata, _unstructure_metadata)
    # A history is long: a comprehension over the item's own hook beats the
    # generic iterable hook's generator (msgpack writes lists and tuples alike).
    for item in (ToolCall, Message):
        _register_tuple_unstructure(conv, item)

    configure_tagged_union(_EventUnion, conv, tag_generator=_TAG_OF.__getitem__, tag_name=_TAG_KEY)
    return conv


_CONVERTER: Final = _make_converter()
_unstructure_state: Final = _CONVERTER.get_unstructure_hook(SessionState)
_structure_state: Final = _CONVERTER.get_structure_hook(SessionState)
_unstructure_event: Final = _CONVERTER.get_unstructure_hook(_EventUnion)
_structure_event: Final = _CONVERTER.get_structure_hook(_EventUnion)
_unstructure_info: Final = _CONVERTER.get_unstructure_hook(SessionInfo)
_structure_info: Final = _CONVERTER.get_structure_hook(SessionInfo)
_unstructure_message: Final = _CONVERTER.get_unstructure_hook(Message)
# Each event class's own hook and tag, looked up once: a journal entry is written
# every turn, and the union's dispatch is most of its cost. Same bytes as the union's.
_EVENT_HOOKS: Final = {
    cls: (tag, _CONVERTER.get_unstructure_hook(cls)) for cls, tag in _TAG_OF.items()
}


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
    elif isinstance(exc, UnicodeDecodeError):
        detail = "a string is not valid UTF-8"
    elif exc.__class__ is ValueError and "incomplete" in str(exc):
        detail = "the data is truncated"
    elif isinstance(exc, OverflowError):
        detail = "a timestamp is out of range"
    elif isinstance(exc, RecursionError):
        detail = "nested too deeply"
    else:
        detail = str(exc) or _type_name(exc)
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    return detail


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, _InvalidValueError):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required field missing"
    return _cattrs_format_exception(exc, type_)


def _corrupt(what: str, session_id: str | None, detail: str) -> SnapshotCorruptError:
    if session_id is None:
        return SnapshotCorruptError(
            f"the {what} of an unknown session is corrupt: {detail}; restore the session"
            " from a backup or delete it with registry.delete(name)"
        )
    return SnapshotCorruptError(
        f"the {what} of session {session_id!r} is corrupt: {detail}; restore the session"
        f" from a backup or delete it with registry.delete({session_id!r})",
        session_id=session_id,
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _refusal(what: str, session_id: str | None, exc: BaseException) -> SnapshotError:
    """The error for a map that does not structure: a newer format, or corruption.

    Fields this version does not know, and nothing else wrong, are what a
    newer sessionactors writes (a new field with a default): upgrade.
    """
    if all(isinstance(leaf, _UnknownFieldsError) for leaf in _leaves(exc)):
        name = "an unknown session" if session_id is None else f"session {session_id!r}"
        return SnapshotVersionError(
            f"the {what} of {name} has fields this sessionactors does not know"
            f" ({_describe(exc)}): a newer sessionactors wrote it; upgrade sessionactors"
            " to load it",
            session_id=session_id,
        )
    return _corrupt(what, session_id, _describe(exc))


def _foreign_ext(code: int, data: bytes) -> _Extension:
    # Not refused here, so that the error can name the session and the field.
    return _Extension(code)


def _unpack_map(data: bytes, what: str, session_id: str | None, max_size: int) -> dict[str, Any]:
    """Size check, then msgpack with tight limits; the result is a map."""
    raw = _unpack(data, what, session_id, max_size)
    if raw.__class__ is not dict:
        raise _corrupt(what, session_id, f"expected a map, got {_type_name(raw)}")
    result: dict[str, Any] = raw
    return result


def _unpack(data: bytes, what: str, session_id: str | None, max_size: int) -> Any:
    """Size check, then msgpack with tight limits."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{what} data must be bytes, not {_type_name(data)}")
    size = len(data)
    if size > max_size:
        raise _corrupt(what, session_id, f"{size} bytes is over the limit of {max_size} bytes")
    try:
        raw = msgpack.unpackb(
            data,
            timestamp=3,
            strict_map_key=True,
            ext_hook=_foreign_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=min(size, _MAX_ARRAY_LEN),
            max_map_len=min(size, _MAX_MAP_LEN),
            max_ext_len=_MAX_EXT_LEN,
        )
    except _DECODE_ERRORS as exc:
        raise _corrupt(what, session_id, _describe(exc)) from exc
    return raw


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
        raise _corrupt("snapshot", session_id, f"there is no {_VERSION_KEY} {version}")
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
        raw[_VERSION_KEY] = version
    return raw


# -- encoding ----------------------------------------------------------------------


_PACKERS: Final = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer (a Packer is not thread-safe; making one per call is slow)."""
    try:
        packer: msgpack.Packer = _PACKERS.packer
    except AttributeError:
        packer = _PACKERS.packer = msgpack.Packer(datetime=True)
    return packer


def _encode(
    unstructure: Callable[[Any], Any], record: Any, what: str, session_id: object, max_size: int
) -> bytes:
    try:
        data: bytes = _packer().pack(unstructure(record))
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        # Only the unstructured data can say where the problem is.
        try:
            problem = _find_unencodable(unstructure(record), "$") or str(exc)
        except (ValueError, TypeError, AttributeError):
            problem = str(exc)
        error = ValueError if isinstance(exc, ValueError | OverflowError) else TypeError
        raise error(f"cannot encode the {what} of session {session_id!r}: {problem}") from exc
    if len(data) > max_size:
        raise ValueError(
            f"the {what} of session {session_id!r} would be {len(data)} bytes, over the limit"
            f" of {max_size} bytes; make it smaller (truncate or compact the history)"
        )
    return data


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
            found = _find_unencodable(item, f"{path}.{key}", depth + 1)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find_unencodable(item, f"{path}[{index}]", depth + 1)
            if found:
                return found
    elif isinstance(value, datetime.datetime) and value.tzinfo is None:
        return f"{path} is a naive datetime; use an aware one such as utcnow()"
    elif isinstance(value, int) and not -(2**63) <= value < 2**64:
        return f"{path} is an integer out of the 64-bit range"
    elif isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return f"{path} is a string that is not valid unicode (a lone surrogate)"
    elif not isinstance(value, _PACKABLE):
        return f"{path} is a {_type_name(value)}, which has no msgpack form"
    return None


# -- the public functions ------------------------------------------------------------


def dump_snapshot(state: SessionState, *, max_size: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> bytes:
    """Encode a session's state as snapshot bytes at :data:`SCHEMA_VERSION`.

    Raises ``ValueError`` for a naive datetime, metadata that is not plain
    data or output over ``max_size`` bytes, and ``TypeError`` for a value
    msgpack cannot hold.
    """
    if not isinstance(state, SessionState):
        raise TypeError(f"expected a SessionState, got {_type_name(state)}")
    if state.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"session {state.session_id!r} has schema_version {state.schema_version!r}, but"
            f" snapshots are written at version {SCHEMA_VERSION}; leave the default"
        )
    return _encode(_unstructure_state, state, "snapshot", state.session_id, max_size)


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

    __slots__ = ("_body", "_messages", "_min_messages")

    def __init__(self, min_messages: int = MIN_MESSAGES) -> None:
        self._min_messages = min_messages
        self._messages: tuple[Message, ...] = ()
        self._body = b""

    def clear(self) -> None:
        """Forget the saved bytes (the session hibernates: nothing to reuse)."""
        self._messages = ()
        self._body = b""

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
            data = self._dump(state, state.messages)
        except (ValueError, TypeError, AttributeError, OverflowError):
            data = None
        if data is None or len(data) > max_size:
            # dump_snapshot says what is wrong
            self.clear()
            return dump_snapshot(state, max_size=max_size)
        return data

    def _dump(self, state: SessionState, messages: tuple[Message, ...]) -> bytes:
        packer = _packer()
        previous = self._messages
        if previous and len(previous) <= len(messages) and all(map(_is, previous, messages)):
            new = messages[len(previous) :]
            body = self._body
        else:
            new, body = messages, b""
        if new:
            packed = packer.pack([_unstructure_message(m) for m in new])
            body += packed[_array_header_size(len(new)) :]
        # Every field but the messages, packed as the state's own map would be.
        raw = _unstructure_state(attrs.evolve(state, messages=()))
        keys = list(raw)
        at = keys.index("messages")
        if len(keys) > 15:  # pragma: no cover - a fixmap has room for 15 fields
            raise ValueError("too many fields for the snapshot writer")
        head = packer.pack({k: raw[k] for k in keys[:at]})[1:]
        tail = packer.pack({k: raw[k] for k in keys[at + 1 :]})[1:]
        data = b"".join(
            (
                bytes((0x80 | len(keys),)),
                head,
                packer.pack("messages"),
                _array_header(len(messages)),
                body,
                tail,
            )
        )
        self._messages, self._body = messages, body
        return data


def _is(a: object, b: object) -> bool:
    return a is b


def _array_header_size(count: int) -> int:
    return 1 if count < 16 else 3 if count < 1 << 16 else 5


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
    version = raw.get(_VERSION_KEY)
    if version.__class__ is not int:
        raise _corrupt("snapshot", session_id, f"{_VERSION_KEY} is missing or not an integer")
    if version != SCHEMA_VERSION:
        raw = _migrate(raw, version, session_id)
    try:
        state: SessionState = _structure_state(raw, SessionState)
    except _DECODE_ERRORS as exc:
        raise _refusal("snapshot", session_id, exc) from exc
    return state


def dump_event(event: Event, *, max_size: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode one event as a journal entry, tagged with its name in :data:`EVENT_TAGS`.

    Raises ``TypeError`` for an event class without a tag, otherwise as
    :func:`dump_snapshot` does.
    """
    if event.__class__ not in _TAG_OF:
        raise TypeError(f"{_type_name(event)} has no journal tag; give it one in EVENT_TAGS")
    return _encode(_unstructure_event, event, "journal entry", event.session_id, max_size)


def load_event(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_EVENT_BYTES
) -> Event:
    """Decode one journal entry; raises :class:`SnapshotCorruptError` if it is not valid."""
    return _structure_event_map(
        _unpack_map(data, "journal entry", session_id, max_size), session_id
    )


def dump_events(events: Sequence[Event], *, max_size: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode the events of one commit as one journal entry (an array of tagged maps).

    Raises like :func:`dump_event`.
    """
    if not events:
        raise ValueError("a journal entry holds at least one event")
    for event in events:
        if event.__class__ not in _TAG_OF:
            raise TypeError(f"{_type_name(event)} has no journal tag; give it one in EVENT_TAGS")
    return _encode(_unstructure_events, events, "journal entry", events[0].session_id, max_size)


def load_events(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_EVENT_BYTES
) -> list[Event]:
    """Decode a journal entry: one event (a map) or a commit's events (an array of maps).

    Raises :class:`SnapshotCorruptError` if it is not valid.
    """
    raw = _unpack(data, "journal entry", session_id, max_size)
    if raw.__class__ is dict:
        return [_structure_event_map(raw, session_id)]
    if raw.__class__ is not list or not raw:
        raise _corrupt(
            "journal entry",
            session_id,
            f"expected a map or a non-empty array, got {_type_name(raw)}",
        )
    events = []
    for item in raw:
        if item.__class__ is not dict:
            raise _corrupt("journal entry", session_id, f"expected maps, got {_type_name(item)}")
        events.append(_structure_event_map(item, session_id))
    return events


def _unstructure_events(events: Sequence[Event]) -> list[Any]:
    out = []
    for event in events:
        tag, hook = _EVENT_HOOKS[event.__class__]
        raw = hook(event)
        raw[_TAG_KEY] = tag
        out.append(raw)
    return out


def _structure_event_map(raw: dict[str, Any], session_id: str | None) -> Event:
    session_id = _session_id_in(raw, session_id)
    tag = raw.get(_TAG_KEY)
    if tag.__class__ is not str:
        raise _corrupt("journal entry", session_id, "the event type is missing or not a string")
    if tag not in EVENT_TAGS:
        raise _corrupt(
            "journal entry",
            session_id,
            f"unknown event type {tag[:64]!r} (if a newer sessionactors wrote it, upgrade)",
        )
    try:
        event: Event = _structure_event(raw, _EventUnion)
    except _DECODE_ERRORS as exc:
        raise _refusal("journal entry", session_id, exc) from exc
    return event


def dump_info(info: SessionInfo) -> bytes:
    """Encode a session's short description; raises as :func:`dump_snapshot` does."""
    if not isinstance(info, SessionInfo):
        raise TypeError(f"expected a SessionInfo, got {_type_name(info)}")
    return _encode(_unstructure_info, info, "info", info.session_id, MAX_INFO_BYTES)


def load_info(data: bytes, *, session_id: str | None = None) -> SessionInfo:
    """Decode a session's short description; raises :class:`SnapshotCorruptError` if invalid."""
    raw = _unpack_map(data, "info", session_id, MAX_INFO_BYTES)
    session_id = _session_id_in(raw, session_id)
    try:
        info: SessionInfo = _structure_info(raw, SessionInfo)
    except _DECODE_ERRORS as exc:
        raise _refusal("info", session_id, exc) from exc
    return info
