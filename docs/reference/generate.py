"""Write docs/reference/index.md from the public namespaces of sessionactors.

Run it after changing a public name, signature or docstring, and commit the result:

    .venv/bin/python docs/reference/generate.py

``--check`` exits with status 1 if index.md is out of date instead of writing it.
It reads only public namespaces; everything it prints comes from the code.
"""

import enum
import importlib
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import attrs

import sessionactors as sa
from sessionactors.stores import Store

OUT = Path(__file__).with_name("index.md")

NAMESPACES = [
    "sessionactors",
    "sessionactors.stores",
    "sessionactors.models",
    "sessionactors.testing",
    "sessionactors.aio",
    "sessionactors.http",
    "sessionactors.otel",
    "sessionactors.workers",
]

INTRO = {
    "sessionactors": (
        "The core: the registry and session handles, agents, models and tools, records, "
        "events, snapshots, errors, and the two stores without extra dependencies."
    ),
    "sessionactors.stores": (
        "Where sessions are kept. `RedisStore` needs the `redis` extra and is imported "
        "on first use. `Store` is the protocol a store implements."
    ),
    "sessionactors.models": (
        "Adapters for real model servers. `OpenAIChatModel` needs the `openai` extra."
    ),
    "sessionactors.testing": (
        "Fakes for tests and examples: models, stores that fail or break on purpose, a "
        "reader of a session's journal, and the store conformance suite."
    ),
    "sessionactors.aio": (
        "The library from asyncio: a registry opened inside a running asyncio loop (trio's "
        "guest mode on that loop), with the methods, records, events and errors of the trio "
        "API; asyncio models and tools run as asyncio tasks, and so do the calls of a store "
        "wrapped by `asyncio_store`."
    ),
    "sessionactors.http": (
        "An ASGI gateway (JSON, server-sent events, WebSocket) and the chat page, for "
        "hypercorn's trio worker and for uvicorn. Needs the `http` extra."
    ),
    "sessionactors.otel": (
        "OpenTelemetry traces and metrics after the GenAI semantic conventions, through the "
        "core's `Telemetry` seam. Needs the `otel` extra (`opentelemetry-api`); the "
        "application brings the SDK and its exporters."
    ),
    "sessionactors.workers": (
        "The multi-worker layer, a plug-in behind the core's router seam: `RedisStore` "
        "opens it for each registry (`open_cluster` over a `Transport`). Listed for what "
        "it reports (`ClusterStatistics`); the seam a store of your own would need to "
        "connect workers (the router host `open_cluster` takes) is not public yet."
    ),
}

# Top-level names grouped by topic; a name not listed lands in "Other", so nothing is lost.
GROUPS = {
    "Registry and sessions": [
        "open_registry",
        "Registry",
        "RegistryStatistics",
        "SessionRef",
        "Turn",
        "Reply",
        "read_session",
    ],
    "Agents, models and tools": [
        "Agent",
        "Compaction",
        "Model",
        "ModelRequest",
        "ModelChunk",
        "TextChunk",
        "ToolCallChunk",
        "UsageChunk",
        "FinishChunk",
        "ToolSpec",
        "tool",
        "Tool",
        "ToolOutcome",
    ],
    "Records": [
        "Message",
        "Role",
        "ToolCall",
        "ReviewRequest",
        "SessionState",
        "Status",
        "SessionInfo",
        "Usage",
    ],
    "Events": [
        "Event",
        "TurnStarted",
        "Delta",
        "MessageAdded",
        "TurnFinished",
        "TurnFailed",
        "TurnCancelled",
        "StatusChanged",
        "ToolCallStarted",
        "ToolResult",
        "ReviewRequested",
        "ReviewResolved",
        "HistoryEdited",
        "MetadataChanged",
    ],
    "Stores": ["MemoryStore", "SQLiteStore"],
    "Telemetry": ["Telemetry", "TurnTrace", "ModelCallTrace", "ToolCallTrace"],
    "Snapshots": ["dump_snapshot", "load_snapshot"],
    "Errors": [],  # filled with every exception class
}

# Made by the library, not by users: shown without their constructor's arguments.
NOT_CONSTRUCTED = {"Registry", "SessionRef", "Turn", "EventStream", "SessionsApp"}

