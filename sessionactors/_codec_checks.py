"""The codec's checks of what is dumped: every value that loading would refuse
is refused before anything is written (see :mod:`._codec`).
"""

import datetime
from collections.abc import Callable, Mapping
from typing import Any, Final, get_args

import attrs

from ._codec_convert import (
    SCALARS,
    PlainError,
    as_plain,
    datetime_problem,
    is_enum,
    is_homogeneous_tuple,
    is_metadata,
    optional_record,
    record_types,
    type_name,
    with_article,
)
from ._codec_format import MAX_ARRAY_LEN, MAX_MAP_LEN, MAX_METADATA_DEPTH, MAX_SEQ
from ._errors import shown
from ._records import NO_METADATA, Message, SessionInfo, SessionState

# -- checking what is dumped ---------------------------------------------------------
#
# cattrs unstructures by the declared types without looking at the values, and
# msgpack writes whatever it is given: an int in a str field would be written,
# and then refused on every load. Each record class gets a checker, made here
# from its fields (the code is generated and compiled once, as cattrs does its
# hooks): it refuses every value that loading would refuse, and counts the maps
# and arrays the record makes. Only a refusal takes the slow path that names
# the field.


class FieldError(Exception):
    """A value that loading would refuse; ``path`` is filled in on the way out."""

    def __init__(self, error: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.error = error
        self.problem = problem
        self.path: list[str] = []


def _refuse(value: Any, expected: str, at: str = "") -> None:
    """Raise the error for the field ``at`` holding ``value`` where ``expected`` belongs."""
    if value.__class__ is int and expected == _COUNT:
        error = FieldError(ValueError, f"is {value}, out of range; expected {expected}")
    elif isinstance(value, datetime.datetime) and expected == _AWARE:
        error = FieldError(ValueError, datetime_problem(value) or "")
    else:
        error = FieldError(TypeError, f"is {with_article(type_name(value))}; expected {expected}")
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
    return isinstance(value, datetime.datetime) and datetime_problem(value) is None


def check_records(values: Any, check: Callable[[Any], int], expected: str, at: str) -> int:
    """Check the tuple of records in field ``at``; the number of maps and arrays it makes."""
    if values.__class__ is not tuple:
        _refuse(values, expected, at)
    count = 1
    for index, value in enumerate(values):
        try:
            count += check(value)
        except FieldError as exc:
            exc.path += (f"[{index}]", at)
            raise
    return count


def check_strings(values: Any, expected: str, at: str) -> int:
    """Check the tuple of strings in field ``at``; it makes one array."""
    if values.__class__ is not tuple:
        _refuse(values, expected, at)
    for index, value in enumerate(values):
        if not _is_str(value):
            _refuse(value, "a string", f"{at}[{index}]")
    return 1


_FLAT: Final = frozenset({str, float, bool, bytes, type(None)})


def check_metadata(value: Any, at: str) -> int:
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
    except PlainError as exc:
        error = FieldError(exc.error, exc.problem)
        error.path = [*exc.path, at]
        raise error from None


def _plain_count(value: Any, depth: int) -> int:
    cls = value.__class__
    if cls is int:
        if -(2**63) <= value < 2**64:
            return 0
        raise PlainError(ValueError, "is an integer out of the 64-bit range")
    if cls in SCALARS:
        return 0
    if depth > MAX_METADATA_DEPTH:
        raise PlainError(ValueError, f"is nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, Mapping):
        if len(value) > MAX_MAP_LEN:
            raise PlainError(ValueError, f"has more than {MAX_MAP_LEN} entries")
        count = 1
        for key, item in value.items():
            if key.__class__ is not str:
                raise PlainError(TypeError, f"has a {type_name(key)} key; keys must be str")
            try:
                count += _plain_count(item, depth + 1)
            except PlainError as exc:
                exc.path.append(f"[{shown(key)}]")
                raise
        return count
    if cls is list or cls is tuple:
        if len(value) > MAX_ARRAY_LEN:
            raise PlainError(ValueError, f"has more than {MAX_ARRAY_LEN} items")
        count = 1
        for index, item in enumerate(value):
            try:
                count += _plain_count(item, depth + 1)
            except PlainError as exc:
                exc.path.append(f"[{index}]")
                raise
        return count
    as_plain(value, depth)  # an aware datetime; anything else raises, saying what is wrong
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
            "if v.__class__ is not _datetime or v.tzinfo is not _UTC:",
            f"    if not _is_aware(v): {refuse}",
        ]
    if is_enum(type_):
        names[f"e_{name}"] = type_
        return [f"if v.__class__ is not e_{name}: {refuse}"]
    if is_metadata(type_):
        return [f"n += 1 if v is _NO_METADATA else check_metadata(v, {at})"]
    if is_homogeneous_tuple(type_):
        item = get_args(type_)[0]
        empty = "if v.__class__ is tuple and not v: n += 1"
        if item is str:
            return [empty, f"else: n += check_strings(v, x_{name}, {at})"]
        if attrs.has(item):
            names[f"c_{name}"] = CHECKS[item]
            return [empty, f"else: n += check_records(v, c_{name}, x_{name}, {at})"]
    inner = type_ if attrs.has(type_) else optional_record(type_)
    if inner is not None:
        names[f"c_{name}"] = CHECKS[inner]
        check = [
            f"try: n += c_{name}(v)",
            f"except FieldError as exc: exc.path.append({at}); raise",
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
    if is_metadata(type_):
        return "a mapping"
    if is_homogeneous_tuple(type_):
        return f"a tuple of {_expected(get_args(type_)[0])}"
    inner = optional_record(type_)
    if inner is not None:
        return f"{with_article(inner.__name__)} or None"
    return {str: "a string", bool: "a bool"}.get(type_) or with_article(
        getattr(type_, "__name__", "value")
    )


class _Checks(dict[type[Any], Callable[[Any], int]]):
    """Each record class's checker, made on first lookup (while this module loads)."""

    def __missing__(self, cls: type[Any]) -> Callable[[Any], int]:
        names: dict[str, Any] = {
            "cls": cls,
            "_refuse": _refuse,
            "FieldError": FieldError,
            "_is_str": _is_str,
            "_is_count": _is_count,
            "_is_aware": _is_aware,
            "_datetime": datetime.datetime,
            "_UTC": datetime.UTC,
            "_NO_METADATA": NO_METADATA,
            "check_metadata": check_metadata,
            "check_records": check_records,
            "check_strings": check_strings,
            "x_cls": with_article(cls.__name__),
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


CHECKS: Final = _Checks()
for _type in record_types():
    if attrs.has(_type):
        CHECKS[_type]
del _type
check_state: Final = CHECKS[SessionState]
check_info: Final = CHECKS[SessionInfo]
check_message: Final = CHECKS[Message]
