"""The public namespaces: their names resolve, are documented, and errors follow the rules."""

import importlib
import inspect
import types

import pytest

import sessionactors as sa

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

# Known gaps, each an xfail(strict=True): when one is fixed, its test passes unexpectedly
# and fails the run, so the mark is removed in the same change.
NO_ALL: dict[str, str] = {}
NOT_SESSION_ACTORS_ERRORS: dict[str, str] = {}


def public_names(namespace: str) -> list[str]:
    """``__all__``, or, for a namespace without one, its names without a leading ``_``."""
    module = importlib.import_module(namespace)
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    ]


def public_objects() -> list[tuple[str, object]]:
    """``(qualified name, object)`` for every public name of every namespace."""
    out = []
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        out += [(f"{namespace}.{n}", getattr(module, n)) for n in public_names(namespace)]
    return out


def xfail_if_known(key: str, known: dict[str, str]) -> object:
    marks = [pytest.mark.xfail(reason=known[key], strict=True)] if key in known else []
    return pytest.param(key, marks=marks, id=key)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_resolves(namespace: str) -> None:
    """Every name a public namespace lists can be imported from it."""
    module = importlib.import_module(namespace)
    names = public_names(namespace)
    assert names, f"{namespace} has no public names"
    for name in names:
        assert getattr(module, name, None) is not None, f"{namespace}.{name} does not resolve"


@pytest.mark.parametrize("namespace", [xfail_if_known(ns, NO_ALL) for ns in NAMESPACES])
def test_all_is_defined_and_sorted(namespace: str) -> None:
    """Each public namespace defines ``__all__``, sorted, without duplicates."""
    module = importlib.import_module(namespace)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{namespace} has no __all__"
    assert list(names) == sorted(set(names)), f"{namespace}.__all__ is not sorted: {names}"


def test_top_level_re_exports_are_listed_in_all() -> None:
    """If the top level defines ``__all__``, it lists every public name it re-exports."""
    names = getattr(sa, "__all__", None)
    if names is None:
        pytest.skip(NO_ALL["sessionactors"])
    exported = {
        n
        for n in dir(sa)
        if not n.startswith("_") and not isinstance(getattr(sa, n), types.ModuleType)
    }
    assert exported <= set(names), f"missing from __all__: {sorted(exported - set(names))}"


def test_stores_are_the_same_classes_at_both_addresses() -> None:
    """``sa.MemoryStore`` and ``sa.SQLiteStore`` are the classes of ``sessionactors.stores``."""
    stores = importlib.import_module("sessionactors.stores")
    assert sa.MemoryStore is stores.MemoryStore
    assert sa.SQLiteStore is stores.SQLiteStore


# The names of DESIGN.md's public API (section 3), namespace by namespace.
CONTRACT = {
    "sessionactors": [
        "open_registry", "Registry", "SessionRef", "Turn", "Reply",
        "Agent", "Compaction", "Model", "ModelRequest", "ModelChunk", "TextChunk",
        "ToolCallChunk", "tool", "Tool",
        "Message", "Role", "SessionState", "Status", "SessionInfo", "ToolCall", "ReviewRequest",
        "Event", "TurnStarted", "Delta", "MessageAdded", "TurnFinished", "TurnFailed",
        "TurnCancelled", "StatusChanged", "ToolCallStarted", "ToolResult", "ReviewRequested",
        "dump_snapshot", "load_snapshot",
        "SessionActorsError", "SessionNotFoundError", "SessionExistsError",
        "InvalidSessionNameError", "TurnFailedError", "TurnCancelledError",
        "SessionCrashedError", "SessionStoppedError", "MailboxFullError",
        "SubscriberLaggedError", "EventsExpiredError", "SnapshotError",
        "SnapshotVersionError", "SnapshotCorruptError", "StoreError", "FencedOutError",
        "SessionBusyError",
        "MemoryStore", "SQLiteStore",
    ],
    "sessionactors.stores": ["MemoryStore", "SQLiteStore", "RedisStore"],
    "sessionactors.models": ["OpenAIChatModel"],
    "sessionactors.testing": ["EchoModel", "ScriptedModel", "check_store"],
    "sessionactors.aio": ["open_registry", "Registry", "SessionRef", "Turn"],
    "sessionactors.http": ["create_app", "event_to_json"],
    "sessionactors.otel": ["OpenTelemetry"],
    "sessionactors.workers": [],  # (the multi-worker plug-in: no names in DESIGN)
}  # fmt: skip


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_design_contract_is_exported(namespace: str) -> None:
    """Every name of the design's public API is public in its namespace."""
    missing = [n for n in CONTRACT[namespace] if n not in public_names(namespace)]
    assert not missing, f"{namespace} does not export {missing}"


@pytest.mark.parametrize(
    ("name", "obj"),
    [(n, o) for n, o in public_objects() if inspect.isclass(o) or inspect.isfunction(o)],
    ids=[n for n, o in public_objects() if inspect.isclass(o) or inspect.isfunction(o)],
)
def test_public_classes_and_functions_have_docstrings(name: str, obj: object) -> None:
    """Every public class and function has a docstring of its own."""
    assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


ERRORS = [n for n, o in public_objects() if inspect.isclass(o) and issubclass(o, BaseException)]


@pytest.mark.parametrize("name", [xfail_if_known(n, NOT_SESSION_ACTORS_ERRORS) for n in ERRORS])
def test_public_errors_are_session_actors_errors_named_error(name: str) -> None:
    """Every public exception class subclasses SessionActorsError and ends in ``Error``."""
    namespace, _, short = name.rpartition(".")
    cls = getattr(importlib.import_module(namespace), short)
    assert short.endswith("Error"), f"{name} does not end in Error"
    assert issubclass(cls, sa.SessionActorsError), f"{name} is not a SessionActorsError"


def test_errors_also_subclass_the_builtin_a_user_would_catch() -> None:
    """The errors about lookups and bad values are also LookupError and ValueError."""
    assert issubclass(sa.SessionNotFoundError, LookupError)
    assert issubclass(sa.InvalidSessionNameError, ValueError)


def test_errors_carry_the_session_and_their_extra_fields() -> None:
    """Errors take ``session_id``; the lag and expiry errors carry their seq."""
    assert sa.SessionExistsError("x", session_id="s").session_id == "s"
    assert sa.SubscriberLaggedError("x", session_id="s", last_seq=7).last_seq == 7
    assert sa.EventsExpiredError("x", session_id="s", oldest_seq=3).oldest_seq == 3


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_error_is_named_where_users_import_it(namespace: str) -> None:
    """A traceback names ``sessionactors.ReviewResolvedError``, not the private module the
    error is written in: every public exception of the library says it lives in a public
    namespace."""
    module = importlib.import_module(namespace)
    private = [
        f"{name} ({value.__module__})"
        for name in public_names(namespace)
        if isinstance(value := getattr(module, name), type)
        and issubclass(value, BaseException)
        and value.__module__.startswith("sessionactors")
        and any(part.startswith("_") for part in value.__module__.split("."))
    ]
    assert private == []
