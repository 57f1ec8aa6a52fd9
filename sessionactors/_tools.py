"""Tools: Python functions an agent's model may call.

A :class:`Tool` wraps a function. :attr:`Tool.spec` is what the model is told
(name, description, a JSON schema of the arguments); :meth:`Tool.invoke` runs
the function on the model's JSON arguments. Whatever goes wrong on the way
(arguments that are not JSON, arguments that do not fit the schema, the
function raising) comes back as a :class:`ToolOutcome` with ``is_error=True``
and a message the model can act on, never as an exception, so the model sees
the error and can try again. Cancellation is never caught.

Unless a tool is given ``parameters`` explicitly, the schema is derived from
the function's signature (see :func:`tool` for the annotations understood),
with each parameter's description taken from a Google-style ``Args:`` section
or reST ``:param name:`` fields of its docstring.

The argument check is deliberately small: it understands the JSON schema
keywords ``type``, ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties``, ``items`` and ``anyOf``, and ignores every other
keyword (``minimum``, ``pattern``, ``$ref``, ...). A tool that needs finer
checks makes them itself and raises: the message reaches the model.
"""

import collections.abc
import copy
import dataclasses
import datetime
import decimal
import enum
import functools
import inspect
import ipaddress
import json
import math
import pathlib
import re
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, overload

import attrs
import trio

from ._model import ToolSpec
from ._records import maker

__all__ = [
    "Tool",
    "ToolContext",
    "ToolOutcome",
    "adapted",
    "describe_exception",
    "is_async_callable",
    "run_in_thread",
    "stops",
    "tool",
]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

_Convert = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


@attrs.frozen(kw_only=True)
class ToolOutcome:
    """What one call of a tool produced: the text for the model, and whether it is an error."""

    content: str
    is_error: bool = False


_outcome: Final = maker(ToolOutcome)


@attrs.frozen(kw_only=True)
class ToolContext:
    """Which call, of which turn of which session, a tool is running for.

    A tool function that declares a parameter annotated ``ToolContext`` (of any
    name) is given one there for each call; the parameter is not one of the
    arguments the model is told of or sends. A tool acts with it for the session's
    user (whom the session's metadata names, as the app set it with
    ``registry.spawn(metadata=...)``), and tags the work it does or the requests
    it sends on with the turn and the call.
    """

    #: The session whose turn called the tool.
    session_id: str
    #: That turn's id (``Reply.turn_id``, the events' ``turn_id``).
    turn_id: str
    #: The call's id, as the model gave it (``ToolCall.id``, ``Message.tool_call_id``).
    call_id: str
    #: A copy of the session's metadata as the call began (a metadata change is
    #: a request in the session's mailbox: it comes after the turn).
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


_context: Final = maker(ToolContext)


def _plain_copy(value: Any) -> Any:
    """A copy of plain data (as metadata is: dicts, lists and scalars), several times
    quicker than ``copy.deepcopy``."""
    if value.__class__ is dict:
        return {key: _plain_copy(item) for key, item in value.items()}
    if value.__class__ is list:
        return [_plain_copy(item) for item in value]
    return value


def _check_name(_instance: object, _attribute: object, name: Any) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(
            f"tool name {name!r} is invalid: use 1 to 64 ASCII letters, digits, '_' or '-' "
            "(the rule OpenAI-compatible servers apply)"
        )


def _check_flag(instance: Any, attribute: Any, value: Any) -> None:
    # (a flag read from a config file as "false" is true to Python)
    if not isinstance(value, bool):
        raise TypeError(
            f"tool {instance.name!r}: {attribute.name} must be True or False, "
            f"not {type(value).__name__} ({value!r:.60})"
        )


def _check_description(instance: Any, _attribute: object, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"tool {instance.name!r}: description must be str, not {type(value).__name__}"
        )


def _check_fn(_instance: object, _attribute: object, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"tool fn must be callable, got {fn!r}")
    if inspect.isasyncgenfunction(fn):
        raise TypeError(f"tool fn {fn!r} is an async generator function; a tool returns one result")


