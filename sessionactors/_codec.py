"""The codec: snapshot, journal and info bytes to records and back.

Pure (no trio). Everything goes through one private cattrs converter, built
by :func:`_make_converter` when this module loads, and msgpack. Every hook
the converter will ever use is made then too (:func:`_build_hooks`), so
decoding stored bytes never generates, compiles or executes code.

Formats (version 1):

* A snapshot is a msgpack map of the fields of :class:`SessionState`, among
  them ``schema_version``, the version of the format. Older versions are
  carried forward by :data:`MIGRATIONS`; newer ones raise
  :class:`SnapshotVersionError`.
* A journal entry is one event, or the events of one commit: a msgpack map
  of the event's fields plus its tag from :data:`EVENT_TAGS` under
  ``"type"``, or an array of such maps.
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
sessionactors wrote it.

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
import enum
import itertools
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Union, get_args, get_origin

import attrs
import cattrs
import msgpack
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.fns import identity
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
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
    "CONTAINER_BYTES",
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "EVENT_TAGS",
    "FREE_CONTAINERS",
    "MAX_ARRAY_LEN",
    "MAX_INFO_BYTES",
    "MAX_JOURNAL_ENTRY_BYTES",
    "MAX_MAP_LEN",
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
    "load_snapshot",
]

#: The largest snapshot written or read by default (64 MiB).
MAX_SNAPSHOT_BYTES: Final = 64 * 1024 * 1024
#: The largest journal entry (the events of one commit) written or read by default (16 MiB).
MAX_JOURNAL_ENTRY_BYTES: Final = 16 * 1024 * 1024
#: The same limits under their first names.
DEFAULT_MAX_SNAPSHOT_BYTES: Final = MAX_SNAPSHOT_BYTES
DEFAULT_MAX_EVENT_BYTES: Final = MAX_JOURNAL_ENTRY_BYTES
#: The largest session info written or read (it carries the session's metadata).
MAX_INFO_BYTES: Final = MAX_JOURNAL_ENTRY_BYTES
#: The longest text (in characters) that one turn can carry and still be journaled:
#: UTF-8 takes at most 4 bytes a character, a turn's entry may hold its input twice
#: (``TurnStarted.text`` and the user message), and half the entry is left for the
#: reply and the rest (4 * 2 * 1 MiB = 8 MiB of the 16 MiB).
MAX_TEXT_CHARS: Final = 1024 * 1024
#: The largest value of an integer field of a record (seqs and counts; the least is 0).
MAX_SEQ: Final = 2**53 - 1
#: How deeply metadata may nest: the metadata map is level 1, a list in it level 2.
MAX_METADATA_DEPTH: Final = 32
#: Bytes of data for each map or array beyond the first FREE_CONTAINERS: decoding
#: refuses data that holds more (a Python dict costs 64 bytes or more, its msgpack
#: form one), and dumping refuses to write it. Every record's own fields take more
#: than this many bytes for each map and array they make, so only metadata can
#: reach the limit.
CONTAINER_BYTES: Final = 16
#: Maps and arrays that any data may hold whatever its size.
FREE_CONTAINERS: Final = 16384

# msgpack limits on top of the size cap: no session holds more entries in one
# array (messages) or one map (metadata), and a Timestamp is at most 12 bytes.
# Dumping checks metadata against them too; records reach the size cap first.
MAX_ARRAY_LEN: Final = 1_000_000
MAX_MAP_LEN: Final = 100_000
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
    """A map has keys its record does not know: a damaged field name."""


class _Extension:
    """What a msgpack extension other than Timestamp decodes to: valid nowhere."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


def _type_name(value: object) -> str:
    if isinstance(value, _Extension):
        return f"msgpack extension type {value.code}"
    return type(value).__name__


