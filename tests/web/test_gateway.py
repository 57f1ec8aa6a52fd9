"""The HTTP gateway against real servers on 127.0.0.1: hypercorn's trio worker with a trio
registry, and uvicorn with an asyncio registry (asyncio model and tool)."""

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import h11
import httpx
import pytest
import trio
import uvicorn
from starlette.exceptions import HTTPException, WebSocketException

import sessionactors as sa
import sessionactors.aio as aio
from processes import sessions
from sessionactors.http import create_app, event_to_json
from sessionactors.testing import (
    EchoModel,
    FaultyStore,
    Gate,
    Scripted,
    ScriptedModel,
    export_document,
)

from .chat_agents import DROPPED, asyncio_agents, trio_agents
from .servers import Serve, Served, serve_asyncio, serve_trio
from .slow_reader import SilentWebSocket, get_slowly, read_slowly
from .wsclient import Closed, open_websocket

SSE = {"accept": "text/event-stream"}


class SSEReader:
    """SSE messages of a response as (id or None, JSON data); comments and retry-only
    blocks are skipped (a parser of its own: no async generator is left unclosed)."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self) -> tuple[int | None, dict[str, Any]]:
        event_id: int | None = None
        data: list[str] = []
        async for line in self._lines:
            if line == "":
                if data:
                    return event_id, json.loads("\n".join(data))
                event_id = None
            elif line.startswith("id:"):
                event_id = int(line[3:].strip())
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        raise AssertionError("the stream ended")

    async def until(self, stop: Callable[[dict[str, Any]], bool]) -> list:
        """(id, data) of each message, up to and including the one ``stop`` accepts."""
        out = []
        while True:
            out.append(await self.next())
            if stop(out[-1][1]):
                return out


async def read_until(response: httpx.Response, stop: Callable[[dict[str, Any]], bool]) -> list:
    """(id, data) of each SSE message, up to and including the one ``stop`` accepts."""
    return await SSEReader(response).until(stop)


def finished(data: dict[str, Any]) -> bool:
    return data["type"] in ("TurnFinished", "TurnFailed", "TurnCancelled")


async def wait_no_subscribers(served: Served) -> None:
    with trio.fail_after(5):
        while served.registry().statistics().subscribers:
            await trio.sleep(0.01)


async def test_messages_and_session_routes_answer_json(serve: Serve) -> None:
    """A message creates the session and answers its reply; the session routes read,
    list, cancel and delete it."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            r = await client.post("/sessions/chat-1/messages", json={"text": "hello there"})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["text"] == "hello there"
            assert reply["message"]["role"] == "assistant"
            assert reply["reviews"] == []

            state = (await client.get("/sessions/chat-1")).json()
            assert state["status"] in ("idle", "running")
            assert [m["content"] for m in state["messages"]] == ["hello there", "hello there"]
            assert state["event_seq"] > 0
            assert state["pending_reviews"] == []

            await client.post("/sessions/chat-2/messages", json={"text": "second"})
            page = (await client.get("/sessions", params={"limit": 1})).json()
            assert [s["session_id"] for s in page["sessions"]] == ["chat-2"]  # newest first
            assert page["next"] == "chat-2"
            rest = (await client.get("/sessions", params={"after": page["next"]})).json()
            assert [s["session_id"] for s in rest["sessions"]] == ["chat-1"]
            assert rest["next"] is None
            assert rest["sessions"][0]["message_count"] == 2

            r = await client.post("/sessions/chat-1/cancel")
            assert r.json() == {"cancelled": False}
            r = await client.delete("/sessions/chat-1")
            assert r.json() == {"deleted": "chat-1"}
            assert (await client.get("/sessions/chat-1")).status_code == 404


async def test_sessions_lists_the_sessions_idle_since_active_before(serve: Serve) -> None:
    """GET /sessions?active_before= (ISO 8601 with an offset) lists the sessions whose
    updated_at is before it, newest first and paged with ?after=, on both registries; a
    time without an offset, or no time, is refused with 422 naming the parameter."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            for name in ("a", "b", "c", "d"):
                r = await client.post(f"/sessions/{name}/messages", json={"text": "hi"})
                assert r.status_code == 200, r.text
            listed = (await client.get("/sessions")).json()["sessions"]
            assert [s["session_id"] for s in listed] == ["d", "c", "b", "a"]
            cut = listed[1]["updated_at"]  # c's: c and the newer d are left out
            idle = [s["session_id"] for s in listed if s["updated_at"] < cut]
            assert idle == ["b", "a"]
            page = (await client.get("/sessions", params={"active_before": cut, "limit": 1})).json()
            assert [s["session_id"] for s in page["sessions"]] == ["b"]
            rest = (
                await client.get("/sessions", params={"active_before": cut, "after": page["next"]})
            ).json()
            assert ([s["session_id"] for s in rest["sessions"]], rest["next"]) == (["a"], None)
            for bad in ("junk", "2025-01-01T00:00:00", "2025-01-01T00:00:00 00:00", ""):
                r = await client.get("/sessions", params={"active_before": bad})
                assert r.status_code == 422, (bad, r.text)
                assert r.json()["error"] == "InvalidRequest"
                assert "?active_before= must be an ISO 8601 time" in r.json()["message"]


async def test_a_deleted_sessions_streams_end_saying_it_was_deleted(serve: Serve) -> None:
    """Deleting a session ends its event stream with an error frame, SessionNotFoundError
    (404) naming the session and saying it was deleted, and its WebSocket with that error
    frame and the close code 4404: a client can tell a delete from a dropped connection."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        ws_url = served.url.replace("http://", "ws://") + "/sessions/d/ws"
        with trio.fail_after(10):
            assert (await client.post("/sessions/d/messages", json={"text": "hi"})).is_success
            async with (
                client.stream("GET", "/sessions/d/events", headers=SSE) as r,
                open_websocket(ws_url) as ws,
            ):
                await ws.send({"type": "message", "text": "one more"})
                while (await ws.receive())["type"] != "TurnFinished":
                    pass
                events = SSEReader(r)
                await events.until(finished)  # (both follow the session)
                assert (await client.delete("/sessions/d")).json() == {"deleted": "d"}
                _, sse_error = await events.next()
                with pytest.raises(AssertionError, match="the stream ended"):
                    await events.next()
                ws_error = await ws.receive()
                closed = await _closed(ws)
    for error in (sse_error, ws_error):
        assert error["type"] == "error"
        assert (error["error"], error["status"]) == ("SessionNotFoundError", 404)
        assert error["session_id"] == "d"
        assert "session 'd' was deleted" in error["message"]
    assert closed.code == 4404


async def test_json_answers_are_never_stored_by_a_cache(serve: Serve) -> None:
    """Every JSON answer (a reply, a session's history, the listing, a turn's outcome, an
    error) says ``Cache-Control: no-store``: it holds a conversation, which no browser or
    proxy cache may keep (with ``?access_token=`` in the URL nothing else marks it
    private)."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            reply = await client.post("/sessions/c/messages", json={"text": "private words"})
            turn = reply.json()["turn_id"]
            answers = [
                reply,
                await client.get("/sessions/c"),
                await client.get("/sessions"),
                await client.get(f"/sessions/c/turns/{turn}"),
                await client.get("/sessions/missing"),
            ]
    for answer in answers:
        assert answer.headers["content-type"] == "application/json", answer.request.url
        assert answer.headers.get("cache-control") == "no-store", answer.request.url


async def test_the_cancel_route_and_frame_cancel_only_the_turn_they_name(serve: Serve) -> None:
    """POST /sessions/{name}/cancel with {"turn_id": ...} (and a WebSocket cancel frame with
    one) cancels the turn in flight only if it is that turn: another id answers false and
    the turn runs on; a turn id that is not a string is a 422."""
    async with serve(delay=0.5) as served, httpx.AsyncClient(base_url=served.url) as client:
        ws_url = served.url.replace("http://", "ws://") + "/sessions/x/ws"
        with trio.fail_after(10):
            body = {"text": "one two three four five six"}
            async with client.stream("POST", "/sessions/x/messages", json=body, headers=SSE) as r:
                events = SSEReader(r)
                _, started = await events.next()
                assert started["type"] == "TurnStarted"
                turn_id = started["turn_id"]
                other = {"turn_id": turn_id + "0"}
                r2 = await client.post("/sessions/x/cancel", json=other)
                assert r2.json() == {"cancelled": False}
                r2 = await client.post("/sessions/x/cancel", json={"turn_id": 7})
                assert r2.status_code == 422, r2.text
                async with open_websocket(ws_url) as ws:
                    await ws.send({"type": "cancel", "turn_id": turn_id + "0"})
                    while (frame := await ws.receive())["type"] != "cancelled":
                        pass
                    assert frame == {"type": "cancelled", "cancelled": False}
                r2 = await client.post("/sessions/x/cancel", json={"turn_id": turn_id})
                assert r2.json() == {"cancelled": True}
                rest = await events.until(finished)
            assert rest[-1][1]["type"] == "TurnCancelled"
            assert rest[-1][1]["turn_id"] == turn_id


async def test_the_turns_route_tells_what_became_of_each_turn(serve: Serve) -> None:
    """GET /sessions/{name}/turns/{turn_id} answers a turn's outcome as JSON: finished with
    its reply, failed with its error told by its kind, running, waiting on a review,
    cancelled, and lost for an id of the session's form that never ran."""
    async with serve(delay=0.2) as served, httpx.AsyncClient(base_url=served.url) as client:

        async def outcome(turn_id: str) -> dict[str, Any]:
            r = await client.get(f"/sessions/t/turns/{turn_id}")
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            assert (body["session_id"], body["turn_id"]) == ("t", turn_id)
            return body

        with trio.fail_after(20):
            reply = (await client.post("/sessions/t/messages", json={"text": "hi there"})).json()
            done = await outcome(reply["turn_id"])
            assert (done["status"], done["error"]) == ("finished", None)
            assert done["message"] == reply["message"]

            r = await client.post("/sessions/t/messages", json={"text": "fail half an answer"})
            assert r.status_code == 500, r.text
            failed = await outcome(r.json()["turn_id"])
            assert (failed["status"], failed["message"]) == ("failed", None)
            assert failed["error"].startswith("the turn failed with ConnectionError; ")
            assert DROPPED not in failed["error"]

            body = {"text": " ".join(["word"] * 30)}
            async with client.stream("POST", "/sessions/t/messages", json=body, headers=SSE) as r:
                events = SSEReader(r)
                _, started = await events.next()
                running = started["turn_id"]
                assert (await outcome(running))["status"] == "running"
                r2 = await client.post("/sessions/t/cancel", json={"turn_id": running})
                assert r2.json() == {"cancelled": True}
                await events.until(finished)
            assert (await outcome(running))["status"] == "cancelled"

            reply = (await client.post("/sessions/t/messages", json={"text": "refund A7"})).json()
            assert (await outcome(reply["turn_id"]))["status"] == "waiting"
            review = reply["reviews"][0]["id"]
            await client.post(f"/sessions/t/reviews/{review}", json={"approve": True})
            assert (await outcome(reply["turn_id"]))["status"] == "finished"

            turn_id = done["turn_id"]
            forged = turn_id[:-1] + ("y" if turn_id.endswith("z") else "z")
            assert (await outcome(forged))["status"] == "lost"


