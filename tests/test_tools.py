"""Tools: schema derivation, docstrings, the decorator and invoking with JSON arguments."""

import collections
import collections.abc
import dataclasses
import datetime
import decimal
import enum
import functools
import inspect
import json
import pathlib
import types
import typing
import uuid
from typing import Any, Literal, Optional

import attrs
import hypothesis.strategies as st
import pytest
import trio
from hypothesis import given

from sessionactors import Tool, ToolOutcome, ToolSpec, tool


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def noop() -> None:
    """Do nothing."""


def props(t: Tool) -> dict[str, Any]:
    return dict(t.spec.parameters["properties"])


# -- schema derivation -----------------------------------------------------------


@pytest.mark.parametrize(
    ("annotation", "schema"),
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (Any, {}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (list, {"type": "array"}),
        (collections.abc.Sequence[str], {"type": "array", "items": {"type": "string"}}),
        (tuple[float, ...], {"type": "array", "items": {"type": "number"}}),
        (dict[str, bool], {"type": "object", "additionalProperties": {"type": "boolean"}}),
        (dict, {"type": "object"}),
        (
            collections.abc.Mapping[str, int],
            {"type": "object", "additionalProperties": {"type": "integer"}},
        ),
        (Optional[int], {"type": ["integer", "null"]}),  # noqa: UP045
        (str | None, {"type": ["string", "null"]}),
        (int | str, {"type": ["integer", "string"]}),
        (
            list[str] | None,
            {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        ),
        (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
        (Literal[1, 2.5], {"type": "number", "enum": [1, 2.5]}),
        (Literal["a", 1], {"enum": ["a", 1]}),
        (Literal["a"] | None, {"type": ["string", "null"], "enum": ["a", None]}),
        (Colour, {"type": "string", "enum": ["red", "green"]}),
        (Level, {"type": "integer", "enum": [1, 2]}),
        (list[Colour], {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}}),
    ],
)
def test_schema_for_each_supported_annotation(annotation: Any, schema: dict[str, Any]) -> None:
    """Each supported annotation maps to its JSON schema, and the parameter is required."""

    def fn(x):  # type: ignore[no-untyped-def]
        return x

    fn.__annotations__ = {"x": annotation}
    t = Tool(name="t", fn=fn)
    assert t.spec.parameters == {
        "type": "object",
        "properties": {"x": schema},
        "required": ["x"],
        "additionalProperties": False,
    }


def test_unannotated_parameter_accepts_any_value() -> None:
    """A parameter without an annotation gets the empty schema, which accepts any JSON value."""

    @tool
    def echo(value):  # type: ignore[no-untyped-def]
        return value

    assert props(echo) == {"value": {}}


def test_defaults_are_recorded_and_not_required() -> None:
    """A parameter with a default is optional and its default, as JSON, is in its schema."""

    @tool
    def search(
        query: str,
        limit: int = 10,
        colour: Colour = Colour.GREEN,
        tags: tuple[str, ...] = ("a",),
        since: Optional[str] = None,  # noqa: UP045
        until: str | None = None,
        when=datetime.date(2024, 1, 1),
    ) -> list[str]:
        return []

    params = search.spec.parameters
    assert params["required"] == ["query"]
    assert params["properties"]["limit"] == {"type": "integer", "default": 10}
    assert params["properties"]["colour"]["default"] == "green"
    assert params["properties"]["tags"]["default"] == ["a"]
    assert params["properties"]["since"] == {"type": ["string", "null"], "default": None}
    assert params["properties"]["until"] == params["properties"]["since"]
    assert params["properties"]["when"] == {}  # no JSON form, so no default recorded


def test_optional_without_default_is_required_but_nullable() -> None:
    """``T | None`` without a default stays required and accepts null."""

    @tool
    def f(x: int | None) -> None:
        pass

    assert f.spec.parameters["required"] == ["x"]
    assert props(f)["x"] == {"type": ["integer", "null"]}


def test_string_annotations_are_resolved() -> None:
    """Annotations written as strings are resolved with ``typing.get_type_hints``."""

    @tool
    def f(x: "int", y: "list[Colour]") -> "str":
        return ""

    assert props(f)["x"] == {"type": "integer"}
    assert props(f)["y"]["items"]["enum"] == ["red", "green"]


def test_unresolvable_string_annotation_is_a_type_error() -> None:
    """A string annotation naming something undefined fails at decoration time."""
    with pytest.raises(TypeError, match="cannot resolve the annotations"):

        @tool
        def f(x: "Undefined") -> None:  # type: ignore[name-defined]  # noqa: F821
            pass


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (datetime.datetime, "has no JSON schema"),
        (tuple[int, str], "fixed-length tuple"),
        (dict[int, str], "keys are strings"),
        (Literal[b"x"], "not a JSON string"),
    ],
)
def test_unsupported_annotation_is_a_type_error(annotation: Any, message: str) -> None:
    """An annotation with no JSON schema raises TypeError naming the tool and parameter."""

    def fn(x):  # type: ignore[no-untyped-def]
        return x

    fn.__annotations__ = {"x": annotation}
    with pytest.raises(TypeError, match=message) as info:
        Tool(name="t", fn=fn)
    assert "tool 't': parameter 'x'" in str(info.value)


