"""The codec's cattrs converter: strict structure hooks that check and never
coerce, plain metadata, and every hook made when the module loads (see
:mod:`._codec`).
"""

import datetime
import enum
import types
from collections.abc import Callable, Mapping
from typing import Any, Final, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.fns import identity
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union

from ._codec_format import (
    EVENT_TAGS,
    EVENT_UNION,
    MAX_ARRAY_LEN,
    MAX_MAP_LEN,
    MAX_METADATA_DEPTH,
    MAX_SEQ,
    TAG_KEY,
    TAG_OF,
)
from ._errors import shown
from ._events import (
    Event,
    HistoryEdited,
    MetadataChanged,
    StatusChanged,
)
from ._records import (
    NO_METADATA,
    CompletedTurn,
    Message,
    SessionInfo,
    SessionState,
    ToolCall,
)


class InvalidValueError(ValueError):
    """A value of the wrong type or shape; the message never quotes the value."""


class _UnknownFieldsError(InvalidValueError):
    """A map has keys its record does not know: a damaged field name."""


class Extension:
    """What a msgpack extension other than Timestamp decodes to: valid nowhere."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


def type_name(value: object) -> str:
    if isinstance(value, Extension):
        return f"msgpack extension type {value.code}"
    return type(value).__name__


def with_article(name: str) -> str:
    """``name`` with its indefinite article."""
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


# -- strict structure hooks: check, never coerce ------------------------------------


def _structure_str(value: Any, _: object) -> str:
    if value.__class__ is str:
        return value
    raise InvalidValueError(f"expected a string, got {type_name(value)}")


def _structure_optional_str(value: Any, _: object) -> str | None:
    if value is None or value.__class__ is str:
        return value
    raise InvalidValueError(f"expected a string or nil, got {type_name(value)}")


def _structure_int(value: Any, _: object) -> int:
    # Every integer field is a seq or a count: range-checked like any other input.
    if value.__class__ is int:
        if 0 <= value <= MAX_SEQ:
            return value
        raise InvalidValueError("an integer out of range (0 to 2**53 - 1)")
    raise InvalidValueError(f"expected an integer, got {type_name(value)}")


def _structure_float(value: Any, _: object) -> float:
    # An integer is a valid float: msgpack writers may store 1.0 as 1.
    if value.__class__ is float:
        return value
    if value.__class__ is int:
        return float(value)
    raise InvalidValueError(f"expected a number, got {type_name(value)}")


def _structure_bool(value: Any, _: object) -> bool:
    if value.__class__ is bool:
        return value
    raise InvalidValueError(f"expected a boolean, got {type_name(value)}")


def _structure_bytes(value: Any, _: object) -> bytes:
    if value.__class__ is bytes:
        return value
    raise InvalidValueError(f"expected bytes, got {type_name(value)}")


def datetime_problem(value: datetime.datetime) -> str | None:
    """What keeps the datetime ``value`` out of stored data, if anything: no time zone,
    or one that puts it outside UTC's years 1 to 9999 (it is stored as a UTC time)."""
    if value.utcoffset() is None:
        return "is a naive datetime; use an aware one such as utcnow()"
    try:
        value.astimezone(datetime.UTC)
    except OverflowError:
        return f"is {value.isoformat()}, which in UTC is outside the years 1 to 9999"
    return None


def _structure_datetime(value: Any, _: object) -> datetime.datetime:
    # msgpack turns every Timestamp into an aware UTC datetime (timestamp=3).
    if value.__class__ is datetime.datetime and value.tzinfo is datetime.UTC:
        return value
    raise InvalidValueError(f"expected a timestamp, got {type_name(value)}")


def is_enum(type_: Any) -> bool:
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
        raise InvalidValueError(f"not a {name} value")

    return structure_enum


def is_homogeneous_tuple(type_: Any) -> bool:
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
            raise InvalidValueError(f"expected an array, got {type_name(value)}")
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
        allowed |= {TAG_KEY}
    name = cls.__name__

    def structure_attrs(value: Any, _: object) -> Any:
        if value.__class__ is not dict:
            raise InvalidValueError(f"expected a map for {name}, got {type_name(value)}")
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

