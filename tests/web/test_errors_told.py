"""What the gateway tells HTTP clients of the server's failures: the kind of an
exception that is not the library's own, never its message (the server's log has it),
and request errors in HTTP's terms, not Python's."""

import json
import logging
import re
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import sessionactors as sa
from redis_workers import open_worker
from sessionactors.http import create_app
from sessionactors.models import OpenAIChatModel
from sessionactors.testing import FaultyStore, Scripted, ScriptedModel

from .chat_agents import DROPPED, trio_agents
from .servers import Serve, serve_trio
from .test_gateway import SSE, SSEReader, finished, read_until
from .wsclient import Closed, open_websocket

#: What an exception of the app's own says, which no client may read.
SECRET = "postgres://admin:hunter2@db/prod"


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    """The records whose message or traceback holds ``text``."""
    found = []
    for record in caplog.records:
        told = record.getMessage()
        if record.exc_info is not None:
            told += logging.Formatter().formatException(record.exc_info)
        if text in told:
            found.append(record)
    return found


async def test_a_failed_turn_tells_clients_the_exception_kind_and_logs_its_message(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn whose model raises is told to HTTP clients (the JSON error, the streamed
    and replayed TurnFailed, the WebSocket's) as the exception's kind and where its
    message is (the server's log), never the message itself; the log holds it once per
    turn, with the session and the turn."""
    caplog.set_level(logging.INFO)
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            r = await client.post("/sessions/f/messages", json={"text": "fail "})
            assert r.status_code == 500, r.text
            body = r.json()
            assert (body["error"], body["session_id"]) == ("TurnFailedError", "f"), body
            assert DROPPED not in r.text
            assert "ConnectionError" in body["message"], body
            assert "server's log" in body["message"], body
            turns = [body["turn_id"]]

            async with client.stream(
                "POST", "/sessions/f/messages", json={"text": "fail half"}, headers=SSE
            ) as r:
                failed = (await read_until(r, finished))[-1][1]
            assert failed["type"] == "TurnFailed"
            assert failed["error"] == (
                "the turn failed with ConnectionError; the server's log has the details"
            )
            turns.append(failed["turn_id"])

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/f/ws") as ws:
                await ws.send({"type": "message", "text": "fail again"})
                while (frame := await ws.receive())["type"] != "TurnFailed":
                    pass
            assert frame["error"] == failed["error"]
            turns.append(frame["turn_id"])

            async with client.stream("GET", "/sessions/f/events", params={"after": 0}) as r:
                reader, replayed = SSEReader(r), []
                for _ in range(3):
                    replayed += await reader.until(finished)
            outcomes = [data for _, data in replayed if data["type"] == "TurnFailed"]
            assert [data["turn_id"] for data in outcomes] == turns
            assert {data["error"] for data in outcomes} == {failed["error"]}
            assert all(DROPPED not in str(data) for _, data in replayed)
    for turn in turns:
        records = [r for r in logged(caplog, DROPPED) if turn in r.getMessage()]
        assert len(records) == 1, [r.getMessage() for r in logged(caplog, DROPPED)]
        assert "'f'" in records[0].getMessage()
    assert len(logged(caplog, DROPPED)) == 3


async def test_an_authorize_that_raises_answers_500_without_its_message(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``authorize`` that raises (not an HTTPException: a bug, its database down) is
    answered 500 naming the exception's kind, on a JSON route and a WebSocket, and its
    message goes to the server's log only."""

    def authorize(request: Any, name: str | None, action: str) -> bool:
        raise RuntimeError(f"the users database at {SECRET} is down")

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(10):
            r = await client.post("/sessions/a/messages", json={"text": "hi"})
            assert r.status_code == 500, r.text
            assert SECRET not in r.text
            body = r.json()
            assert body["status"] == 500, body
            assert "RuntimeError" in body["message"], body
            assert "server's log" in body["message"], body

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/a/ws") as ws:
                error = await ws.receive()
                assert (error["type"], error["status"]) == ("error", 500), error
                assert SECRET not in str(error)
                with pytest.raises(Closed) as closed:
                    await ws.receive()
                assert closed.value.code == 4500
    assert len(logged(caplog, SECRET)) == 2


async def test_a_store_failure_answers_503_without_the_store_internals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that fails (a SQLite file the disk lost) is answered 503 naming the
    session and saying to retry, without the store's message (the server's file path):
    the server's log has it."""
    path = str(tmp_path / "secret-dir" / "sessions.db")
    (tmp_path / "secret-dir").mkdir()
    agents = trio_agents()
    store = FaultyStore(sa.SQLiteStore(path))
    app = create_app(store=store, agents=agents)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            failure = sa.StoreError(
                f"session 's': the sqlite store at {path!r} failed (disk I/O error); "
                "check the file, its directory and the disk, then retry",
                session_id="s",
            )
            store.fail("load", session_id="s", error=failure)
            r = await client.post("/sessions/s/messages", json={"text": "hi"})
            assert r.status_code == 503, r.text
            assert "secret-dir" not in r.text
            assert r.headers["retry-after"] == "1"
            body = r.json()
            assert (body["error"], body["session_id"]) == ("StoreError", "s"), body
            assert "retry" in body["message"], body
            r = await client.post("/sessions/s/messages", json={"text": "hi"})
            assert r.status_code == 200, r.text
    assert len(logged(caplog, "secret-dir")) == 1


async def test_a_library_error_out_of_authorize_is_answered_as_the_route_answers_it(
    tmp_path: Path,
) -> None:
    """An ``authorize`` that reads the session's metadata, as the how-to suggests, lets
    the library's errors out: each is answered as the route answers it (a store that
    fails 503 with Retry-After, an unknown session 404), not as the app's fault (500,
    which a client does not retry)."""
    store = FaultyStore(sa.SQLiteStore(str(tmp_path / "s.db")))
    opened: list[Any] = []

    async def authorize(request: Any, name: str | None, action: str) -> bool:
        if name is None:
            return True
        state = await opened[0].registry.ref(name).state()
        return bool(state.metadata.get("customer") == request.headers.get("x-customer"))

    app = create_app(store=store, agents=trio_agents(), authorize=authorize)
    opened.append(app)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            await app.registry.spawn("s", metadata={"customer": "ada"})
            await app.registry.ref("s").hibernate()
            ada = {"x-customer": "ada"}
            store.fail("load", session_id="s", error=sa.StoreError("disk lost", session_id="s"))
            r = await client.get("/sessions/s", headers=ada)
            assert (r.status_code, r.json()["error"]) == (503, "StoreError"), r.text
            assert r.headers["retry-after"] == "1"
            r = await client.get("/sessions/nobody", headers=ada)
            assert (r.status_code, r.json()["error"]) == (404, "SessionNotFoundError"), r.text
            r = await client.get("/sessions/s", headers=ada)
            assert r.status_code == 200, r.text
            r = await client.get("/sessions/s", headers={"x-customer": "bob"})
            assert r.status_code == 403, r.text


class JournalLostStore(sa.MemoryStore):
    """A MemoryStore whose replays fail, once ``pages_left`` pages were read, with an
    exception that is not the library's (its message holds SECRET)."""

    pages_left: int | None = None

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[Any]]:
        if self.pages_left is not None:
            if self.pages_left == 0:
                raise RuntimeError(f"the journal at {SECRET} is gone")
            self.pages_left -= 1
        return await super().read_journal_page(session_id, after, limit=limit, max_bytes=max_bytes)


async def test_an_event_stream_failed_after_it_began_ends_with_an_error_frame(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """An event stream whose replay fails after its answer began (the store raised, on
    the replay's second page, an exception that is not the library's) ends with an
    error frame that names the exception's kind, not its message, with status 500, and
    a clean end of its body; the log names the session and the exception's kind and
    message, with its traceback: not the repr of the task group's exception group."""
    caplog.set_level(logging.INFO)
    store = JournalLostStore()
    big = "x" * 300_000  # (two entries of it fill a page of a replay)
    async with sa.open_registry(store=store, agents=trio_agents(delay=0)) as registry:
        ref = await registry.spawn("long")
        with trio.fail_after(20):
            await ref.send(big)  # (hibernated as the registry closes)
    store.pages_left = 1  # (the subscription reads the first as it opens)
    async with serve(store=store) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            async with client.stream("GET", "/sessions/long/events", params={"after": 0}) as r:
                assert r.status_code == 200, r.text  # (its answer began)
                lines = [line async for line in r.aiter_lines()]  # (to its clean end)
    frames = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert frames, lines
    *events, last = frames
    assert events, frames  # (the first page's)
    assert all(data["type"] != "error" for data in events), frames
    assert last["type"] == "error", last
    assert (last["error"], last["status"]) == ("RuntimeError", 500), last
    assert "session 'long'" in last["message"], last
    assert SECRET not in "".join(lines)
    [record] = logged(caplog, SECRET)
    told = record.getMessage()
    assert "session 'long'" in told, told
    assert f"RuntimeError: the journal at {SECRET} is gone" in told, told
    assert "Group" not in told, told
    assert record.exc_info is not None
    assert record.levelno == logging.ERROR


async def test_a_store_failure_that_crashes_a_session_is_told_without_the_store_internals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that fails as a turn's outcome is written crashes the session (it restarts
    from its last durable state): the caller's SessionCrashedError is told with the
    cause's kind and the advice it carries (the route that tells what became of the
    turn), not the cause's message (the server's file path), which the server's log has,
    with the same advice."""
    path = str(tmp_path / "secret-dir" / "sessions.db")
    (tmp_path / "secret-dir").mkdir()
    store = FaultyStore(sa.SQLiteStore(path))
    app = create_app(store=store, agents=trio_agents())
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            r = await client.post("/sessions/s/messages", json={"text": "hi"})
            assert r.status_code == 200, r.text
            failure = sa.StoreError(
                f"session 's': the sqlite store at {path!r} failed (disk I/O error); "
                "check the file, its directory and the disk, then retry",
                session_id="s",
            )
            store.fail("append", session_id="s", error=failure)
            r = await client.post("/sessions/s/messages", json={"text": "again"})
            body = r.json()
            assert body["error"] == "SessionCrashedError", body
            assert "secret-dir" not in r.text
            assert "StoreError; the server's log has the details" in body["message"], body
            # its advice, for HTTP: the route that tells what became of the turn
            asked = re.search(r"ask GET (/sessions/s/turns/\S+) ", body["message"])
            assert asked is not None, body
            r = await client.get(asked[1])
            assert r.status_code == 200, r.text
            assert r.json()["status"] in ("finished", "lost"), r.text
    assert logged(caplog, "secret-dir")
    # the log's line advises the operator as the client was advised: the route, not Python
    [line] = [r.getMessage() for r in logged(caplog, "a request met a crashed session")]
    assert f"ask GET {asked[1]}" in line, line
    assert "turn_outcome" not in line, line


@pytest.mark.parametrize(
    ("body", "told", "python"),
    [
        (b'{"text": ' + b"7" * 5000 + b"}", "number of 5,000 digits", "set_int_max_str_digits"),
        (b'{"text": "a\\ud800b"}', "lone surrogate", "errors='replace'"),
        (b'{"text": "hi", "idempotency_key": "\\udc00"}', "lone surrogate", "errors='replace'"),
    ],
)
async def test_request_errors_speak_of_json_not_python(
    serve: Serve, body: bytes, told: str, python: str
) -> None:
    """A body with a number too long to read or a lone surrogate in a string is refused
    (422) in the terms of JSON, in a request body and a WebSocket frame, without a
    Python remedy."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            headers = {"content-type": "application/json"}
            r = await client.post("/sessions/j/messages", content=body, headers=headers)
            assert r.status_code == 422, r.text
            assert told in r.json()["message"], r.text
            assert python not in r.text

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/j/ws") as ws:
                await ws.send('{"type": "message", ' + body.decode()[1:])
                error = await ws.receive()
                while error["type"] != "error":
                    error = await ws.receive()
            assert error["status"] == 422, error
            assert told in error["message"], error
            assert python not in str(error)