# Methods the registry's session actors call: public names, but not for users.
HIDDEN_MEMBERS = {"Registry": {"agent_for", "hub_for", "detach", "replace", "mark_failed"}}

# A method without a docstring that implements one of these takes the protocol's.
PROTOCOLS = [sa.Model, Store]

# Private classes that public methods return, described by what they are.
PRIVATE_TYPES = {
    "_Subscription": "AsyncContextManager[AsyncIterator[Event]]",
    "_InBlock": "AsyncContextManager[AsyncIterator[Event]]",
}

# Values that are neither classes nor functions, so they carry no docstring of their own.
VALUE_DOCS = {
    "MAX_METADATA_BYTES": (
        "The largest session metadata, in bytes, encoded as the store writes it (64 KiB):"
        " `spawn`, `get_or_spawn` and `set_metadata` refuse more with `ValueError`."
        " See [Limits on what goes in]"
        "(../explanation/index.md#limits-on-what-goes-in)."
    ),
    "METRICS": (
        "Every metric `OpenTelemetry` records: name -> (instrument, unit, what it measures);"
        " the [observability how-to](../howto/observability.md) lists them."
    ),
    "ModelChunk": (
        "What a model's `stream` yields: a `TextChunk`, a `ToolCallChunk`, a `UsageChunk`"
        " or a `FinishChunk`."
    ),
}


# -- text -----------------------------------------------------------------------------