def test_var_args_are_rejected_at_decoration() -> None:
    """``*args`` and ``**kwargs`` raise TypeError when the schema is derived."""
    with pytest.raises(TypeError, match=r"\*args; a tool receives its arguments by name"):

        @tool
        def f(*args: int) -> None:
            pass

    with pytest.raises(TypeError, match=r"\*\*kwargs"):

        @tool
        def g(x: int, **kwargs: int) -> None:
            pass


def test_positional_only_parameters_are_rejected() -> None:
    """A positional-only parameter raises TypeError, as arguments are passed by name."""
    with pytest.raises(TypeError, match="positional-only"):

        @tool
        def f(x: int, /) -> None:
            pass


async def test_explicit_parameters_allow_kwargs() -> None:
    """With an explicit schema a ``**kwargs`` function is accepted and gets the JSON values."""
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}}

    @tool(parameters=schema)
    def f(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    assert f.spec.parameters is schema
    outcome = await f.invoke('{"colour": "red", "extra": 1}')
    assert outcome == ToolOutcome(content='{"colour": "red", "extra": 1}')


async def test_explicit_parameters_are_checked() -> None:
    """An explicit schema is used as is for the spec and to check the arguments."""
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    t = Tool(name="paint", fn=lambda colour: colour, parameters=schema)
    assert t.spec == ToolSpec(name="paint", description="", parameters=schema)
    assert (await t.invoke('{"colour": "red"}')) == ToolOutcome(content="red")
    outcome = await t.invoke('{"colour": "blue"}')
    assert outcome.is_error
    assert '\'colour\' must be one of "red", got "blue"' in outcome.content


def test_explicit_parameters_must_describe_an_object() -> None:
    """An explicit schema whose type is not ``object`` is a ValueError."""
    with pytest.raises(ValueError, match='"type": "object"'):
        Tool(name="t", fn=noop, parameters={"type": "string"})


# -- docstrings -------------------------------------------------------------------


def test_google_docstring_gives_descriptions() -> None:
    """A Google-style ``Args:`` section describes parameters, with or without types."""

    @tool
    def lookup(order_id: str, verbose: bool = False) -> str:
        """Look up an order by its id.

        Longer explanation that is not part of the description.

        Args:
            order_id: The order's id,
                for example "A1001".
            verbose (bool): Include the line items.

        Returns:
            The order as text.
        """
        return ""

    assert lookup.spec.description == "Look up an order by its id."
    assert props(lookup)["order_id"]["description"] == 'The order\'s id, for example "A1001".'
    assert props(lookup)["verbose"]["description"] == "Include the line items."


def test_rest_docstring_gives_descriptions() -> None:
    """reST ``:param name:`` and ``:param type name:`` fields describe parameters."""

    @tool
    def lookup(order_id: str, verbose: bool = False) -> str:
        """Look up an order
        by its id.

        :param order_id: The order's id,
            as printed on the invoice.
        :param bool verbose: Include the line items.
        :returns: The order as text.
        """
        return ""

    assert lookup.spec.description == "Look up an order by its id."
    assert props(lookup)["order_id"]["description"] == (
        "The order's id, as printed on the invoice."
    )
    assert props(lookup)["verbose"]["description"] == "Include the line items."


def test_description_stops_at_a_section_header() -> None:
    """The description is the first paragraph even when a section follows without a blank line."""

    @tool
    def f(x: int) -> None:
        """Do the thing:
        Args:
            x: How much.
        """

    assert f.spec.description == "Do the thing:"
    assert props(f)["x"]["description"] == "How much."


def test_explicit_description_wins_and_no_docstring_means_empty() -> None:
    """An explicit description replaces the docstring; without either it is empty."""

    @tool(description="Explicit.")
    def f() -> None:
        """From the docstring."""

    @tool
    def g() -> None:
        pass

    assert f.spec.description == "Explicit."
    assert g.spec.description == ""


# -- decorator, names, construction -----------------------------------------------


def test_decorator_forms() -> None:
    """``@tool``, ``@tool()`` and ``@tool(...)`` all return a Tool with the given settings."""

    @tool
    def a() -> None:
        pass

    @tool()
    def b() -> None:
        pass

    @tool(name="refund-order", description="Refund.", requires_review=True, idempotent=False)
    def c() -> None:
        pass

    assert isinstance(a, Tool)
    assert (a.name, a.requires_review, a.idempotent) == ("a", False, True)
    assert isinstance(b, Tool)
    assert b.name == "b"
    assert (c.name, c.description, c.requires_review, c.idempotent) == (
        "refund-order",
        "Refund.",
        True,
        False,
    )
    assert c.spec.name == "refund-order"


def test_decorator_rejects_a_positional_name() -> None:
    """``@tool("name")`` is a TypeError that points to ``name=``."""
    with pytest.raises(TypeError, match=r"@tool\(name='x'\)"):
        tool("x")  # type: ignore[call-overload]


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "naïve", "a.b", "<lambda>"])
def test_bad_names_are_rejected(name: str) -> None:
    """A name outside ``[A-Za-z0-9_-]{1,64}`` is a ValueError that states the rule."""
    with pytest.raises(ValueError, match="1 to 64 ASCII letters, digits"):
        Tool(name=name, fn=noop)


