"""The compact form of a journal entry: every record an array of its fields, in order.

A journal entry holds the events of one commit. Written in the compact form it
is the array ``[COMPACT_ENTRY, session_id, event, ...]``, each event the array
``[tag, seq, field, ...]``: its tag from ``EVENT_TAGS``, then the fields of its
class in their declared order, without ``session_id`` (the entry's). A nested
record (a message, a tool call, a usage, a review) is the array of its fields
in the same way, a tuple of records an array of them, ``None`` for an optional
record nil; every other value is written as in the map form (enum values,
Timestamps, metadata maps). It is the map form without the keys and the
repeated session name: about half the bytes, and packed from arrays that are
cheaper to build than maps.

Rules: a record's fields keep their order, and a new field is added last, with a
default (an event's array ends before it while it is its default, if it is one of
``TRAILING_OMITTED``: an older sessionactors reads those). The order is attrs' (a
base class's fields first), so a class other records derive from (``Event``)
never gains a field: it would shift theirs. An
array shorter than its record's fields leaves the rest to their defaults
(records written before the field existed); one longer than them is corrupt
(written by a newer sessionactors). Reading turns each array back into
the map of the map form, so that the same structuring checks every value.

Pure (no trio); see :mod:`._codec` for the rest of the codec.
"""

from collections.abc import Iterator
from typing import Any, Final, get_args

import attrs

from ._codec_convert import CONVERTER, TRAILING_OMITTED, is_homogeneous_tuple, optional_record
from ._codec_format import COMPACT_ENTRY, EVENT_TAGS, TAG_KEY

__all__ = ["EVENT_FIELDS", "CompactError", "from_compact", "to_compact"]

#: How a field's value is laid out: as it is, or as nested record arrays.
_PLAIN: Final = 0
_RECORD: Final = 1  # a record: its array
_OPTIONAL: Final = 2  # a record or None: its array or nil
_RECORDS: Final = 3  # a tuple of records: an array of their arrays

#: A field's place in its record's array: name, layout, the nested record's fields
#: (layouts other than _PLAIN), the raw default written when a map of the map form
#: leaves the field out (only the fields omitted while they are their default).
_Field = tuple[str, int, "tuple[_Field, ...]", Any]
_NO_DEFAULT: Final = object()


def _fields(cls: type[Any], skip: str | None = None) -> tuple[_Field, ...]:
    out: list[_Field] = []
    for field in attrs.fields(cls):
        if field.name == skip:
            continue
        type_ = field.type
        inner: Any = None
        if attrs.has(type_):
            layout, inner = _RECORD, type_
        elif optional_record(type_) is not None:
            layout, inner = _OPTIONAL, optional_record(type_)
        elif is_homogeneous_tuple(type_) and attrs.has(get_args(type_)[0]):
            layout, inner = _RECORDS, get_args(type_)[0]
        else:
            layout = _PLAIN
        default = field.default
        raw_default = (
            _NO_DEFAULT
            if default is attrs.NOTHING or isinstance(default, attrs.Factory)  # type: ignore[arg-type]
            else CONVERTER.unstructure(default)
        )
        out.append((field.name, layout, () if inner is None else _fields(inner), raw_default))
    return tuple(out)


#: The fields of each event's array after its tag (``seq`` first), by tag.
EVENT_FIELDS: Final = {tag: _fields(cls, "session_id") for tag, cls in EVENT_TAGS.items()}
#: The tags whose array ends before its last field while that is its default (see
#: TRAILING_OMITTED), with that default.
_TRAILING_DEFAULTS: Final = {
    tag: EVENT_FIELDS[tag][-1][3] for tag, cls in EVENT_TAGS.items() if cls in TRAILING_OMITTED
}


class CompactError(ValueError):
    """A compact entry that does not have the compact form's shape."""


# -- writing (the general path; the fast path is generated in _codec_fast) -----------