async def test_a_sessions_state_names_its_open_turn(serve: Serve) -> None:
    """GET /sessions/{name} names the turn under way in "open_turn" (its id, running or
    waiting on a review, when it began, its user message and idempotency key), and says
    null once the turn ended."""
    async with serve(delay=0.2) as served, httpx.AsyncClient(base_url=served.url) as client:

        async def open_turn() -> Any:
            r = await client.get("/sessions/o")
            assert r.status_code == 200, r.text
            return r.json()["open_turn"]

        with trio.fail_after(20):
            body = {"text": " ".join(["word"] * 30), "idempotency_key": "k-open"}
            async with client.stream("POST", "/sessions/o/messages", json=body, headers=SSE) as r:
                events = SSEReader(r)
                _, started = await events.next()
                assert started["type"] == "TurnStarted", started
                assert await open_turn() == {
                    "turn_id": started["turn_id"],
                    "status": "running",
                    "started_at": started["created_at"],
                    "message_id": started["message_id"],
                    "idempotency_key": "k-open",
                    "started_calls": [],
                }
                await client.post("/sessions/o/cancel", json={"turn_id": started["turn_id"]})
                await events.until(finished)
            assert await open_turn() is None

            reply = (await client.post("/sessions/o/messages", json={"text": "refund A7"})).json()
            waiting = await open_turn()
            assert (waiting["turn_id"], waiting["status"]) == (reply["turn_id"], "waiting")
            review = reply["reviews"][0]["id"]
            await client.post(f"/sessions/o/reviews/{review}", json={"approve": True})
            assert await open_turn() is None


