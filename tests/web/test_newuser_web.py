"""The gateway as a newcomer first serves it: inside an app of their own, in tests."""

import logging

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.routing import Mount

import sessionactors as sa
from sessionactors.http import create_app
from sessionactors.testing import FaultyStore

from .chat_agents import asyncio_agents, trio_agents
from .servers import serve_asyncio, serve_trio
from .wsclient import Closed, open_websocket


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_a_mounted_app_whose_lifespan_never_ran_says_so(kind: str) -> None:
    """create_app(agents=...) mounted inside another app gets no lifespan events, so it
    never opens its registry: its requests are answered 500 with a message that says
    why and what to do, not 503 "shutting down", which a client retries for ever."""
    trio_side = kind == "hypercorn-trio"
    gateway = create_app(agents=trio_agents(0.0) if trio_side else asyncio_agents(0.0))
    outer = Starlette(routes=[Mount("/api", gateway)])
    serve = serve_trio if trio_side else serve_asyncio
    async with serve(outer) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            r = await client.post("/api/sessions/ada/messages", json={"text": "hi"})
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["error"] == "NoRegistry"
    assert "lifespan" in body["message"]
    assert "create_app(registry)" in body["message"]
    assert "shutting down" not in body["message"]


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_an_app_serves_a_second_lifespan(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """One create_app(store=..., agents=...) app served again after its server stopped (as
    a test suite does with one module-level app, a TestClient per test) opens a new
    registry on the new loop, answers, and drains on the new loop (it answered 503
    "shutting down" for ever, and drain() reached for the first, closed loop)."""
    trio_side = kind == "hypercorn-trio"
    store = sa.MemoryStore()
    agents = trio_agents(0.0) if trio_side else asyncio_agents(0.0)
    app = create_app(store=store, agents=agents)
    serve = serve_trio if trio_side else serve_asyncio
    for run in range(2):
        with caplog.at_level(logging.ERROR):
            async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
                with trio.fail_after(20):
                    r = await client.post("/sessions/ada/messages", json={"text": f"run {run}"})
                assert r.status_code == 200, r.text
                assert r.json()["text"].strip() == f"run {run}"
                app.drain()  # from this thread, as a signal handler's: reaches this loop
                with trio.fail_after(20):
                    r = await client.get("/sessions/ada")
                assert r.status_code == 503, r.text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    state = await sa.read_session(store, "ada")
    assert [m.content.strip() for m in state.messages] == ["run 0", "run 0", "run 1", "run 1"]
    assert state.status is sa.Status.HIBERNATED


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_a_message_naming_another_agent_for_an_existing_session_is_409(kind: str) -> None:
    """POST /sessions/{name}/messages with an "agent" other than the existing session's
    answers 409 SessionExistsError naming both agents, and runs no turn."""
    trio_side = kind == "hypercorn-trio"
    [agent] = (trio_agents(0.0) if trio_side else asyncio_agents(0.0)).values()
    app = create_app(agents={"support": agent, "sales": agent})
    serve = serve_trio if trio_side else serve_asyncio
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            body = {"text": "hi", "agent": "support"}
            r = await client.post("/sessions/ada/messages", json=body)
            assert r.status_code == 200, r.text
            body = {"text": "again", "agent": "sales"}
            for headers in ({}, {"accept": "text/event-stream"}):
                r = await client.post("/sessions/ada/messages", json=body, headers=headers)
                assert r.status_code == 409, r.text
                assert r.json()["error"] == "SessionExistsError"
                assert "'support'" in r.json()["message"]
                assert "'sales'" in r.json()["message"]
            state = (await client.get("/sessions/ada")).json()
    assert state["agent"] == "support"
    assert len(state["messages"]) == 2


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_a_first_message_without_a_known_agent_says_what_to_send(kind: str) -> None:
    """A first message that names no agent (the server has several) or one the server does
    not have answers 422 naming the session and the agents, and saying to send "agent"
    (not Python advice such as spawn(...) or open_registry(agents=...)); nothing is stored."""
    trio_side = kind == "hypercorn-trio"
    [agent] = (trio_agents(0.0) if trio_side else asyncio_agents(0.0)).values()
    app = create_app(agents={"support": agent, "sales": agent})
    serve = serve_trio if trio_side else serve_asyncio
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            for body in ({"text": "hi"}, {"text": "hi", "agent": "suport"}):
                for headers in ({}, {"accept": "text/event-stream"}):
                    r = await client.post("/sessions/ada/messages", json=body, headers=headers)
                    assert r.status_code == 422, r.text
                    answer = r.json()
                    assert answer["session_id"] == "ada"
                    assert "['sales', 'support']" in answer["message"]
                    assert '"agent"' in answer["message"]
                    assert "spawn(" not in answer["message"]
                    assert "open_registry" not in answer["message"]
            # a WebSocket, which creates its session as it connects: told to name the
            # agent in its URL (a message frame with "agent" is refused)
            base = url.replace("http://", "ws://")
            for query in ("", "?agent=suport"):
                async with open_websocket(f"{base}/sessions/ada/ws{query}") as ws:
                    error = await ws.receive()
                    with pytest.raises(Closed) as closed:
                        await ws.receive()
                assert (error["status"], closed.value.code) == (422, 4422), error
                assert "['sales', 'support']" in error["message"], error
                assert "?agent= on the WebSocket's URL" in error["message"], error
                assert "message's JSON" not in error["message"], error
            listed = (await client.get("/sessions")).json()
    assert listed["sessions"] == []


async def test_a_store_that_fails_for_a_moment_at_startup_does_not_stop_the_server() -> None:
    """The gateway's startup reads its store once; a store error a retry may fix (a store
    restarting as the server starts) is tried again, and the server then serves."""
    store = FaultyStore()
    store.fail("list_sessions", times=2, error=sa.StoreError("the store is restarting"))
    app = create_app(store=store, agents=trio_agents(0.0))
    async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            r = await client.post("/sessions/ada/messages", json={"text": "hi"})
    assert r.status_code == 200, r.text
    assert store.failures_left("list_sessions") == 0