def _a(name: str) -> str:
    """``name`` with its indefinite article."""
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


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
    # Every integer field is a seq or a count: range-checked like any other input.
    if value.__class__ is int:
        if 0 <= value <= MAX_SEQ:
            return value
        raise _InvalidValueError("an integer out of range (0 to 2**53 - 1)")
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
        # Whatever else is wrong comes first (a damaged name also leaves its
        # field missing, which says more).
        structure({key: item for key, item in value.items() if key in allowed}, cls)
        unknown = ", ".join(sorted(repr(key)[:40] for key in value.keys() - allowed))
        raise _UnknownFieldsError(
            f"unknown fields in {name} ({unknown}): damaged field names, or written by"
            " a newer sessionactors"
        )

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
        if len(value) > MAX_MAP_LEN:
            raise _PlainError(ValueError, f"has more than {MAX_MAP_LEN} entries")
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
        if len(value) > MAX_ARRAY_LEN:
            raise _PlainError(ValueError, f"has more than {MAX_ARRAY_LEN} items")
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
    article = "an" if cls.__name__[:1].lower() in "aeiou" else "a"
    raise _PlainError(
        TypeError,
        f"is {article} {cls.__name__}; metadata holds plain data (dict with str keys, list,"
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


#: The records written without their ``usage`` while it is the default.
_USAGE_OMITTED: Final = frozenset({Message, SessionState, SessionInfo})


def _register_usage_omitted(conv: cattrs.Converter, cls: type[Any]) -> None:
    """``cls`` is written without its ``usage`` while that is the default: records
    without usage keep the bytes they had before the field existed (and load in an
    older sessionactors)."""
    assert cls in _USAGE_OMITTED  # the fast path omits it too
    conv.register_unstructure_hook(
        cls, make_dict_unstructure_fn(cls, conv, usage=override(omit_if_default=True))
    )


def _optional_record(type_: Any) -> Any:
    """The record class ``X`` of ``X | None``, or ``None`` for any other type."""
    if get_origin(type_) not in (Union, types.UnionType):
        return None
    args = get_args(type_)
    if len(args) != 2 or type(None) not in args:
        return None
    (inner,) = (arg for arg in args if arg is not type(None))
    return inner if attrs.has(inner) else None


def _optional_structure_factory(
    type_: Any, converter: cattrs.Converter
) -> Callable[[Any, object], Any]:
    # cattrs' own Optional hook looks the inner hook up on first use, making it
    # then: while decoding stored bytes. This one takes it when it is made.
    inner = _optional_record(type_)
    structure = converter.get_structure_hook(inner)

    def structure_optional(value: Any, _: object) -> Any:
        return None if value is None else structure(value, inner)

    return structure_optional


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
    conv.register_structure_hook_factory(
        lambda t: _optional_record(t) is not None, _optional_structure_factory
    )
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
    # Each hook is made after the hooks of the fields it reads.
    _register_tuple_unstructure(conv, ToolCall)
    _register_usage_omitted(conv, Message)
    _register_tuple_unstructure(conv, Message)
    _register_usage_omitted(conv, SessionState)
    _register_usage_omitted(conv, SessionInfo)

    configure_tagged_union(_EventUnion, conv, tag_generator=_TAG_OF.__getitem__, tag_name=_TAG_KEY)
    _build_hooks(conv)
    return conv


def _record_types() -> list[Any]:
    """Every type that a persisted record holds, records first, each once."""
    found: list[Any] = []
    pending: list[Any] = [SessionState, SessionInfo, *EVENT_TAGS.values()]
    while pending:
        type_ = pending.pop()
        if type_ in found:
            continue
        found.append(type_)
        if attrs.has(type_):
            pending.extend(field.type for field in attrs.fields(type_))
        else:
            pending.extend(arg for arg in get_args(type_) if arg is not Ellipsis)
    return found


def _build_hooks(conv: cattrs.Converter) -> None:
    """Make, now, every hook that encoding and decoding will ask the converter for.

    cattrs makes a record's hooks on first use, by generating and executing
    code; done here, no stored bytes ever meet that step. The union's hooks
    are made by ``configure_tagged_union``; each field's hook is made with
    its record's.
    """
    for type_ in _record_types():
        if type_ is Any or type_ is type(None):
            continue
        conv.get_structure_hook(type_)
        conv.get_unstructure_hook(type_)
    conv.get_structure_hook(_EventUnion)
    conv.get_unstructure_hook(_EventUnion)


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


# -- checking what is dumped ---------------------------------------------------------
#
# cattrs unstructures by the declared types without looking at the values, and
# msgpack writes whatever it is given: an int in a str field would be written,
# and then refused on every load. Each record class gets a checker, made here
# from its fields (the code is generated and compiled once, as cattrs does its
# hooks): it refuses every value that loading would refuse, and counts the maps
# and arrays the record makes. Only a refusal takes the slow path that names
# the field.


class _FieldError(Exception):
    """A value that loading would refuse; ``path`` is filled in on the way out."""

    def __init__(self, error: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.error = error
        self.problem = problem
        self.path: list[str] = []


def _refuse(value: Any, expected: str, at: str = "") -> None:
    """Raise the error for the field ``at`` holding ``value`` where ``expected`` belongs."""
    if value.__class__ is int and expected == _COUNT:
        error = _FieldError(ValueError, f"is {value}, out of range; expected {expected}")
    elif isinstance(value, datetime.datetime) and expected == _AWARE:
        error = _FieldError(ValueError, "is a naive datetime; use an aware one such as utcnow()")
    else:
        error = _FieldError(TypeError, f"is {_a(_type_name(value))}; expected {expected}")
    if at:
        error.path.append(at)
    raise error


_COUNT: Final = "an integer from 0 to 2**53 - 1"
_AWARE: Final = "an aware datetime"


def _is_str(value: Any) -> bool:
    # a str subclass (a StrEnum member) is written as its text and loads equal
    return isinstance(value, str)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQ


def _is_aware(value: Any) -> bool:
    return isinstance(value, datetime.datetime) and value.utcoffset() is not None


def _check_records(values: Any, check: Callable[[Any], int], expected: str, at: str) -> int:
    """Check the tuple of records in field ``at``; the number of maps and arrays it makes."""
    if values.__class__ is not tuple:
        _refuse(values, expected, at)
    count = 1
    for index, value in enumerate(values):
        try:
            count += check(value)
        except _FieldError as exc:
            exc.path += (f"[{index}]", at)
            raise
    return count


def _check_strings(values: Any, expected: str, at: str) -> int:
    """Check the tuple of strings in field ``at``; it makes one array."""
    if values.__class__ is not tuple:
        _refuse(values, expected, at)
    for index, value in enumerate(values):
        if not _is_str(value):
            _refuse(value, "a string", f"{at}[{index}]")
    return 1


_FLAT: Final = frozenset({str, float, bool, bytes, type(None)})


def _check_metadata(value: Any, at: str) -> int:
    """Check the metadata in field ``at`` as loading would; the maps and arrays in it."""
    if value.__class__ is dict:  # most metadata: a flat map of short values
        for key, item in value.items():
            if key.__class__ is not str or (
                item.__class__ not in _FLAT
                and not (item.__class__ is int and -(2**63) <= item < 2**64)
            ):
                break
        else:
            return 1
    elif not isinstance(value, Mapping):
        _refuse(value, "a mapping", at)
    try:
        return _plain_count(value, 1)
    except _PlainError as exc:
        error = _FieldError(exc.error, exc.problem)
        error.path = [*exc.path, at]
        raise error from None


def _plain_count(value: Any, depth: int) -> int:
    cls = value.__class__
    if cls is int:
        if -(2**63) <= value < 2**64:
            return 0
        raise _PlainError(ValueError, "is an integer out of the 64-bit range")
    if cls in _SCALARS:
        return 0
    if depth > MAX_METADATA_DEPTH:
        raise _PlainError(ValueError, f"is nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, Mapping):
        if len(value) > MAX_MAP_LEN:
            raise _PlainError(ValueError, f"has more than {MAX_MAP_LEN} entries")
        count = 1
        for key, item in value.items():
            if key.__class__ is not str:
                raise _PlainError(TypeError, f"has a {_type_name(key)} key; keys must be str")
            try:
                count += _plain_count(item, depth + 1)
            except _PlainError as exc:
                exc.path.append(f"[{key!r}]")
                raise
        return count
    if cls is list or cls is tuple:
        if len(value) > MAX_ARRAY_LEN:
            raise _PlainError(ValueError, f"has more than {MAX_ARRAY_LEN} items")
        count = 1
        for index, item in enumerate(value):
            try:
                count += _plain_count(item, depth + 1)
            except _PlainError as exc:
                exc.path.append(f"[{index}]")
                raise
        return count
    _plain(value, depth)  # an aware datetime; anything else raises, saying what is wrong
    return 0


def _field_check(name: str, type_: Any, names: dict[str, Any]) -> list[str]:
    """Source lines that check ``v`` (the value of field ``name``) and count into ``n``."""
    expected = _expected(type_)
    names[f"x_{name}"] = expected
    at = f"'.{name}'"
    refuse = f"_refuse(v, x_{name}, {at})"
    if type_ is str:
        return [f"if v.__class__ is not str and not _is_str(v): {refuse}"]
    if type_ == str | None:
        return [f"if v is not None and v.__class__ is not str and not _is_str(v): {refuse}"]
    if type_ is int:
        return [
            f"if v.__class__ is not int or not 0 <= v <= {MAX_SEQ}:",
            f"    if not _is_count(v): {refuse}",
        ]
    if type_ is bool:
        return [f"if v.__class__ is not bool: {refuse}"]
    if type_ is datetime.datetime:
        return [
            "if v.__class__ is not _datetime or v.tzinfo is None:",
            f"    if not _is_aware(v): {refuse}",
        ]
    if _is_enum(type_):
        names[f"e_{name}"] = type_
        return [f"if v.__class__ is not e_{name}: {refuse}"]
    if _is_metadata(type_):
        return [f"n += 1 if v is _NO_METADATA else _check_metadata(v, {at})"]
    if _is_homogeneous_tuple(type_):
        item = get_args(type_)[0]
        empty = "if v.__class__ is tuple and not v: n += 1"
        if item is str:
            return [empty, f"else: n += _check_strings(v, x_{name}, {at})"]
        if attrs.has(item):
            names[f"c_{name}"] = _CHECKS[item]
            return [empty, f"else: n += _check_records(v, c_{name}, x_{name}, {at})"]
    inner = type_ if attrs.has(type_) else _optional_record(type_)
    if inner is not None:
        names[f"c_{name}"] = _CHECKS[inner]
        check = [
            f"try: n += c_{name}(v)",
            f"except _FieldError as exc: exc.path.append({at}); raise",
        ]
        if inner is type_:
            return check
        return ["if v is not None:", *(f"    {line}" for line in check)]
    raise TypeError(f"the codec cannot check a field of type {type_!r}: teach _field_check")


def _expected(type_: Any) -> str:
    if type_ is int:
        return _COUNT
    if type_ is datetime.datetime:
        return _AWARE
    if type_ == str | None:
        return "a string or None"
    if _is_metadata(type_):
        return "a mapping"
    if _is_homogeneous_tuple(type_):
        return f"a tuple of {_expected(get_args(type_)[0])}"
    inner = _optional_record(type_)
    if inner is not None:
        return f"{_a(inner.__name__)} or None"
    return {str: "a string", bool: "a bool"}.get(type_) or _a(getattr(type_, "__name__", "value"))


class _Checks(dict[type[Any], Callable[[Any], int]]):
    """Each record class's checker, made on first lookup (while this module loads)."""

    def __missing__(self, cls: type[Any]) -> Callable[[Any], int]:
        names: dict[str, Any] = {
            "cls": cls,
            "_refuse": _refuse,
            "_FieldError": _FieldError,
            "_is_str": _is_str,
            "_is_count": _is_count,
            "_is_aware": _is_aware,
            "_datetime": datetime.datetime,
            "_NO_METADATA": NO_METADATA,
            "_check_metadata": _check_metadata,
            "_check_records": _check_records,
            "_check_strings": _check_strings,
            "x_cls": _a(cls.__name__),
        }
        lines = [
            "def check(o):",
            "    if o.__class__ is not cls: _refuse(o, x_cls)",
            "    n = 1",
        ]
        for field in attrs.fields(cls):
            lines.append(f"    v = o.{field.name}")
            lines += [f"    {line}" for line in _field_check(field.name, field.type, names)]
        lines.append("    return n")
        code = compile("\n".join(lines), f"<sessionactors codec check {cls.__name__}>", "exec")
        exec(code, names)  # at import only: the code is made from the record's own fields
        check: Callable[[Any], int] = names["check"]
        self[cls] = check
        return check


_CHECKS: Final = _Checks()
for _type in _record_types():
    if attrs.has(_type):
        _CHECKS[_type]
del _type
_check_state: Final = _CHECKS[SessionState]
_check_info: Final = _CHECKS[SessionInfo]
_check_message: Final = _CHECKS[Message]


# -- the fast path: check and unstructure in one generated function --------------
#
# A journal entry and an info are written every turn. For each event class and
# SessionInfo, a function made here from the record's fields (like the checkers)
# checks every field and builds the record's map in one frame, with its nested
# records inlined: the same maps, and so the same bytes, as the checker and the
# cattrs hook make, and the same count of maps and arrays. It accepts only what
# the checker accepts, more strictly (exact classes, plain metadata); anything
# else raises _Slow, and the general path (which names what is wrong) runs instead.


#: The empty map the fast paths pack in place of the shared empty metadata (never changed).
_EMPTY_MAP: Final[dict[str, Any]] = {}


class _Slow(Exception):
    """A value the fast path does not take: encode it the general way."""


#: Fields written only when they differ from their default (see _register_usage_omitted).
_OMITTED_IF_DEFAULT: Final = "usage"


class _FastBuilder:
    """The source of one fast function: statements that check and build, variable by
    variable (``o0`` the record, ``d0`` its map, ``n`` the maps and arrays)."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names
        self.lines: list[str] = []
        self.count = 0

    def name(self, prefix: str, value: Any) -> str:
        self.count += 1
        key = f"{prefix}{self.count}"
        self.names[key] = value
        return key

    def record(self, cls: type[Any], obj: str, indent: str, omit: bool) -> str:
        """Statements that check ``obj`` (already known to be a ``cls``) and build its
        map; the map's variable."""
        lines = self.lines
        lines.append(f"{indent}n += 1")
        items: list[str] = []
        late: list[str] = []
        for field in attrs.fields(cls):
            value = f"{obj}_{field.name}"
            lines.append(f"{indent}{value} = {obj}.{field.name}")
            if omit and field.name == _OMITTED_IF_DEFAULT:
                # the default (a record) is written as nothing: checked and built only
                # when it is not the default
                default = self.name("default", field.default)
                cls_name = self.name("cls", field.default.__class__)
                late.append(
                    f"{indent}if {value} is not {default} and "
                    f"({value}.__class__ is not {cls_name} or {value} != {default}):"
                )
                start = len(lines)
                expr = self.field(field.type, value, indent + "    ")
                late += lines[start:]
                del lines[start:]
                late.append(f"{indent}    {obj}_d[{field.name!r}] = {expr}")
            else:
                expr = self.field(field.type, value, indent)
                items.append(f"{field.name!r}: {expr}")
        lines.append(f"{indent}{obj}_d = {{{', '.join(items)}}}")
        lines.extend(late)
        return f"{obj}_d"

    def field(self, type_: Any, v: str, indent: str) -> str:
        """Statements that check the value ``v`` of a field of ``type_``; its expression."""
        lines = self.lines
        slow = "raise _Slow"
        if type_ is str:
            lines.append(f"{indent}if {v}.__class__ is not str: {slow}")
            return v
        if type_ == str | None:
            lines.append(f"{indent}if {v} is not None and {v}.__class__ is not str: {slow}")
            return v
        if type_ is int:
            lines.append(
                f"{indent}if {v}.__class__ is not int or not 0 <= {v} <= {MAX_SEQ}: {slow}"
            )
            return v
        if type_ is bool:
            lines.append(f"{indent}if {v}.__class__ is not bool: {slow}")
            return v
        if type_ is datetime.datetime:
            lines.append(f"{indent}if {v}.__class__ is not _datetime or {v}.tzinfo is None: {slow}")
            return v
        if _is_enum(type_):
            enum_name = self.name("enum", type_)
            lines.append(f"{indent}if {v}.__class__ is not {enum_name}: {slow}")
            return f"{v}._value_"
        if _is_metadata(type_):
            lines += [
                # the shared empty metadata, or an empty map (a session's, as spawned)
                # (the shared empty metadata is a dict of its own class: a plain one is
                # packed in its place, the same bytes)
                f"{indent}if {v} is _NO_METADATA:",
                f"{indent}    n += 1",
                f"{indent}    {v} = _EMPTY_MAP",
                f"{indent}elif {v}.__class__ is dict and not {v}: n += 1",
                f"{indent}else:",
                f"{indent}    try: {v}_n = _check_metadata({v}, '')",
                f"{indent}    except _FieldError: {slow}",
                f"{indent}    n += {v}_n",
                # a dict without maps or lists in it is plain data as it is: no copy
                f"{indent}    if {v}_n != 1 or {v}.__class__ is not dict:",
                f"{indent}        {v} = _unstructure_metadata({v})",
            ]
            return v
        if _is_homogeneous_tuple(type_):
            item = get_args(type_)[0]
            if attrs.has(item):  # each record inlined, as a single one is
                cls_name = self.name("cls", item)
                lines += [
                    f"{indent}if {v}.__class__ is not tuple: {slow}",
                    f"{indent}n += 1",
                    f"{indent}{v}_l = []",
                    f"{indent}for {v}_i in {v}:",
                    f"{indent}    if {v}_i.__class__ is not {cls_name}: {slow}",
                ]
                loop = indent + "    "
                item_map = self.record(item, f"{v}_i", loop, item in _USAGE_OMITTED)
                lines.append(f"{loop}{v}_l.append({item_map})")
                return f"{v}_l"
            hook = self.name("hook", _CONVERTER.get_unstructure_hook(type_))
            if item is str:
                count = f"_check_strings({v}, '', '')"
            else:  # pragma: no cover - no such field today
                raise TypeError(f"no fast path for a field of type {type_!r}")
            lines += [
                f"{indent}if {v}.__class__ is not tuple: {slow}",
                f"{indent}if {v}:",
                f"{indent}    try: n += {count}",
                f"{indent}    except _FieldError: {slow}",
                f"{indent}    {v} = {hook}({v})",
                f"{indent}else:",
                f"{indent}    n += 1",
                f"{indent}    {v} = []",
            ]
            return v
        inner = type_ if attrs.has(type_) else _optional_record(type_)
        if inner is None:  # pragma: no cover - no such field today
            raise TypeError(f"no fast path for a field of type {type_!r}")
        cls_name = self.name("cls", inner)
        if inner is type_:
            lines.append(f"{indent}if {v}.__class__ is not {cls_name}: {slow}")
            return self.record(inner, v, indent, inner in _USAGE_OMITTED)
        lines += [
            f"{indent}if {v} is None: {v}_d = None",
            f"{indent}elif {v}.__class__ is not {cls_name}: {slow}",
            f"{indent}else:",
        ]
        return self.record(inner, v, indent + "    ", inner in _USAGE_OMITTED)


def _make_fast(
    cls: type[Any], tag: str | None, *, exact: bool = True
) -> Callable[[Any], tuple[dict[str, Any], int]]:
    """The fast function of ``cls``: its map (with the tag ``tag``, if given) and the
    number of maps and arrays in it; raises _Slow for anything unusual. Without
    ``exact``, it reads the fields from any object that has them as attributes."""
    names: dict[str, Any] = {
        "_Slow": _Slow,
        "_FieldError": _FieldError,
        "_datetime": datetime.datetime,
        "_NO_METADATA": NO_METADATA,
        "_EMPTY_MAP": _EMPTY_MAP,
        "_check_metadata": _check_metadata,
        "_check_records": _check_records,
        "_check_strings": _check_strings,
        "_unstructure_metadata": _unstructure_metadata,
        "cls": cls,
    }
    builder = _FastBuilder(names)
    builder.lines.append("def fast(o):")
    if exact:
        builder.lines.append("    if o.__class__ is not cls: raise _Slow")
    builder.lines.append("    n = 0")
    result = builder.record(cls, "o", "    ", cls in _USAGE_OMITTED)
    if tag is not None:
        builder.lines.append(f"    {result}[{_TAG_KEY!r}] = {tag!r}")
    builder.lines.append(f"    return {result}, n")
    code = compile("\n".join(builder.lines), f"<sessionactors codec fast {cls.__name__}>", "exec")
    exec(code, names)  # at import only: the code is made from the record's own fields
    fast: Callable[[Any], tuple[dict[str, Any], int]] = names["fast"]
    return fast


_FAST_EVENTS: Final = {cls: _make_fast(cls, tag) for cls, tag in _TAG_OF.items()}
_fast_info: Final = _make_fast(SessionInfo, None)
_fast_message: Final = _make_fast(Message, None)  # (a snapshot's new messages)
_fast_live_info: Final = _make_fast(SessionInfo, None, exact=False)


def _raise(error: Exception) -> int:
    raise error


def _check(check: Callable[[Any], int], record: Any, what: str, session_id: object) -> int:
    """Run ``check`` on ``record``; a refusal names the session and the field."""
    try:
        return check(record)
    except _FieldError as exc:
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


def _refusal(what: str, session_id: str | None, exc: BaseException) -> SnapshotError:
    """The error for a map that does not structure: corruption.

    Fields this version does not know are taken for damage too: one flipped
    bit in a field's name makes an unknown field, and a newer sessionactors
    that adds a snapshot field raises ``schema_version`` (see the module's rules).
    """
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
    # Data this small cannot hold more maps and arrays than the budget allows:
    # no hooks (a call per map and array) for it.
    hook = None if size <= FREE_CONTAINERS else _container_budget(_container_limit(size))
    try:
        raw = msgpack.unpackb(
            data,
            timestamp=3,
            strict_map_key=True,
            ext_hook=_foreign_ext,
            list_hook=hook,
            object_hook=hook,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=min(size, MAX_ARRAY_LEN),
            max_map_len=min(size, MAX_MAP_LEN),
            max_ext_len=_MAX_EXT_LEN,
        )
    except _DECODE_ERRORS as exc:
        raise _corrupt(what, session_id, _describe(exc)) from exc
    return raw


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


def _exact_packer() -> msgpack.Packer:
    """This thread's packer of exact types only (``strict_types``: no subclass checks,
    about a third faster), for the maps the fast paths build, which hold only exact
    dicts, lists, str, int, float, bool, bytes, None and aware datetimes. The same
    bytes as :func:`_packer`'s; anything else raises TypeError (the general path then
    says what is wrong, if anything is)."""
    try:
        packer: msgpack.Packer = _PACKERS.exact
    except AttributeError:
        packer = _PACKERS.exact = msgpack.Packer(datetime=True, strict_types=True)
    return packer


def _encode(
    unstructure: Callable[[Any], Any],
    record: Any,
    what: str,
    session_id: object,
    max_size: int,
    containers: int,
) -> bytes:
    """Pack a checked record (``containers``: the maps and arrays it makes)."""
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
            f" of {max_size} bytes; make it smaller (truncate or compact the history)"
        )
    if containers > _container_limit(size):
        raise ValueError(
            f"the {what} of session {session_id!r} would hold {containers} maps and arrays"
            f" in {size} bytes, more than loading accepts ({_container_limit(size)}: one per"
            f" {CONTAINER_BYTES} bytes beyond {FREE_CONTAINERS}); metadata holds too many"
            " small maps or lists: flatten it"
        )


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
            found = _find_unencodable(key, f"{path} key {key!r}", depth + 1)
            if not found:
                name = key if isinstance(key, str) and key.isidentifier() else f"[{key!r}]"
                found = _find_unencodable(item, f"{path}.{name}", depth + 1)
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
            return (
                f"{path} is a string that is not valid unicode (a lone surrogate); decode "
                "the input with errors='replace' first"
            )
    elif not isinstance(value, _PACKABLE):
        return f"{path} is a {_type_name(value)}, which has no msgpack form"
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
        raise TypeError(f"expected a SessionState, got {_type_name(state)}")
    if state.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"session {state.session_id!r} has schema_version {state.schema_version!r}, but"
            f" snapshots are written at version {SCHEMA_VERSION}; leave the default"
        )
    containers = _check(_check_state, state, "snapshot", state.session_id)
    return _encode(_unstructure_state, state, "snapshot", state.session_id, max_size, containers)


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
        except (ValueError, TypeError, AttributeError, OverflowError, _FieldError):
            data, containers = None, 0
        if data is None or len(data) > max_size or containers > _container_limit(len(data)):
            # dump_snapshot says what is wrong
            self.clear()
            return dump_snapshot(state, max_size=max_size)
        return data

    def _dump(self, state: SessionState, messages: tuple[Message, ...]) -> tuple[bytes, int]:
        """The snapshot's bytes and the maps and arrays in it; checks what it packs."""
        packer = _packer()
        previous = self._messages
        if previous and len(previous) <= len(messages) and all(map(_is, previous, messages)):
            new = messages[len(previous) :]
            body = self._body
            containers = self._containers
        else:
            new, body, containers = messages, b"", 0
        if messages.__class__ is not tuple:
            raise TypeError("messages is not a tuple")
        if new:
            maps: list[dict[str, Any]] = []
            count = 0
            try:
                for message in new:
                    raw, n = _fast_message(message)
                    maps.append(raw)
                    count += n
            except _Slow:  # something unusual: the checker refuses it, or it is fine
                count = sum(map(_check_message, new))
                maps = [_unstructure_message(m) for m in new]
            containers += count
            packed = packer.pack(maps)
            body += packed[_array_header_size(len(new)) :]
        # Every field but the messages, packed as the state's own map would be.
        rest = attrs.evolve(state, messages=())
        total = _check_state(rest) + containers  # the empty tuple counted the array
        raw = _unstructure_state(rest)
        keys = list(raw)
        at = keys.index("messages")
        # (both parts have fewer than 16 fields: each packs with a one-byte header)
        head = packer.pack({k: raw[k] for k in keys[:at]})[1:]
        tail = packer.pack({k: raw[k] for k in keys[at + 1 :]})[1:]
        data = b"".join(
            (
                _map_header(len(keys)),
                head,
                packer.pack("messages"),
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
    containers = _check(_CHECKS[event.__class__], event, "journal entry", event.session_id)
    return _encode(
        _unstructure_event, event, "journal entry", event.session_id, max_size, containers
    )


def load_event(
    data: bytes, *, session_id: str | None = None, max_size: int = DEFAULT_MAX_EVENT_BYTES
) -> Event:
    """Decode one journal entry; raises :class:`SnapshotCorruptError` if it is not valid."""
    return _structure_event_map(
        _unpack_map(data, "journal entry", session_id, max_size), session_id
    )


def dump_events(events: Sequence[Event], *, max_size: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode the events of one commit as one journal entry (an array of tagged maps).

    Raises ``TypeError`` for an event class without a journal tag, and refuses
    whatever :func:`load_events` would refuse, as :func:`dump_snapshot` does,
    naming the session and the field (``$[1].message.content``).
    """
    if not events:
        raise ValueError("a journal entry holds at least one event")
    session_id = events[0].session_id
    try:
        containers = 1
        maps = []
        for event in events:
            fast = _FAST_EVENTS.get(event.__class__)
            if fast is None:
                raise _Slow
            raw, count = fast(event)
            containers += count
            maps.append(raw)
        data: bytes = _exact_packer().pack(maps)
    except (_Slow, ValueError, TypeError, AttributeError, OverflowError):
        pass  # the general path says what is wrong, if anything is
    else:
        if len(data) > max_size or containers > FREE_CONTAINERS:  # (else within the limits)
            _check_size(data, containers, "journal entry", session_id, max_size)
        return data
    containers = 1
    for index, event in enumerate(events):
        check = _CHECKS.get(event.__class__) if event.__class__ in _TAG_OF else None
        if check is None:
            raise TypeError(f"{_type_name(event)} has no journal tag; give it one in EVENT_TAGS")
        try:
            containers += check(event)
        except _FieldError as exc:
            exc.path.append(f"[{index}]")
            _check(_raise, exc, "journal entry", session_id)
    return _encode(_unstructure_events, events, "journal entry", session_id, max_size, containers)


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
    try:
        raw, containers = _fast_info(info)
        data: bytes = _exact_packer().pack(raw)
    except (_Slow, ValueError, TypeError, AttributeError, OverflowError):
        pass  # the general path says what is wrong, if anything is
    else:
        if len(data) > MAX_INFO_BYTES or containers > FREE_CONTAINERS:
            _check_size(data, containers, "info", info.session_id, MAX_INFO_BYTES)
        return data
    if not isinstance(info, SessionInfo):
        raise TypeError(f"expected a SessionInfo, got {_type_name(info)}")
    containers = _check(_check_info, info, "info", info.session_id)
    return _encode(_unstructure_info, info, "info", info.session_id, MAX_INFO_BYTES, containers)


def dump_live_info(session: Any) -> bytes:
    """``dump_info(session.info())`` for a live session (any object with the fields of
    :class:`SessionInfo` as attributes, and ``info()``), without making the record."""
    try:
        raw, containers = _fast_live_info(session)
        data: bytes = _exact_packer().pack(raw)
    except (_Slow, ValueError, TypeError, AttributeError, OverflowError):
        return dump_info(session.info())  # the general path says what is wrong
    if len(data) > MAX_INFO_BYTES or containers > FREE_CONTAINERS:
        _check_size(data, containers, "info", session.session_id, MAX_INFO_BYTES)
    return data


def load_info(data: bytes, *, session_id: str | None = None) -> SessionInfo:
    """Decode a session's short description; raises :class:`SnapshotCorruptError` if invalid."""
    raw = _unpack_map(data, "info", session_id, MAX_INFO_BYTES)
    session_id = _session_id_in(raw, session_id)
    try:
        info: SessionInfo = _structure_info(raw, SessionInfo)
    except _DECODE_ERRORS as exc:
        raise _refusal("info", session_id, exc) from exc
    return info
