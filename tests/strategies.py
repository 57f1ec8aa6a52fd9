"""Hypothesis strategies for records and events, shared by the test modules.

Records are built field by field from their attrs types, so a field added to a
record is generated (and round-tripped) without touching this module; a field
of a type it does not know raises ``TypeError`` here, to be taught.

Every value drawn survives a codec round trip unchanged: datetimes are
timezone-aware, integer fields are seqs and counts (0 to ``MAX_SEQ``),
metadata integers fit msgpack, floats are never NaN, metadata is plain data
(lists rather than tuples) nested well under the codec's limit, and ids and
session names are valid names (non-empty, no control characters).

``with_a_wrong_value`` draws records with one value anywhere in them replaced
by an arbitrary one, to drive the encoder with what it must refuse.
"""

import datetime
import enum
import sys
import types
from collections.abc import Mapping
from typing import Any, TypeVar, Union, cast, get_args, get_origin

import attrs
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors.stores import MAX_SEQ

__all__ = [
    "MSGPACK_INT_MAX",
    "MSGPACK_INT_MIN",
    "aware_datetimes",
    "chat_histories",
    "event_classes",
    "events",
    "identifiers",
    "messages",
    "metadata",
    "records",
    "session_infos",
    "session_states",
    "texts",
    "tool_calls",
    "with_a_wrong_value",
    "wrong_values",
]

#: The integers msgpack can hold.
MSGPACK_INT_MIN = -(2**63)
MSGPACK_INT_MAX = 2**64 - 1

_T = TypeVar("_T")

_OFFSETS = [datetime.UTC] + [
    datetime.timezone(datetime.timedelta(minutes=minutes)) for minutes in (-480, -150, 60, 330)
]


def identifiers() -> st.SearchStrategy[str]:
    """Ids and session names: short, non-empty, without control characters."""
    return st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=24)


def texts() -> st.SearchStrategy[str]:
    """Message content and other free text (any unicode but lone surrogates)."""
    return st.text(max_size=80)


def aware_datetimes() -> st.SearchStrategy[datetime.datetime]:
    """Timezone-aware datetimes across nearly all of the datetime range, at several offsets."""
    return st.datetimes(
        min_value=datetime.datetime(1, 1, 2),
        max_value=datetime.datetime(9999, 12, 30),
        timezones=st.sampled_from(_OFFSETS),
    )


def _plain(depth: int) -> st.SearchStrategy[Any]:
    scalars: st.SearchStrategy[Any] = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(MSGPACK_INT_MIN, MSGPACK_INT_MAX),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    if depth <= 1:
        return scalars
    inner = _plain(depth - 1)
    return st.one_of(
        scalars,
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(max_size=10), inner, max_size=3),
    )


def metadata(max_depth: int = 4) -> st.SearchStrategy[Mapping[str, Any]]:
    """Metadata: a map of JSON-ish values (plus bytes) at most ``max_depth`` levels deep."""
    return st.dictionaries(st.text(max_size=10), _plain(max_depth - 1), max_size=4)


_SEQS = st.integers(0, MAX_SEQ)
_SCHEMA_VERSION = attrs.fields(sa.SessionState).schema_version.default
#: Fields of type str that hold an id or a name rather than free text.
_ID_FIELDS = frozenset({"id", "key", "name", "agent", "idempotency_key"})


def _is_id(name: str) -> bool:
    return name in _ID_FIELDS or name.endswith("_id")