def rst_to_md(text: str) -> str:
    """The few reST habits of the docstrings, in Markdown."""
    text = re.sub(r":(?:class|func|meth|attr|data|exc|mod):`~?([^`]+)`", _role, text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    return f"`{match.group(1).rsplit('.', 1)[-1]}`"


def doc(obj: object) -> str:
    return rst_to_md(inspect.getdoc(obj) or "")


def first_paragraph(obj: object) -> str:
    text = doc(obj).split("\n\n", 1)[0]
    return " ".join(line.strip() for line in text.splitlines())


# -- signatures -------------------------------------------------------------------------


def annotation(value: Any, namespace: dict[str, Any] | None = None) -> str:
    """An annotation as text; a bare type alias (``Durability``) is spelled out."""
    if isinstance(value, str):
        alias = namespace.get(value) if namespace and value.isidentifier() else None
        if alias is None or inspect.isclass(alias):
            return value
        value = alias
    text = inspect.formatannotation(value)
    return re.sub(r"\b(?:sessionactors|collections\.abc|typing)(?:\.\w+)*\.", "", text)


def _namespace(obj: Any) -> dict[str, Any]:
    if inspect.isclass(obj):
        module = sys.modules.get(obj.__module__)
        return vars(module) if module else {}
    return getattr(inspect.unwrap(obj), "__globals__", {})


def _factory_defaults(obj: Any) -> dict[str, str]:
    """For an attrs class, how to show the defaults made by a factory."""
    if not (inspect.isclass(obj) and attrs.has(obj)):
        return {}
    shown = {}
    for field in attrs.fields(obj):
        default = field.default
        if isinstance(default, attrs.Factory) and not default.takes_self:  # type: ignore[arg-type]
            shown[field.alias or field.name] = repr(default.factory())
    return shown


def _is_async_context_manager(obj: Any) -> bool:
    """Whether ``obj`` is an async generator function made into a context manager."""
    return inspect.isasyncgenfunction(inspect.unwrap(obj)) and not inspect.isasyncgenfunction(obj)


def signature(obj: Any, *, skip_return: bool = False, drop_first: bool = False) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if drop_first:  # self or cls
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    factory_defaults = _factory_defaults(obj)
    names = _namespace(obj)
    parts: list[str] = []
    star_done = False
    kinds = [p.kind for p in sig.parameters.values()]
    for param in sig.parameters.values():
        if param.name.startswith("_"):
            continue
        if param.kind is param.KEYWORD_ONLY and not star_done:
            if inspect.Parameter.VAR_POSITIONAL not in kinds:
                parts.append("*")
            star_done = True
        text = param.name
        if param.kind is param.VAR_POSITIONAL:
            text, star_done = "*" + text, True
        elif param.kind is param.VAR_KEYWORD:
            text = "**" + text
        if param.annotation is not param.empty:
            text += f": {annotation(param.annotation, names)}"
        if param.default is not param.empty:
            default = param.default
            if default is attrs.NOTHING:
                shown = factory_defaults.get(param.name, "...")
            elif isinstance(default, enum.Enum):
                shown = f"{type(default).__name__}.{default.name}"
            elif callable(default):
                shown = default.__name__
            else:
                shown = repr(default)
            text += f" = {shown}" if param.annotation is not param.empty else f"={shown}"
        parts.append(text)
        if param.kind is param.POSITIONAL_ONLY and (
            len(parts) == len(sig.parameters)
            or list(sig.parameters.values())[len(parts)].kind is not param.POSITIONAL_ONLY
        ):
            parts.append("/")
    result = f"({', '.join(parts)})"
    if not skip_return and sig.return_annotation is not sig.empty:
        returns = annotation(sig.return_annotation, names)
        returns = PRIVATE_TYPES.get(returns, returns)
        if _is_async_context_manager(obj) and returns.startswith("AsyncIterator["):
            returns = "AsyncContextManager[" + returns.removeprefix("AsyncIterator[")
        result += f" -> {returns}"
    return result


def wrap(head: str, sig: str, tail: str = "") -> str:
    """``head(sig)tail`` on one line, or one parameter a line when that is too long."""
    line = f"{head}{sig}{tail}"
    if len(line) <= 88:
        return line
    close = _matching_paren(sig)
    params, rest = sig[1:close], sig[close + 1 :]
    body = "".join(f"    {p},\n" for p in _split_top(params))
    return f"{head}(\n{body}){rest}{tail}"


def _matching_paren(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return i
    return len(text) - 1


def _split_top(text: str) -> list[str]:
    parts, depth, current, quote = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


# -- entries ----------------------------------------------------------------------------


def public_bases(cls: type) -> list[type]:
    """``cls``'s bases as the reference names them: a private base (a shared
    constructor) stands for its own bases, and a base that another of them derives from
    is left out (it shows in that one's entry)."""
    found: list[type] = []
    for base in cls.__bases__:
        for public in public_bases(base) if base.__name__.startswith("_") else [base]:
            if public not in found:
                found.append(public)
    return [b for b in found if not any(o is not b and issubclass(o, b) for o in found)]


def bases(cls: type) -> str:
    names = [b.__name__ for b in public_bases(cls) if b not in (object, enum.Enum)]
    if issubclass(cls, enum.Enum):
        names.insert(0, "Enum")
    names = [n for n in names if n not in ("Protocol", "Generic")]
    return f"({', '.join(names)})" if names else ""


def members(cls: type) -> list[str]:
    lines: list[str] = []
    if issubclass(cls, enum.Enum):
        for member in cls:
            lines.append(f"- `{cls.__name__}.{member.name}` = `{member.value!r}`")
        return lines
    hidden = HIDDEN_MEMBERS.get(cls.__name__, set())
    for name, value in vars(cls).items():
        if name.startswith("_") or name in hidden:
            continue
        if isinstance(value, property):
            kind, sig, target = "property", "", value.fget
        elif isinstance(value, classmethod):
            target = value.__func__
            kind, sig = "classmethod", signature(target, drop_first=True)
        elif inspect.isfunction(value):
            target = value
            sig = signature(value, drop_first=True)
            kind = "async method" if inspect.iscoroutinefunction(value) else "method"
        else:
            continue
        text = first_paragraph(target) if target is not None else ""
        if not text:  # an implementation of a protocol method: the protocol's words
            for protocol in PROTOCOLS:
                if name in vars(protocol) and cls is not protocol:
                    text = first_paragraph(vars(protocol)[name])
        prefix = "await " if kind == "async method" else ""
        line = f"- `{prefix}{name}{sig}`"
        if kind in ("property", "classmethod"):
            line += f" ({kind})"
        lines.append(line + (f": {text}" if text else ""))
    return lines


def entry(namespace: str, name: str, obj: Any, seen: dict[int, str]) -> list[str]:
    anchor = f"{namespace}.{name}"
    out = [f'<a id="{anchor}"></a>', "", f"### `{name}`", ""]
    if id(obj) in seen and not isinstance(obj, str | int | float):
        first = seen[id(obj)]
        out += [f"The same object as [`{first}`](#{first}).", ""]
        return out
    seen[id(obj)] = anchor
    if inspect.isclass(obj):
        sig = (
            ""
            if name in NOT_CONSTRUCTED or issubclass(obj, enum.Enum)
            else signature(obj, skip_return=True)
        )
        if _is_protocol(obj):
            sig = ""
        if bases(obj):
            out += ["```python", f"class {name}{bases(obj)}"]
            if sig:
                out.append(wrap(name, sig))
        else:
            out += ["```python", wrap(f"class {name}", sig or "")]
        out += ["```", ""]
        text = doc(obj)
        if text:
            out += [text, ""]
        more = members(obj)
        if more:
            out += [*more, ""]
    elif callable(obj):
        prefix = "async def" if inspect.iscoroutinefunction(obj) else "def"
        if name == "open_registry":
            prefix = "async with"  # an async context manager
            out += [
                "```python",
                wrap(f"{prefix} {name}", signature(obj, skip_return=True), " as registry"),
            ]
        else:
            out += ["```python", wrap(f"{prefix} {name}", signature(obj))]
        out += ["```", "", doc(obj), ""]
    else:
        shown = annotation(obj) if isinstance(obj, types.UnionType) else repr(obj)
        if isinstance(obj, dict):  # a table: its entries are described in its docs
            shown = f"{{...}}  # {len(obj)} entries"
        out += ["```python", f"{name} = {shown}", "```", "", VALUE_DOCS.get(name, ""), ""]
    return out


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n in dir(module)
            if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)
        ]
    return sorted(names)