def test_longest_name_is_accepted() -> None:
    """A 64-character name of letters, digits, '_' and '-' is valid."""
    assert Tool(name="a-_9" * 16, fn=noop).name == "a-_9" * 16


def test_lambda_needs_a_name() -> None:
    """Decorating a lambda without ``name=`` fails on the invalid name ``<lambda>``."""
    with pytest.raises(ValueError, match="'<lambda>'"):
        tool(lambda: None)


def test_fn_must_be_a_callable_returning_one_result() -> None:
    """A non-callable or an async generator function is a TypeError."""

    async def gen() -> collections.abc.AsyncIterator[int]:
        yield 1

    with pytest.raises(TypeError, match="callable"):
        Tool(name="t", fn="not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="async generator"):
        Tool(name="t", fn=gen)


def test_tools_are_hashable_values() -> None:
    """Tools compare by their fields and hash even with a dict schema."""
    schema = {"type": "object", "properties": {}}
    assert Tool(name="t", fn=noop, parameters=schema) == Tool(
        name="t", fn=noop, parameters=dict(schema)
    )
    assert isinstance(hash(Tool(name="t", fn=noop, parameters=schema)), int)


def test_callable_object_and_partial() -> None:
    """A callable object and a ``functools.partial`` get schemas from their signatures."""

    class Adder:
        """Add to a number."""

        def __call__(self, x: int) -> int:
            return x + 1

    def scale(x: float, factor: float) -> float:
        """Scale a number."""
        return x * factor

    adder = Tool(name="adder", fn=Adder())
    double = Tool(name="double", fn=functools.partial(scale, factor=2.0))
    assert adder.spec.description == "Add to a number."
    assert props(adder) == {"x": {"type": "integer"}}
    assert double.spec.description == "Scale a number."
    assert double.spec.parameters["required"] == ["x"]
    assert props(double)["factor"] == {"type": "number", "default": 2.0}


# -- invoke ---------------------------------------------------------------------


async def test_invoke_async_tool() -> None:
    """An async tool is awaited with the arguments as keyword arguments."""

    @tool
    async def greet(name: str, punctuation: str = "!") -> str:
        await trio.lowlevel.checkpoint()
        return f"hello {name}{punctuation}"

    assert await greet.invoke('{"name": "Ada"}') == ToolOutcome(content="hello Ada!")


async def test_invoke_sync_tool() -> None:
    """A sync tool is called directly."""

    @tool
    def add(a: int, b: int) -> int:
        return a + b

    assert await add.invoke('{"a": 2, "b": 3}') == ToolOutcome(content="5")


async def test_sync_fn_returning_an_awaitable_is_awaited() -> None:
    """A partial of an async function works as a tool: its awaitable is awaited."""

    async def greet(name: str, greeting: str) -> str:
        return f"{greeting} {name}"

    t = Tool(name="hi", fn=functools.partial(greet, greeting="hi"))
    assert await t.invoke('{"name": "Ada"}') == ToolOutcome(content="hi Ada")


async def test_a_plain_function_returning_a_coroutine_has_it_awaited() -> None:
    """A plain def tool (run in a worker thread) that returns a coroutine has it awaited,
    as any sync fn's awaitable is: its result, not trio's refusal of an async function."""

    async def lookup(name: str) -> str:
        await trio.lowlevel.checkpoint()
        return f"found {name}"

    @tool
    def find(name: str) -> Any:
        return lookup(name)

    assert await find.invoke('{"name": "Ada"}') == ToolOutcome(content="found Ada")


async def test_empty_arguments_mean_no_arguments() -> None:
    """Empty or blank argument text is taken as ``{}``."""

    @tool
    def ping() -> str:
        return "pong"

    assert await ping.invoke("") == ToolOutcome(content="pong")
    assert await ping.invoke("  ") == ToolOutcome(content="pong")


@pytest.mark.parametrize(
    ("result", "content"),
    [
        ({"id": "A1", "total": 9.5}, '{"id": "A1", "total": 9.5}'),
        ([1, "two"], '[1, "two"]'),
        (None, "null"),
        (True, "true"),
        (datetime.date(2024, 5, 1), '"2024-05-01"'),
        (Colour.RED, '"red"'),
        ("já", "já"),
        ({"city": "Zürich"}, '{"city": "Zürich"}'),
    ],
)
async def test_results_that_are_not_str_are_json_encoded(result: object, content: str) -> None:
    """A str result is passed as is and anything else is JSON (enums by value)."""
    t = Tool(name="t", fn=lambda: result)
    assert await t.invoke("{}") == ToolOutcome(content=content)


async def test_unencodable_result_is_an_error() -> None:
    """A result that JSON cannot encode (a cycle) is an error outcome, not an exception."""
    cycle: list[object] = []
    cycle.append(cycle)
    outcome = await Tool(name="t", fn=lambda: cycle).invoke("{}")
    assert outcome.is_error
    assert "cannot be encoded as JSON" in outcome.content


@attrs.frozen
class _Refund:
    order_id: str
    amount: decimal.Decimal


@dataclasses.dataclass
class _Order:
    id: str
    placed: datetime.datetime
    tags: frozenset[str]
    refunds: list[_Refund]


class _Model:
    """Quacks as a pydantic model: ``model_dump(mode="json")`` gives its JSON form."""

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]:
        assert mode == "json"
        return {"id": "A1", "total": 42.0}