SCALARS: Final = frozenset({str, int, float, bool, bytes, type(None)})


def is_metadata(type_: Any) -> bool:
    return get_origin(type_) is Mapping and get_args(type_) == (str, Any)


_LOADED_SCALARS: Final = SCALARS | {datetime.datetime}


def _check_loaded(value: Any, depth: int) -> None:
    """Check a loaded metadata container: string keys, no extensions, bounded depth."""
    if depth > MAX_METADATA_DEPTH:
        raise InvalidValueError(f"metadata nested deeper than {MAX_METADATA_DEPTH} levels")
    if value.__class__ is dict:
        for key, item in value.items():
            if key.__class__ is not str:
                raise InvalidValueError(f"metadata key is {type_name(key)}, not a string")
            _check_loaded_item(item, depth)
    else:
        for item in value:
            _check_loaded_item(item, depth)


def _check_loaded_item(item: Any, depth: int) -> None:
    cls = item.__class__
    if cls is dict or cls is list:
        _check_loaded(item, depth + 1)
    elif cls not in _LOADED_SCALARS:
        raise InvalidValueError(f"metadata holds a {type_name(item)}")


def _structure_metadata(value: Any, _: object) -> dict[str, Any]:
    if value.__class__ is not dict:
        raise InvalidValueError(f"expected a map, got {type_name(value)}")
    if value:
        _check_loaded(value, 1)
        return value
    return NO_METADATA


