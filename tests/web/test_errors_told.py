"""What the gateway tells HTTP clients of the server's failures: the kind of an
exception that is not the library's own, never its message (the server's log has it),
and request errors in HTTP's terms, not Python's."""

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import sessionactors as sa
from sessionactors.http import create_app
from sessionactors.testing import FaultyStore

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
            body = r.json()
            assert (body["error"], body["session_id"]) == ("StoreError", "s"), body
            assert "retry" in body["message"], body
            r = await client.post("/sessions/s/messages", json={"text": "hi"})
            assert r.status_code == 200, r.text
    assert len(logged(caplog, "secret-dir")) == 1


async def test_a_store_failure_that_crashes_a_session_is_told_without_the_store_internals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that fails as a turn's outcome is written crashes the session (it restarts
    from its last durable state): the caller's SessionCrashedError is told with the
    cause's kind and the advice it carries, not the cause's message (the server's file
    path), which the server's log has."""
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
            assert "(GET /sessions/s)" in body["message"], body  # (its advice, for HTTP)
    assert logged(caplog, "secret-dir")


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