class _Widget:
    def __str__(self) -> str:
        return "a widget"


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            _Order(
                "A1",
                datetime.datetime(2025, 1, 1, 9, 30, tzinfo=datetime.UTC),
                frozenset({"gift", "big"}),
                [_Refund("A1", decimal.Decimal("42.10"))],
            ),
            {
                "id": "A1",
                "placed": "2025-01-01T09:30:00+00:00",
                "tags": ["big", "gift"],
                "refunds": [{"order_id": "A1", "amount": "42.10"}],
            },
        ),
        (_Model(), {"id": "A1", "total": 42.0}),
        ({2, 1}, [1, 2]),
        ((1, "two"), [1, "two"]),
        (collections.deque([1, 2]), [1, 2]),
        (types.MappingProxyType({"a": 1}), {"a": 1}),
        ({"at": datetime.time(9, 30)}, {"at": "09:30:00"}),
        ({"on": datetime.date(2025, 1, 2), "why": Colour.RED}, {"on": "2025-01-02", "why": "red"}),
        (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"),
        (pathlib.PurePosixPath("/srv/a.txt"), "/srv/a.txt"),
    ],
)
async def test_results_become_json_as_their_fields_and_iso_strings(
    result: object, expected: object
) -> None:
    """Dataclasses, attrs instances and pydantic models reach the model as their fields,
    datetimes as ISO strings, sets (sorted) and tuples as lists, decimals, UUIDs and paths
    as strings: as JSON, never as a Python repr."""
    outcome = await Tool(name="t", fn=lambda: result).invoke("{}")
    assert not outcome.is_error, outcome.content
    assert json.loads(outcome.content) == expected


