"""The two forms of a journal entry, read apart from the codec.

sessionactors writes a journal entry in the compact form: ``[1, session_id,
event, ...]``, each event ``[tag, seq, field, ...]`` (its class's fields in
their declared order, without ``session_id``), nested records as arrays of
their fields. Entries written before it hold the map form: an array of maps,
each an event's fields with its tag under ``"type"``. ``map_form`` turns the
first into the second by those rules alone (from the records' attrs fields),
so the tests can check the layout and make entries as older versions wrote them.
"""

import typing
from collections.abc import Mapping
from typing import Any

import attrs
import msgpack

import sessionactors as sa


def map_form(data: bytes, classes: Mapping[str, type[sa.Event]]) -> list[dict[str, Any]]:
    """The map form of the compact entry ``data`` (``classes``: the event class of each
    tag in it), with datetimes as msgpack Timestamps (as ``msgpack.unpackb`` reads them)."""
    raw = msgpack.unpackb(data)
    assert raw[0] == 1, raw
    session_id = raw[1]
    out = []
    for item in raw[2:]:
        tag = item[0]
        fields = _record(classes[tag], item[1:], skip="session_id")
        out.append({"session_id": session_id, **fields, "type": tag})
    return out


def _record(cls: type[Any], values: list[Any], skip: str | None = None) -> dict[str, Any]:
    fields = [field for field in attrs.fields(cls) if field.name != skip]
    assert len(values) <= len(fields), (cls, values)
    return {
        field.name: _value(field.type, value) for field, value in zip(fields, values, strict=False)
    }


def _value(type_: Any, value: Any) -> Any:
    if value is None:
        return None
    if attrs.has(type_):
        return _record(type_, value)
    args = typing.get_args(type_)
    if typing.get_origin(type_) is tuple and args and attrs.has(args[0]):
        return [_record(args[0], item) for item in value]
    inner = [arg for arg in args if arg is not type(None)]
    if len(inner) == 1 and attrs.has(inner[0]):
        return _record(inner[0], value)
    return value


def pack_maps(maps: list[dict[str, Any]]) -> bytes:
    """The entry of ``maps`` in the map form (as earlier versions wrote it)."""
    data: bytes = msgpack.packb(maps, datetime=True)
    return data