async def test_the_open_turn_of_a_retry_began_when_the_retry_was_asked() -> None:
    """The "started_at" of a turn that ref.retry() runs is when the retry was asked for,
    not when the user message it answers again was written."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(error=RuntimeError("down")), Scripted(text="ok", wait=gate)])
    async with (
        sa.open_registry(agents={"app": sa.Agent(model=model)}) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            r = await client.post("/sessions/r/messages", json={"text": "hi", "agent": "app"})
            assert r.status_code == 500, r.text
            [asked, _] = (await client.get("/sessions/r")).json()["messages"]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(registry.ref("r").retry)
                while (await registry.ref("r").state()).open_turn is None:
                    await trio.sleep(0.01)
                state = (await client.get("/sessions/r")).json()
                gate.set()
    turn = state["open_turn"]
    assert turn["message_id"] == asked["id"]
    assert turn["started_at"] > asked["created_at"], (turn, asked)


async def test_the_turns_route_tells_the_kind_of_an_error_with_no_message() -> None:
    """A turn that failed with an exception whose message is empty (``RuntimeError()``)
    is told by the turns route by that kind, as one with a message is."""
    agents = {"app": sa.Agent(model=ScriptedModel([Scripted(error=RuntimeError())]))}
    async with (
        sa.open_registry(agents=agents) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            r = await client.post("/sessions/e/messages", json={"text": "hi", "agent": "app"})
            assert r.status_code == 500, r.text
            r = await client.get(f"/sessions/e/turns/{r.json()['turn_id']}")
    body = r.json()
    assert body["status"] == "failed", body
    assert body["error"].startswith("the turn failed with RuntimeError; "), body


async def test_a_turn_cut_by_the_registrys_close_is_told_failed_not_cancelled() -> None:
    """A turn still running when the gateway's registry closes past its shutdown grace is
    told to a client that follows the session's events (GET .../events) as a TurnFailed
    of kind SessionStoppedError whose error says to send the message again (a
    TurnCancelled would read as the user's stop); the turn's own stream ends with that
    event or with the SessionStoppedError, never a TurnCancelled; and GET
    /sessions/{name}/turns/{turn_id} then answers it failed, with its kind's advice:
    send the message again."""
    store = sa.MemoryStore()
    script = Scripted(text="half a reply and no more", wait=Gate(), wait_after=2)
    agents = {"held": sa.Agent(model=ScriptedModel([script]))}
    close = trio.Event()

    async def run_registry(*, task_status: trio.TaskStatus[sa.Registry]) -> None:
        async with sa.open_registry(store=store, agents=agents, shutdown_grace=0.2) as registry:
            task_status.started(registry)
            await close.wait()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            registry = await nursery.start(run_registry)
            await registry.spawn("g")
            async with (
                serve_trio(create_app(registry)) as url,
                httpx.AsyncClient(base_url=url) as client,
                client.stream("GET", "/sessions/g/events") as listening,
            ):
                followed = SSEReader(listening)
                body = {"text": "hello"}
                async with client.stream(
                    "POST", "/sessions/g/messages", json=body, headers=SSE
                ) as r:
                    own = SSEReader(r)
                    _, started = await own.next()
                    assert started["type"] == "TurnStarted", started
                    await own.until(lambda data: data["type"] == "Delta")
                    close.set()  # the registry closes, and cuts the turn off after its grace
                    told = await own.until(lambda data: finished(data) or data["type"] == "error")
                    _, ended = told[-1]
                seen = await followed.until(finished)
        async with (
            sa.open_registry(store=store, agents=agents) as registry,
            serve_trio(create_app(registry)) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            r = await client.get(f"/sessions/g/turns/{started['turn_id']}")
    _, outcome = seen[-1]
    assert outcome["type"] == "TurnFailed", outcome
    assert (outcome["turn_id"], outcome["error_kind"]) == (
        started["turn_id"],
        "SessionStoppedError",
    )
    assert "send the message again" in outcome["error"], outcome
    if ended["type"] == "error":  # (the caller's error may end the turn's stream first)
        assert ended["error"] == "SessionStoppedError", ended
    else:
        assert ended == outcome
    answer = r.json()
    assert r.status_code == 200, answer
    assert answer["status"] == "failed", answer
    assert answer["error"] == (
        "the turn failed with SessionStoppedError: the worker running it stopped; "
        "send the message again"
    ), answer


async def test_the_turns_route_tells_a_cut_turn_by_its_kind_in_any_words(tmp_path: Path) -> None:
    """A failed turn of kind SessionStoppedError whose stored error is not in this
    version's words (a worker of another version cut it off, or the words changed) is
    told by GET /sessions/{name}/turns/{turn_id} with that kind's own advice: its worker
    stopped, send the message again; not sent to a server log that may hold nothing of
    it."""
    other_words = (
        "SessionStoppedError: the turn of session 'old' was cut off when its worker "
        "went away; send it again"
    )
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("old")
        reply = await ref.send("hello")
        state = await ref.state()
    [record] = state.turns
    cut = attrs.evolve(record, status=sa.TurnStatus.FAILED, reply_id=None, error=other_words)
    document = export_document(attrs.evolve(state, turns=(cut,)))
    target = tmp_path / "old.db"
    done = await trio.to_thread.run_sync(
        lambda: sessions(
            "import", "-", "--store", f"sqlite:///{target}", stdin=json.dumps(document)
        )
    )
    assert done.returncode == 0, done.stderr
    async with (
        sa.open_registry(
            store=sa.SQLiteStore(target), agents={"echo": sa.Agent(model=EchoModel())}
        ) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            r = await client.get(f"/sessions/old/turns/{reply.turn_id}")
    answer = r.json()
    assert r.status_code == 200, answer
    assert answer["status"] == "failed", answer
    assert answer["error"].startswith("the turn failed with SessionStoppedError"), answer
    assert "the worker running it stopped" in answer["error"], answer
    assert "send the message again" in answer["error"], answer
    assert "log" not in answer["error"], answer


async def test_the_turns_route_answers_404_for_unknown_sessions_and_turns(serve: Serve) -> None:
    """A turn id the session never issued (another session's, or one of its form that it
    could not have issued: stamped before it was created or days from now, or longer than
    any turn id) answers 404 TurnNotFoundError naming the session, the id cut to 64
    characters; an unknown session 404 SessionNotFoundError; the route is authorized as
    "read"."""
    seen: list[tuple[str | None, str]] = []

    def authorize(request: Any, name: str | None, action: str) -> bool:
        seen.append((name, action))
        return True

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(10):
            reply = (await client.post("/sessions/u/messages", json={"text": "hi"})).json()
            for other in ("nonsense", reply["turn_id"]):
                r = await client.get(f"/sessions/v/turns/{other}")
                assert r.status_code == 404, r.text
                assert r.json()["error"] == "SessionNotFoundError"
            mine = (await client.post("/sessions/v/messages", json={"text": "hi"})).json()
            _, tag, stamp, process = mine["turn_id"].split("_")  # turn_<tag>_<time>_<process>
            days_later = f"{int(stamp, 16) + 3 * 86_400 * 10**6:x}"
            forged = [
                f"turn_{tag}_0_{process}",
                f"turn_{tag}_{days_later}_{process}",
                f"turn_{tag}_{'f' * 3000}_{process}",
                f"turn_{tag}_{stamp}_{'Z' * 8000}",
            ]
            for other in ("nonsense", reply["turn_id"], *forged):
                r = await client.get(f"/sessions/v/turns/{other}")
                assert r.status_code == 404, r.text[:300]
                body = r.json()
                assert (body["error"], body["session_id"]) == ("TurnNotFoundError", "v")
                assert body["message"].startswith("session 'v' never issued a turn id")
                assert len(r.text) < 500, r.text[:300]
    assert ("v", "read") in seen


async def test_a_streamed_message_sends_its_turn_events_with_seq_ids(serve: Serve) -> None:
    """With Accept: text/event-stream a message answers its turn's events, each with its
    seq as the SSE id, in the one JSON form, ending with the turn's outcome."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            body = {"text": "one two three"}
            async with client.stream("POST", "/sessions/s/messages", json=body, headers=SSE) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                got = await read_until(r, finished)
            types = [data["type"] for _, data in got]
            assert types == ["TurnStarted", "Delta", "Delta", "Delta", "TurnFinished"]
            assert [seq for seq, _ in got] == [data["seq"] for _, data in got]
            seqs = [seq for seq, _ in got]
            assert seqs == sorted(seqs)
            assert "".join(d["text"] for _, d in got if d["type"] == "Delta") == "one two three"
            turn = got[0][1]["turn_id"]
            assert all(d["turn_id"] == turn and d["session_id"] == "s" for _, d in got)


async def test_the_accept_header_is_read_as_http_reads_it(serve: Serve) -> None:
    """A media type matches in any case, among others, with parameters; one refused with
    q=0 is not chosen: the message is then answered in JSON."""
    streamed = ("TEXT/Event-Stream", "application/json;q=0.5, text/event-stream; charset=utf-8")
    answered = ("text/event-stream;q=0", "text/event-stream; q=0.0, application/json", "*/*")
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            for accept in streamed + answered:
                headers = {"accept": accept}
                body = {"text": "hi"}
                async with client.stream(
                    "POST", "/sessions/a/messages", json=body, headers=headers
                ) as r:
                    assert r.status_code == 200
                    kind = r.headers["content-type"].split(";")[0]
                    assert kind == (
                        "text/event-stream" if accept in streamed else "application/json"
                    ), accept
                    await r.aread()


async def test_a_turn_that_fails_mid_reply_keeps_what_it_streamed(serve: Serve) -> None:
    """A turn whose model fails after streaming words streams them, then the message
    that keeps them (marked interrupted) and TurnFailed; the session's state holds that
    message, and its events replayed after the turn end with the same two events; a
    turn that fails before streaming leaves the "no reply" message."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            body = {"text": "fail half an answer"}
            async with client.stream("POST", "/sessions/f/messages", json=body, headers=SSE) as r:
                assert r.status_code == 200
                got = [data for _, data in await read_until(r, finished)]
            types = [data["type"] for data in got]
            assert types == ["TurnStarted", "Delta", "Delta", "Delta", "MessageAdded", "TurnFailed"]
            kept = got[4]["message"]
            assert (kept["role"], kept["content"], kept["interrupted"]) == (
                "assistant",
                "half an answer",
                True,
            )
            assert "".join(d["text"] for d in got if d["type"] == "Delta") == kept["content"]
            assert got[5]["error"].startswith("the turn failed with ConnectionError; ")
            assert DROPPED not in got[5]["error"]

            state = (await client.get("/sessions/f")).json()
            assert state["messages"][-1] == kept
            params = {"after": got[0]["seq"]}
            async with client.stream("GET", "/sessions/f/events", params=params) as r:
                replayed = [data for _, data in await read_until(r, finished)]
            assert replayed[-2:] == got[-2:]
            r = await client.post("/sessions/f/messages", json={"text": "fail "})
            assert r.status_code == 500, r.text
            last = (await client.get("/sessions/f")).json()["messages"][-1]
            assert (last["content"], last["interrupted"]) == ("(no reply: this turn failed)", True)


async def test_sse_resumes_from_the_middle_of_a_reply_with_every_event_once(
    serve: Serve,
) -> None:
    """A client that drops the events stream mid-reply and reconnects with Last-Event-ID
    gets every event exactly once, as a client that never dropped sees them."""
    async with serve(delay=0.03) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            await client.post("/sessions/r/messages", json={"text": "warm up"})
            start = (await client.get("/sessions/r")).json()["event_seq"]
            reference: list[tuple[int, dict]] = []
            first: list[tuple[int, dict]] = []
            second: list[tuple[int, dict]] = []
            connected = trio.Event()

            async def read_all() -> None:
                params = {"after": start}
                async with client.stream("GET", "/sessions/r/events", params=params) as r:
                    reference.extend(await read_until(r, lambda d: d["type"] == "TurnFinished"))

            async def drop_and_resume() -> None:
                headers = {"last-event-id": str(start)}
                async with client.stream("GET", "/sessions/r/events", headers=headers) as r:
                    connected.set()
                    reader = SSEReader(r)
                    while sum(d["type"] == "Delta" for _, d in first) < 3:
                        first.append(await reader.next())
                    # leaving the block drops the connection in the middle of the reply
                last = first[-1][0]
                async with client.stream(
                    "GET", "/sessions/r/events", headers={"last-event-id": str(last)}
                ) as r:
                    second.extend(await read_until(r, lambda d: d["type"] == "TurnFinished"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                nursery.start_soon(drop_and_resume)
                await connected.wait()
                text = "one two three four five six seven eight"
                r = await client.post("/sessions/r/messages", json={"text": text})
                assert r.status_code == 200

    seqs = [seq for seq, _ in reference]
    assert seqs == list(range(start + 1, start + 1 + len(seqs)))
    assert [seq for seq, _ in first + second] == seqs
    assert [data for _, data in first + second] == [data for _, data in reference]
    deltas = [d["text"] for _, d in reference if d["type"] == "Delta"]
    assert "".join(deltas) == "one two three four five six seven eight"
    assert 3 <= len(first) < len(reference)


async def test_a_client_that_goes_away_mid_stream_leaves_no_subscription(serve: Serve) -> None:
    """Clients that disconnect in the middle of an events stream or of a streamed message
    leave the registry with no subscriber; the turn runs on and its reply is kept."""
    async with serve(delay=0.03) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            await client.post("/sessions/d/messages", json={"text": "hi"})
            text = "a reply nobody reads to the end"
            async with trio.open_nursery() as nursery:
                listening = trio.Event()

                async def listen_then_leave() -> None:
                    async with client.stream("GET", "/sessions/d/events") as r:
                        listening.set()
                        await read_until(r, lambda d: d["type"] == "Delta")
                    # leaving the block closes the connection mid-stream

                nursery.start_soon(listen_then_leave)
                await listening.wait()
                body = {"text": text}
                async with client.stream(
                    "POST", "/sessions/d/messages", json=body, headers=SSE
                ) as r:
                    await read_until(r, lambda d: d["type"] == "Delta")
            assert served.registry().statistics().subscribers <= 2
            await wait_no_subscribers(served)
            while (await client.get("/sessions/d")).json()["messages"][-1]["content"] != text:
                await trio.sleep(0.02)


async def test_event_streams_send_heartbeats_while_quiet(serve: Serve) -> None:
    """An events stream with nothing to say sends a heartbeat comment every ``heartbeat``."""
    async with serve(heartbeat=0.1) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            await client.post("/sessions/h/messages", json={"text": "hi"})
            async with client.stream("GET", "/sessions/h/events") as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if lines.count(": heartbeat") == 2:
                        break
            assert lines[0] == "retry: 1000"


async def _store_fat_session(path: Path) -> sa.SQLiteStore:
    """A store at ``path`` holding the served agent's session "fat" of 10 large messages
    and their replies: 5 MB of history, 5 MB of stored events to replay (more than the
    sockets hold). Written here, not through a server that the test runs with a heartbeat
    of 0.05 s: an answer of 500 KB has two heartbeats for each 64 KB its client takes, and
    a loaded machine that pauses the test's process for longer cuts it."""
    agents = {"shop": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        ref = await registry.spawn("fat")
        for _ in range(10):
            await ref.send("x" * 250_000)
    return sa.SQLiteStore(path)


def _port(served: Served) -> int:
    return int(served.url.rsplit(":", 1)[1])


async def _silent_reader_is_ended(
    serve: Serve, request: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> bytes:
    """A raw client that sends ``request`` (a GET of ``/sessions/fat...``) about a session
    of large messages (``_store_fat_session``) and reads nothing for 60 heartbeats (a
    WebSocket message of its events, up to 500 KB, may wait 16: two for each 64 KB): then
    what is left must end (the answer ended, the connection reset or closed), within
    30 s, and the server's log say so, naming the session; what the client got."""
    store = await _store_fat_session(tmp_path / "fat.db")
    async with serve(heartbeat=0.05, store=store) as served:
        port = _port(served)
        got = bytearray()
        with trio.socket.socket() as reader:
            reader.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
            # (an Ethernet's segments, not loopback's 64 KB, with which the server's
            # kernel would hold megabytes of the stream)
            reader.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_MAXSEG, 1400)
            await reader.connect(("127.0.0.1", port))
            await reader.send(request.format(host=f"127.0.0.1:{port}").encode())
            await trio.sleep(3)  # (not an assertion: it reads nothing for 60 heartbeats)
            with trio.fail_after(30):  # then what is left ends, not a live stream
                while True:
                    try:
                        data = await reader.recv(1 << 20)
                    except ConnectionResetError:
                        break
                    if not data:
                        break
                    got += data
    told = [r.getMessage() for r in caplog.records if "client took" in r.getMessage()]
    assert any("session 'fat'" in line for line in told), told
    return bytes(got)


@pytest.mark.one_server  # (slow)
async def test_an_event_stream_whose_client_takes_nothing_is_ended(
    serve: Serve, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A client that replays a session of large messages and reads nothing (the server's
    write to it never done) does not hold its connection: after two heartbeat intervals
    without a write taken, the stream ends and the connection is reset."""
    request = "GET /sessions/fat/events?after=0 HTTP/1.1\r\nHost: {host}\r\n\r\n"
    await _silent_reader_is_ended(serve, request, caplog, tmp_path)


@pytest.mark.one_server  # (slow)
async def test_a_websocket_whose_client_takes_nothing_is_ended(
    serve: Serve, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A WebSocket client that replays a session of large messages and reads nothing (the
    server's send to it never done) does not hold its connection: after two heartbeat
    intervals without a send taken, the socket ends (the client resumes with ?after=)."""
    request = (
        "GET /sessions/fat/ws?after=0 HTTP/1.1\r\nHost: {host}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    await _silent_reader_is_ended(serve, request, caplog, tmp_path)


#: A frame that the gateway answers (an error frame: no such review), by a task of its own.
UNKNOWN_REVIEW: dict[str, Any] = {"type": "review", "review_id": "rev_none", "approve": True}


@pytest.mark.one_server  # (slow)
async def test_a_websocket_client_that_reads_nothing_is_ended_however_many_frames_it_sends(
    serve: Serve, tmp_path: Path
) -> None:
    """A WebSocket client that replays a session of large messages and reads nothing, but
    sends a frame that is answered four times in each heartbeat interval, does not hold its
    connection: the answers wait behind the write that is not taken, which still has only
    its own allowance (two heartbeats for each 64 KB), and then the socket ends."""
    store = await _store_fat_session(tmp_path / "fat.db")
    async with serve(heartbeat=0.05, store=store) as served:
        ws = await SilentWebSocket.connect(_port(served), "/sessions/fat/ws?after=0")
        try:
            with trio.move_on_after(30) as attack:  # (not an assertion: 600 heartbeats)
                while True:
                    try:
                        await ws.send(UNKNOWN_REVIEW)
                    except ConnectionError:
                        break
                    await trio.sleep(0.0125)
        finally:
            ws.close()
    assert not attack.cancelled_caught, "the client held its connection for 600 heartbeats"


@pytest.mark.one_server  # (slow)
async def test_a_websocket_client_that_takes_no_answers_is_read_no_further(
    serve: Serve, tmp_path: Path
) -> None:
    """A WebSocket client that reads nothing but sends frames that are answered, each 8 KB,
    is read no further once a few answers wait: its frames stay in the network's buffers
    (its sends stop), rather than piling up answers in the server's memory."""
    frame = {**UNKNOWN_REVIEW, "note": "n" * 8192}
    sent = 0
    store = await _store_fat_session(tmp_path / "fat.db")
    async with serve(heartbeat=30, store=store) as served:  # (the writes' allowance: a minute each)
        ws = await SilentWebSocket.connect(_port(served), "/sessions/fat/ws?after=0")
        try:
            while sent < 4096:  # (32 MB)
                with trio.move_on_after(2) as blocked:  # (not an assertion: a send that waits)
                    await ws.send(frame)
                if blocked.cancelled_caught:
                    break
                sent += 1
        finally:
            ws.close()
    assert sent < 2048, f"the server took {sent} frames of 8 KB whose answers wait"


@pytest.mark.one_server  # (slow)
async def test_a_json_answer_whose_client_takes_nothing_is_ended(
    serve: Serve, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A client that asks for a session of a long history (5 MB of JSON) and reads
    nothing (the server's write to it never done) holds neither the answer nor its
    connection: after two heartbeat intervals without 64 KB of it taken, the answer ends
    and the connection is reset, before the client has it whole."""
    request = "GET /sessions/fat HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    got = await _silent_reader_is_ended(serve, request, caplog, tmp_path)
    answer = h11.Connection(h11.CLIENT)
    answer.send(h11.Request(method="GET", target="/sessions/fat", headers=[("host", "x")]))
    answer.receive_data(got)
    body = 0
    while (event := answer.next_event()) is not h11.NEED_DATA:
        assert not isinstance(event, h11.EndOfMessage), f"the whole answer came: {body} bytes"
        if isinstance(event, h11.Response):
            assert event.status_code == 200, event
        elif isinstance(event, h11.Data):
            body += len(event.data)


@pytest.mark.one_server  # (slow)
async def test_a_client_that_reads_a_json_answer_slowly_but_steadily_gets_it(
    serve: Serve,
) -> None:
    """A client that reads a session of a long history slowly but steadily (about 400 KB/s:
    its 2 MB of JSON takes it longer than two heartbeat intervals) gets the whole answer.
    (A heartbeat of 1 s, not less: a 64 KB piece's allowance is then 2 s, which a test
    process sharing the machine with another one does not overrun by a stall.)"""
    async with (
        serve(heartbeat=1.0) as served,
        httpx.AsyncClient(base_url=served.url, timeout=60) as client,
    ):
        big = "x" * 500_000
        for _ in range(2):
            assert (await client.post("/sessions/big/messages", json={"text": big})).is_success
        expected = (await client.get("/sessions/big")).content
        port = _port(served)
        with trio.fail_after(120):
            body = await get_slowly(port, "/sessions/big")
    assert len(expected) > 2_000_000
    assert body == expected


@pytest.mark.one_server  # (slow)
@pytest.mark.parametrize(
    "target", ["/sessions/big/events?after=0", "/sessions/big/ws?after=0"], ids=["sse", "ws"]
)
async def test_a_client_that_reads_slowly_but_steadily_gets_its_stream(
    serve: Serve, target: str
) -> None:
    """A client that reads a session of large messages slowly but steadily (about 400 KB/s:
    an event of 1 MB takes it longer than two heartbeat intervals) gets every event.
    (A heartbeat of 1 s, not less: a 64 KB piece's allowance is then 2 s, which a test
    process sharing the machine with another one does not overrun by a stall.)"""
    async with (
        serve(heartbeat=1.0) as served,
        httpx.AsyncClient(base_url=served.url, timeout=60) as client,
    ):
        big = "x" * 500_000  # (its TurnStarted, with the text twice, is 1 MB)
        assert (await client.post("/sessions/big/messages", json={"text": big})).is_success
        async with client.stream("GET", "/sessions/big/events?after=0") as r:
            expected = [data for _, data in await read_until(r, finished)]
        port = _port(served)
        with trio.fail_after(120):
            events = await read_slowly(port, target, turns=1)
    assert [event["seq"] for event in events] == [event["seq"] for event in expected]
    assert events == expected
    assert events[-1]["type"] == "TurnFinished"
    assert events[-1]["message"]["content"] == big


async def test_errors_answer_json_with_fitting_statuses(serve: Serve) -> None:
    """Unknown sessions and reviews answer 404, a pending review 409, bad input 422, a full
    mailbox 429; each body names the error and says what to do."""
    async with (
        serve(mailbox_size=1, delay=0.05) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(20):
            for method, path in [
                ("GET", "/sessions/nobody"),
                ("GET", "/sessions/nobody/events"),
                ("POST", "/sessions/nobody/cancel"),
                ("DELETE", "/sessions/nobody"),
            ]:
                r = await client.request(method, path)
                assert r.status_code == 404, (method, path, r.text)
                body = r.json()
                assert body["error"] == "SessionNotFoundError"
                assert body["session_id"] == "nobody"
                assert "'nobody'" in body["message"]

            await client.post("/sessions/e/messages", json={"text": "hi"})
            bad = [
                ("POST", "/sessions/e/messages", {"content": b"{not json"}),
                ("POST", "/sessions/e/messages", {"json": ["a list"]}),
                ("POST", "/sessions/e/messages", {"json": {"text": 42}}),
                ("POST", "/sessions/e/messages", {"json": {"text": "x", "idempotency_key": 1}}),
                ("POST", "/sessions/e/reviews/r1", {"json": {"approve": "yes"}}),
                ("GET", "/sessions/e/events", {"headers": {"last-event-id": "abc"}}),
                ("GET", "/sessions/e/events", {"params": {"after": "-1"}}),
                ("GET", "/sessions", {"params": {"limit": "0"}}),
                ("GET", "/sessions/bad%01name", {}),
            ]
            for method, path, kwargs in bad:
                r = await client.request(method, path, **kwargs)
                assert r.status_code == 422, (method, path, kwargs, r.text)
                assert r.json()["message"]
                if path.startswith("/sessions/e/"):
                    assert r.json()["message"].startswith("session 'e'"), r.json()

            r = await client.get("/no/such/route")
            assert (r.status_code, r.json()["error"]) == (404, "NotFound")
            r = await client.put("/sessions/e/messages", json={"text": "x"})
            assert (r.status_code, r.json()["error"]) == (405, "MethodNotAllowed")
            assert "POST" in r.headers["allow"]
            r = await client.put("/sessions/e", json={})
            assert (r.status_code, r.json()["error"]) == (405, "MethodNotAllowed")
            assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}, r.headers

            r = await client.post("/sessions/e/reviews/r-none", json={"approve": True})
            assert r.status_code == 404
            assert r.json()["error"] == "ReviewNotFoundError"

            # a pending review: the next message is refused with 409
            reply = (await client.post("/sessions/e/messages", json={"text": "refund A7"})).json()
            [review] = reply["reviews"]
            assert review["tool_call"]["name"] == "refund"
            r = await client.post("/sessions/e/messages", json={"text": "hello?"})
            assert r.status_code == 409
            assert r.json()["error"] == "SessionBusyError"
            assert review["id"] in r.json()["message"]
            r = await client.post(f"/sessions/e/reviews/{review['id']}", json={"approve": True})
            assert r.json()["text"] == "Refunded: order A7 refunded"

            # a turn runs, one waits in the mailbox (of 1): the next is refused with 429
            async with trio.open_nursery() as nursery:
                running, queued = trio.Event(), trio.Event()

                async def stream(text: str, started: trio.Event, wait_for: str) -> None:
                    body = {"text": text}
                    async with client.stream(
                        "POST", "/sessions/e/messages", json=body, headers=SSE
                    ) as r:
                        assert r.status_code == 200
                        reader = SSEReader(r)
                        if wait_for != "headers":
                            await reader.until(lambda d: d["type"] == wait_for)
                        started.set()
                        await reader.until(finished)

                nursery.start_soon(stream, "one two three four five six seven", running, "Delta")
                await running.wait()
                nursery.start_soon(stream, "queued", queued, "headers")
                await queued.wait()
                r = await client.post("/sessions/e/messages", json={"text": "one too many"})
                assert r.status_code == 429, r.text
                assert r.json()["error"] == "MailboxFullError"
                assert r.headers["retry-after"] == "1"  # (the moment the message speaks of)


async def test_a_token_is_required_when_set(serve: Serve) -> None:
    """With a token, API requests without it (or with another) answer 401; the header or
    ?access_token= lets them through; the chat page itself needs none."""
    async with serve(token="s3cret") as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}):
                r = await client.get("/sessions", headers=headers)
                assert r.status_code == 401
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert r.json()["error"] == "Unauthorized"
            r = await client.get("/sessions", headers={"authorization": "Bearer s3cret"})
            assert r.status_code == 200
            r = await client.get("/sessions", params={"access_token": "s3cret"})
            assert r.status_code == 200
            r = await client.get("/")
            assert r.status_code == 200
            assert "<html" in r.text
            r = await client.get("/sessionactors.js")
            assert "export class SessionsClient" in r.text


async def test_the_authorize_hook_decides_per_session_and_action(serve: Serve) -> None:
    """``authorize(request, session_name, action)`` sees every API request; false answers 403."""
    seen: list[tuple[str | None, str]] = []

    async def authorize(request: Any, name: str | None, action: str) -> bool:
        seen.append((name, action))
        return request.headers.get("x-tenant") == "acme" and not (name or "").startswith("other")

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url, headers={"x-tenant": "acme"}) as client,
    ):
        with trio.fail_after(10):
            assert (
                await client.post("/sessions/a/messages", json={"text": "x"})
            ).status_code == 200
            r = await client.post("/sessions/other-1/messages", json={"text": "x"})
            assert r.status_code == 403
            assert r.json()["error"] == "Forbidden"
            r = await client.get("/sessions", headers={"x-tenant": "evil"})
            assert r.status_code == 403
    assert ("a", "send") in seen
    assert ("other-1", "send") in seen
    assert (None, "list") in seen


async def test_an_http_exception_raised_by_authorize_answers_its_status(serve: Serve) -> None:
    """An ``authorize`` that refuses FastAPI-style, raising Starlette's ``HTTPException``,
    is answered with that exception's status, detail and headers: on a JSON route, an
    event stream, a WebSocket's connection (error frame, close code 4000 + status) and a
    WebSocket's frame (error frame; the socket lives on)."""

    def authorize(request: Any, name: str | None, action: str) -> bool:
        if request.headers.get("x-user") != "ada":
            raise HTTPException(401, "who are you?", headers={"WWW-Authenticate": "Basic"})
        if action == "cancel":
            raise HTTPException(403, "ada may not cancel")
        return True

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(10):
            for method, path, headers in [
                ("POST", "/sessions/h/messages", {}),
                ("POST", "/sessions/h/messages", SSE),
                ("GET", "/sessions/h/events", SSE),
                ("GET", "/sessions", {}),
            ]:
                r = await client.request(method, path, headers=headers, json={"text": "hi"})
                assert r.status_code == 401, (method, path, r.text)
                assert r.headers["www-authenticate"] == "Basic"
                body = r.json()
                assert (body["error"], body["status"]) == ("Unauthorized", 401), body
                assert "who are you?" in body["message"], body
            r = await client.post("/sessions/h/cancel", headers={"x-user": "ada"}, json={})
            assert (r.status_code, r.json()["error"]) == (403, "Forbidden"), r.text
            assert "ada may not cancel" in r.json()["message"]

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/h/ws") as ws:
                error = await ws.receive()
                assert (error["type"], error["status"]) == ("error", 401), error
                assert "who are you?" in error["message"]
                with pytest.raises(Closed) as closed:
                    await ws.receive()
                assert closed.value.code == 4401
            async with open_websocket(base + "/sessions/h/ws", headers=[("x-user", "ada")]) as ws:
                await ws.send({"type": "cancel"})
                frame = await ws.receive()
                while "seq" in frame:
                    frame = await ws.receive()
                assert (frame["type"], frame["status"]) == ("error", 403), frame
                assert "ada may not cancel" in frame["message"]
                await ws.send({"type": "nonsense"})  # the socket lives on
                frame = await ws.receive()
                while "seq" in frame:
                    frame = await ws.receive()
                assert frame["status"] == 422


async def _closed(ws: Any) -> Closed:
    """How the server closes ``ws``, after the frames it sends first."""
    while True:
        try:
            await ws.receive()
        except Closed as closed:
            return closed


async def test_a_websocket_exception_raised_by_authorize_closes_with_its_code(
    serve: Serve,
) -> None:
    """An ``authorize`` that refuses as a Starlette WebSocket endpoint does, raising
    ``WebSocketException``, closes a WebSocket with that exception's code and reason, when
    it connects and at a frame it refuses; an HTTP request it refuses answers 403 with the
    reason as its message."""

    def authorize(request: Any, name: str | None, action: str) -> bool:
        if request.headers.get("x-user") != "ada":
            raise WebSocketException(1008, "who are you?")
        if action == "cancel":  # (a close frame carries 123 bytes of it)
            raise WebSocketException(4001, "ada may not cancel" + "." * 200)
        return True

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(10):
            for method, path, headers in [
                ("POST", "/sessions/h/messages", {}),
                ("GET", "/sessions/h/events", SSE),
                ("GET", "/sessions", {}),
            ]:
                r = await client.request(method, path, headers=headers, json={"text": "hi"})
                assert r.status_code == 403, (method, path, r.text)
                body = r.json()
                assert (body["error"], body["status"]) == ("Forbidden", 403), body
                assert "who are you?" in body["message"], body

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/h/ws") as ws:
                with pytest.raises(Closed) as closed:
                    await ws.receive()
                assert (closed.value.code, closed.value.reason) == (1008, "who are you?")
            async with open_websocket(base + "/sessions/h/ws", headers=[("x-user", "ada")]) as ws:
                await ws.send({"type": "cancel"})
                ended = await _closed(ws)  # (after any events of the session)
                reason = "ada may not cancel" + "." * 105
                assert (ended.code, ended.reason) == (4001, reason)
            await wait_no_subscribers(served)


async def test_a_replayed_idempotent_message_streams_its_stored_reply(serve: Serve) -> None:
    """A streamed message whose idempotency key already completed answers one "reply"
    frame with the stored reply, and runs no second turn."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            body = {"text": "only once", "idempotency_key": "k1"}
            first = (await client.post("/sessions/i/messages", json=body)).json()
            async with client.stream("POST", "/sessions/i/messages", json=body, headers=SSE) as r:
                [(seq, data)] = await read_until(r, lambda d: d["type"] == "reply")
            assert seq is None
            assert data["turn_id"] == first["turn_id"]
            assert data["text"] == "only once"
            assert len((await client.get("/sessions/i")).json()["messages"]) == 2


async def test_the_idempotency_key_header_keys_a_message(serve: Serve) -> None:
    """A message whose key comes in the ``Idempotency-Key`` header (a structured-field
    string, as the IETF draft writes it, or a bare value) runs once however often it is
    sent again, as JSON or streamed, and the same key in the header and the body is one
    key."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            quoted, bare = {"idempotency-key": '"k-1"'}, {"idempotency-key": "k-1"}
            first = await client.post("/sessions/h/messages", json={"text": "once"}, headers=bare)
            assert first.status_code == 200, first.text
            turn = first.json()["turn_id"]
            for body, headers in [
                ({"text": "once"}, bare),
                ({"text": "once"}, quoted),
                ({"text": "once", "idempotency_key": "k-1"}, quoted),
            ]:
                r = await client.post("/sessions/h/messages", json=body, headers=headers)
                assert (r.status_code, r.json()["turn_id"]) == (200, turn), r.text
            async with client.stream(
                "POST", "/sessions/h/messages", json={"text": "once"}, headers={**SSE, **quoted}
            ) as r:
                [(_, data)] = await read_until(r, lambda d: d["type"] == "reply")
            assert data["turn_id"] == turn
            escaped = {"idempotency-key": r'"a\\\"b"'}  # (a string's escapes: the key a\"b)
            for _ in range(2):
                r = await client.post(
                    "/sessions/h/messages", json={"text": "twice"}, headers=escaped
                )
                assert r.status_code == 200, r.text
            r = await client.post(
                "/sessions/h/messages", json={"text": "twice", "idempotency_key": 'a\\"b'}
            )
            assert r.status_code == 200, r.text
            # a key of UTF-8 text, unquoted in the header (its bytes as they come), is the
            # body's key: a retry that moves it from one to the other runs nothing again
            r = await client.post(
                "/sessions/h/messages", json={"text": "utf", "idempotency_key": "заказ-7"}
            )
            assert r.status_code == 200, r.text
            moved = {"idempotency-key": "заказ-7".encode()}
            for body in ({"text": "utf"}, {"text": "utf", "idempotency_key": "заказ-7"}):
                again = await client.post("/sessions/h/messages", json=body, headers=moved)
                assert (again.status_code, again.json()["turn_id"]) == (200, r.json()["turn_id"])
            latin = {"idempotency-key": b"k-\xe9"}  # (no UTF-8: refused, not guessed)
            r = await client.post("/sessions/h/messages", json={"text": "x"}, headers=latin)
            assert (r.status_code, r.json()["error"]) == (400, "InvalidRequest"), r.text
            assert "UTF-8" in r.json()["message"], r.text
            state = (await client.get("/sessions/h")).json()
    assert [m["content"] for m in state["messages"]] == [
        "once",
        "once",
        "twice",
        "twice",
        "utf",
        "utf",
    ]


async def test_a_streamed_message_refused_before_its_turn_began_ends_with_the_refusal(
    serve: Serve,
) -> None:
    """A message streamed while its session waits on a review is refused: its stream
    ends with the error frame (409, the gateway's words, the refused turn's id), every
    time; its ``TurnFailed``, which tells the refusal in a Python caller's words and
    raced the error, is the session's subscribers' (it ended some streams first)."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(30):
            reply = (await client.post("/sessions/w/messages", json={"text": "refund A7"})).json()
            [review] = reply["reviews"]
            for k in range(20):
                body = {"text": f"hello {k}?"}
                async with client.stream(
                    "POST", "/sessions/w/messages", json=body, headers=SSE
                ) as r:
                    assert r.status_code == 200
                    [(_, told)] = await SSEReader(r).until(lambda d: True)
                assert told["type"] == "error", told
                assert (told["status"], told["error"]) == (409, "SessionBusyError"), told
                assert f"POST /sessions/w/reviews/{review['id']}" in told["message"], told
                outcome = await client.get(f"/sessions/w/turns/{told['turn_id']}")
                assert outcome.json()["status"] == "failed", outcome.json()


async def test_a_message_whose_header_and_body_keys_differ_is_refused(serve: Serve) -> None:
    """A message whose ``Idempotency-Key`` header and ``"idempotency_key"`` differ, or
    whose header is no key (an unclosed string, two keys), is refused with 400 before
    anything runs: no session is created, no turn runs, as JSON and streamed."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            body = {"text": "pay", "idempotency_key": "k-body"}
            differ = {"idempotency-key": '"k-header"'}
            for headers in (differ, {**differ, **SSE}):
                r = await client.post("/sessions/new/messages", json=body, headers=headers)
                assert r.status_code == 400, r.text
                error = r.json()
                assert (error["error"], error["status"]) == ("IdempotencyKeyConflict", 400)
                assert error["session_id"] == "new"
                for told in ("session 'new'", "Idempotency-Key", "'k-header'", "'k-body'"):
                    assert told in error["message"], error
            assert (await client.get("/sessions/new")).status_code == 404

            assert (await client.post("/sessions/old/messages", json=body)).status_code == 200
            for headers in (
                differ,
                {**differ, **SSE},
                {"idempotency-key": '"k-body'},
                {"idempotency-key": '"k-body", "k-2"'},
            ):
                r = await client.post("/sessions/old/messages", json=body, headers=headers)
                assert r.status_code == 400, (headers, r.text)
                assert r.json()["message"].startswith("session 'old'"), r.json()
            two = [("idempotency-key", "k-a"), ("idempotency-key", "k-b")]
            r = await client.post("/sessions/old/messages", json={"text": "x"}, headers=two)
            assert r.status_code == 400, r.text
            state = (await client.get("/sessions/old")).json()
    assert [m["content"] for m in state["messages"]] == ["pay", "pay"]


@asynccontextmanager
async def waking_session(
    name: str, key: str
) -> AsyncIterator[tuple[str, httpx.AsyncClient, sa.Reply, Any]]:
    """A session whose ``key`` completed, served by an app over a store that holds its
    load: (base url, client, the reply of that key's turn, the gate to open). A read
    wakes it before this yields, and waits at the gate."""
    stored = sa.MemoryStore()
    agents = trio_agents()
    async with sa.open_registry(store=stored, agents=agents) as registry:
        first = await (await registry.spawn(name)).send("only once", idempotency_key=key)
    store = FaultyStore(stored)
    loading = store.hold("load", session_id=name)
    app = create_app(store=store, agents=agents)
    async with (
        serve_trio(app) as url,
        httpx.AsyncClient(base_url=url) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(client.get, f"/sessions/{name}")  # wakes it: the load is held
        with trio.fail_after(10):
            while not loading.waiting:
                await trio.sleep(0.01)
        yield url, client, first, loading


async def test_a_first_message_while_a_read_of_the_name_loads_creates_the_session() -> None:
    """The chat page opens a session (GET, 404 for a new name) and its first message
    (POST) may reach the server while that read's load is still in flight: the message
    creates the session and is answered, not failed with 404."""
    store = FaultyStore(sa.MemoryStore())
    loading = store.hold("load", session_id="web-1")
    app = create_app(store=store, agents=trio_agents())
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                read: list[int] = []

                async def get() -> None:
                    read.append((await client.get("/sessions/web-1")).status_code)

                nursery.start_soon(get)
                while not loading.waiting:
                    await trio.sleep(0.01)
                nursery.start_soon(_open_later, loading)
                sent = await client.post("/sessions/web-1/messages", json={"text": "hello"})
            assert read == [404]
            assert sent.status_code == 200, sent.text
            assert sent.json()["text"] == "hello"
            state = (await client.get("/sessions/web-1")).json()
            assert [m["content"] for m in state["messages"]] == ["hello", "hello"]


async def _open_later(gate: Any) -> None:
    await trio.sleep(0.2)  # the message reaches the server while the load is held
    gate.open()


async def test_a_replayed_message_to_a_waking_session_streams_its_stored_reply() -> None:
    """A streamed message whose idempotency key completed, sent while its session wakes
    (the store is slow to load it), ends with the stored reply instead of waiting."""
    async with waking_session("i", "k1") as (_, client, first, loading):
        with trio.fail_after(10):
            body = {"text": "only once", "idempotency_key": "k1"}
            async with client.stream("POST", "/sessions/i/messages", json=body, headers=SSE) as r:
                loading.open()
                got = await read_until(r, lambda d: d["type"] in ("reply", "TurnFinished"))
            assert got[-1][1]["type"] == "reply"
            assert got[-1][1]["turn_id"] == first.turn_id
            state = (await client.get("/sessions/i")).json()
            assert len(state["messages"]) == 2


async def test_a_replayed_websocket_message_to_a_waking_session_gets_its_stored_reply() -> None:
    """A WebSocket message whose idempotency key completed, sent while its session wakes,
    gets a "reply" frame with the stored reply (no events follow for it)."""
    async with waking_session("w", "k1") as (url, _, first, loading):
        with trio.fail_after(10):
            async with open_websocket(url.replace("http://", "ws://") + "/sessions/w/ws") as ws:
                await ws.send({"type": "message", "text": "only once", "idempotency_key": "k1"})
                submitted = await ws.receive()
                loading.open()
                frame = submitted
                while frame["type"] not in ("reply", "TurnFinished"):
                    frame = await ws.receive()
            assert submitted["type"] == "submitted"
            assert frame["type"] == "reply"
            assert frame["turn_id"] == first.turn_id
            assert frame["text"] == "only once"


async def test_a_websocket_message_sent_again_after_its_turn_finished_gets_its_reply(
    serve: Serve,
) -> None:
    """A WebSocket message sent again with its idempotency key after its turn finished
    (a client whose socket dropped before the answer came, on a new socket) is answered
    ``submitted`` with ``replayed`` and then a "reply" frame with the stored reply, as
    the same retry over HTTP is (no events come for it: it got nothing it could show)."""
    async with serve() as served:
        ws_url = served.url.replace("http://", "ws://") + "/sessions/r/ws"
        with trio.fail_after(10):
            async with open_websocket(ws_url) as ws:
                await ws.send({"type": "message", "text": "only once", "idempotency_key": "k"})
                while (await ws.receive())["type"] != "TurnFinished":
                    pass
            async with open_websocket(ws_url) as ws:
                await ws.send({"type": "message", "text": "only once", "idempotency_key": "k"})
                submitted, reply = await ws.receive(), await ws.receive()
        assert (submitted["type"], submitted["replayed"]) == ("submitted", True), submitted
        assert reply["type"] == "reply", reply
        assert (reply["turn_id"], reply["text"]) == (submitted["turn_id"], "only once")


async def test_a_websocket_message_sent_again_mid_turn_after_the_last_seq_gets_the_rest(
    serve: Serve,
) -> None:
    """A client whose socket dropped mid-turn opens a new one with ``?after=`` the last
    seq it received and sends its message again with its key: it joins the turn, and
    the two sockets' deltas make the whole reply, none twice."""
    words = " ".join(f"w{i}" for i in range(20))
    async with serve(delay=0.05) as served:
        ws_url = served.url.replace("http://", "ws://") + "/sessions/m/ws"
        message = {"type": "message", "text": words, "idempotency_key": "k"}
        with trio.fail_after(20):
            async with open_websocket(ws_url) as ws:
                await ws.send(message)
                first: list[dict[str, Any]] = []
                while sum(f["type"] == "Delta" for f in first) < 5:
                    first.append(await ws.receive())
            last = max(f["seq"] for f in first if "seq" in f)
            async with open_websocket(f"{ws_url}?after={last}") as ws:
                await ws.send(message)
                rest: list[dict[str, Any]] = []
                while not rest or rest[-1]["type"] != "TurnFinished":
                    rest.append(await ws.receive())
        submitted = next(f for f in rest if f["type"] == "submitted")
        assert submitted["replayed"] is False  # (joined: not a new turn)
        deltas = [f["text"] for f in first + rest if f["type"] == "Delta"]
        assert "".join(deltas) == words
        assert rest[-1]["message"]["content"] == words


async def test_a_streamed_review_answer_sends_the_rest_of_the_turn(serve: Serve) -> None:
    """Approving a review with Accept: text/event-stream streams the turn's remaining events."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            reply = (await client.post("/sessions/v/messages", json={"text": "refund B2"})).json()
            review_id = reply["reviews"][0]["id"]
            state = (await client.get("/sessions/v")).json()
            assert [r["id"] for r in state["pending_reviews"]] == [review_id]
            async with client.stream(
                "POST", f"/sessions/v/reviews/{review_id}", json={"approve": True}, headers=SSE
            ) as r:
                got = await read_until(r, finished)
            types = [d["type"] for _, d in got]
            assert types[0] == "ReviewResolved"
            assert "ToolResult" in types
            assert got[-1][1]["message"]["content"] == "Refunded: order B2 refunded"


async def test_a_retried_review_answers_its_decision_again_and_refuses_the_other(
    serve: Serve,
) -> None:
    """A review resolved again with the same decision (a retry after a lost answer) is
    answered 200 with the turn's reply, as JSON, as an event stream's "reply" and on the
    WebSocket, and the tool ran once; the other decision is refused with 409
    ReviewResolvedError saying it was already approved, by which turn, and where to ask
    what became of that turn."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            reply = (await client.post("/sessions/rr/messages", json={"text": "refund D4"})).json()
            route = f"/sessions/rr/reviews/{reply['reviews'][0]['id']}"
            first = await client.post(route, json={"approve": True})
            again = await client.post(route, json={"approve": True})
            assert (first.status_code, again.status_code) == (200, 200)
            assert again.json() == first.json()
            assert first.json()["text"] == "Refunded: order D4 refunded"
            async with client.stream("POST", route, json={"approve": True}, headers=SSE) as r:
                assert r.status_code == 200
                [(_, streamed)] = await read_until(r, lambda d: d["type"] == "reply")
            assert streamed == {"type": "reply", **first.json()}
            denied = await client.post(route, json={"approve": False})
            assert denied.status_code == 409
            assert denied.json()["error"] == "ReviewResolvedError"
            assert "was already approved" in denied.json()["message"]
            assert first.json()["turn_id"] in denied.json()["message"]
            asked = f"ask GET /sessions/rr/turns/{first.json()['turn_id']}"
            assert asked in denied.json()["message"]  # (what became of that turn)
            ws_url = served.url.replace("http://", "ws://") + "/sessions/rr/ws"
            review_id = reply["reviews"][0]["id"]
            async with open_websocket(ws_url) as ws:
                await ws.send({"type": "review", "review_id": review_id, "approve": True})
                while (frame := await ws.receive())["type"] != "reply":
                    pass
                assert {k: v for k, v in frame.items() if k != "type"} == first.json()
                await ws.send({"type": "review", "review_id": review_id, "approve": False})
                while (frame := await ws.receive())["type"] != "error":
                    pass
                assert (frame["status"], frame["error"]) == (409, "ReviewResolvedError")
            history = (await client.get("/sessions/rr")).json()["messages"]
            assert [m["role"] for m in history].count("tool") == 1
        await wait_no_subscribers(served)


async def test_a_streamed_retry_of_a_turn_waiting_on_a_review_sends_its_review(
    serve: Serve,
) -> None:
    """A streamed message whose idempotency key joins a turn waiting on a review sends
    that turn's events up to its ReviewRequested at once, as the first request did."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            body = {"text": "refund C3", "idempotency_key": "k-c3"}
            seen = []
            for _ in range(2):
                async with client.stream(
                    "POST", "/sessions/rv/messages", json=body, headers=SSE
                ) as r:
                    seen.append(await read_until(r, lambda d: d["type"] == "ReviewRequested"))
            assert [d["type"] for _, d in seen[1]] == [d["type"] for _, d in seen[0]]
            assert seen[1][-1] == seen[0][-1]  # the same review, with the same seq


async def test_a_resume_seq_is_read_whatever_its_leading_zeros_and_length(serve: Serve) -> None:
    """``?after=`` (as Last-Event-ID) is a seq in ASCII digits: with leading zeros it is
    the seq they lead (resumed after it); past 20 digits it is past every seq, 410, as
    a 20-digit one is."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            await client.post("/sessions/z/messages", json={"text": "one two"})
            last = (await client.get("/sessions/z")).json()["event_seq"]
            padded = str(last - 1).rjust(30, "0")
            async with client.stream("GET", "/sessions/z/events", params={"after": padded}) as r:
                assert r.status_code == 200, await r.aread()
                [(seq, _)] = await SSEReader(r).until(lambda d: True)
            assert seq == last
            for digits in ("9" * 20, "9" * 23):
                r = await client.get("/sessions/z/events", params={"after": digits})
                assert (r.status_code, r.json()["error"]) == (410, "EventsExpiredError"), r.text


async def test_the_websocket_carries_events_and_takes_messages(serve: Serve) -> None:
    """A WebSocket gets the session's events in their JSON form and takes messages and
    cancels; bad frames get error frames, and the connection lives on."""
    async with serve() as served:
        ws_url = served.url.replace("http://", "ws://") + "/sessions/w/ws"
        with trio.fail_after(10):
            async with open_websocket(ws_url) as ws:
                await ws.send("not json")
                error = await ws.receive()
                assert (error["type"], error["status"]) == ("error", 422)
                assert error["error"] == "InvalidJSON"
                assert error["session_id"] == "w"
                await ws.send({"type": "message", "text": "over the socket"})
                frames = []
                while not frames or frames[-1]["type"] != "TurnFinished":
                    frames.append(await ws.receive())
                assert frames[0]["type"] == "submitted"
                events = [f for f in frames if "seq" in f]
                assert "".join(e["text"] for e in events if e["type"] == "Delta") == (
                    "over the socket"
                )
                await ws.send({"type": "cancel"})
                while (frame := await ws.receive())["type"] != "cancelled":
                    pass
                assert frame == {"type": "cancelled", "cancelled": False}
            await wait_no_subscribers(served)


async def test_the_websocket_of_an_unknown_session_is_closed_with_404(serve: Serve) -> None:
    """Without create_sessions, a WebSocket to an unknown session gets a 404 error frame and
    close code 4404; a wrong token gets 401 and 4401."""
    async with serve(create_sessions=False, token="t") as served:
        base = served.url.replace("http://", "ws://")
        with trio.fail_after(10):
            for path, status in [
                ("/sessions/nope/ws?access_token=t", 404),
                ("/sessions/x/ws", 401),
            ]:
                async with open_websocket(base + path) as ws:
                    error = await ws.receive()
                    assert error["status"] == status
                    with pytest.raises(Closed) as closed:
                        await ws.receive()
                    assert closed.value.code == 4000 + status


async def test_a_draining_app_ends_streams_and_answers_503(serve: Serve) -> None:
    """``drain()`` ends open event streams at once; later requests answer 503."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(10):
            await client.post("/sessions/z/messages", json={"text": "hi"})
            async with client.stream("GET", "/sessions/z/events") as r:
                lines = r.aiter_lines()
                assert await lines.__anext__() == "retry: 1000"  # the stream is open
                served.app.drain()
                rest = [line async for line in lines]  # and it ends
            assert ": heartbeat" not in rest
            r = await client.get("/sessions/z")
            assert r.status_code == 503
            assert r.json()["error"] == "ShuttingDown"
            assert r.headers["retry-after"] == "1"


async def test_an_open_trio_registry_can_be_served_under_hypercorn() -> None:
    """``create_app(registry)`` serves a registry the caller opened in the same trio run."""
    async with sa.open_registry(agents=trio_agents()) as registry:
        app = create_app(registry)
        assert app.registry is registry
        async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                r = await client.post("/sessions/o/messages", json={"text": "mine"})
                assert r.json()["text"] == "mine"
        assert [m.content for m in await registry.ref("o").history()] == ["mine", "mine"]


async def test_a_trio_registry_served_by_asyncio_is_refused_with_a_clear_error() -> None:
    """A trio registry served by uvicorn answers 500 WrongLoop, saying what to use instead."""
    async with sa.open_registry(agents=trio_agents()) as registry:
        app = create_app(registry)
        async with serve_asyncio(app) as url, httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                r = await client.get("/sessions")
        assert r.status_code == 500
        assert r.json()["error"] == "WrongLoop"
        assert "sessionactors.aio.open_registry" in r.json()["message"]


def test_create_app_checks_its_arguments() -> None:
    """create_app takes a registry or registry options, not both and not neither."""
    with pytest.raises(TypeError, match="agents="):
        create_app()
    with pytest.raises(TypeError, match="not str"):
        create_app("registry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heartbeat"):
        create_app(agents=trio_agents(), heartbeat=0)


def test_event_to_json_is_the_documented_form() -> None:
    """An event's JSON form is its class name as "type", then its fields, records nested."""
    message = sa.Message.create(sa.Role.ASSISTANT, "hi")
    event = sa.TurnFinished(session_id="s", seq=7, turn_id="t", message=message)
    data = event_to_json(event)
    assert list(data)[:4] == ["type", "session_id", "seq", "turn_id"]
    assert data["type"] == "TurnFinished"
    assert data["message"]["role"] == "assistant"
    assert data["message"]["created_at"] == message.created_at.isoformat()
    assert json.loads(json.dumps(data)) == data
    status = event_to_json(sa.StatusChanged(session_id="s", seq=8, status=sa.Status.IDLE))
    assert status == {
        "type": "StatusChanged",
        "session_id": "s",
        "seq": 8,
        "status": "idle",
        "skipped_from": 0,
    }


async def test_an_open_asyncio_registry_can_be_served_under_uvicorn() -> None:
    """``create_app(registry)`` serves an aio registry opened on the loop that runs uvicorn."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def program() -> None:
        async with aio.open_registry(agents=asyncio_agents(delay=0.001)) as registry:
            app = create_app(registry)
            assert app.registry is registry
            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
            server = state["server"] = uvicorn.Server(config)
            serving = asyncio.ensure_future(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            state["port"] = server.servers[0].sockets[0].getsockname()[1]
            started.set()
            await serving
            state["history"] = [m.content for m in await registry.ref("o").history()]

    thread = threading.Thread(target=asyncio.run, args=(program(),))
    thread.start()
    try:
        with trio.fail_after(10):
            await trio.to_thread.run_sync(started.wait, abandon_on_cancel=True)
            url = f"http://127.0.0.1:{state['port']}"
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/sessions/o/messages", json={"text": "mine too"})
                assert r.json()["text"] == "mine too"
    finally:
        if "server" in state:
            state["server"].should_exit = True
        await trio.to_thread.run_sync(thread.join)
    assert state["history"] == ["mine too", "mine too"]


async def test_a_follower_of_a_session_whose_wake_fails_gets_an_error_frame() -> None:
    """A client following a hibernated session's events (which does not wake it), when
    a message's wake of the session fails in the store: the message is answered 503,
    and the follower's stream ends with an error frame naming the session (to reconnect
    from its Last-Event-ID once the store is back), not cut off without a word."""
    stored = sa.MemoryStore()
    agents = trio_agents()
    async with sa.open_registry(store=stored, agents=agents) as registry:
        await (await registry.spawn("f")).send("hello")
    store = FaultyStore(stored)
    app = create_app(store=store, agents=agents)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            async with client.stream("GET", "/sessions/f/events", headers=SSE) as events:
                assert events.status_code == 200
                store.fail("load", session_id="f")
                sent = await client.post("/sessions/f/messages", json={"text": "again"})
                assert sent.status_code == 503, sent.text
                got = await read_until(events, lambda d: d["type"] == "error")
            assert got[-1][1]["session_id"] == "f"
            assert "StoreError" in got[-1][1]["error"], got[-1]
            assert store.injected == 1
            # the store is back: the session wakes and answers
            sent = await client.post("/sessions/f/messages", json={"text": "again"})
            assert sent.status_code == 200, sent.text


async def test_a_message_whose_keyed_reply_an_edit_removed_answers_410() -> None:
    """A message whose idempotency key's turn ran but whose reply an edit then removed
    answers 410 ReplyRemovedError, as JSON and when streamed, naming the session, the key
    and the turn, and runs nothing."""
    store = sa.MemoryStore()
    agents = trio_agents()
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("k")
        first = await ref.send("only once", idempotency_key="k1")
        await ref.send("then this")
        await ref.truncate(2)
    app = create_app(store=store, agents=agents)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            body = {"text": "only once", "idempotency_key": "k1"}
            plain = await client.post("/sessions/k/messages", json=body)
            streamed = await client.post("/sessions/k/messages", json=body, headers=SSE)
            state = (await client.get("/sessions/k")).json()
    for answer in (plain, streamed):
        assert answer.status_code == 410, answer.text
        error = answer.json()
        assert error["error"] == "ReplyRemovedError"
        assert (error["session_id"], error["turn_id"]) == ("k", first.turn_id)
        assert error["idempotency_key"] == "k1"
        assert "'k1'" in error["message"]
        assert '"idempotency_key"' in error["message"]
    assert [m["content"] for m in state["messages"]] == ["then this", "then this"]


async def test_a_key_sent_again_with_other_words_answers_422() -> None:
    """A message whose idempotency key the session took for other words answers 422
    IdempotencyKeyReusedError (as JSON, when streamed, and as a WebSocket error frame)
    naming the session, the key and its turn, and runs nothing; the same words get the
    stored reply."""
    agents = trio_agents()
    app = create_app(store=sa.MemoryStore(), agents=agents)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            first = await client.post(
                "/sessions/p/messages", json={"text": "pay alice", "idempotency_key": "k1"}
            )
            assert first.status_code == 200, first.text
            body = {"text": "pay carol", "idempotency_key": "k1"}
            plain = await client.post("/sessions/p/messages", json=body)
            streamed = await client.post("/sessions/p/messages", json=body, headers=SSE)
            async with open_websocket(url.replace("http://", "ws://") + "/sessions/p/ws") as ws:
                await ws.send({"type": "message", **body})
                while (frame := await ws.receive())["type"] != "error":
                    pass
            again = await client.post(
                "/sessions/p/messages", json={"text": "pay alice", "idempotency_key": "k1"}
            )
            state = (await client.get("/sessions/p")).json()
    turn_id = first.json()["turn_id"]
    for error in (plain.json(), streamed.json(), frame):
        assert error["status"] == 422, error
        assert error["error"] == "IdempotencyKeyReusedError"
        assert (error["session_id"], error["turn_id"]) == ("p", turn_id)
        assert error["idempotency_key"] == "k1"
        assert "'k1'" in error["message"]
        assert '"idempotency_key"' in error["message"]
    assert (plain.status_code, streamed.status_code) == (422, 422)
    assert again.json()["turn_id"] == turn_id
    assert [m["content"] for m in state["messages"] if m["role"] == "user"] == ["pay alice"]


def _lifespan_apart(app: Any) -> Any:
    """``app`` with the server's lifespan events answered here: the test opens and
    closes the app's lifespan itself (as ``serve`` does, closing the registry while
    the requests in flight wait)."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    return asgi


@pytest.mark.parametrize("stream", [False, True], ids=["json", "events"])
async def test_a_first_message_in_flight_at_shutdown_is_answered_or_stores_nothing(
    tmp_path: Path, stream: bool
) -> None:
    """A first message whose session is being stored when the server shuts down (the
    drain and the registry's close begun, as serve begins them on a signal) has its
    turn accepted and answered; a first message that comes, or finishes its body,
    after the drain began is refused with 503 and stores nothing: no refused request
    leaves an empty session."""
    path = tmp_path / "s.db"
    store = FaultyStore(sa.SQLiteStore(path))
    created = store.hold("create", session_id="fresh", after=True)  # stored, told late
    app = create_app(store=store, agents=trio_agents(delay=0))
    leave = trio.Event()
    answers: dict[str, httpx.Response] = {}
    headers = {"accept": "text/event-stream"} if stream else {}
    body_gate = trio.Event()

    async def late_body() -> AsyncIterator[bytes]:
        yield b'{"text": '
        await body_gate.wait()
        yield b'"hello"}'

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def lifespan(task_status: trio.TaskStatus[None]) -> None:
                async with app.lifespan():
                    task_status.started()
                    await leave.wait()

            await nursery.start(lifespan)
            async with (
                serve_trio(_lifespan_apart(app)) as url,
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                trio.open_nursery() as requests,
            ):

                async def post(name: str, content: Any = None) -> None:
                    route = f"/sessions/{name}/messages"
                    if content is None:
                        sent = client.post(route, json={"text": "hello"}, headers=headers)
                    else:
                        sent = client.post(route, content=content, headers=headers)
                    answers[name] = await sent
                    await answers[name].aread()

                requests.start_soon(post, "fresh")
                requests.start_soon(post, "slow-body", late_body())
                while not created.waiting:
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()  # (the slow body is being read)
                app.drain()  # a signal: serve drains the app and closes its registry
                leave.set()
                await trio.testing.wait_all_tasks_blocked()
                created.open()
                body_gate.set()
    after = sa.SQLiteStore(path)
    try:
        assert answers["slow-body"].status_code == 503, answers["slow-body"].text
        assert not await after.exists("slow-body")
        assert answers["fresh"].status_code == 200, answers["fresh"].text
        state = await sa.read_session(after, "fresh")
        assert [m.content for m in state.messages] == ["hello", "hello"]
    finally:
        await after.aclose()


async def test_a_store_that_never_answers_fails_the_startup_instead_of_holding_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A store whose calls never return (a store of your own without timeouts, on a
    host that stopped answering) fails the lifespan's startup within its bound, with a
    StoreError saying so, instead of holding the server's startup for ever."""
    store = FaultyStore(sa.MemoryStore())
    store.hold("list_sessions")  # never opened
    app = create_app(store=store, agents=trio_agents(delay=0))
    start = trio.current_time()
    with trio.fail_after(3600), pytest.raises(sa.StoreError, match="did not answer") as info:
        async with app.lifespan():
            pytest.fail("started")  # pragma: no cover
    assert trio.current_time() - start < 600
    assert "bound its calls" in str(info.value)
