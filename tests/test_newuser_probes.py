"""What a newcomer meets first: get_or_spawn with an agent, and the command line's JSON
for data an earlier version stored. Each test pins one promise through the public API."""

import ast
import datetime
import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import sessionactors as sa
from processes import sessions
from sessionactors.stores import dump_info
from sessionactors.testing import EchoModel


def two_agents() -> dict[str, sa.Agent]:
    return {"support": sa.Agent(model=EchoModel()), "sales": sa.Agent(model=EchoModel())}


@pytest.mark.parametrize("where", ["live", "stored"])
async def test_get_or_spawn_refuses_an_existing_session_of_another_agent(where: str) -> None:
    """get_or_spawn(name, agent=b) of a session that runs agent a raises SessionExistsError
    naming the session, both agents and what to do, and changes nothing; with its own agent
    or none it returns the session."""
    async with sa.open_registry(agents=two_agents()) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("chat-1", agent="support")
            await ref.send("hi")
            if where == "stored":
                await ref.hibernate()
            with pytest.raises(sa.SessionExistsError) as info:
                await registry.get_or_spawn("chat-1", agent="sales")
            assert await registry.get_or_spawn("chat-1", agent="support") == ref
            assert await registry.get_or_spawn("chat-1") == ref
            state = await ref.state()
    message = str(info.value)
    assert info.value.session_id == "chat-1"
    assert "'chat-1'" in message
    assert "'support'" in message
    assert "'sales'" in message
    assert "registry.ref('chat-1')" in message
    assert state.agent == "support"
    assert [m.content for m in state.messages] == ["hi", "hi"]


def sessions_cli(*args: str) -> str:
    """The standard output of ``python -m sessionactors sessions ARGS`` (which must succeed)."""
    done = sessions(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def strict_json(text: str) -> Any:
    """JSON as a strict reader (a browser's JSON.parse, jq) reads it: no NaN, no Infinity."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


async def test_the_command_line_writes_valid_json_for_stored_non_finite_floats(
    tmp_path: Path,
) -> None:
    """Metadata stored with NaN or an infinity (before such values were refused) is written
    as null by list --json, show --json, show --events --json, tail and export, as the
    gateway does; the export still imports, restoring the stored values."""
    path = tmp_path / "old.db"
    now = datetime.datetime.now(datetime.UTC)
    metadata = {"score": math.nan, "range": [1.5, -math.inf], "tier": "gold"}
    state = sa.SessionState(session_id="old", agent="echo", created_at=now, updated_at=now)
    state = attrs.evolve(state, metadata=metadata)
    info = sa.SessionInfo(
        session_id="old",
        agent="echo",
        status=sa.Status.HIBERNATED,
        message_count=0,
        updated_at=now,
        metadata=metadata,
    )
    store = sa.SQLiteStore(str(path))
    await store.create("old", sa.dump_snapshot(state), dump_info(info))
    await store.aclose()
    url = f"sqlite:///{path}"

    expected = {"score": None, "range": [1.5, None], "tier": "gold"}
    [listed] = strict_json(sessions_cli("list", "--store", url, "--json"))
    assert listed["metadata"] == expected
    assert strict_json(sessions_cli("show", "old", "--store", url, "--json"))["metadata"] == (
        expected
    )
    shown = strict_json(sessions_cli("show", "old", "--events", "--store", url, "--json"))
    assert shown["metadata"] == expected
    for line in sessions_cli("tail", "old", "--no-follow", "--store", url).splitlines():
        strict_json(line)
    export = sessions_cli("export", "old", "--store", url)
    assert strict_json(export)["session"]["metadata"] == expected
    assert "NaN" not in sessions_cli("show", "old", "--store", url)

    exported = tmp_path / "old.json"
    exported.write_text(export, encoding="utf-8")
    sessions_cli("import", str(exported), "--as", "copy", "--store", url)
    reader = sa.SQLiteStore(str(path), readonly=True)
    try:
        copy = await sa.read_session(reader, "copy")
    finally:
        await reader.aclose()
    assert math.isnan(copy.metadata["score"])
    assert copy.metadata["range"] == [1.5, -math.inf]


def private_reads(package: Path) -> list[str]:
    """Where the modules under ``package`` read a private attribute (``x._name``) of an
    object other than their own ``self`` or ``cls``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_the_gateway_reads_no_private_attribute_of_another_object() -> None:
    """The HTTP gateway reaches the asyncio registry, refs and turns through their
    module's functions, never through their private fields (a renamed field must not
    break it); the check catches a deliberate breach."""
    http = Path(sa.__file__).parent / "http"
    assert private_reads(http) == []


def test_the_private_read_check_catches_a_breach(tmp_path: Path) -> None:
    """Negative control: the check finds a read of another object's private field."""
    (tmp_path / "breach.py").write_text("def f(turn):\n    return turn._turn\n")
    assert private_reads(tmp_path) == ["breach.py:2: ._turn"]


async def test_an_unknown_agent_is_refused_with_what_to_name() -> None:
    """spawn and get_or_spawn with an agent the registry does not have raise ValueError
    naming the session, the agents there are and how to name one; nothing is stored."""
    async with sa.open_registry(agents=two_agents()) as registry:
        with trio.fail_after(10):
            for call in (registry.spawn, registry.get_or_spawn):
                with pytest.raises(ValueError) as info:
                    await call("chat-9", agent="suport")
                message = str(info.value)
                assert "'chat-9'" in message
                assert "['sales', 'support']" in message
                assert "agent='sales'" in message
            assert await registry.sessions() == []


async def test_iterating_a_stream_or_subscription_without_async_with_says_how() -> None:
    """``async for event in ref.stream(text)`` (the ``async with`` forgotten) raises a
    TypeError that shows the right form, and sends nothing; the same for subscribe."""
    async with sa.open_registry(agents=two_agents()) as registry:
        ref = await registry.spawn("chat-1", agent="support")
        with trio.fail_after(10):
            for events, form in [
                (ref.stream("hi"), "async with ref.stream(text) as events"),
                (ref.subscribe(), "async with ref.subscribe() as events"),
            ]:
                with pytest.raises(TypeError) as info:
                    async for _ in events:  # type: ignore[attr-defined]
                        pass
                assert form in str(info.value)
            assert await ref.history() == []


def test_the_asyncio_stream_without_async_with_says_how_too() -> None:
    """The same from asyncio: sessionactors.aio's stream and subscribe say how."""
    import asyncio

    import sessionactors.aio as aio

    async def main() -> None:
        async with aio.open_registry(agents=two_agents()) as registry:
            ref = await registry.spawn("chat-1", agent="support")
            for events in (ref.stream("hi"), ref.subscribe()):
                with pytest.raises(TypeError, match="async with ref"):
                    async for _ in events:  # type: ignore[attr-defined]
                        pass
            assert await ref.history() == []

    asyncio.run(main())


BAD_MESSAGES: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
    (5, {}, TypeError, "must be str"),
    ("x" * 2_000_000, {}, ValueError, "over the limit"),
    ("hi", {"idempotency_key": ""}, ValueError, "idempotency_key"),
]