async def test_an_unknown_turn_id_is_told_where_an_http_client_finds_turn_ids(
    serve: Serve,
) -> None:
    """A turn id the session never issued (a typo) answers 404 saying where an HTTP
    client takes turn ids from, not a Python caller's ``reply.turn_id``."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            await client.post("/sessions/t/messages", json={"text": "hi"})
            r = await client.get("/sessions/t/turns/turn_from_a_typo")
    assert (r.status_code, r.json()["error"]) == (404, "TurnNotFoundError"), r.text
    told = r.json()["message"]
    assert "session 't' never issued a turn id 'turn_from_a_typo'" in told, told
    assert '"turn_id" of a message\'s answer or of its events' in told, told
    assert "reply.turn_id" not in told, told


class StoreError(Exception):
    """An exception of the app's own that bears the name of one of the library's."""


class SessionNotFoundError(LookupError):
    """Another: the app's own, about the sessions of its users' logins."""


async def failed_turn_told(app: Any, name: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The JSON error of a turn of session ``name`` that fails, the TurnFailed of a
    second one as its stream tells it, and the session's events replayed, as text."""
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            r = await client.post(f"/sessions/{name}/messages", json={"text": "hi"})
            assert r.status_code == 500, r.text
            async with client.stream(
                "POST", f"/sessions/{name}/messages", json={"text": "again"}, headers=SSE
            ) as streamed:
                failed = (await read_until(streamed, finished))[-1][1]
            async with client.stream(
                "GET", f"/sessions/{name}/events", params={"after": 0}
            ) as replay:
                reader = SSEReader(replay)
                replayed = [await reader.until(finished) for _ in range(2)]
    assert [data["type"] for _, data in replayed[1]][-1] == "TurnFailed"
    return r.json(), failed, str(replayed)