async def test_a_pydantic_result_is_its_json_form() -> None:
    """A pydantic model reaches the model as its fields, by ``model_dump(mode="json")``
    (duck-typed: the library does not import pydantic, and the tests do not need it)."""

    class OrderOut:  # (what pydantic.BaseModel offers for this)
        def __init__(self, id: str, placed: datetime.datetime) -> None:
            self.id, self.placed = id, placed

        def model_dump(self, *, mode: str = "python") -> dict[str, object]:
            placed = self.placed.isoformat().replace("+00:00", "Z")
            return {"id": self.id, "placed": placed if mode == "json" else self.placed}

    order = OrderOut(id="A1", placed=datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC))
    outcome = await Tool(name="t", fn=lambda: {"order": order}).invoke("{}")
    assert json.loads(outcome.content) == {"order": {"id": "A1", "placed": "2025-01-01T00:00:00Z"}}


@pytest.mark.parametrize(
    ("result", "named"),
    [
        ({"widget": _Widget()}, "test_tools._Widget"),
        (b"raw", "bytes"),
        ({(1, 2): "a pair as a key"}, "tuple"),
        (object(), "object"),
        ({"score": float("nan")}, "Out of range float"),
        ([float("-inf")], "Out of range float"),
    ],
)
async def test_a_result_that_is_not_json_is_an_error_naming_the_tool_and_type(
    result: object, named: str
) -> None:
    """A result holding a value with no JSON form (an object of its own, bytes, a key
    that is not a string, a float that is not finite) is an error result naming the
    tool and the value's type, as a raising tool's is, never the value's str() or
    repr. (A NaN was sent as ``NaN``, which is not JSON.)"""
    outcome = await Tool(name="lookup", fn=lambda: result).invoke("{}")
    assert outcome.is_error
    assert "tool 'lookup'" in outcome.content, outcome.content
    assert named in outcome.content, outcome.content
    assert "a widget" not in outcome.content