async def test_stream_refuses_a_bad_message_when_called() -> None:
    """ref.stream(text) raises the error send would, naming the session, when it is called,
    not when its block is entered: a web handler learns of bad input before it starts a
    streaming response; nothing is sent."""
    async with sa.open_registry(agents=two_agents()) as registry:
        ref = await registry.spawn("chat-1", agent="support")
        with trio.fail_after(10):
            for text, kwargs, error, words in BAD_MESSAGES:
                with pytest.raises(error, match=words) as info:
                    ref.stream(text, **kwargs)
                assert "'chat-1'" in str(info.value)
            assert await ref.history() == []


def test_the_asyncio_stream_and_subscribe_refuse_bad_input_when_called() -> None:
    """sessionactors.aio's ref.stream(text) and ref.subscribe(after=) raise their errors
    when called, as trio's ref.subscribe does, before a web handler starts its response."""
    import asyncio

    import sessionactors.aio as aio

    async def main() -> None:
        async with aio.open_registry(agents=two_agents()) as registry:
            ref = await registry.spawn("chat-1", agent="support")
            for text, kwargs, error, words in BAD_MESSAGES:
                with pytest.raises(error, match=words):
                    ref.stream(text, **kwargs)
            with pytest.raises(TypeError, match="'chat-1'"):
                ref.subscribe(after="5")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="'chat-1'"):
                ref.subscribe(after=-1)
            assert await ref.history() == []

    asyncio.run(main())


def test_a_sqlite_url_given_as_a_path_is_refused_with_the_path_to_give(tmp_path: Path) -> None:
    """SQLiteStore('sqlite:///sessions.db'), the command line's URL where a path belongs,
    raises ValueError when made, saying which path to pass, instead of failing its first
    call over a lock file in a directory named 'sqlite:'."""
    for url, path in [
        ("sqlite:///sessions.db", "sessions.db"),
        ("sqlite:////var/lib/app/sessions.db", "/var/lib/app/sessions.db"),
    ]:
        with pytest.raises(ValueError, match="takes a file path") as info:
            sa.SQLiteStore(url)
        assert f"SQLiteStore({path!r})" in str(info.value)
    assert sa.SQLiteStore(tmp_path / "sqlite:x.db").path.endswith("sqlite:x.db")


def test_an_asyncio_registry_kept_past_its_loop_says_it_is_closed() -> None:
    """A sessionactors.aio registry or ref kept after its block and its loop ended (an
    app's state after its lifespan, as a test's second TestClient meets it) raises
    SessionStoppedError saying the registry is closed, not that another loop called it."""
    import asyncio

    import sessionactors.aio as aio

    kept: dict[str, Any] = {}

    async def first() -> None:
        async with aio.open_registry(agents=two_agents()) as registry:
            kept["registry"] = registry
            kept["ref"] = await registry.spawn("chat-1", agent="support")

    async def second() -> None:
        registry, ref = kept["registry"], kept["ref"]
        for call in (registry.sessions, lambda: registry.get_or_spawn("chat-2"), ref.history):
            with pytest.raises(sa.SessionStoppedError, match="closed"):
                await call()
        with pytest.raises(sa.SessionStoppedError, match="closed"):
            ref.submit_nowait("hi")

    asyncio.run(first())
    asyncio.run(second())