@pytest.mark.parametrize("cls", [StoreError, SessionNotFoundError])
async def test_an_app_exception_named_as_a_library_error_is_told_by_its_kind(
    cls: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    """An app's exception whose class bears a library error's name (StoreError,
    SessionNotFoundError) is the app's all the same: HTTP clients are told its kind,
    never its message, which the server's log has."""
    failure = cls(f"the orders database at {SECRET} is down")
    agents = {"app": sa.Agent(model=ScriptedModel([Scripted(error=failure)], repeat=True))}
    body, failed, replayed = await failed_turn_told(create_app(agents=agents), "n")
    assert body["error"] == "TurnFailedError", body
    assert SECRET not in str(body), body
    assert f"failed: {cls.__name__}; the server's log has the details" in body["message"]
    assert failed["error"] == (
        f"the turn failed with {cls.__name__}; the server's log has the details"
    )
    assert SECRET not in replayed
    assert len(logged(caplog, SECRET)) == 2


#: Where the model's provider is, and what its error response says: for the server's log.
PROVIDER = "http://llm.internal.example:8000/v1"
PROVIDER_SAID = "Incorrect API key provided: sk-live-51Hx"


def failing_provider() -> OpenAIChatModel:
    """An OpenAI model whose server refuses every request (401), quoting the key."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": PROVIDER_SAID}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return OpenAIChatModel(base_url=PROVIDER, model="m", client=client, max_retries=0)


async def test_a_model_error_is_told_to_http_clients_by_its_kind_and_whole_to_python(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ModelError that quotes the provider's address and its error response (the OpenAI
    adapter's, for a 401) is told to HTTP clients as the turn failing with a ModelError,
    without either; a Python caller, a Python subscriber and the server's log read it
    whole."""
    app = create_app(agents={"app": sa.Agent(model=failing_provider())})
    body, failed, replayed = await failed_turn_told(app, "m")
    for told in (str(body), str(failed), replayed):
        assert "llm.internal.example" not in told
        assert PROVIDER_SAID not in told
    assert "failed: ModelError; the server's log has the details" in body["message"], body
    assert failed["error"] == "the turn failed with ModelError; the server's log has the details"
    assert logged(caplog, PROVIDER_SAID)

    async with sa.open_registry(agents={"app": sa.Agent(model=failing_provider())}) as registry:
        ref = await registry.spawn("m")
        async with ref.subscribe() as events:
            with pytest.raises(sa.TurnFailedError) as raised:
                await ref.send("hi")
            with trio.fail_after(10):
                async for outcome in events:
                    if isinstance(outcome, sa.TurnFailed):
                        break
    assert isinstance(outcome, sa.TurnFailed)
    assert (outcome.error_kind, outcome.error_public) == ("ModelError", False)
    assert isinstance(raised.value.__cause__, sa.ModelError)
    assert raised.value.__cause__.status_code == 401
    for told in (str(raised.value), outcome.error):
        assert "llm.internal.example" in told
        assert PROVIDER_SAID in told


async def test_the_library_s_own_failures_and_a_model_error_marked_public_are_told_whole() -> None:
    """A ModelError its adapter raised with ``public=True`` is told to HTTP clients
    whole, as the library's own failures are (a MaxStepsError: the model kept calling
    tools); TurnFailed says which kind failed the turn and that it is public."""
    said = "the model is overloaded; try again in a minute"
    overloaded = sa.ModelError(said, session_id="p", status_code=529, public=True)
    body, failed, _ = await failed_turn_told(
        create_app(agents={"app": sa.Agent(model=ScriptedModel([overloaded], repeat=True))}),
        "p",
    )
    assert f"failed: ModelError: {said}; the session is fine" in body["message"], body
    assert (failed["error"], failed["error_kind"]) == (f"ModelError: {said}", "ModelError")
    assert failed["error_public"] is True

    @sa.tool
    async def again() -> str:
        """Ask again."""
        return "ask again"

    call = sa.ToolCall(id="c", name="again", arguments="{}")
    looping = ScriptedModel([Scripted(tool_calls=[call])], repeat=True)
    agents = {"app": sa.Agent(model=looping, tools=[again], max_steps=2)}
    body, failed, _ = await failed_turn_told(create_app(agents=agents), "q")
    steps = "MaxStepsError: the model was still calling tools after max_steps=2 steps"
    assert f"failed: {steps}" in body["message"], body
    assert failed["error"].startswith(steps), failed
    assert (failed["error_kind"], failed["error_public"]) == ("MaxStepsError", True)


@pytest.mark.redis
async def test_a_turn_failed_on_another_worker_is_told_by_its_kind(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn that fails on the worker that runs its session, asked for through another
    worker's gateway, is told there by its exception's kind as well: which part of the
    error is the server's own account crosses between the workers with it."""
    failure = SessionNotFoundError(f"the orders database at {SECRET} is down")
    agents = {"app": sa.Agent(model=ScriptedModel([Scripted(error=failure)], repeat=True))}
    prefix = f"sa-test:{uuid.uuid4().hex}"

    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", agents=agents, lease_ttl=30.0) as a,
            open_worker(redis_url, prefix, "b", agents=agents, lease_ttl=30.0) as b,
        ):
            await a.spawn("w")
            await a.ref("w").history()  # live on a
            async with serve_trio(create_app(b)) as url, httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/sessions/w/messages", json={"text": "hi"})
            assert (a.live(), b.live()) == (["w"], [])  # (it ran on a)
    assert r.status_code == 500, r.text
    assert SECRET not in r.text
    assert "failed: SessionNotFoundError; the server's log has the details" in r.json()["message"]
    assert logged(caplog, SECRET)


#: What a worker of an older version says of a failed turn and of a crash: the whole
#: text, quoting its cause, with nothing to mark which part is the server's own account.
UNMARKED = {
    sa.TurnFailedError: (
        f"turn t1 of session 'o' failed: RuntimeError: the orders database at {SECRET} is "
        "down; the session is fine, send the next message when the cause is fixed"
    ),
    sa.SessionCrashedError: (
        f"session 'o' crashed while handling this request (RuntimeError: the orders "
        f"database at {SECRET} is down); it was restarted from its last durable state, so "
        "retry the request"
    ),
}


def unmarked(cls: type[sa.SessionActorsError]) -> sa.SessionActorsError:
    """An error of ``cls`` about session 'o' (turn 't1') as it arrives from a worker of
    an older version: its message only."""
    if cls is sa.TurnFailedError:
        return sa.TurnFailedError(UNMARKED[cls], session_id="o", turn_id="t1")
    return cls(UNMARKED[cls], session_id="o")


@pytest.mark.parametrize("cls", list(UNMARKED))
async def test_a_failure_that_does_not_mark_its_cause_is_told_by_its_kind_only(
    cls: type[sa.SessionActorsError], caplog: pytest.LogCaptureFixture
) -> None:
    """A TurnFailedError or SessionCrashedError that comes without the parts of its
    message that mark the server's own account (as one from a worker of an older version
    arrives, its cause quoted whole) is told to HTTP clients by its kind, its session and
    its turn only, never by its text, which the server's log has."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=trio_agents()) as registry:
        await (await registry.spawn("o")).hibernate()
        store.fail("load", error=unmarked(cls))  # (what waking it answers)
        async with serve_trio(create_app(registry)) as url, httpx.AsyncClient(base_url=url) as c:
            with trio.fail_after(10):
                r = await c.post("/sessions/o/messages", json={"text": "hi"})
    assert store.injected == 1
    assert SECRET not in r.text, r.text
    body = r.json()
    assert (body["error"], body["session_id"]) == (cls.__name__, "o"), body
    assert f"failed with {cls.__name__}; the server's log has the details" in body["message"]
    if cls is sa.TurnFailedError:
        assert (body["turn_id"], "turn t1 of session 'o'" in body["message"]) == ("t1", True)
    assert logged(caplog, SECRET)


async def test_a_turn_failed_by_an_unmarked_failure_is_told_by_its_kind() -> None:
    """A turn that fails with a TurnFailedError that does not mark its cause (a tool or a
    model that asked a session on a worker of an older version) is told to HTTP clients
    by that kind, never by its text."""
    failure = unmarked(sa.TurnFailedError)
    agents = {"app": sa.Agent(model=ScriptedModel([Scripted(error=failure)], repeat=True))}
    body, failed, replayed = await failed_turn_told(create_app(agents=agents), "u")
    for told in (str(body), str(failed), replayed):
        assert SECRET not in told
    assert "failed: TurnFailedError; the server's log has the details" in body["message"]
    assert (failed["error_kind"], failed["error_public"]) == ("TurnFailedError", False)


@pytest.mark.redis
async def test_a_model_error_marked_public_stays_public_on_another_worker(redis_url: str) -> None:
    """A ModelError its adapter raised with ``public=True``, which failed a turn on the
    worker that runs its session, is public still as a caller on another worker reads
    it (the ``__cause__`` of its TurnFailedError), and told there whole."""
    said = "the model is overloaded; try again in a minute"
    overloaded = sa.ModelError(said, session_id="w", status_code=529, public=True)
    agents = {"app": sa.Agent(model=ScriptedModel([overloaded], repeat=True))}
    prefix = f"sa-test:{uuid.uuid4().hex}"

    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", agents=agents, lease_ttl=30.0) as a,
            open_worker(redis_url, prefix, "b", agents=agents, lease_ttl=30.0) as b,
        ):
            await a.spawn("w")
            await a.ref("w").history()  # live on a
            with pytest.raises(sa.TurnFailedError) as raised:
                await b.ref("w").send("hi")
            async with serve_trio(create_app(b)) as url, httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/sessions/w/messages", json={"text": "again"})
            assert (a.live(), b.live()) == (["w"], [])  # (it ran on a)
    cause = raised.value.__cause__
    assert isinstance(cause, sa.ModelError), repr(cause)
    assert (cause.public, cause.status_code) == (True, 529)
    assert f"failed: ModelError: {said}" in r.json()["message"], r.text


@pytest.mark.redis
async def test_a_turn_cut_by_its_workers_shutdown_answers_503_through_another_worker(
    redis_url: str,
) -> None:
    """A message whose turn the shutdown of the worker running it cut off is answered 503
    SessionStoppedError through another worker's gateway too, as through the stopping
    worker's (send it again: it goes to the session's next worker); 409 stays for a
    session that is stopped (ref.stop()), which takes no more messages."""
    never = trio.Event()  # (the turn runs until the shutdown cuts it)
    agents = {"app": sa.Agent(model=ScriptedModel([Scripted(text="late", wait=never)]))}
    prefix = f"sa-test:{uuid.uuid4().hex}"

    def worker(worker_id: str, **options: Any) -> Any:  # (the registry's default leases)
        return open_worker(redis_url, prefix, worker_id, agents=agents, lease_ttl=30.0, **options)

    answers: list[httpx.Response] = []
    with trio.fail_after(30):
        async with (
            worker("b") as b,
            serve_trio(create_app(b)) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            async with trio.open_nursery() as nursery, worker("a", shutdown_grace=0.2) as a:
                await a.spawn("s", agent="app")
                await a.ref("s").history()  # live on a

                async def post() -> None:
                    r = await client.post("/sessions/s/messages", json={"text": "hi"})
                    answers.append(r)

                nursery.start_soon(post)
                while not a.statistics().turns_running:
                    await trio.sleep(0.01)
            # a closed, and cut the turn off after its grace; the gateway answered
            await (await b.spawn("t", agent="app")).stop()
            stopped = await client.post("/sessions/t/messages", json={"text": "hi"})
    [cut] = answers
    assert (cut.status_code, cut.json()["error"]) == (503, "SessionStoppedError"), cut.text
    assert "worker 'a', which ran it, stopped" in cut.json()["message"], cut.text
    assert "send it again" in cut.json()["message"], cut.text
    assert cut.json()["turn_id"].startswith("turn_"), cut.text
    assert (stopped.status_code, stopped.json()["error"]) == (409, "SessionStoppedError")


@pytest.mark.redis
async def test_a_session_stopped_on_another_worker_answers_409(redis_url: str) -> None:
    """A message to a session stopped (ref.stop()) on the worker that holds it, sent
    through another worker's gateway, is answered 409 SessionStoppedError, as through
    its own worker's: that the session is stopped crosses between the workers as a fact
    of the error, not read off its wording."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", lease_ttl=30.0) as a,
            open_worker(redis_url, prefix, "b", lease_ttl=30.0) as b,
        ):
            await (await a.spawn("t")).stop()
            with pytest.raises(sa.SessionStoppedError) as raised:
                await b.ref("t").send("hi")
            assert "raised by worker 'a', which runs session 't'" in raised.value.__notes__
            async with serve_trio(create_app(b)) as url, httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/sessions/t/messages", json={"text": "hi"})
            assert (a.live(), b.live()) == ([], [])
    assert (r.status_code, r.json()["error"]) == (409, "SessionStoppedError"), r.text