class PlainError(Exception):
    """Metadata that cannot be dumped; ``path`` is filled in on the way out."""

    def __init__(self, error: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.error = error
        self.problem = problem
        self.path: list[str] = []


def as_plain(value: Any, depth: int) -> Any:
    """A checked copy of metadata for dumping: mappings become dicts, tuples lists."""
    cls = value.__class__
    if cls in SCALARS:
        return value
    if depth > MAX_METADATA_DEPTH:
        raise PlainError(ValueError, f"is nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, Mapping):
        if len(value) > MAX_MAP_LEN:
            raise PlainError(ValueError, f"has more than {MAX_MAP_LEN} entries")
        out = {}
        for key, item in value.items():
            if key.__class__ is not str:
                raise PlainError(TypeError, f"has a {type_name(key)} key; keys must be str")
            try:
                out[key] = as_plain(item, depth + 1)
            except PlainError as exc:
                exc.path.append(f"[{shown(key)}]")
                raise
        return out
    if cls is list or cls is tuple:
        if len(value) > MAX_ARRAY_LEN:
            raise PlainError(ValueError, f"has more than {MAX_ARRAY_LEN} items")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(as_plain(item, depth + 1))
            except PlainError as exc:
                exc.path.append(f"[{index}]")
                raise
        return items
    if cls is datetime.datetime:
        if value.tzinfo is not datetime.UTC:
            problem = datetime_problem(value)
            if problem is not None:
                raise PlainError(ValueError, problem)
        return value
    article = "an" if cls.__name__[:1].lower() in "aeiou" else "a"
    raise PlainError(
        TypeError,
        f"is {article} {cls.__name__}; metadata holds plain data (dict with str keys, list,"
        " tuple, str, bytes, int, float, bool, None, aware datetime)",
    )


def unstructure_metadata(value: Mapping[str, Any]) -> dict[str, Any]:
    if value is NO_METADATA or (value.__class__ is dict and not value):
        return value
    try:
        out: dict[str, Any] = as_plain(value, 1)
    except PlainError as exc:
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
USAGE_OMITTED: Final = frozenset({Message, SessionState, SessionInfo, HistoryEdited})


def _register_usage_omitted(conv: cattrs.Converter, cls: type[Any]) -> None:
    """``cls`` is written without its ``usage`` while that is the default: records
    without usage keep the bytes they had before the field existed (and load in an
    older sessionactors)."""
    assert cls in USAGE_OMITTED  # the fast path omits it too
    conv.register_unstructure_hook(
        cls, make_dict_unstructure_fn(cls, conv, usage=override(omit_if_default=True))
    )


#: The last field of a record that is written only when it differs from its default
#: (in the map form left out, in the compact form the array ends before it): records
#: without it keep the bytes they had before the field existed, which an older
#: sessionactors reads.
TRAILING_OMITTED: Final[dict[type[Any], str]] = {
    StatusChanged: "skipped_from",
    MetadataChanged: "replaced",
}


def _register_trailing_omitted(conv: cattrs.Converter, cls: type[Any]) -> None:
    name = TRAILING_OMITTED[cls]
    assert attrs.fields(cls)[-1].name == name  # (the compact form drops the array's last)
    omitted: dict[str, Any] = {name: override(omit_if_default=True)}
    conv.register_unstructure_hook(cls, make_dict_unstructure_fn(cls, conv, **omitted))


def optional_record(type_: Any) -> Any:
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
    inner = optional_record(type_)
    structure = converter.get_structure_hook(inner)

    def structure_optional(value: Any, _: object) -> Any:
        return None if value is None else structure(value, inner)

    return structure_optional


# -- completed idempotency keys: by their reply's id ------------------------------


@attrs.frozen(kw_only=True)
class StoredCompletedTurn:
    """A completed idempotency key as a snapshot holds it: with its reply whole (every
    key of schema version 2 and before; since, a key whose reply the history does not
    hold as it is), or with the id of its reply (``reply_id``), which the history
    holds, or held until an edit removed it."""

    key: str
    turn_id: str
    reply: Message | None = None
    reply_id: str | None = None


def _unstructure_completed_factory(conv: cattrs.Converter) -> Callable[[CompletedTurn], Any]:
    unstructure_reply = conv.get_unstructure_hook(Message)

    def unstructure_completed(turn: CompletedTurn) -> dict[str, Any]:
        # (the snapshot's writer gives a key whose reply the history holds without
        # its reply: see ``by_reference`` in _codec)
        reply = turn.reply
        if reply is None:
            return {"key": turn.key, "turn_id": turn.turn_id, "reply_id": turn.reply_id}
        return {"key": turn.key, "turn_id": turn.turn_id, "reply": unstructure_reply(reply)}

    return unstructure_completed


def _stored_completed_factory(conv: cattrs.Converter) -> Callable[[Any, object], Any]:
    structure = _attrs_structure_factory(StoredCompletedTurn, conv)

    def structure_stored_completed(value: Any, _: object) -> StoredCompletedTurn:
        stored: StoredCompletedTurn = structure(value, StoredCompletedTurn)
        if (stored.reply is None) == (stored.reply_id is None):
            raise InvalidValueError(
                "a completed idempotency key holds its reply or its reply's id, not "
                + ("both" if stored.reply is not None else "neither")
            )
        return stored

    return structure_stored_completed


_STORED_COMPLETED: Final = tuple[StoredCompletedTurn, ...]
_COMPLETED: Final = tuple[CompletedTurn, ...]


def _state_structure_factory(conv: cattrs.Converter) -> Callable[[Any, object], SessionState]:
    """A snapshot's state: its completed keys resolved against its history (a key
    written by its reply's id gets the very message of the history, or None if the
    history no longer holds it)."""
    structure = _attrs_structure_factory(SessionState, conv)
    structure_completed = conv.get_structure_hook(_STORED_COMPLETED)

    def structure_state(value: Any, _: object) -> SessionState:
        if value.__class__ is not dict or "completed" not in value:
            state: SessionState = structure(value, SessionState)
            return state
        state = structure({k: v for k, v in value.items() if k != "completed"}, SessionState)
        try:
            stored = structure_completed(value["completed"], _STORED_COMPLETED)
        except Exception as exc:
            note = AttributeValidationNote(
                "Structuring class SessionState @ attribute completed", "completed", _COMPLETED
            )
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            raise ClassValidationError(
                "While structuring SessionState", [exc], SessionState
            ) from None
        if not stored:
            return state
        return attrs.evolve(state, completed=_resolved(stored, state.messages))

    return structure_state


def _resolved(
    stored: tuple[StoredCompletedTurn, ...], messages: tuple[Message, ...]
) -> tuple[CompletedTurn, ...]:
    held: dict[str, Message] | None = None
    out = []
    for turn in stored:
        reply_id = turn.reply_id
        if reply_id is None:
            out.append(CompletedTurn(key=turn.key, turn_id=turn.turn_id, reply=turn.reply))
            continue
        if held is None:
            held = {m.id: m for m in messages}
        reply = held.get(reply_id)
        out.append(
            CompletedTurn(key=turn.key, turn_id=turn.turn_id, reply=reply, reply_id=reply_id)
        )
    return tuple(out)


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
    conv.register_structure_hook_factory(is_enum, _enum_structure_factory)
    conv.register_structure_hook_factory(is_homogeneous_tuple, _tuple_structure_factory)
    conv.register_structure_hook_func(is_metadata, _structure_metadata)
    conv.register_structure_hook_factory(
        lambda t: optional_record(t) is not None, _optional_structure_factory
    )
    conv.register_structure_hook_factory(attrs.has, _attrs_structure_factory)

    # Passed through for msgpack itself to write (datetimes as Timestamps):
    # the generated hooks then read these fields inline, with no call.
    conv.register_unstructure_hook(datetime.datetime, identity)
    # an enum's value from a dict: the ``.value`` property is a slow descriptor
    conv.register_unstructure_hook_factory(is_enum, _enum_unstructure_factory)
    conv.register_unstructure_hook(str | None, identity)
    conv.register_unstructure_hook_func(is_metadata, unstructure_metadata)
    # A history is long: a comprehension over the item's own hook beats the
    # generic iterable hook's generator (msgpack writes lists and tuples alike).
    # Each hook is made after the hooks of the fields it reads.
    _register_tuple_unstructure(conv, ToolCall)
    _register_usage_omitted(conv, Message)
    _register_tuple_unstructure(conv, Message)
    conv.register_unstructure_hook(CompletedTurn, _unstructure_completed_factory(conv))
    _register_usage_omitted(conv, SessionState)
    _register_usage_omitted(conv, SessionInfo)
    _register_usage_omitted(conv, HistoryEdited)
    for cls in TRAILING_OMITTED:
        _register_trailing_omitted(conv, cls)

    # (registered last: the hooks of one class win over the factories registered before)
    conv.register_structure_hook_func(
        lambda t: t is StoredCompletedTurn, _stored_completed_factory(conv)
    )
    conv.register_structure_hook_func(lambda t: t is SessionState, _state_structure_factory(conv))

    configure_tagged_union(EVENT_UNION, conv, tag_generator=TAG_OF.__getitem__, tag_name=TAG_KEY)
    _build_hooks(conv)
    return conv


def record_types() -> list[Any]:
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
    for type_ in record_types():
        if type_ is Any or type_ is type(None):
            continue
        conv.get_structure_hook(type_)
        conv.get_unstructure_hook(type_)
    conv.get_structure_hook(EVENT_UNION)
    conv.get_unstructure_hook(EVENT_UNION)


CONVERTER: Final = _make_converter()
unstructure_state: Final = CONVERTER.get_unstructure_hook(SessionState)
structure_state: Final = CONVERTER.get_structure_hook(SessionState)
unstructure_event: Final = CONVERTER.get_unstructure_hook(EVENT_UNION)
structure_event: Final = CONVERTER.get_structure_hook(EVENT_UNION)
unstructure_info: Final = CONVERTER.get_unstructure_hook(SessionInfo)
structure_info: Final = CONVERTER.get_structure_hook(SessionInfo)
unstructure_message: Final = CONVERTER.get_unstructure_hook(Message)
# Each event class's own hook and tag, looked up once: a journal entry is written
# every turn, and the union's dispatch is most of its cost. Same bytes as the union's.
EVENT_HOOKS: Final = {
    cls: (tag, CONVERTER.get_unstructure_hook(cls)) for cls, tag in TAG_OF.items()
}