@attrs.frozen(kw_only=True)
class Tool:
    """A function the model may call.

    ``fn`` is an async function, which runs in the session's task, or a plain
    function, which runs in a worker thread (``trio.to_thread.run_sync``, as a
    web framework runs a ``def`` route), so that a blocking call in it (a sync
    HTTP client, a database driver) holds up no other session. A sync tool
    therefore runs alongside other sessions' sync tools and must be
    thread-safe; it cannot call trio functions but through
    ``trio.from_thread``; to run a quick function in the session's task,
    declare it ``async def``. A turn cancelled (``ref.cancel()``, the
    registry's close) while a sync tool runs ends at once, leaving its thread
    to finish on its own (the call is answered as cut short: it may or may not
    take effect). ``fn`` is called with the model's arguments as keyword
    arguments; a sync ``fn`` that returns an awaitable has it awaited.

    A ``str`` result goes to the model as is, anything else as JSON:
    a dataclass, an attrs instance or a pydantic model (``model_dump(mode="json")``)
    as an object of its fields, an :class:`enum.Enum` as its value, a datetime,
    date or time as its ISO string, a set (sorted) or tuple as an array, a
    :class:`~decimal.Decimal`, UUID, path or IP address as its string. A result
    holding anything else (bytes, an object of no such kind) is an error result
    naming the tool and the type, as an exception raised by ``fn`` is: the
    model sees it, and the turn goes on.

    A parameter of ``fn`` annotated :class:`ToolContext` is given the call's
    context (its session's id and metadata, its turn's id and its own) and is not
    one of the arguments.

    ``parameters`` is the JSON schema (``"type": "object"``) of the
    arguments; when ``None`` it is derived from ``fn``'s signature and
    docstring, and arguments typed as an :class:`enum.Enum`, a tuple or a
    float are converted to that type before the call. An explicit schema is
    used as is and the JSON values are passed unchanged.

    ``requires_review`` asks for a person to approve each call before it
    runs; ``idempotent`` says whether running the same call twice is harmless.
    """

    name: str = attrs.field(validator=_check_name)
    fn: Callable[..., Any] = attrs.field(validator=_check_fn)
    description: str = attrs.field(default="", validator=_check_description)
    parameters: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    requires_review: bool = attrs.field(default=False, validator=_check_flag)
    idempotent: bool = attrs.field(default=True, validator=_check_flag)
    _spec: ToolSpec = attrs.field(init=False, repr=False, eq=False, hash=False)
    _converters: Mapping[str, _Convert] = attrs.field(init=False, repr=False, eq=False, hash=False)
    _in_thread: bool = attrs.field(init=False, repr=False, eq=False, hash=False)
    #: The name of ``fn``'s ToolContext parameter, if it has one.
    _context_parameter: str | None = attrs.field(init=False, repr=False, eq=False, hash=False)
    #: Whether a call without arguments is checked against the schema: no arguments
    #: always fit a schema derived from a signature that requires none.
    _check_empty: bool = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_in_thread", not is_async_callable(self.fn))
        doc = _docstring(self.fn)
        description = self.description or _first_paragraph(doc)
        converters: dict[str, _Convert] = {}
        schema: Mapping[str, Any]
        if self.parameters is None:
            schema, converters, context = _signature_schema(self.name, self.fn, doc)
        else:
            context = _find_context(self.name, self.fn)
            if not isinstance(self.parameters, Mapping):
                raise TypeError(
                    f"tool {self.name!r}: parameters must be a JSON schema mapping, "
                    f"got {type(self.parameters).__name__}"
                )
            if self.parameters.get("type") != "object":
                raise ValueError(
                    f"tool {self.name!r}: parameters must be a JSON schema with "
                    '"type": "object" (tool arguments are always a JSON object)'
                )
            schema = self.parameters
            named = schema.get("properties") or {}
            if context is not None and (context in named or context in schema.get("required", ())):
                raise TypeError(
                    f"tool {self.name!r}: parameter {context!r} is the tool's ToolContext: "
                    "the model is not told of it and cannot send it; take it out of parameters="
                )
        spec = ToolSpec(name=self.name, description=description, parameters=schema)
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_converters", converters)
        object.__setattr__(self, "_context_parameter", context)
        check_empty = self.parameters is not None or bool(schema.get("required"))
        object.__setattr__(self, "_check_empty", check_empty)

    @property
    def spec(self) -> ToolSpec:
        """What the model is told about this tool: name, description and argument schema."""
        return self._spec

    async def invoke(self, arguments: str, *, context: ToolContext | None = None) -> ToolOutcome:
        """Call the tool with ``arguments``, the model's JSON text, and return the outcome.

        Empty ``arguments`` (as some models send for a tool without
        parameters) mean ``{}``. Bad arguments and exceptions raised by the
        function (``SystemExit`` included) become an outcome with ``is_error=True``;
        ``trio.Cancelled``, ``KeyboardInterrupt`` and the like propagate.
        ``context`` is given to a tool whose function has a :class:`ToolContext`
        parameter, and is required for it (``TypeError`` without one).

        It is trio code (``trio.run``, a pytest-trio test), as the turn that calls a
        tool is: an asyncio test calls the tool's function itself,
        ``await tool.fn(**arguments, context=...)`` (``RuntimeError`` outside trio).
        """
        if not trio.lowlevel.in_trio_run():
            raise RuntimeError(
                f"Tool.invoke runs in trio (trio.run, pytest-trio), as a turn does: to "
                f"test tool {self.name!r} from asyncio, call its function: "
                "await tool.fn(**arguments) (with context=sessionactors.ToolContext(...) "
                "for a tool that takes one)"
            )
        if context is not None and not isinstance(context, ToolContext):
            raise TypeError(
                f"tool {self.name!r}: context must be a sessionactors.ToolContext or None, "
                f"not {type(context).__name__}"
            )
        if context is None and self._context_parameter is not None:
            raise TypeError(
                f"tool {self.name!r} takes a ToolContext (its parameter "
                f"{self._context_parameter!r}): pass invoke(arguments, "
                "context=sessionactors.ToolContext(session_id=..., turn_id=..., call_id=...))"
            )
        await trio.lowlevel.checkpoint()
        return await self._run(arguments, None, context)

    def _context_for(
        self, session_id: str, turn_id: str, call_id: str, metadata: Mapping[str, Any]
    ) -> ToolContext | None:
        """The context a call is given (None if the tool takes none): ``metadata``, the
        session's, is copied."""
        if self._context_parameter is None:
            return None
        return _context(
            session_id=session_id,
            turn_id=turn_id,
            call_id=call_id,
            metadata=_plain_copy(metadata) if metadata else {},
        )

    async def _run(
        self,
        arguments: str,
        on_error: Callable[[BaseException], None] | None = None,
        context: ToolContext | None = None,
    ) -> ToolOutcome:
        """:meth:`invoke` without its own checkpoint: the turn loop's path (it checks
        for cancellation itself; a tool that blocks yields anyway). ``on_error`` hears
        the exception a failing function raised; ``context`` is given to a tool that
        takes one."""
        parsed = _parse_arguments(self.name, arguments)
        if isinstance(parsed, ToolOutcome):  # not valid JSON
            return parsed
        if parsed or self._check_empty:
            errors: list[str] = []
            _check(self._spec.parameters, parsed, (), errors)
            if errors:
                return _outcome(
                    content=f"arguments for tool {self.name!r} are invalid: " + "; ".join(errors),
                    is_error=True,
                )
        if self._context_parameter is not None:  # (the model's arguments never name it)
            parsed[self._context_parameter] = context
        try:
            if parsed:
                converters = self._converters
                kwargs = {key: converters.get(key, _identity)(v) for key, v in parsed.items()}
                if self._in_thread:
                    result = await run_in_thread(self.fn, kwargs)
                else:
                    result = self.fn(**kwargs)
            elif self._in_thread:
                result = await run_in_thread(self.fn, {})
            else:
                result = self.fn()
            if result.__class__ is _CoroutineType or inspect.isawaitable(result):
                result = await result
        except BaseException as exc:  # a tool's own exit fails its call only
            if stops(exc):
                raise
            if on_error is not None:
                on_error(exc)
            return _outcome(content=describe_exception(exc), is_error=True)
        if result.__class__ is str:
            return _outcome(content=result, is_error=False)
        return _encode_result(self.name, result)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    requires_review: bool = False,
    idempotent: bool = True,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    requires_review: bool = False,
    idempotent: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a :class:`Tool` of a function: ``@tool``, ``@tool()`` or ``@tool(name=..., ...)``.

    The name defaults to the function's ``__name__`` and the description to
    the first paragraph of its docstring. Unless ``parameters`` is given, the
    schema is derived from the signature, which then must name every
    parameter (no ``*args``, ``**kwargs`` or positional-only parameters) and
    annotate each with ``str``, ``int``, ``float``, ``bool``, ``list[T]``,
    ``tuple[T, ...]``, ``dict[str, T]`` (or ``Sequence[T]``,
    ``Mapping[str, T]``), ``Literal[...]``, an :class:`enum.Enum` subclass,
    ``Any``, a union of these (``T | None``, ``Optional[T]``), or nothing
    (any JSON value). A parameter with a default is optional. Anything else
    raises :class:`TypeError` here, at decoration time.
    """
    if isinstance(fn, str):
        raise TypeError(f"use @tool(name={fn!r}) to name a tool; @tool takes no positional name")

    def make(fn: Callable[..., Any]) -> Tool:
        tool_name = name
        if tool_name is None:
            tool_name = getattr(fn, "__name__", None)
            if not isinstance(tool_name, str):
                raise TypeError(f"{fn!r} has no __name__; use @tool(name=...)")
        return Tool(
            name=tool_name,
            fn=fn,
            description=description,
            parameters=parameters,
            requires_review=requires_review,
            idempotent=idempotent,
        )

    if fn is None:
        return make
    return make(fn)


def adapted(tool: Tool, fn: Callable[..., Any]) -> Tool:
    """``tool``, with ``fn`` called in place of its function (an adapter that calls it
    with the same keyword arguments): what the model is told of it, how its arguments
    are read and whether it takes a context stay the tool's own."""
    clone = copy.copy(tool)
    object.__setattr__(clone, "fn", fn)
    object.__setattr__(clone, "_in_thread", not is_async_callable(fn))
    return clone