async def test_arguments_are_converted_to_annotated_types() -> None:
    """Enum, tuple and float parameters receive an enum member, a tuple and floats."""
    seen: dict[str, Any] = {}

    @tool
    def f(
        colour: Colour,
        levels: tuple[Level, ...],
        ratio: float,
        by_name: dict[str, Colour],
        maybe: Colour | None = None,
    ) -> None:
        seen.update(colour=colour, levels=levels, ratio=ratio, by_name=by_name, maybe=maybe)

    args = '{"colour": "red", "levels": [2, 1], "ratio": 1, "by_name": {"a": "green"}}'
    assert not (await f.invoke(args)).is_error
    assert seen == {
        "colour": Colour.RED,
        "levels": (Level.HIGH, Level.LOW),
        "ratio": 1.0,
        "by_name": {"a": Colour.GREEN},
        "maybe": None,
    }
    assert type(seen["ratio"]) is float
    assert not (await f.invoke(args[:-1] + ', "maybe": "green"}')).is_error
    assert seen["maybe"] is Colour.GREEN


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("{not json", "are not valid JSON (Expecting property name"),
        ('{"x": "1', "not valid JSON (Unterminated string starting at: line 1 column 7)"),
        ('{"x": NaN}', "NaN is not allowed"),
        ('{"x": Infinity}', "Infinity is not allowed"),
        ("[1, 2]", "must be a JSON object of the arguments, got an array"),
        ('"x"', "must be a JSON object of the arguments, got a string"),
    ],
)
async def test_bad_json_is_an_error_outcome(arguments: str, message: str) -> None:
    """Arguments that are not a JSON object give an error outcome saying what to send."""

    @tool
    def f(x: float) -> float:
        return x

    outcome = await f.invoke(arguments)
    assert outcome.is_error
    assert message in outcome.content
    assert "tool 'f'" in outcome.content


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"count": "3"}', "'count' must be an integer, got a string"),
        ('{"count": true}', "'count' must be an integer, got a boolean"),
        ('{"count": 3.5}', "'count' must be an integer, got a number"),
        ('{"count": 1, "ratio": "x"}', "'ratio' must be a number, got a string"),
        ('{"count": 1, "ratio": false}', "'ratio' must be a number, got a boolean"),
        ('{"count": 1, "tags": ["a", 2]}', "'tags[1]' must be a string, got an integer"),
        ('{"count": 1, "tags": "a"}', "'tags' must be an array, got a string"),
        ('{"count": 1, "mode": "slow"}', '\'mode\' must be one of "fast", "safe", got "slow"'),
        ('{"count": 1, "level": true}', "'level' must be one of 1, 2, got true"),
        ('{"count": 1, "flags": {"a": 1}}', "'flags.a' must be a boolean, got an integer"),
        # (a path that holds a quote is quoted as Python quotes it)
        ('{"count": 1, "flags": {"\'": 1}}', '"flags.\'" must be a boolean, got an integer'),
        ('{"count": 1, "note": 5}', "'note' must be a string or null, got an integer"),
        ('{"count": 1, "batch": [["a"]]}', "'batch[0]' must be an integer, got an array"),
        ('{"count": 1, "batch": [1, "x"]}', "'batch[1]' must be an integer, got a string"),
        ('{"count": 1, "level": null}', "'level' must be one of 1, 2, got null"),
        ("{}", "missing required argument 'count'"),
        ('{"count": 1, "colour": "red"}', "unknown argument 'colour' (known: 'count', "),
    ],
)
async def test_arguments_that_break_the_schema_are_error_outcomes(
    arguments: str, message: str
) -> None:
    """Wrong types, missing and unknown arguments give an error outcome naming the argument."""
    called = False

    @tool
    def f(
        count: int,
        ratio: float = 1.0,
        tags: list[str] = [],  # noqa: B006
        mode: Literal["fast", "safe"] = "fast",
        level: Level = Level.LOW,
        flags: dict[str, bool] = {},  # noqa: B006
        note: str | None = None,
        batch: list[int] | None = None,
    ) -> None:
        nonlocal called
        called = True

    outcome = await f.invoke(arguments)
    assert outcome.is_error
    assert outcome.content.startswith("arguments for tool 'f' are invalid: ")
    assert message in outcome.content
    assert not called


async def test_every_problem_is_reported_at_once() -> None:
    """All the problems with the arguments are listed in one outcome."""

    @tool
    def f(a: int, b: str) -> None:
        pass

    outcome = await f.invoke('{"a": "x", "c": 1}')
    assert outcome.content == (
        "arguments for tool 'f' are invalid: missing required argument 'b'; "
        "'a' must be an integer, got a string; unknown argument 'c' (known: 'a', 'b')"
    )