def _for_type(type_: Any, name: str) -> st.SearchStrategy[Any]:
    """A strategy for one field of type ``type_`` named ``name``."""
    origin, args = get_origin(type_), get_args(type_)
    if origin in (Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        strategy = st.one_of([_for_type(arg, name) for arg in options])
        return st.none() | strategy if len(options) < len(args) else strategy
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        items = _for_type(args[0], name.removesuffix("s"))
        return st.lists(items, max_size=3).map(tuple)
    if origin is Mapping and args == (str, Any):
        return metadata()
    if type_ is str:
        return identifiers() if _is_id(name) else texts()
    if type_ is bool:
        return st.booleans()
    if type_ is int:
        return _SEQS
    if type_ is float:
        return st.floats(allow_nan=False)
    if type_ is bytes:
        return st.binary(max_size=20)
    if type_ is datetime.datetime:
        return aware_datetimes()
    if isinstance(type_, type) and issubclass(type_, enum.Enum):
        return st.sampled_from(type_)
    if attrs.has(type_):
        return records(type_)
    raise TypeError(f"no strategy for field {name!r} of type {type_!r}: add one to strategies.py")


def records(cls: type[_T], **overrides: st.SearchStrategy[Any]) -> st.SearchStrategy[_T]:
    """Instances of the attrs class ``cls``, every field drawn from its type."""
    fields = {
        field.name: overrides[field.name]
        if field.name in overrides
        else _for_type(field.type, field.name)
        for field in attrs.fields(cast(Any, cls))
        if field.init
    }
    return st.builds(cls, **fields)


def tool_calls() -> st.SearchStrategy[sa.ToolCall]:
    """A tool call with arbitrary (not necessarily JSON) argument text."""
    return records(sa.ToolCall)


def messages() -> st.SearchStrategy[sa.Message]:
    """A message of any role, with or without tool calls and metadata."""
    return records(sa.Message, metadata=metadata(max_depth=3))


@st.composite
def _completed_turns(
    draw: st.DrawFn, history: tuple[sa.Message, ...]
) -> tuple[sa.CompletedTurn, ...]:
    """Completed idempotency keys as a session holds them: each with a reply of the
    history (the last message of its id), with a reply the history does not hold (as a
    snapshot of schema version 2 may), or without its reply (an edit removed it)."""
    held = {m.id: m for m in history}
    out = []
    for _ in range(draw(st.integers(0, 3))):
        key, turn_id = draw(identifiers()), draw(identifiers())
        kind = draw(st.sampled_from(["held", "whole", "removed"] if held else ["whole", "removed"]))
        if kind == "held":
            reply: sa.Message | None = held[draw(st.sampled_from(sorted(held)))]
        elif kind == "whole":
            reply = draw(messages().filter(lambda m: m.id not in held))
        else:
            gone = draw(identifiers().filter(lambda i: i not in held))
            out.append(sa.CompletedTurn(key=key, turn_id=turn_id, reply=None, reply_id=gone))
            continue
        out.append(sa.CompletedTurn(key=key, turn_id=turn_id, reply=reply))
    return tuple(out)


def session_states() -> st.SearchStrategy[sa.SessionState]:
    """A session state at the current schema version, with a few messages and keys."""
    return (
        st.lists(messages(), max_size=4)
        .map(tuple)
        .flatmap(
            lambda history: records(
                sa.SessionState,
                schema_version=st.just(_SCHEMA_VERSION),
                messages=st.just(history),
                completed=_completed_turns(history),
            )
        )
    )


def session_infos() -> st.SearchStrategy[sa.SessionInfo]:
    """A session's short description."""
    return records(sa.SessionInfo)


def event_classes() -> list[type[sa.Event]]:
    """Every concrete event class the package defines (every subclass of ``Event``)."""
    # attrs replaces each slotted class with a new one; the replaced class can
    # linger among the subclasses until it is collected, so only the class its
    # module exports counts.
    found: set[type[sa.Event]] = set()
    pending = list(sa.Event.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        module = sys.modules.get(cls.__module__)
        if (
            cls.__module__.startswith("sessionactors.")
            and getattr(module, cls.__name__, None) is cls
        ):
            found.add(cls)
    return sorted(found, key=lambda cls: cls.__name__)


def events(*classes: type[sa.Event]) -> st.SearchStrategy[sa.Event]:
    """An event of one of ``classes`` (by default of every concrete event class)."""
    return st.one_of([records(cls) for cls in classes or event_classes()])


def wrong_values() -> st.SearchStrategy[Any]:
    """Values of every kind, most of them wrong for most fields: numbers of any
    size and sign, booleans, text with lone surrogates, bytes, naive and aware
    datetimes, containers, enums and records."""
    naive = st.datetimes(min_value=datetime.datetime(1, 1, 2))
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([-1, MAX_SEQ, MAX_SEQ + 1, 2**63, 2**64, -(2**63) - 1]),
        st.floats(),
        st.text(max_size=5),
        st.text(st.characters(categories=("Cs",)), min_size=1, max_size=3),
        st.binary(max_size=5),
        naive,
        aware_datetimes(),
        st.sampled_from(list(sa.Role) + list(sa.Status)),
        st.builds(object),
    )
    return (
        st.recursive(
            scalars,
            lambda inner: st.one_of(
                st.lists(inner, max_size=3),
                st.lists(inner, max_size=3).map(tuple),
                st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3),
                st.frozensets(st.integers(), max_size=2),
            ),
            max_leaves=6,
        )
        | records(sa.ToolCall)
        | messages()
    )


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a record: attribute names into records, indexes into tuples,
    keys into metadata."""
    if attrs.has(type(value)):
        out = []
        for field in attrs.fields(type(value)):
            out.append((*path, field.name))
            out += _places(getattr(value, field.name), (*path, field.name))
        return out
    if isinstance(value, tuple | list):
        out = []
        for index, item in enumerate(value):
            out.append((*path, index))
            out += _places(item, (*path, index))
        return out
    if isinstance(value, Mapping):
        out = []
        for key, item in value.items():
            out.append((*path, key))
            out += _places(item, (*path, key))
        return out
    return []


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if attrs.has(type(value)):
        return attrs.evolve(value, **{head: _replace(getattr(value, head), rest, new)})
    if isinstance(value, tuple | list):
        items = list(value)
        items[head] = _replace(items[head], rest, new)
        return type(value)(items)
    copy = dict(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


@st.composite
def with_a_wrong_value(draw: st.DrawFn, base: st.SearchStrategy[_T]) -> _T:
    """A record from ``base`` with the value at one place in it replaced by any value."""
    record = draw(base)
    places = _places(record)
    if not places:
        return record
    path = draw(st.sampled_from(places))
    return cast(_T, _replace(record, path, draw(wrong_values())))


_T0 = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)


@st.composite
def chat_histories(draw: st.DrawFn, max_blocks: int = 12) -> list[sa.Message]:
    """A history that ``ref.replace_history`` accepts, of any shape a conversation can take:
    user messages, assistant replies (some interrupted), system notes and tool groups (an
    assistant message with 1 to 3 calls, answered in any order), in any order, so that it
    may begin with any of them or hold no user message at all."""
    out: list[sa.Message] = []

    def add(role: sa.Role, **fields: Any) -> sa.Message:
        message = sa.Message(
            id=f"h{len(out)}",
            role=role,
            content=f"{role.value} {len(out)}",
            created_at=_T0,
            **fields,
        )
        out.append(message)
        return message

    kinds = st.sampled_from(["user", "assistant", "interrupted", "system", "tools"])
    for kind in draw(st.lists(kinds, max_size=max_blocks), label="blocks"):
        if kind == "user":
            add(sa.Role.USER)
        elif kind in ("assistant", "interrupted"):
            add(sa.Role.ASSISTANT, interrupted=kind == "interrupted")
        elif kind == "system":
            add(sa.Role.SYSTEM)
        else:
            n = len(out)
            calls = tuple(
                sa.ToolCall(id=f"call{n}_{i}", name="echo", arguments="{}")
                for i in range(draw(st.integers(1, 3)))
            )
            add(sa.Role.ASSISTANT, tool_calls=calls)
            for i in draw(st.permutations(range(len(calls)))):
                add(sa.Role.TOOL, tool_call_id=calls[i].id)
    return out
