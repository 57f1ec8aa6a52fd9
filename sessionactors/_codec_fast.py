"""The codec's fast paths: a record checked and unstructured in one generated
function, made when the module loads (see :mod:`._codec`).
"""

import datetime
from collections.abc import Callable
from typing import Any, Final, get_args

import attrs

from ._codec_checks import FieldError, check_metadata, check_records, check_strings
from ._codec_convert import (
    CONVERTER,
    TRAILING_OMITTED,
    USAGE_OMITTED,
    is_enum,
    is_homogeneous_tuple,
    is_metadata,
    optional_record,
    unstructure_metadata,
)
from ._codec_format import MAX_SEQ, TAG_OF
from ._records import NO_METADATA, Message, SessionInfo, SessionState

# -- the fast path: check and unstructure in one generated function --------------
#
# A journal entry and an info are written every turn, and a snapshot at every spawn
# and hibernation. For SessionInfo, SessionState and a snapshot's messages, a
# function made here from the record's fields (like the checkers) checks every field
# and builds the record's map in one frame, with its nested records inlined: the same
# maps, and so the same bytes, as the checker and the cattrs hook make, and the count
# of the maps and arrays written (the checker counts a usage left out as the default
# too: one more). For each event class, one builds the event's array of the compact
# journal entry the same way (the same bytes as the general path's maps laid out by
# _codec_compact), and counts nothing. Each accepts only what the checker accepts,
# more strictly (exact classes, plain metadata); anything else raises Slow, and the
# general path (which names what is wrong) runs instead.


#: The empty map the fast paths pack in place of the shared empty metadata (never changed).
_EMPTY_MAP: Final[dict[str, Any]] = {}


class Slow(Exception):
    """A value the fast path does not take: encode it the general way."""


#: Fields written only when they differ from their default (see _register_usage_omitted).
_OMITTED_IF_DEFAULT: Final = "usage"


class _FastBuilder:
    """The source of one fast function: statements that check and build, variable by
    variable (``o`` the record, ``o_d`` its map, ``n`` the maps and arrays).

    With ``compact``, each record is built as the array of the compact form (see
    :mod:`._codec_compact`: every field in order, none omitted) and nothing is counted.
    """

    def __init__(self, names: dict[str, Any], *, compact: bool = False) -> None:
        self.names = names
        self.lines: list[str] = []
        self.count = 0
        self.compact = compact

    def counted(self, indent: str, statement: str) -> None:
        """``statement``, which counts maps and arrays: left out of a compact function."""
        if not self.compact:
            self.lines.append(f"{indent}{statement}")

    def name(self, prefix: str, value: Any) -> str:
        self.count += 1
        key = f"{prefix}{self.count}"
        self.names[key] = value
        return key

    def record(
        self,
        cls: type[Any],
        obj: str,
        indent: str,
        omit: bool,
        skip: str | None = None,
        head: str | None = None,
    ) -> str:
        """Statements that check ``obj`` (already known to be a ``cls``) and build its
        map (if compact, its array, starting with ``head`` and without the field
        ``skip``); the variable."""
        lines = self.lines
        self.counted(indent, "n += 1")
        items: list[str] = [] if head is None else [head]
        late: list[str] = []
        for field in attrs.fields(cls):
            if field.name == skip:
                continue
            value = f"{obj}_{field.name}"
            lines.append(f"{indent}{value} = {obj}.{field.name}")
            if self.compact:
                items.append(self.field(field.type, value, indent))
            elif omit and field.name == _OMITTED_IF_DEFAULT:
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
        if self.compact:
            lines.append(f"{indent}{obj}_d = [{', '.join(items)}]")
        else:
            lines.append(f"{indent}{obj}_d = {{{', '.join(items)}}}")
        lines.extend(late)
        return f"{obj}_d"

    def field(self, type_: Any, v: str, indent: str) -> str:
        """Statements that check the value ``v`` of a field of ``type_``; its expression."""
        lines = self.lines
        slow = "raise Slow"
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
            # (not UTC: the general path checks that UTC can tell it)
            lines.append(
                f"{indent}if {v}.__class__ is not _datetime or {v}.tzinfo is not _UTC: {slow}"
            )
            return v
        if is_enum(type_):
            enum_name = self.name("enum", type_)
            lines.append(f"{indent}if {v}.__class__ is not {enum_name}: {slow}")
            return f"{v}._value_"
        one = "pass" if self.compact else "n += 1"  # (a compact function counts nothing)
        if is_metadata(type_):
            lines += [
                # the shared empty metadata, or an empty map (a session's, as spawned)
                # (the shared empty metadata is a dict of its own class: a plain one is
                # packed in its place, the same bytes)
                f"{indent}if {v} is _NO_METADATA: {v} = _EMPTY_MAP; {one}",
                f"{indent}elif {v}.__class__ is dict and not {v}: {one}",
                f"{indent}else:",
                f"{indent}    try: {v}_n = check_metadata({v}, '')",
                f"{indent}    except FieldError: {slow}",
                *(() if self.compact else (f"{indent}    n += {v}_n",)),
                # a dict without maps or lists in it is plain data as it is: no copy
                f"{indent}    if {v}_n != 1 or {v}.__class__ is not dict:",
                f"{indent}        {v} = unstructure_metadata({v})",
            ]
            return v
        if is_homogeneous_tuple(type_):
            item = get_args(type_)[0]
            if attrs.has(item):  # each record inlined, as a single one is
                cls_name = self.name("cls", item)
                lines += [f"{indent}if {v}.__class__ is not tuple: {slow}"]
                self.counted(indent, "n += 1")
                lines += [
                    f"{indent}{v}_l = []",
                    f"{indent}for {v}_i in {v}:",
                    f"{indent}    if {v}_i.__class__ is not {cls_name}: {slow}",
                ]
                loop = indent + "    "
                item_map = self.record(item, f"{v}_i", loop, item in USAGE_OMITTED)
                lines.append(f"{loop}{v}_l.append({item_map})")
                return f"{v}_l"
            hook = self.name("hook", CONVERTER.get_unstructure_hook(type_))
            if item is str:
                count = f"check_strings({v}, '', '')"
            else:  # pragma: no cover - no such field today
                raise TypeError(f"no fast path for a field of type {type_!r}")
            lines += [
                f"{indent}if {v}.__class__ is not tuple: {slow}",
                f"{indent}if {v}:",
                f"{indent}    try: {'' if self.compact else 'n += '}{count}",
                f"{indent}    except FieldError: {slow}",
                f"{indent}    {v} = {hook}({v})",
                f"{indent}else: {v} = []; {one}",
            ]
            return v
        inner = type_ if attrs.has(type_) else optional_record(type_)
        if inner is None:  # pragma: no cover - no such field today
            raise TypeError(f"no fast path for a field of type {type_!r}")
        cls_name = self.name("cls", inner)
        if inner is type_:
            lines.append(f"{indent}if {v}.__class__ is not {cls_name}: {slow}")
            return self.record(inner, v, indent, inner in USAGE_OMITTED)
        lines += [
            f"{indent}if {v} is None: {v}_d = None",
            f"{indent}elif {v}.__class__ is not {cls_name}: {slow}",
            f"{indent}else:",
        ]
        return self.record(inner, v, indent + "    ", inner in USAGE_OMITTED)


