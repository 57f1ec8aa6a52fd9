"""Edges of the HTTP gateway and of sessionactors.aio, as a demanding client or an
attacker hits them: each test pins one promise (bad input is refused before anything is
written, a resume never skips events, the asyncio face answers with clear errors)."""

import asyncio
import contextlib
import datetime
import json
import logging
import math
import re
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import attrs
import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.routing import Mount

import sessionactors as sa
import sessionactors.aio as aio
import sessionactors.testing
from durability_checks import die_mid_turn
from sessionactors.http import create_app
from sessionactors.stores import RedisStore, dump_info

from .chat_agents import asyncio_agents, trio_agents
from .servers import Serve, serve_asyncio, serve_trio
from .test_gateway import SSE, SSEReader, finished
from .wsclient import open_websocket


@pytest.mark.parametrize(
    "body",
    [
        b'{"text": "\\ud800 a lone surrogate"}',
        b'{"text": "x", "idempotency_key": ""}',
        b'{"text": "x", "idempotency_key": "' + b"k" * 2000 + b'"}',
        b'{"text": "x", "idempotency_key": "\\udc00"}',
        b'{"text": "' + b"a" * (1024 * 1024 + 1) + b'"}',
    ],
    ids=["surrogate-text", "empty-key", "long-key", "surrogate-key", "text-over-1MiB"],
)
async def test_a_refused_first_message_creates_no_session(serve: Serve, body: bytes) -> None:
    """A first message that is refused as bad input (422) leaves nothing behind: the name
    is not created, not listed, and a read of it still answers 404."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            for accept in ({}, SSE):
                r = await client.post(
                    "/sessions/fresh/messages",
                    content=body,
                    headers={"content-type": "application/json", **accept},
                )
                assert r.status_code == 422, r.text
                assert r.json()["session_id"] == "fresh"
                assert "'fresh'" in r.json()["message"]
                r = await client.get("/sessions/fresh")
                assert r.status_code == 404, r.text
                assert (await client.get("/sessions")).json()["sessions"] == []


async def test_a_websocket_frame_refused_as_bad_input_is_told_as_the_http_route_tells_it(
    serve: Serve,
) -> None:
    """A message frame whose text or key the library refuses as bad input (an empty or
    over-long key, text over 1 MiB) gets the error frame the HTTP route answers with:
    InvalidRequest, 422, naming the session; the socket goes on."""
    bad = [
        {"text": "x", "idempotency_key": ""},
        {"text": "x", "idempotency_key": "k" * 2000},
        {"text": "a" * (1024 * 1024 + 1)},
    ]
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        ws_url = served.url.replace("http://", "ws://")
        with trio.fail_after(20):
            await client.post("/sessions/w/messages", json={"text": "hi"})
            async with open_websocket(f"{ws_url}/sessions/w/ws") as ws:
                for fields in bad:
                    await ws.send({"type": "message", **fields})
                    frame = await ws.receive()
                    while frame["type"] != "error":
                        frame = await ws.receive()
                    assert (frame["error"], frame["status"]) == ("InvalidRequest", 422), frame
                    assert "'w'" in frame["message"], frame
                await ws.send({"type": "message", "text": "still open"})
                frame = await ws.receive()
                while frame["type"] != "submitted":
                    frame = await ws.receive()


async def test_a_last_event_id_beyond_the_session_is_not_a_silent_stream(serve: Serve) -> None:
    """A client resuming with a Last-Event-ID the session never reached (the id came from
    a deleted session of the same name, which the chat page recreates) must not get a
    stream that silently drops the session's events: it gets a JSON error telling it to
    reload (as an expired id does), or the events."""
    async with serve(delay=0.01) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            for text in ("one two three", "four five six"):
                await client.post("/sessions/n/messages", json={"text": text})
            old_seq = (await client.get("/sessions/n")).json()["event_seq"]
            assert (await client.delete("/sessions/n")).status_code == 200
            await client.post("/sessions/n/messages", json={"text": "a new conversation"})

            for headers, params in [({"last-event-id": str(old_seq)}, {}), ({}, {"after": 10**30})]:
                got: list[tuple[int | None, dict[str, Any]]] = []
                async with client.stream(
                    "GET", "/sessions/n/events", headers=headers, params=params
                ) as r:
                    if r.status_code == 200:
                        async with trio.open_nursery() as nursery:

                            async def read(r: httpx.Response = r, got: list[Any] = got) -> None:
                                got.extend(await SSEReader(r).until(finished))
                                nursery.cancel_scope.cancel()

                            nursery.start_soon(read)
                            await client.post("/sessions/n/messages", json={"text": "hello?"})
                            with trio.move_on_after(2):
                                await trio.sleep_forever()
                            nursery.cancel_scope.cancel()
                        assert got, "the stream sent nothing of the turn that just ran"
                        assert got[-1][1]["message"]["content"] == "hello?"
                    else:
                        await r.aread()
                        assert r.status_code in (409, 410, 422), r.text
                        assert r.json()["session_id"] == "n"

            # a WebSocket resuming after a seq of a name that does not exist (any more)
            # is refused, and creates nothing
            ws_url = served.url.replace("http://", "ws://") + f"/sessions/gone/ws?after={old_seq}"
            async with open_websocket(ws_url) as ws:
                error = await ws.receive()
                assert error["type"] == "error"
                assert error["status"] in (404, 410), error
            assert (await client.get("/sessions/gone")).status_code == 404


async def test_a_last_event_id_of_a_deleted_namesake_is_refused_once_passed(serve: Serve) -> None:
    """A browser resuming with the Last-Event-ID of a deleted session, after a session
    of the same name has gone past that seq, gets 410 (reload), not the new session's
    events from the middle of one of its turns."""
    async with serve(delay=0) as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(30):
            for text in ("one two three", "four five six"):
                await client.post("/sessions/n/messages", json={"text": text})
            old_seq = (await client.get("/sessions/n")).json()["event_seq"]
            assert (await client.delete("/sessions/n")).status_code == 200
            while (await client.get("/sessions/n")).json().get("event_seq", 0) <= old_seq + 5:
                r = await client.post("/sessions/n/messages", json={"text": "a new owner"})
                assert r.status_code == 200, r.text
            headers = {"last-event-id": str(old_seq)}
            async with client.stream("GET", "/sessions/n/events", headers=headers) as r:
                status = r.status_code
                if status != 200:
                    await r.aread()
            assert status == 410, "the stream went on with the new session's events"
            assert r.json()["session_id"] == "n"


async def test_a_resume_of_a_hibernated_session_does_not_wake_it() -> None:
    """Checking a Last-Event-ID against the session reads a hibernated session as
    stored: browsers reconnecting after a restart do not wake every session they
    follow (subscribing does not wake a session)."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=trio_agents()) as registry:
        ref = await registry.spawn("h")
        await ref.send("hello")
        last = (await ref.state()).event_seq
    app = create_app(store=store, agents=trio_agents())
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            headers = {"last-event-id": str(last)}
            async with client.stream("GET", "/sessions/h/events", headers=headers) as r:
                assert r.status_code == 200
                assert app.registry is not None
                assert app.registry.live() == []
            r = await client.get("/sessions/h/events", headers={"last-event-id": str(last + 1000)})
            assert r.status_code == 410, r.text