@pytest.mark.parametrize(
    ("error", "content"),
    [
        (ValueError("order A1 not found"), "ValueError: order A1 not found"),
        (KeyError("A1"), "KeyError: 'A1'"),
        (RuntimeError(), "RuntimeError"),
        # a nursery's group: what failed inside it (the model read only the group's words)
        (
            ExceptionGroup("Exceptions from Trio nursery", [ValueError("w2 crashed")]),
            "ExceptionGroup: Exceptions from Trio nursery (1 sub-exception): "
            "ValueError: w2 crashed",
        ),
        (
            ExceptionGroup("many", [KeyError("a"), ExceptionGroup("inner", [OSError(5, "io")])]),
            "ExceptionGroup: many (2 sub-exceptions): KeyError: 'a'; "
            "ExceptionGroup: inner (1 sub-exception): OSError: [Errno 5] io",
        ),
    ],
)
async def test_exception_from_fn_becomes_an_error_outcome(error: Exception, content: str) -> None:
    """An Exception raised by the tool becomes ``is_error=True`` with ``"{type}: {message}"``."""

    @tool
    async def fail() -> None:
        raise error

    assert await fail.invoke("{}") == ToolOutcome(content=content, is_error=True)


async def test_a_keyboard_interrupt_propagates_and_another_base_exception_does_not() -> None:
    """A KeyboardInterrupt (Ctrl-C) is raised, not turned into an outcome; another
    BaseException that is not an Exception is the tool's own failure, an outcome."""

    class Stop(BaseException):
        pass

    def interrupt() -> None:
        raise KeyboardInterrupt

    def stop() -> None:
        raise Stop("stopped")

    with pytest.raises(KeyboardInterrupt):
        await Tool(name="interrupt", fn=interrupt).invoke("{}")
    outcome = await Tool(name="stop", fn=stop).invoke("{}")
    assert outcome == ToolOutcome(content="Stop: stopped", is_error=True)


async def test_cancellation_propagates(autojump_clock: trio.abc.Clock) -> None:
    """Cancelling a scope around a running tool cancels it; invoke does not swallow Cancelled."""
    finished = False

    @tool
    async def slow() -> str:
        nonlocal finished
        await trio.sleep(60)
        finished = True
        return "done"

    start = trio.current_time()
    with trio.move_on_after(1) as scope:
        await slow.invoke("{}")
    assert scope.cancelled_caught
    assert not finished
    assert trio.current_time() - start == pytest.approx(1)


async def test_invoke_checkpoints_before_calling() -> None:
    """Invoking inside a cancelled scope raises Cancelled before the function runs."""
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1

    with trio.CancelScope() as scope:
        scope.cancel()
        await Tool(name="count", fn=count).invoke("{}")
    assert scope.cancelled_caught
    assert calls == 0


# -- property: derived schemas accept what fits and reject what does not ------------

_SCALARS: list[Any] = [
    str,
    int,
    float,
    bool,
    Literal["a", "b"],
    Literal[1, 2],
    Colour,
    Level,
]


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        children.map(lambda t: list[t]),  # type: ignore[valid-type]
        children.map(lambda t: tuple[t, ...]),  # type: ignore[valid-type]
        children.map(lambda t: dict[str, t]),  # type: ignore[valid-type]
        children.map(lambda t: Optional[t]),  # noqa: UP045
    )


annotations = st.recursive(st.sampled_from(_SCALARS), _extend, max_leaves=3)

_INTS = st.integers(min_value=-(2**63), max_value=2**63)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
_TEXT = st.text(max_size=4)