# -- running a call -----------------------------------------------------------


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` starts a coroutine (an ``async def`` function, a partial or
    a bound method of one, an object whose ``__call__`` is one) rather than running it."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


#: Sync tools running at once in one trio run, at most (as many as trio's default
#: threads, in a limit of their own: hung tools never take the threads the rest of
#: the app uses, a web framework's or a model client's).
TOOL_THREADS: Final = 40

_tool_threads: Final[trio.lowlevel.RunVar[trio.CapacityLimiter]] = trio.lowlevel.RunVar(
    "sessionactors.tool_threads"
)


async def run_in_thread(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """``fn(**kwargs)`` in a worker thread; cancelled, it returns at once and leaves the
    thread to finish (a blocking call cannot be interrupted; until it ends, its thread
    counts against ``TOOL_THREADS``)."""
    try:
        limiter = _tool_threads.get()
    except LookupError:
        limiter = trio.CapacityLimiter(TOOL_THREADS)
        _tool_threads.set(limiter)
    result = await trio.to_thread.run_sync(
        _called, fn, kwargs, abandon_on_cancel=True, limiter=limiter
    )
    return result.awaitable if result.__class__ is _Returned else result


class _Returned:
    """A coroutine that a function run in a thread returned, for its caller to await
    (``trio.to_thread.run_sync`` refuses to hand one back as it is)."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Any) -> None:
        self.awaitable = awaitable


def _called(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    result = fn(**kwargs)
    return _Returned(result) if result.__class__ is _CoroutineType else result


def _reject_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not allowed in JSON")


_CoroutineType: Final = types.CoroutineType

#: One decoder for every call (``json.loads`` with options builds a new one each time).
_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_arguments(name: str, arguments: str) -> dict[str, Any] | ToolOutcome:
    if arguments == "{}" or not arguments.strip():  # a call without arguments
        return {}
    try:
        parsed = _DECODER.decode(arguments)
    except json.JSONDecodeError as exc:
        return ToolOutcome(
            content=f"arguments for tool {name!r} are not valid JSON ({exc.msg}: "
            f"line {exc.lineno} column {exc.colno}); send one JSON object of the arguments",
            is_error=True,
        )
    except (ValueError, RecursionError) as exc:
        return ToolOutcome(
            content=f"arguments for tool {name!r} are not valid JSON ({exc}); "
            "send one JSON object of the arguments",
            is_error=True,
        )
    if not isinstance(parsed, dict):
        return ToolOutcome(
            content=f"arguments for tool {name!r} must be a JSON object of the arguments, "
            f"got {_json_type_article(parsed)}",
            is_error=True,
        )
    return parsed


#: What stops more than the code that raised it: trio's Cancelled (the scope that was
#: cancelled handles it) and a KeyboardInterrupt (it stops the registry).
_STOPS: Final = (trio.Cancelled, KeyboardInterrupt)


def stops(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a tool or a model, is a cancellation or a
    KeyboardInterrupt (or a group holding one), to let out; anything else it raises
    (``sys.exit()``, a misused generator's GeneratorExit, an asyncio task's
    CancelledError, any exception) fails its own call or turn only."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(_STOPS) is not None
    return isinstance(exc, _STOPS)


def describe_exception(exc: BaseException) -> str:
    """``exc`` as "Kind: message" (its kind alone if its ``str()`` is empty); a group
    (a nursery's) followed by what its exceptions say, each so, after a colon."""
    try:
        message = str(exc)
    except Exception:  # its own str() failed: the model is still told what failed
        message = "(its message could not be read)"
    kind = type(exc).__name__
    told = f"{kind}: {message}" if message else kind
    if isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions
        told += ": " + "; ".join(describe_exception(e) for e in inner[:_GROUP_TOLD])
        if len(inner) > _GROUP_TOLD:
            told += f"; and {len(inner) - _GROUP_TOLD} more"
    return told


#: How many of a group's exceptions ``describe_exception`` tells.
_GROUP_TOLD: Final = 5


#: Values whose JSON form is their ``str()`` (exact: a Decimal keeps its digits).
_AS_STRING: Final = (
    decimal.Decimal,
    uuid.UUID,
    pathlib.PurePath,
    ipaddress.IPv4Address,
    ipaddress.IPv6Address,
    ipaddress.IPv4Network,
    ipaddress.IPv6Network,
    ipaddress.IPv4Interface,
    ipaddress.IPv6Interface,
)


class _NotJSONError(TypeError):
    """A value in a tool's result that has no JSON form."""


def _json_form(value: object) -> object:
    """What ``value``, which ``json`` does not know, stands for in JSON (``json.dumps``
    encodes what this returns in turn); ``_NotJSONError`` if nothing."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime.date | datetime.time):  # (a datetime is a date)
        return value.isoformat()
    if isinstance(value, set | frozenset):
        try:
            return sorted(value)  # (the same set, the same text)
        except TypeError:
            return list(value)
    if isinstance(value, collections.abc.Mapping):
        return dict(value)
    if isinstance(value, collections.abc.Sequence | collections.abc.Set) and not isinstance(
        value, bytes | bytearray
    ):
        return list(value)
    cls = type(value)
    if callable(getattr(cls, "model_dump", None)):  # a pydantic model, duck-typed
        return value.model_dump(mode="json")  # type: ignore[attr-defined]
    if dataclasses.is_dataclass(cls):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(cls)}
    if attrs.has(cls):
        return {field.name: getattr(value, field.name) for field in attrs.fields(cls)}
    if isinstance(value, _AS_STRING):
        return str(value)
    module = cls.__module__
    named = cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
    raise _NotJSONError(
        f"it holds a {cls.__name__} ({named}), which has no JSON form; return a str, or "
        "JSON values (dict, list, str, int, float, bool, None) with dataclasses, attrs or "
        "pydantic instances, enums, datetimes, sets, tuples, Decimals, UUIDs or paths in them"
    )


#: A result's JSON (strict: a NaN or an infinity has no JSON form).
_RESULT_ENCODER: Final = json.JSONEncoder(default=_json_form, ensure_ascii=False, allow_nan=False)


def _encode_result(name: str, result: object) -> ToolOutcome:
    if isinstance(result, str):
        return ToolOutcome(content=result)
    try:
        return ToolOutcome(content=_RESULT_ENCODER.encode(result))
    except _NotJSONError as exc:
        return ToolOutcome(
            content=f"tool {name!r} returned a result that cannot be encoded as JSON: {exc}",
            is_error=True,
        )
    except Exception as exc:  # (a cycle, too deep, a key of another type, a model_dump failing)
        return ToolOutcome(
            content=f"tool {name!r} returned a result that cannot be encoded as JSON "
            f"({describe_exception(exc)})",
            is_error=True,
        )


# -- checking arguments against a schema ----------------------------------------

_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _json_type_article(value: object) -> str:
    kind = _json_type(value)
    return _TYPE_NAMES.get(kind, kind)


def _is_type(value: object, kind: object) -> bool:
    match kind:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
        case "null":
            return value is None
        case _:  # a type this checker does not know: let it through
            return True


def _json_equal(a: object, b: object) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _where(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return repr(text)


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _types_of(schema: Mapping[str, Any]) -> list[Any] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    return list(kind) if isinstance(kind, list | tuple) else [kind]


def _type_fits(schema: Mapping[str, Any], value: object) -> bool:
    kinds = _types_of(schema)
    return kinds is None or any(_is_type(value, kind) for kind in kinds)


def _describe(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(_show(option) for option in schema["enum"])
    if "const" in schema:
        return _show(schema["const"])
    kinds = _types_of(schema)
    if kinds is not None:
        return " or ".join(_TYPE_NAMES.get(str(kind), str(kind)) for kind in kinds)
    if "anyOf" in schema:
        return " or ".join(_describe(option) for option in schema["anyOf"])
    return "a valid value"


def _check(
    schema: Mapping[str, Any], value: object, path: tuple[str | int, ...], errors: list[str]
) -> None:
    """Append to ``errors`` a sentence for each way ``value`` breaks ``schema``."""
    if not _type_fits(schema, value):
        got = _show(value) if "enum" in schema else _json_type_article(value)
        errors.append(f"{_where(path)} must be {_describe(schema)}, got {got}")
        return
    if "enum" in schema and not any(_json_equal(value, option) for option in schema["enum"]):
        errors.append(f"{_where(path)} must be {_describe(schema)}, got {_show(value)}")
        return
    if "const" in schema and not _json_equal(value, schema["const"]):
        errors.append(f"{_where(path)} must be {_show(schema['const'])}, got {_show(value)}")
        return
    options = schema.get("anyOf")
    if isinstance(options, list | tuple) and options:
        found = [_errors_for(option, value, path) for option in options]
        if all(found):
            near = [
                errs
                for option, errs in zip(options, found, strict=True)
                if _type_fits(option, value)
            ]
            if len(near) == 1:  # one option has the right type: its complaint is the useful one
                errors.extend(near[0])
            else:
                errors.append(
                    f"{_where(path)} must be {_describe(schema)}, got {_json_type_article(value)}"
                )
            return
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, Mapping):
        for index, item in enumerate(value):
            _check(items, item, (*path, index), errors)
    if isinstance(value, dict):
        _check_object(schema, value, path, errors)


def _check_object(
    schema: Mapping[str, Any],
    value: dict[str, Any],
    path: tuple[str | int, ...],
    errors: list[str],
) -> None:
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        properties = {}
    noun = "key" if path else "argument"
    for key in schema.get("required", ()):
        if key not in value:
            errors.append(f"missing required {noun} {_where((*path, key))}")
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            if isinstance(properties[key], Mapping):
                _check(properties[key], item, (*path, key), errors)
        elif extra is False:
            known = ", ".join(repr(name) for name in properties) or "none"
            errors.append(f"unknown {noun} {_where((*path, key))} (known: {known})")
        elif isinstance(extra, Mapping):
            _check(extra, item, (*path, key), errors)


def _errors_for(schema: Mapping[str, Any], value: object, path: tuple[str | int, ...]) -> list[str]:
    errors: list[str] = []
    _check(schema, value, path, errors)
    return errors


# -- deriving a schema from a signature -----------------------------------------


def _docstring(fn: Callable[..., Any]) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.getdoc(target) or ""


_SECTION = re.compile(
    r"^\s*(?:Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters"
    r"|Returns?|Yields?|Raises|Warns|Examples?|Notes?|Attributes|Methods|References|See Also"
    r"|Todo|Warnings?):\s*$"
)
_GOOGLE_ARGS = re.compile(
    r"^(\s*)(?:Args|Arguments|Parameters|Keyword Args|Keyword Arguments):\s*$"
)
_GOOGLE_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:(.*)$")
_REST_PARAM = re.compile(
    r"^(\s*):(?:param|parameter|arg|argument|key|keyword)\s+(?:[^:]*\s)?(\w+)\s*:(.*)$"
)


def _first_paragraph(doc: str) -> str:
    lines: list[str] = []
    for line in doc.splitlines():
        if not line.strip() or _SECTION.match(line) or line.lstrip().startswith(":"):
            break
        lines.append(line.strip())
    return " ".join(lines)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _param_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from Google-style ``Args:`` sections and reST ``:param:`` fields."""
    found: dict[str, list[str]] = {}
    lines = doc.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if header := _GOOGLE_ARGS.match(line):
            base = len(header.group(1))
            entry_indent: int | None = None
            current: list[str] | None = None
            while index < len(lines):
                line = lines[index]
                if not line.strip():
                    index += 1
                    continue
                indent = _indent(line)
                if indent <= base:
                    break
                index += 1
                if entry_indent is None:
                    entry_indent = indent
                entry = _GOOGLE_ENTRY.match(line.strip()) if indent <= entry_indent else None
                if entry:
                    current = found.setdefault(entry.group(1), [])
                    current.append(entry.group(2).strip())
                elif current is not None:
                    current.append(line.strip())
        elif field := _REST_PARAM.match(line):
            base = len(field.group(1))
            current = found.setdefault(field.group(2), [])
            current.append(field.group(3).strip())
            while index < len(lines):
                line = lines[index]
                if not line.strip() or _indent(line) <= base:
                    break
                current.append(line.strip())
                index += 1
    return {name: " ".join(part for part in parts if part) for name, parts in found.items()}


def _type_hints(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn.func if isinstance(fn, functools.partial) else fn
    for candidate in (target, getattr(target, "__call__", None)):  # noqa: B004
        if candidate is None:
            continue
        try:
            return typing.get_type_hints(candidate)
        except TypeError:  # not a function, method, class or module
            continue
        except NameError as exc:
            raise TypeError(
                f"tool {name!r}: cannot resolve the annotations of {fn!r} ({exc}); "
                "import the names they use at module level"
            ) from exc
    return {}


def _find_context(name: str, fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s ToolContext parameter, if it has one, for a tool given its
    parameters' schema: its annotations are not evaluated (they may be any text), a
    context parameter is told by its class or by its name as written."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    found = None
    for param in signature.parameters.values():
        if _is_context(name, param, param.annotation):
            found = _one_context(name, param, found)
    return found


#: An annotation written as text that names ToolContext (``"sa.ToolContext"``; quoted
#: again under ``from __future__ import annotations``).
_CONTEXT_TEXT: Final = re.compile(r"""\s*(['"]?)(?:[A-Za-z_][\w.]*\.)?ToolContext\1\s*""")


def _is_context(name: str, param: inspect.Parameter, annotation: Any) -> bool:
    """Whether ``param``, annotated ``annotation`` (resolved, or as written), is a
    ToolContext parameter; refused (TypeError) if it may be one or not."""
    if annotation is ToolContext:
        return True
    if isinstance(annotation, str):
        if _CONTEXT_TEXT.fullmatch(annotation):
            return True
        maybe = re.search(r"\bToolContext\b", annotation) is not None
    else:
        maybe = ToolContext in typing.get_args(annotation)
    if maybe:
        raise TypeError(
            f"tool {name!r}: parameter {param.name!r} may be a ToolContext or something "
            "else: annotate it ToolContext: a tool is always given one"
        )
    return False


def _one_context(name: str, param: inspect.Parameter, found: str | None) -> str:
    """``param``, a ToolContext parameter, unless one was ``found`` before it."""
    if found is not None:
        raise TypeError(
            f"tool {name!r}: parameters {found!r} and {param.name!r} are both annotated "
            "ToolContext; declare one"
        )
    if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        raise TypeError(
            f"tool {name!r}: parameter {param.name!r} (a ToolContext) is given by name: "
            "make it a named parameter"
        )
    return param.name


def _signature_schema(
    name: str, fn: Callable[..., Any], doc: str
) -> tuple[dict[str, Any], dict[str, _Convert], str | None]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"tool {name!r}: cannot read the signature of {fn!r}; give parameters= explicitly"
        ) from exc
    hints = _type_hints(name, fn)
    descriptions = _param_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    converters: dict[str, _Convert] = {}
    context = None
    for param in signature.parameters.values():
        if _is_context(name, param, hints.get(param.name, param.annotation)):
            context = _one_context(name, param, context)
            continue
        where = f"tool {name!r}: parameter {param.name!r}"
        if param.kind is param.VAR_POSITIONAL or param.kind is param.VAR_KEYWORD:
            stars = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise TypeError(
                f"{where} is {stars}{param.name}; a tool receives its arguments by name, so "
                "declare each one as a named parameter (or give parameters= explicitly)"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(
                f"{where} is positional-only; a tool receives its arguments by name, "
                "so drop the '/'"
            )
        annotation = hints.get(param.name, param.annotation)
        if isinstance(annotation, str):
            raise TypeError(f"{where}: cannot resolve the annotation {annotation!r}")
        schema, convert = _annotation_schema(annotation, where)
        if descriptions.get(param.name):
            schema["description"] = descriptions[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            default = _json_default(param.default)
            if default is not _NO_DEFAULT:
                schema["default"] = default
        properties[param.name] = schema
        if convert is not _identity:
            converters[param.name] = convert
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return schema, converters, context


_NO_DEFAULT = object()


def _json_default(value: object) -> object:
    """The default as a JSON value, or ``_NO_DEFAULT`` when it has none."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return _NO_DEFAULT


_SCALARS = (str, int, float, bool, type(None))
_SEQUENCES = (list, collections.abc.Sequence, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _enum_schema(values: list[Any], where: str, what: str) -> dict[str, Any]:
    for value in values:
        if not isinstance(value, _SCALARS) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            raise TypeError(
                f"{where}: {what} has the value {value!r}, which is not a JSON string, "
                "number, boolean or null"
            )
    kinds = list(dict.fromkeys(_json_type(value) for value in values))
    if kinds == ["integer", "number"] or kinds == ["number", "integer"]:
        kinds = ["number"]
    schema: dict[str, Any] = {"enum": values}
    if len(kinds) == 1:
        schema = {"type": kinds[0], "enum": values}
    return schema


def _annotation_schema(annotation: Any, where: str) -> tuple[dict[str, Any], _Convert]:
    """The JSON schema of ``annotation`` and a function from a valid JSON value to it."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}, _identity
    if annotation is None or annotation is type(None):
        return {"type": "null"}, _identity
    if annotation is str:
        return {"type": "string"}, _identity
    if annotation is bool:
        return {"type": "boolean"}, _identity
    if annotation is int:
        return {"type": "integer"}, _identity
    if annotation is float:
        return {"type": "number"}, _to_float
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [member.value for member in annotation]
        return _enum_schema(values, where, f"enum {annotation.__name__}"), annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return _enum_schema(list(args), where, "Literal"), _identity
    if origin is typing.Union or origin is types.UnionType:
        return _union_schema(args, where)
    if annotation in _SEQUENCES or origin in _SEQUENCES:
        if not args:
            return {"type": "array"}, _identity
        items, convert = _annotation_schema(args[0], where)
        return {"type": "array", "items": items}, _each(convert, list)
    if annotation is tuple or origin is tuple:
        if not args:
            return {"type": "array"}, tuple
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(
                f"{where}: fixed-length tuple annotations are not supported; "
                "use tuple[T, ...] or list[T]"
            )
        items, convert = _annotation_schema(args[0], where)
        return {"type": "array", "items": items}, _each(convert, tuple)
    if annotation in _MAPPINGS or origin in _MAPPINGS:
        if not args:
            return {"type": "object"}, _identity
        if args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings; use dict[str, T]")
        value_schema, convert = _annotation_schema(args[1], where)
        mapping = {"type": "object", "additionalProperties": value_schema}
        if convert is _identity:
            return mapping, _identity
        return mapping, lambda value: {key: convert(item) for key, item in value.items()}
    raise TypeError(
        f"{where}: the annotation {annotation!r} has no JSON schema; use str, int, float, "
        "bool, list[T], tuple[T, ...], dict[str, T], Literal[...], an Enum or a union of "
        "these, or give the tool parameters= explicitly"
    )


def _to_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _each(convert: _Convert, container: Callable[[Any], Any]) -> _Convert:
    if convert is _identity and container is list:
        return _identity
    return lambda value: container(convert(item) for item in value)


def _union_schema(args: tuple[Any, ...], where: str) -> tuple[dict[str, Any], _Convert]:
    members = [arg for arg in args if arg is not type(None)]
    nullable = len(members) < len(args)
    derived = [_annotation_schema(member, where) for member in members]
    schemas = [schema for schema, _ in derived]
    if nullable:
        schemas.append({"type": "null"})
    schema: dict[str, Any]
    if any(not option for option in schemas):  # one member is Any: anything goes
        schema = {}
    elif all(set(option) == {"type"} and isinstance(option["type"], str) for option in schemas):
        schema = {"type": list(dict.fromkeys(option["type"] for option in schemas))}
    elif len(schemas) == 2 and nullable and set(schemas[0]) <= {"type", "enum"}:
        # ``Literal[...] | None`` or ``SomeEnum | None``: keep it flat
        schema = {"type": [schemas[0]["type"], "null"]} if "type" in schemas[0] else {}
        if "enum" in schemas[0]:
            schema["enum"] = [*schemas[0]["enum"], None]
    else:
        schema = {"anyOf": schemas}
    converters = [(option, convert) for option, convert in derived if convert is not _identity]
    if not converters:
        return schema, _identity

    def convert(value: Any) -> Any:
        if value is None and nullable:
            return None
        for option, member_convert in derived:
            if not _errors_for(option, value, ()):
                return member_convert(value)
        return value

    return schema, convert