def to_compact(session_id: str, maps: list[dict[str, Any]]) -> list[Any]:
    """The compact entry of one session's events, from their maps of the map form
    (as the converter unstructures them, tagged)."""
    out: list[Any] = [COMPACT_ENTRY, session_id]
    for raw in maps:
        tag = raw[TAG_KEY]
        array = [tag, *_array(raw, EVENT_FIELDS[tag])]
        if tag in _TRAILING_DEFAULTS and array[-1] == _TRAILING_DEFAULTS[tag]:
            array.pop()
        out.append(array)
    return out


def _array(raw: dict[str, Any], fields: tuple[_Field, ...]) -> list[Any]:
    out = []
    for name, layout, nested, default in fields:
        value = raw.get(name, default)
        if value is _NO_DEFAULT:  # pragma: no cover - the converter writes every other
            raise KeyError(name)
        if layout == _PLAIN or value is None:
            out.append(value)
        elif layout == _RECORDS:
            out.append([_array(item, nested) for item in value])
        else:
            out.append(_array(value, nested))
    return out


# -- reading ---------------------------------------------------------------------------


def from_compact(raw: list[Any]) -> tuple[str, Iterator[dict[str, Any]]]:
    """The session name and the events' maps (of the map form, tagged) of a compact
    entry, as msgpack decoded it (``raw[0]`` is an integer); raises CompactError, the
    header's at once, an event's as the maps are drawn. Each event's array is
    dropped as its map is drawn: with the caller building each event before it draws
    the next map, no two forms of the entry's events live at once."""
    version = raw[0]
    if version != COMPACT_ENTRY:
        if version.__class__ is int and version > COMPACT_ENTRY:
            raise CompactError(
                f"its layout is version {version}, newer than this sessionactors reads"
                f" ({COMPACT_ENTRY}); if a newer sessionactors wrote it, upgrade"
            )
        raise CompactError(f"there is no compact layout {str(version)[:40]}")
    if len(raw) < 3:
        raise CompactError("expected a session name and at least one event after the layout")
    session_id = raw[1]
    if session_id.__class__ is not str:
        raise CompactError("the session name is not a string")
    return session_id, _event_maps(raw, session_id)


def _event_maps(raw: list[Any], session_id: str) -> Iterator[dict[str, Any]]:
    for index in range(2, len(raw)):
        item = raw[index]
        raw[index] = None
        if item.__class__ is not list or len(item) < 2:
            raise CompactError(f"expected events as arrays of a tag and fields (event {index - 2})")
        tag = item[0]
        fields = EVENT_FIELDS.get(tag) if tag.__class__ is str else None
        if fields is None:
            # unknown tags are named as the map form names them (see _codec)
            yield {"session_id": session_id, TAG_KEY: tag}
            continue
        event = _map(item, 1, fields, tag)
        del item
        event["session_id"] = session_id
        event[TAG_KEY] = tag
        yield event


def _map(values: list[Any], start: int, fields: tuple[_Field, ...], what: str) -> dict[str, Any]:
    if len(values) - start > len(fields):
        raise CompactError(
            f"{what} has {len(values) - start} fields, more than the {len(fields)} this"
            " sessionactors knows; if a newer sessionactors wrote it, upgrade"
        )
    out: dict[str, Any] = {}
    for index in range(start, len(values)):
        name, layout, nested, _ = fields[index - start]
        value = values[index]
        if layout != _PLAIN and not (layout == _OPTIONAL and value is None):
            if value.__class__ is not list:
                raise CompactError(f"{what}.{name} is not an array")
            if layout == _RECORDS:
                for at, item in enumerate(value):  # in place: each item's array goes
                    if item.__class__ is not list:
                        raise CompactError(f"{what}.{name}[{at}] is not an array")
                    value[at] = _map(item, 0, nested, f"{what}.{name}[{at}]")
            else:
                value = _map(value, 0, nested, f"{what}.{name}")
        out[name] = value
    return out