async def test_deeply_nested_json_is_bad_input_not_a_server_error(serve: Serve) -> None:
    """A body of deeply nested JSON arrays is refused as bad input (422), not a 500; a
    WebSocket frame of it gets an error frame and the connection lives on."""
    nested = "[" * 100_000 + "]" * 100_000
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            r = await client.post(
                "/sessions/deep/messages",
                content=b'{"text": ' + nested.encode() + b"}",
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "InvalidJSON"
            ws_url = served.url.replace("http://", "ws://") + "/sessions/deep/ws"
            async with open_websocket(ws_url) as ws:
                await ws.send(nested)
                error = await ws.receive()
                assert (error["type"], error["status"]) == ("error", 422), error
                await ws.send({"type": "message", "text": "still here"})
                frame = await ws.receive()
                while frame["type"] != "TurnFinished":
                    frame = await ws.receive()
                assert frame["message"]["content"] == "still here"


def test_a_call_from_another_event_loop_is_refused_before_it_runs() -> None:
    """An aio ref used from another thread's event loop (a worker thread, a second
    asyncio.run) is refused with a clear error that names the cause, and the request does
    not run: a caller told it failed must be able to retry without a second turn."""

    async def main() -> None:
        async with aio.open_registry(agents=asyncio_agents(delay=0.001)) as registry:
            ref = await registry.spawn("t")
            errors: list[BaseException] = []

            def elsewhere() -> None:
                async def use() -> None:
                    for attempt in (
                        lambda: ref.send("from another loop"),
                        lambda: ref.submit("submitted from another loop"),
                        lambda: ref.history(),
                    ):
                        try:
                            await attempt()
                        except Exception as exc:
                            errors.append(exc)
                    try:
                        ref.submit_nowait("nowait from another thread")
                    except Exception as exc:
                        errors.append(exc)

                asyncio.run(use())

            thread = threading.Thread(target=elsewhere)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # a request that slipped through would have run by now
            history = [m.content for m in await ref.history()]
            assert history == [], history
            assert len(errors) == 4, errors
            for error in errors:
                assert isinstance(error, RuntimeError), repr(error)
                assert "loop" in str(error)
                assert "attached to a different loop" not in str(error)

    async def bounded() -> None:
        async with asyncio.timeout(15):  # (before the fix, a nowait call could wedge it)
            await main()

    asyncio.run(bounded())


@pytest.mark.parametrize("another_open", [False, True], ids=["alone", "another-open"])
def test_a_closed_aio_registry_raises_session_stopped_like_the_trio_one(another_open: bool) -> None:
    """A ref or registry used after its block raises SessionStoppedError, as the trio
    registry's do, whether or not another registry still keeps the loop's trio run."""

    async def main() -> None:
        agents = asyncio_agents(delay=0.001)
        async with contextlib.AsyncExitStack() as stack:
            if another_open:
                await stack.enter_async_context(aio.open_registry(agents=agents))
            async with aio.open_registry(agents=agents) as registry:
                ref = await registry.spawn("c")
                await ref.send("hi")
            for call in (lambda: ref.send("late"), ref.history, lambda: registry.spawn("d")):
                with pytest.raises(sa.SessionStoppedError):
                    await call()
            with pytest.raises(sa.SessionStoppedError):
                async with ref.subscribe():
                    pass
            with pytest.raises(sa.SessionStoppedError):
                ref.submit_nowait("late")

    async def bounded() -> None:
        async with asyncio.timeout(15):
            await main()

    asyncio.run(bounded())


@pytest.mark.parametrize("another_open", [False, True], ids=["alone", "another-open"])
def test_a_done_aio_turn_answers_its_reply_after_the_block_like_the_trio_one(
    another_open: bool,
) -> None:
    """A turn whose outcome is known answers ``reply()`` after its registry's block, as a
    trio turn does: the reply (or the turn's error) is the caller's, not the run's."""

    async def main() -> None:
        agents = asyncio_agents(delay=0.001)
        async with contextlib.AsyncExitStack() as stack:
            if another_open:
                await stack.enter_async_context(aio.open_registry(agents=agents))
            async with aio.open_registry(agents=agents) as registry:
                ref = await registry.spawn("c")
                turn = await ref.submit("hi")
                first = await turn.reply()
                cancelled = await ref.submit("a long answer, word by word, to cut short")
                assert await ref.cancel()
                with pytest.raises(sa.TurnCancelledError):
                    await cancelled.reply()
            assert turn.done
            assert cancelled.done
            assert await turn.reply() == first
            with pytest.raises(sa.TurnCancelledError):
                await cancelled.reply()

    async def bounded() -> None:
        async with asyncio.timeout(15):
            await main()

    asyncio.run(bounded())


@pytest.mark.parametrize("denied", ["send", "cancel", "review"])
async def test_each_websocket_frame_is_authorized_as_its_own_action(
    serve: Serve, denied: str
) -> None:
    """An app that lets a client hold a WebSocket but not, say, approve reviews (a
    customer, not the staff) keeps that rule over the socket: a frame is authorized as
    the action it does ("send", "cancel", "review"); a refused one gets a 403 error frame,
    does nothing, and the socket lives on."""
    seen: list[tuple[str | None, str]] = []

    async def authorize(request: Any, name: str | None, action: str) -> bool:
        seen.append((name, action))
        return action != denied

    async def until_not_an_event(ws: Any) -> dict[str, Any]:
        frame: dict[str, Any] = await ws.receive()
        while "seq" in frame:
            frame = await ws.receive()
        return frame

    async with (
        serve(authorize=authorize) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        frames: dict[str, dict[str, Any]] = {
            "send": {"type": "message", "text": "hello"},
            "cancel": {"type": "cancel"},
        }
        with trio.fail_after(20):
            if denied == "review":  # a turn paused for a review of its refund
                r = await client.post("/sessions/w/messages", json={"text": "refund B7"})
                assert r.status_code == 200, r.text
                [pending] = (await client.get("/sessions/w")).json()["pending_reviews"]
                frames["review"] = {"type": "review", "review_id": pending["id"], "approve": True}
            async with open_websocket(
                served.url.replace("http://", "ws://") + "/sessions/w/ws"
            ) as ws:
                await ws.send(frames[denied])
                frame = await until_not_an_event(ws)
                assert (frame["type"], frame["status"], frame["error"]) == (
                    "error",
                    403,
                    "Forbidden",
                )
                await ws.send({"type": "nonsense"})  # the socket lives on
                assert (await until_not_an_event(ws))["status"] == 422
            state = (await client.get("/sessions/w")).json()
    assert ("w", denied) in seen
    if denied == "review":
        assert len(state["pending_reviews"]) == 1  # not approved
    if denied == "send":
        assert state["messages"] == []


async def test_a_stored_non_finite_float_is_answered_as_valid_json(serve: Serve) -> None:
    """Metadata stored with a NaN or an infinity (by an earlier version, or a store
    written by hand) is answered as null: every JSON answer stays valid JSON, which a
    browser's JSON.parse reads (``NaN`` is not JSON, and it broke the whole listing)."""
    store = sa.MemoryStore()
    now = datetime.datetime.now(datetime.UTC)
    metadata = {"score": math.nan, "range": [1.5, math.inf], "tier": "gold"}
    state = sa.SessionState(session_id="old", agent="shop", created_at=now, updated_at=now)
    state = attrs.evolve(state, metadata=metadata)
    info = sa.SessionInfo(
        session_id="old",
        agent="shop",
        status=sa.Status.HIBERNATED,
        message_count=0,
        updated_at=now,
        metadata=metadata,
    )
    await store.create("old", sa.dump_snapshot(state), dump_info(info))

    def strict(text: str) -> Any:
        def refuse(constant: str) -> None:
            raise ValueError(f"{constant} is not JSON")

        return json.loads(text, parse_constant=refuse)

    async with (
        serve(store=store) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(20):
            [listed] = strict((await client.get("/sessions")).text)["sessions"]
            shown = strict((await client.get("/sessions/old")).text)
    expected = {"score": None, "range": [1.5, None], "tier": "gold"}
    assert listed["metadata"] == expected
    assert shown["metadata"] == expected


async def test_a_last_event_id_inside_a_turn_that_died_with_its_process_is_410() -> None:
    """A browser resuming with the Last-Event-ID of a Delta of a turn whose process died
    (never stored) gets 410 with oldest_seq, whether the session woke already or not,
    instead of a stream that never ends that turn; its message says to reload the state
    with the route of a gateway mounted at /api (not ref.turn_outcome(...))."""
    store = sa.MemoryStore()
    death = await die_mid_turn(store)
    gateway = create_app(store=store, agents={"a": sa.Agent(model=sa.testing.EchoModel())})
    app = Starlette(routes=[Mount("/api", app=gateway)], lifespan=gateway.lifespan)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            for _ in range(2):  # the first request wakes the session
                headers = {"last-event-id": str(death.last)}
                r = await client.get("/api/sessions/s/events", headers=headers)
                assert r.status_code == 410, r.text
                assert r.json()["session_id"] == "s"
                assert r.json()["oldest_seq"] > death.last
                assert "GET /api/sessions/s" in http_advice(r.json())


async def test_an_unknown_body_field_is_refused_before_anything_runs(serve: Serve) -> None:
    """A body or WebSocket frame with a field the gateway does not know (a misspelled
    ``idempotencyKey``, whose retry would otherwise run the turn twice) is refused with
    422 (an error frame on the WebSocket) naming the field and the accepted ones, before
    anything is written: no session is created, no turn runs, no review is answered."""

    def refused(body: dict[str, Any], unknown: str, accepted: str) -> None:
        assert (body["status"], body["error"]) == (422, "InvalidRequest"), body
        assert repr(unknown) in body["message"], body
        assert repr(accepted) in body["message"], body

    misspelled = {"text": "only once", "idempotencyKey": "k1"}
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            for accept in ({}, SSE):  # a first message: nothing is created
                r = await client.post("/sessions/u/messages", json=misspelled, headers=accept)
                assert r.status_code == 422, r.text
                refused(r.json(), "idempotencyKey", "idempotency_key")
                assert r.json()["session_id"] == "u"
                assert (await client.get("/sessions/u")).status_code == 404
            reply = (await client.post("/sessions/u/messages", json={"text": "refund A1"})).json()
            [review] = reply["reviews"]
            for accept in ({}, SSE):  # to an existing session: no turn runs
                r = await client.post("/sessions/u/messages", json=misspelled, headers=accept)
                assert r.status_code == 422, r.text
            r = await client.post("/sessions/u/cancel", json={"turnId": "t"})
            assert r.status_code == 422, r.text
            refused(r.json(), "turnId", "turn_id")
            for accept in ({}, SSE):
                r = await client.post(
                    f"/sessions/u/reviews/{review['id']}",
                    json={"approve": True, "notes": "ok"},
                    headers=accept,
                )
                assert r.status_code == 422, r.text
                refused(r.json(), "notes", "note")

            ws_url = served.url.replace("http://", "ws://") + "/sessions/u/ws"
            async with open_websocket(ws_url) as ws:
                for frame, unknown, accepted in [
                    ({"type": "message", **misspelled}, "idempotencyKey", "idempotency_key"),
                    ({"type": "cancel", "turnId": "t"}, "turnId", "turn_id"),
                    (
                        {"type": "review", "review_id": review["id"], "approve": True, "x": 1},
                        "x",
                        "note",
                    ),
                ]:
                    await ws.send(frame)
                    error = await ws.receive()
                    assert error["type"] == "error", error
                    refused(error, unknown, accepted)
                    assert error["session_id"] == "u"
            state = (await client.get("/sessions/u")).json()
            assert [m["content"] for m in state["messages"]][:1] == ["refund A1"]
            assert "only once" not in [m["content"] for m in state["messages"]]
            assert [r["id"] for r in state["pending_reviews"]] == [review["id"]]


async def test_errors_repeat_only_the_start_of_a_long_client_value(serve: Serve) -> None:
    """An error answering a request with a long value from the client (a session name of
    5,000 bytes, an agent or review id or query value as long, many unknown fields)
    repeats at most its first characters and its length, in the message and the body's
    other fields, on every route and on the WebSocket."""
    long = "n" * 5000

    def short(r: httpx.Response | dict[str, Any], status: int) -> None:
        text = r.text if isinstance(r, httpx.Response) else json.dumps(r)
        body = r.json() if isinstance(r, httpx.Response) else r
        assert body["status"] == status, text
        assert "n" * 65 not in text, text[:300]
        assert re.search(r"\(5,0\d\d characters\)", body["message"]), body["message"][:300]

    async def deny(request: Any, name: str | None, action: str) -> bool:
        return action != "delete"

    async with (
        serve(authorize=deny) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(30):
            for method, path, kwargs, status in [
                ("POST", f"/sessions/{long}/messages", {"json": {"text": "hi"}}, 422),
                ("POST", f"/sessions/{long}/messages", {"json": {"text": 42}}, 422),
                ("POST", f"/sessions/{long}/messages", {"json": {"text": "hi", "x": 1}}, 422),
                ("POST", f"/sessions/{long}/messages", {"content": b'{"text": "\\ud800"}'}, 422),
                ("GET", f"/sessions/{long}", {}, 422),
                ("GET", f"/sessions/{long}/events", {}, 422),
                ("POST", f"/sessions/{long}/cancel", {}, 422),
                ("DELETE", f"/sessions/{long}", {}, 403),
                ("POST", "/sessions/s/messages", {"json": {"text": "hi", "agent": long}}, 422),
                ("POST", "/sessions/s/messages", {"json": {"text": "hi", long: 1}}, 422),
                ("GET", "/sessions", {"params": {"limit": long}}, 422),
                ("GET", "/sessions", {"params": {"after": long}}, 422),
                ("GET", "/sessions/s/events", {"headers": {"last-event-id": long}}, 422),
                ("GET", f"/no/{long}", {}, 404),
            ]:
                r = await client.request(method, path, **kwargs)
                assert r.status_code == status, (method, path[:80], r.text[:300])
                short(r, status)
            many = {"text": "hi", **{f"field-{i}": i for i in range(5000)}}
            r = await client.post("/sessions/s/messages", json=many)
            assert r.status_code == 422, r.text[:300]
            assert len(r.content) < 2000, r.text[:300]
            assert "field-4999" not in r.text

            assert (await client.get("/sessions")).json()["sessions"] == []
            await client.post("/sessions/s/messages", json={"text": "hi"})
            for accept in ({}, SSE):
                r = await client.post(
                    f"/sessions/s/reviews/{long}", json={"approve": True}, headers=accept
                )
                short(r, 404)

            base = served.url.replace("http://", "ws://")
            async with open_websocket(base + "/sessions/s/ws") as ws:
                await ws.send({"type": long})
                short(await ws.receive(), 422)
                await ws.send({"type": "review", "review_id": long, "approve": True})
                frame = await ws.receive()
                while "seq" in frame:
                    frame = await ws.receive()
                short(frame, 404)
            async with open_websocket(base + f"/sessions/{long}/ws") as ws:
                short(await ws.receive(), 422)
            async with open_websocket(base + f"/sessions/t/ws?agent={long}") as ws:
                short(await ws.receive(), 422)


#: Advice in an error message that only a Python caller can follow.
PYTHON_ADVICE = re.compile(
    r"\b(?:ref|registry|sa|turn|reply|state)\.\w|\bawait |async with|open_registry|"
    r"get_or_spawn|spawn\(|submit\(|(?<!\?)after=|idempotency_key="
)


def http_advice(body: dict[str, Any]) -> str:
    """``body``'s message, checked to hold no advice that only Python can follow."""
    message: str = body["message"]
    assert not PYTHON_ADVICE.search(message), message
    return message


@asynccontextmanager
async def mounted(kind: str, **options: Any) -> AsyncIterator[str]:
    """The gateway mounted at /api in a Starlette app (as the how-to's example does), on
    a real server; the server's base URL."""
    trio_side = kind == "hypercorn-trio"
    [agent] = (trio_agents(0.05) if trio_side else asyncio_agents(0.05)).values()
    gateway = create_app(agents={"shop": agent, "other": agent}, **options)
    app = Starlette(routes=[Mount("/api", app=gateway)], lifespan=gateway.lifespan)
    async with (serve_trio if trio_side else serve_asyncio)(app) as url:
        yield url


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_errors_of_a_mounted_gateway_give_advice_an_http_client_can_follow(
    kind: str,
) -> None:
    """The errors of a gateway mounted at /api tell an HTTP client what to do with routes
    under /api (which it can follow), never with Python calls (registry.spawn(...),
    ref.review(...), await ref.submit(...)) or paths without the mount."""
    async with (
        mounted(kind, mailbox_size=1) as url,
        httpx.AsyncClient(base_url=url + "/api") as client,
    ):
        with trio.fail_after(30):
            for method, path, kwargs in [
                ("GET", "/sessions/ghost", {}),
                ("GET", "/sessions/ghost/events", {}),
                ("POST", "/sessions/ghost/cancel", {}),
                ("POST", "/sessions/ghost/reviews/r1", {"json": {"approve": True}}),
            ]:
                r = await client.request(method, path, **kwargs)
                assert (r.status_code, r.json()["error"]) == (404, "SessionNotFoundError")
                assert "POST /api/sessions/ghost/messages" in http_advice(r.json()), path
            base = url.replace("http://", "ws://")
            async with open_websocket(base + "/api/sessions/ghost/ws?after=3") as ws:
                error = await ws.receive()
                assert "POST /api/sessions/ghost/messages" in http_advice(error)
            r = await client.get("/nowhere")
            assert "/api/sessions" in http_advice(r.json())
            r = await client.get("/sessions", params={"after": "ghost"})
            assert (r.status_code, r.json()["error"]) == (404, "SessionNotFoundError")
            assert "?after=" in http_advice(r.json())

            r = await client.post(
                "/sessions/ghost/messages", json={"text": "refund A7", "agent": "shop"}
            )
            assert r.status_code == 200, r.text  # (followed: the route exists)
            [review] = r.json()["reviews"]
            r = await client.post("/sessions/ghost/messages", json={"text": "hi", "agent": "other"})
            assert (r.status_code, r.json()["error"]) == (409, "SessionExistsError")
            assert '"agent"' in http_advice(r.json())
            r = await client.post("/sessions/ghost/messages", json={"text": "hello?"})
            assert (r.status_code, r.json()["error"]) == (409, "SessionBusyError")
            route = f"POST /api/sessions/ghost/reviews/{review['id']}"
            assert route in http_advice(r.json())
            for accept in ({}, SSE):
                r = await client.post(
                    "/sessions/ghost/reviews/nope", json={"approve": True}, headers=accept
                )
                assert (r.status_code, r.json()["error"]) == (404, "ReviewNotFoundError")
                assert "GET /api/sessions/ghost" in http_advice(r.json())
            r = await client.post(route.split(" /api")[1], json={"approve": True})
            assert r.json()["text"] == "Refunded: order A7 refunded"  # (followed)

            r = await client.get("/sessions/ghost/events", headers={"last-event-id": "999"})
            assert (r.status_code, r.json()["error"]) == (410, "EventsExpiredError")
            assert "GET /api/sessions/ghost" in http_advice(r.json())

            # a turn runs, one waits in the mailbox (of 1): the next is refused with 429
            async with trio.open_nursery() as nursery:

                async def stream(text: str, started: trio.Event, wait_for: str) -> None:
                    async with client.stream(
                        "POST", "/sessions/ghost/messages", json={"text": text}, headers=SSE
                    ) as r:
                        reader = SSEReader(r)
                        if wait_for != "headers":
                            await reader.until(lambda d: d["type"] == wait_for)
                        started.set()
                        await reader.until(finished)

                running, queued = trio.Event(), trio.Event()
                nursery.start_soon(stream, "one two three four five six seven", running, "Delta")
                await running.wait()
                nursery.start_soon(stream, "queued", queued, "headers")
                await queued.wait()
                r = await client.post("/sessions/ghost/messages", json={"text": "one too many"})
                assert (r.status_code, r.json()["error"]) == (429, "MailboxFullError")
                http_advice(r.json())


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_a_gateway_that_creates_no_sessions_does_not_advise_creating_one(kind: str) -> None:
    """With create_sessions=False, a request to an unknown session answers 404 without
    advice to create it by a message (which would answer 404 again) or in Python."""
    async with (
        mounted(kind, create_sessions=False) as url,
        httpx.AsyncClient(base_url=url + "/api") as client,
    ):
        with trio.fail_after(20):
            for method, path, kwargs in [
                ("GET", "/sessions/ghost", {}),
                ("GET", "/sessions/ghost/events", {}),
                ("POST", "/sessions/ghost/messages", {"json": {"text": "hi", "agent": "shop"}}),
            ]:
                r = await client.request(method, path, **kwargs)
                assert (r.status_code, r.json()["error"]) == (404, "SessionNotFoundError")
                assert "POST" not in http_advice(r.json()), path


async def test_advice_for_an_http_client_leaves_the_clients_own_values_as_sent() -> None:
    """A session whose name reads like advice (``spawn it afresh``, ``given as after=``)
    is named in the 404 as the client sent it; only the advice is told for HTTP."""
    app = create_app(agents=trio_agents())
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(10):
            for name in ["spawn it afresh", "given as after=", "x create it with registry.ref"]:
                r = await client.get("/sessions/" + quote(name, safe=""))
                assert r.json()["session_id"] == name
                assert r.json()["message"].startswith(f"session {name!r} does not exist; send")


async def test_a_gateway_over_a_registry_without_agents_gives_http_advice() -> None:
    """A first message naming no agent, to a gateway whose registry has no agents, is
    refused (422 ValueError) with advice an HTTP client can follow (send "agent")."""
    async with (
        sa.open_registry(store=sa.MemoryStore()) as registry,
        serve_trio(create_app(registry)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        with trio.fail_after(10):
            r = await client.post("/sessions/new/messages", json={"text": "hi"})
            assert (r.status_code, r.json()["error"]) == (422, "ValueError"), r.text
            assert '"agent"' in http_advice(r.json())


def test_a_gateway_over_a_closed_aio_registry_gives_http_advice() -> None:
    """A request to a gateway mounted at /api whose asyncio registry has closed answers
    503 SessionStoppedError (the server does not serve: the session is not stopped), with
    no advice about Python's ``async with`` block."""

    async def main() -> None:
        agents = asyncio_agents(delay=0.001)
        async with aio.open_registry(agents=agents) as registry:
            app = Starlette(routes=[Mount("/api", app=create_app(registry))])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for method, path, kwargs in [
                ("GET", "/api/sessions/s", {}),
                ("POST", "/api/sessions/s/messages", {"json": {"text": "hi"}}),
            ]:
                r = await client.request(method, path, **kwargs)
                assert (r.status_code, r.json()["error"]) == (503, "SessionStoppedError")
                http_advice(r.json())

    async def bounded() -> None:
        async with asyncio.timeout(15):
            await main()

    asyncio.run(bounded())


async def test_an_unknown_websocket_message_type_is_named_as_sent(serve: Serve) -> None:
    """A WebSocket frame whose "type" is not a string is refused naming the type sent."""
    async with serve(delay=0.01) as served:
        base = served.url.replace("http://", "ws://")
        with trio.fail_after(10):
            async with open_websocket(base + "/sessions/w/ws?agent=shop") as ws:
                await ws.send({"type": 5})
                error = await ws.receive()
                while error["type"] != "error":
                    error = await ws.receive()
                assert "unknown message type 5;" in error["message"]


async def test_lag_advice_names_the_route_that_resumes_after_a_seq() -> None:
    """A subscriber that falls behind is told to resume after its last seq as its route
    can: a turn's stream (POST .../messages, which reads no Last-Event-ID) with GET
    .../events under the mount, the WebSocket with ?after= (it reads no Last-Event-ID)."""
    gateway = create_app(agents={"a": sa.Agent(model=sa.testing.EchoModel())}, subscriber_buffer=1)
    app = Starlette(routes=[Mount("/api", app=gateway)], lifespan=gateway.lifespan)
    text = " ".join(["w"] * 300)
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url + "/api") as client:
        with trio.fail_after(30):
            error = None
            while error is None:  # (until a stream lags)
                r = await client.post("/sessions/s/messages", json={"text": text}, headers=SSE)
                for line in r.text.splitlines():
                    if line.startswith("data: ") and '"type":"error"' in line:
                        error = json.loads(line[6:])
            assert error["error"] == "SubscriberLaggedError"
            seq = error["last_seq"]
            assert f"GET /api/sessions/s/events with Last-Event-ID: {seq}" in http_advice(error)

            base = url.replace("http://", "ws://")
            error = None
            while error is None:
                async with open_websocket(base + "/api/sessions/w/ws?agent=a") as ws:
                    await ws.send({"type": "message", "text": text})
                    while True:
                        data = await ws.receive()
                        if data["type"] == "error" or data["type"] == "TurnFinished":
                            break
                    if data["type"] == "error":
                        error = data
            assert error["error"] == "SubscriberLaggedError"
            message = http_advice(error)
            assert f"?after={error['last_seq']}" in message
            assert "Last-Event-ID" not in message


async def test_a_subscriber_that_lags_is_told_409_and_no_server_failure_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscriber that falls behind gets its SubscriberLaggedError frame with status
    409, on a turn's event stream and on the WebSocket (it resumes after its last seq:
    nothing failed on the server), and the server logs no error for it."""
    gateway = create_app(agents={"a": sa.Agent(model=sa.testing.EchoModel())}, subscriber_buffer=1)
    text = " ".join(["w"] * 300)
    async with serve_trio(gateway) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(30):
            errors = []
            while not errors:  # (until a stream lags)
                r = await client.post("/sessions/s/messages", json={"text": text}, headers=SSE)
                errors = [
                    json.loads(line[6:])
                    for line in r.text.splitlines()
                    if line.startswith("data: ") and '"type":"error"' in line
                ]
            base = url.replace("http://", "ws://")
            while len(errors) < 2:
                async with open_websocket(base + "/sessions/w/ws?agent=a") as ws:
                    await ws.send({"type": "message", "text": text})
                    while True:
                        data = await ws.receive()
                        if data["type"] in ("error", "TurnFinished"):
                            break
                    if data["type"] == "error":
                        errors.append(data)
    assert [(e["error"], e["status"]) for e in errors] == [("SubscriberLaggedError", 409)] * 2
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [], [r.getMessage() for r in logged]


@pytest.mark.redis
async def test_an_error_raised_by_the_worker_that_runs_the_session_is_told_for_http(
    redis_url: str,
) -> None:
    """An error the session's owner raised (a pending review refusing a message) reaches a
    client of a gateway on another worker with the advice told for HTTP, its route and
    review id included, as an error raised where the gateway runs is."""
    store_options = {"prefix": f"sa-test:{uuid.uuid4().hex}", "balance": False}
    agents = trio_agents(0.01)
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=RedisStore(redis_url, **store_options), agents=agents) as a,
            sa.open_registry(store=RedisStore(redis_url, **store_options), agents=agents) as b,
        ):
            reply = await (await a.spawn("s")).send("refund A7")  # live on a, waiting
            [review] = reply.reviews
            async with serve_trio(create_app(b)) as url, httpx.AsyncClient(base_url=url) as c:
                r = await c.post("/sessions/s/messages", json={"text": "hi"})
                assert (r.status_code, r.json()["error"]) == (409, "SessionBusyError")
                assert f"POST /sessions/s/reviews/{review.id}" in http_advice(r.json())
            assert b.live() == []  # (it ran on a)


@pytest.mark.redis
async def test_a_last_event_id_past_64_bits_is_told_alike_by_every_worker(redis_url: str) -> None:
    """A Last-Event-ID or ``?after=`` of 20 digits (or more), past what the wire between
    workers carries, is answered 410 by a gateway on a worker that does not run the session, as
    by one on the worker that does: the session's last seq, named, and the advice to
    reload; a WebSocket is closed with that error."""
    store_options = {"prefix": f"sa-test:{uuid.uuid4().hex}", "balance": False}
    agents = trio_agents(0.01)
    seq = "9" * 20  # (above 2**64)
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=RedisStore(redis_url, **store_options), agents=agents) as a,
            sa.open_registry(store=RedisStore(redis_url, **store_options), agents=agents) as b,
        ):
            await (await a.spawn("s")).send("hello")
            last = (await a.ref("s").state()).event_seq
            told: list[dict[str, Any]] = []
            for registry in (a, b):
                async with (
                    serve_trio(create_app(registry)) as url,
                    httpx.AsyncClient(base_url=url) as client,
                ):
                    for options in (
                        {"headers": {"last-event-id": seq}},
                        {"params": {"after": seq}},
                        {"headers": {"last-event-id": seq + "999"}},  # (past any int of 20)
                    ):
                        r = await client.get("/sessions/s/events", **options)
                        assert r.status_code == 410, r.text
                        told.append(r.json())
                    ws_url = url.replace("http://", "ws://") + f"/sessions/s/ws?after={seq}"
                    async with open_websocket(ws_url) as ws:
                        error = await ws.receive()
                        told.append(error)
                        assert error["status"] == 410, error
            assert (a.live(), b.live()) == (["s"], [])
    for body in told:
        assert (body["error"], body["session_id"], body["oldest_seq"]) == (
            "EventsExpiredError",
            "s",
            last + 1,
        ), body
        assert f"after seq {seq}" in body["message"], body
    assert {body["message"] for body in told[4:]} == {body["message"] for body in told[:4]}