def error_tree(errors: list[type]) -> list[str]:
    """The exception hierarchy as an indented list, base first."""
    known = set(errors)
    lines: list[str] = []

    def walk(cls: type, depth: int) -> None:
        builtins = [b.__name__ for b in public_bases(cls) if b not in known and b is not Exception]
        extra = f" (also a `{'`, `'.join(builtins)}`)" if builtins else ""
        lines.append(f"{'  ' * depth}- [`{cls.__name__}`](#sessionactors.{cls.__name__}){extra}")
        for sub in sorted((c for c in errors if cls in public_bases(c)), key=lambda c: c.__name__):
            walk(sub, depth + 1)

    roots = [c for c in errors if not any(b in known for b in public_bases(c))]
    for root in roots:
        walk(root, 0)
    return lines


def render() -> str:
    out = [
        "# Reference",
        "",
        "Every public name of the public namespaces, with its signature and docstring.",
        "This page is generated from the code by `docs/reference/generate.py`; do not edit",
        "it by hand. Anything not listed here (modules whose names start with `_`) is",
        "private and may change without notice.",
        "",
    ]
    modules = {ns: importlib.import_module(ns) for ns in NAMESPACES}
    out.append("Namespaces:")
    out.append("")
    for ns in NAMESPACES:
        out.append(f"- [`{ns}`](#{ns.replace('.', '')}): {INTRO[ns]}")
    out.append("")
    seen: dict[int, str] = {}
    for ns, module in modules.items():
        names = public_names(module)
        out += [f"## `{ns}`", "", INTRO[ns], ""]
        if ns == "sessionactors":
            values = {n: getattr(module, n) for n in names}
            errors = [v for v in values.values() if inspect.isclass(v) and issubclass(v, Exception)]
            groups = {k: list(v) for k, v in GROUPS.items()}
            groups["Errors"] = [e.__name__ for e in errors]
            placed = {n for group in groups.values() for n in group}
            other = [n for n in names if n not in placed]
            if other:
                groups["Other"] = other
            for title, group in groups.items():
                group = [n for n in group if n in values]
                if not group:
                    continue
                out += [f"### {title}", ""]
                if title == "Errors":
                    out += [
                        "Every error is a `SessionActorsError` and carries `session_id`; "
                        "several also subclass the builtin you would catch:",
                        "",
                        *error_tree(errors),
                        "",
                    ]
                for name in group:
                    lines = entry(ns, name, values[name], seen)
                    out += [line.replace("### `", "#### `", 1) for line in lines]
        else:
            for name in names:
                lines = entry(ns, name, getattr(module, name), seen)
                out += lines
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return text


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