#: What the generated functions refer to by name.
_NAMES: Final[dict[str, Any]] = {
    "Slow": Slow,
    "FieldError": FieldError,
    "_datetime": datetime.datetime,
    "_UTC": datetime.UTC,
    "_NO_METADATA": NO_METADATA,
    "_EMPTY_MAP": _EMPTY_MAP,
    "check_metadata": check_metadata,
    "check_records": check_records,
    "check_strings": check_strings,
    "unstructure_metadata": unstructure_metadata,
}


def _compiled(builder: _FastBuilder, what: str) -> Callable[..., Any]:
    code = compile("\n".join(builder.lines), f"<sessionactors codec {what}>", "exec")
    exec(code, builder.names)  # at import only: the code is made from the record's own fields
    fast: Callable[..., Any] = builder.names["fast"]
    return fast


def _make_fast(
    cls: type[Any], *, exact: bool = True
) -> Callable[[Any], tuple[dict[str, Any], int]]:
    """The fast function of ``cls``: its map and the number of maps and arrays in it;
    raises Slow for anything unusual. Without ``exact``, it reads the fields from any
    object that has them as attributes."""
    builder = _FastBuilder({**_NAMES, "cls": cls})
    builder.lines.append("def fast(o):")
    if exact:
        builder.lines.append("    if o.__class__ is not cls: raise Slow")
    builder.lines.append("    n = 0")
    result = builder.record(cls, "o", "    ", cls in USAGE_OMITTED)
    builder.lines.append(f"    return {result}, n")
    return _compiled(builder, f"fast {cls.__name__}")


def _make_compact(cls: type[Any], tag: str) -> Callable[[Any], list[Any]]:
    """The compact function of the event class ``cls``: its array in the compact form
    (see :mod:`._codec_compact`: the tag, then every field but ``session_id``, the
    entry's); raises Slow for anything unusual. The caller checks the class and the
    session."""
    builder = _FastBuilder(dict(_NAMES), compact=True)
    builder.lines.append("def fast(o):")
    result = builder.record(cls, "o", "    ", False, skip="session_id", head=repr(tag))
    if cls in TRAILING_OMITTED:  # its array ends before that field while it is the default
        # (as the array holds it: a tuple's default as a list)
        default = builder.name("default", CONVERTER.unstructure(attrs.fields(cls)[-1].default))
        builder.lines.append(f"    if {result}[-1] == {default}: {result}.pop()")
    builder.lines.append(f"    return {result}")
    return _compiled(builder, f"compact {cls.__name__}")


#: The compact function of each event class (see _make_compact).
COMPACT_EVENTS: Final = {cls: _make_compact(cls, tag) for cls, tag in TAG_OF.items()}
fast_info: Final = _make_fast(SessionInfo)
fast_message: Final = _make_fast(Message)  # (a snapshot's new messages)
fast_live_info: Final = _make_fast(SessionInfo, exact=False)
fast_state: Final = _make_fast(SessionState)  # (a snapshot written whole)