def _parts(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(annotation), typing.get_args(annotation)


def values_for(annotation: Any) -> st.SearchStrategy[Any]:
    """JSON values that fit ``annotation``."""
    origin, args = _parts(annotation)
    if annotation is str:
        return _TEXT
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return _INTS
    if annotation is float:
        return _FLOATS | _INTS
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from([member.value for member in annotation])
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (list, tuple):
        return st.lists(values_for(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(_TEXT, values_for(args[1]), max_size=3)
    (inner,) = [arg for arg in args if arg is not type(None)]
    return st.none() | values_for(inner)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def fits(value: Any, annotation: Any) -> bool:
    """Whether the JSON ``value`` fits ``annotation`` (an oracle independent of the schema)."""
    origin, args = _parts(annotation)
    if annotation is str:
        return isinstance(value, str)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return any(_same(value, member.value) for member in annotation)
    if origin is Literal:
        return any(_same(value, option) for option in args)
    if origin in (list, tuple):
        return isinstance(value, list) and all(fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(item, args[1]) for item in value.values())
    (inner,) = [arg for arg in args if arg is not type(None)]
    return value is None or fits(value, inner)


_ANY_JSON = st.one_of(
    _TEXT,
    _INTS,
    _FLOATS,
    st.booleans(),
    st.none(),
    st.lists(_INTS, max_size=2),
    st.dictionaries(_TEXT, _INTS, max_size=2),
)


def wrong_for(annotation: Any) -> st.SearchStrategy[Any]:
    """JSON values that do not fit ``annotation``, at the top or inside a container."""
    origin, args = _parts(annotation)
    wrong = _ANY_JSON.filter(lambda value: not fits(value, annotation))
    if origin in (list, tuple):
        nested = st.builds(
            lambda good, bad, at: [*good[:at], bad, *good[at:]],
            st.lists(values_for(args[0]), max_size=2),
            wrong_for(args[0]),
            st.integers(0, 2),
        )
        return wrong | nested
    if origin is dict:
        nested = st.builds(
            lambda good, key, bad: {**good, key: bad},
            st.dictionaries(_TEXT, values_for(args[1]), max_size=2),
            _TEXT,
            wrong_for(args[1]),
        )
        return wrong | nested
    return wrong


def python_fits(value: Any, annotation: Any) -> bool:
    """Whether the function received ``value`` as the Python type ``annotation`` promises."""
    origin, args = _parts(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, annotation)
    if annotation is float:
        return type(value) is float
    if origin is list:
        return type(value) is list and all(python_fits(item, args[0]) for item in value)
    if origin is tuple:
        return type(value) is tuple and all(python_fits(item, args[0]) for item in value)
    if origin is dict:
        return type(value) is dict and all(python_fits(v, args[1]) for v in value.values())
    if origin is not None and origin is not Literal:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return value is None or python_fits(value, inner)
    return True


def make_fn(annotations: list[Any], received: list[dict[str, Any]]) -> Any:
    async def fn(**kwargs: Any) -> str:
        received.append(kwargs)
        return "ok"

    names = [f"p{index}" for index in range(len(annotations))]
    fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
            for name, annotation in zip(names, annotations, strict=True)
        ]
    )
    fn.__annotations__ = dict(zip(names, annotations, strict=True))
    return fn


@given(st.data())
async def test_derived_schema_accepts_fitting_and_rejects_wrong_arguments(
    data: st.DataObject,
) -> None:
    """Arguments that fit the annotations pass (as the annotated types); one wrong value fails."""
    types = data.draw(st.lists(annotations, min_size=1, max_size=4), label="annotations")
    received: list[dict[str, Any]] = []
    t = Tool(name="generated", fn=make_fn(types, received))
    json.dumps(t.spec.parameters, allow_nan=False)
    names = list(t.spec.parameters["properties"])

    good = {
        name: data.draw(values_for(kind), label=name)
        for name, kind in zip(names, types, strict=True)
    }
    outcome = await t.invoke(json.dumps(good))
    assert outcome == ToolOutcome(content="ok"), outcome.content
    assert all(python_fits(received[0][n], k) for n, k in zip(names, types, strict=True))

    index = data.draw(st.integers(0, len(names) - 1), label="index")
    bad = {**good, names[index]: data.draw(wrong_for(types[index]), label="wrong")}
    outcome = await t.invoke(json.dumps(bad))
    assert outcome.is_error
    # the argument begins the path the message names, quoted as Python quotes it: with
    # double quotes if the path holds a single quote (a key of a map, say)
    assert f"'{names[index]}" in outcome.content or f'"{names[index]}' in outcome.content
    assert len(received) == 1