async def test_a_request_that_failed_on_the_server_is_logged_with_its_route_and_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request answered 500 for the server's own failure (a session whose stored
    snapshot is damaged) is logged as an ERROR whose line names the request's method and
    path, the error's kind and its session, not "request failed" alone (an operator
    searching the log for a session, or alerting on ERROR lines, finds it)."""
    path = tmp_path / "s.db"
    agents = trio_agents()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        await (await registry.spawn("b1")).send("hi")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE snapshots SET data = x'c1'")
    db.close()
    async with (
        sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            r = await client.get("/sessions/b1")
    assert r.status_code == 500, r.text
    lines = [x.getMessage() for x in caplog.records if x.levelno == logging.ERROR]
    [line] = [x for x in lines if "GET /sessions/b1" in x]
    assert "SnapshotCorruptError" in line, line
    assert "session 'b1'" in line, line


async def test_a_request_the_stores_configuration_refused_is_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request that fails with StoreConfigurationError (another program's key where
    the store keeps its sessions' listing, say: no retry fixes it until the operator
    does) is answered 503, as any failure of the store, and logged as an ERROR, which is
    what operators alert on; a store that failed for a moment is a WARNING."""
    store = FaultyStore()
    agents = trio_agents()
    async with (
        sa.open_registry(store=store, agents=agents) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            store.fail("list_sessions", error=sa.StoreConfigurationError("the key holds a string"))
            r = await client.get("/sessions")
            assert r.status_code == 503, r.text
            store.fail("list_sessions", error=sa.StoreError("down for a moment"))
            r = await client.get("/sessions")
            assert r.status_code == 503, r.text

    def levels(said: str) -> set[str]:
        start = "a request (GET /sessions) failed in the store"
        return {
            x.levelname
            for x in caplog.records
            if x.getMessage().startswith(start) and said in x.getMessage()
        }

    assert levels("holds a string") == {"ERROR"}
    assert levels("for a moment") == {"WARNING"}
