"""The gateway as a FastAPI team adopts it: mounted in an app of their own, whose lifespan
is the gateway's, with routes of their own on its registry, under uvicorn and hypercorn.

FastAPI is not among the test dependencies; Starlette stands in for it: FastAPI's
``lifespan=`` and ``app.mount`` are Starlette's."""

import contextlib
import json
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

import sessionactors as sa
from redis_workers import open_worker
from sessionactors.http import SessionsApp, create_app, event_to_json
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, Scripted, ScriptedModel

from .chat_agents import asyncio_agents, trio_agents
from .servers import serve_asyncio, serve_trio

KINDS = ["hypercorn-trio", "uvicorn-asyncio"]


def own_route(gateway: SessionsApp) -> Route:
    """A route of the user's own that sends through ``gateway.registry``."""

    async def ask(request: Request) -> JSONResponse:
        registry: Any = gateway.registry
        ref = await registry.get_or_spawn(request.path_params["name"])
        reply = await ref.send((await request.json())["text"])
        return JSONResponse({"text": reply.text.strip(), "live": registry.live()})

    return Route("/ask/{name}", ask, methods=["POST"])


@pytest.mark.parametrize("form", ["lifespan=", "inside"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_mounted_gateway_runs_with_its_lifespan_given_to_the_outer_app(
    kind: str, form: str
) -> None:
    """create_app(store=..., agents=...) mounted in an app whose lifespan is
    gateway.lifespan (or enters it) serves its routes under the mount, the app's own
    routes reach the same registry as gateway.registry, and a second run of the app
    (a test client per test) opens a new registry over the same store."""
    trio_side = kind == "hypercorn-trio"
    store = sa.MemoryStore()
    gateway = create_app(store=store, agents=trio_agents(0.0) if trio_side else asyncio_agents(0.0))
    if form == "lifespan=":
        lifespan: Any = gateway.lifespan
    else:

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with gateway.lifespan(app):
                yield

    app = Starlette(routes=[own_route(gateway), Mount("/api", gateway)], lifespan=lifespan)
    serve = serve_trio if trio_side else serve_asyncio
    for run in range(2):
        async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(20):
                r = await client.post("/ask/ada", json={"text": f"own {run}"})
                assert r.status_code == 200, r.text
                assert r.json() == {"text": f"own {run}", "live": ["ada"]}
                r = await client.post("/api/sessions/ada/messages", json={"text": f"api {run}"})
                assert r.status_code == 200, r.text
                r = await client.get("/api/sessions/ada")
                assert r.status_code == 200, r.text
                assert len(r.json()["messages"]) == 4 * (run + 1)
    state = await sa.read_session(store, "ada")
    assert state.status is sa.Status.HIBERNATED
    assert [m.content.strip() for m in state.messages][::2] == ["own 0", "api 0", "own 1", "api 1"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_browser_leaving_an_own_sse_route_mid_turn_leaves_the_turn_stored(
    kind: str,
) -> None:
    """A route of the app's own that streams ``ref.stream(text)`` as SSE, whose client goes
    away after the first delta (the server cancels the handler), abandons only its wait:
    the turn runs to its end and is stored, and no subscription is left behind."""
    trio_side = kind == "hypercorn-trio"
    gateway = create_app(agents=trio_agents(0.02) if trio_side else asyncio_agents(0.02))

    async def ask(request: Request) -> StreamingResponse:
        registry: Any = gateway.registry
        ref = await registry.get_or_spawn(request.path_params["name"])
        text = request.query_params["text"]

        async def events() -> AsyncIterator[str]:
            async with ref.stream(text) as stream:
                async for event in stream:
                    yield f"id: {event.seq}\ndata: {json.dumps(event_to_json(event))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(
        routes=[Route("/ask/{name}", ask, methods=["POST"]), Mount("/api", gateway)],
        lifespan=gateway.lifespan,
    )
    text = " ".join(f"word{i}" for i in range(20))
    serve = serve_trio if trio_side else serve_asyncio
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            async with client.stream("POST", "/ask/ada", params={"text": text}) as r:
                async for line in r.aiter_lines():
                    if '"Delta"' in line:
                        break
            registry: Any = gateway.registry
            while registry.statistics().subscribers:
                await trio.sleep(0.01)
            while (await client.get("/api/sessions/ada")).json()["status"] != "idle":
                await trio.sleep(0.05)
            state = (await client.get("/api/sessions/ada")).json()
    assert [m["content"] for m in state["messages"]] == [text, text]
    assert [m["interrupted"] for m in state["messages"]] == [False, False]


async def test_the_gateway_lifespan_entered_twice_at_once_is_refused() -> None:
    """Entering a gateway's lifespan while it is open raises RuntimeError and leaves the
    open one serving; an app made with create_app(registry) has no lifespan (TypeError),
    and the mounted gateway's NoRegistry answer names gateway.lifespan."""
    gateway = create_app(agents=trio_agents(0.0))
    with trio.fail_after(10):
        async with gateway.lifespan(None):
            registry = gateway.registry
            assert isinstance(registry, sa.Registry)
            with pytest.raises(RuntimeError, match="already open"):
                async with gateway.lifespan(None):
                    pass  # pragma: no cover
            assert gateway.registry is registry
            ref = await registry.get_or_spawn("x")
            assert (await ref.send("still here")).text.strip() == "still here"
        async with gateway.lifespan(None):  # afterwards, again
            assert gateway.registry is not registry
    async with sa.open_registry(agents=trio_agents(0.0)) as registry:
        with pytest.raises(TypeError, match=r"make the app with create_app\(store="):
            create_app(registry).lifespan(None)

    outer = Starlette(routes=[Mount("/api", create_app(agents=trio_agents(0.0)))])
    async with serve_trio(outer) as url, httpx.AsyncClient(base_url=url) as client:
        with trio.fail_after(20):
            r = await client.get("/api/sessions")
    assert r.status_code == 500, r.text
    assert r.json()["error"] == "NoRegistry"
    assert "lifespan=gateway.lifespan" in r.json()["message"]


@pytest.mark.redis
async def test_two_workers_started_at_once_under_one_worker_id_do_not_both_run(
    redis_url: str,
) -> None:
    """Two registries opened at the same moment on one Redis under the same worker_id
    (``worker_id=socket.gethostname()`` under ``uvicorn --workers 2``) do not both run:
    one fails to open with StoreConfigurationError, and the other serves on."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    outcomes: list[str] = []
    tried = trio.Event()

    async def worker() -> None:
        store = RedisStore(redis_url, prefix=prefix)
        agents = {"echo": sa.Agent(model=EchoModel())}
        try:
            async with sa.open_registry(
                store=store, agents=agents, worker_id="web", lease_ttl=1.0
            ) as registry:
                outcomes.append("open")
                if len(outcomes) == 2:
                    tried.set()
                await tried.wait()
                ref = await registry.get_or_spawn("s")
                assert (await ref.send("still serving")).text == "still serving"
        except sa.StoreConfigurationError as exc:
            outcomes.append("refused" if "worker_id 'web'" in str(exc) else repr(exc))
            if len(outcomes) == 2:
                tried.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
            nursery.start_soon(worker)
    assert sorted(outcomes) == ["open", "refused"]


#: An app as a FastAPI team writes it, for ``uvicorn app_module:app --workers 2``: the
#: gateway mounted under /api and run by the app's lifespan, a route of its own on the
#: gateway's registry, on the RedisStore of $REDIS_URL; worker_id left at its default.
APP_MODULE = """
import asyncio, os
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient
import sessionactors as sa
from sessionactors.http import create_app
from sessionactors.stores import RedisStore


class Echo:
    async def stream(self, request):
        await asyncio.sleep(0.01)
        yield sa.TextChunk(request.messages[-1].content)


gateway = create_app(
    store=RedisStore(os.environ["REDIS_URL"], prefix=os.environ["PREFIX"]),
    agents={"echo": sa.Agent(model=Echo())},
    lease_ttl=3.0,
)


async def ask(request: Request) -> JSONResponse:
    registry = gateway.registry
    name = request.path_params["name"]
    ref = await registry.get_or_spawn(name)
    reply = await ref.send(request.query_params["text"])
    return JSONResponse({"pid": os.getpid(), "text": reply.text, "here": name in registry.live()})


app = Starlette(
    routes=[Route("/ask/{name}", ask, methods=["POST"]), Mount("/api", gateway)],
    lifespan=gateway.lifespan,
)
"""


@pytest.mark.redis
async def test_uvicorn_workers_processes_each_run_as_a_worker_and_reach_each_others_sessions(
    redis_url: str, tmp_path: Path
) -> None:
    """Under ``uvicorn app:app --workers 2`` (real processes) with the gateway's lifespan on
    a RedisStore and default worker ids, both processes start, a request to either one
    reaches a session live in the other, and SIGTERM hibernates every session."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    (tmp_path / "app_module.py").write_text(APP_MODULE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "REDIS_URL": redis_url, "PREFIX": prefix}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(tmp_path)])
    command = [sys.executable, "-m", "uvicorn", "app_module:app", "--workers", "2"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    command += ["--timeout-graceful-shutdown", "5"]
    log = (tmp_path / "uvicorn.log").open("wb")
    process = await trio.lowlevel.open_process(
        command, cwd=tmp_path, env=env, stdout=log, stderr=log
    )
    sent: dict[str, int] = {}
    try:
        served: dict[str, set[tuple[int, bool]]] = {}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"connection": "close"}
        ) as client:
            with trio.fail_after(60):
                while True:  # until both processes answer
                    try:
                        r = await client.get("/api/sessions")
                    except httpx.TransportError:
                        assert process.poll() is None, (tmp_path / "uvicorn.log").read_text()
                        await trio.sleep(0.1)
                        continue
                    assert r.status_code == 200, r.text
                    break
                for attempt in range(300):
                    name = f"s{attempt % 6}"
                    text = f"{name} {attempt}"
                    r = await client.post(f"/ask/{name}", params={"text": text})
                    assert r.status_code == 200, r.text
                    assert r.json()["text"] == text
                    sent[name] = sent.get(name, 0) + 1
                    served.setdefault(name, set()).add((r.json()["pid"], r.json()["here"]))
                    pids = {pid for ways in served.values() for pid, _ in ways}
                    elsewhere = {
                        name for name, ways in served.items() if (False in {h for _, h in ways})
                    }
                    if len(pids) == 2 and elsewhere and attempt >= 12:
                        break
                assert len(pids) == 2, served  # both processes served
                assert elsewhere, served  # a request reached a session live in the other
                r = await client.get(f"/api/sessions/{next(iter(elsewhere))}")
                assert r.status_code == 200, r.text
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            code = await process.wait()
        log.close()
    assert code == 0, (tmp_path / "uvicorn.log").read_text()
    store = RedisStore(redis_url, prefix=prefix)
    for name, count in sent.items():
        state = await sa.read_session(store, name)
        assert state.status is sa.Status.HIBERNATED, (name, state.status)
        assert len(state.messages) == 2 * count


def test_a_request_after_the_lifespan_ended_says_so_rather_than_retry() -> None:
    """A mounted gateway whose lifespan ran and ended (a test suite's ``with
    TestClient(app)`` in one test, a bare ``TestClient(app)`` in the next, which runs no
    lifespan) answers 500 NoRegistry saying its lifespan is not running, not 503
    "shutting down; retry", which a client retries for ever."""
    gateway = create_app(store=sa.MemoryStore(), agents=asyncio_agents(0.0))
    app = Starlette(routes=[Mount("/api", gateway)], lifespan=gateway.lifespan)
    with TestClient(app) as client:
        r = client.post("/api/sessions/ada/messages", json={"text": "hi"})
        assert r.status_code == 200, r.text
    r = TestClient(app).get("/api/sessions")
    assert r.status_code == 500, r.text
    assert r.json()["error"] == "NoRegistry"
    assert "lifespan" in r.json()["message"]
    assert "with TestClient(app)" in r.json()["message"]
    with TestClient(app) as client:  # and a lifespan again serves again
        assert client.get("/api/sessions/ada").status_code == 200


@pytest.mark.redis
async def test_a_keyed_stream_through_another_worker_joins_its_turn_from_its_start(
    redis_url: str,
) -> None:
    """ref.stream(text, idempotency_key=k) made on a worker that does not run the session,
    while the turn of key k runs on the worker that does (a browser's retry reaching the
    other uvicorn process), follows that turn from its TurnStarted, every delta included,
    as it does on the session's own worker; no second turn runs."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    words = [f"w{i}" for i in range(40)]
    gate = trio.Event()  # the turn on a waits here after 3 deltas, until b's stream joined
    scripts = {
        "a": ScriptedModel([Scripted(text=" ".join(words), wait=gate, wait_after=3)]),
        "b": ScriptedModel([]),  # (the turn never runs on b)
    }

    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", scripts["a"], lease_ttl=2.0) as a,
            open_worker(redis_url, prefix, "b", scripts["b"], lease_ttl=2.0) as b,
        ):
            await a.spawn("s")
            async with a.ref("s").subscribe() as seen:
                await a.ref("s").submit("go", idempotency_key="k")
                deltas = 0
                async for event in seen:
                    deltas += isinstance(event, sa.Delta)
                    if deltas == 3:
                        break
            assert a.live() == ["s"]
            assert b.live() == []
            got: list[sa.Event] = []
            async with b.ref("s").stream("go", idempotency_key="k") as events:
                gate.set()  # joined: the turn goes on
                async for event in events:
                    got.append(event)
            history = await b.ref("s").history()
    assert isinstance(got[0], sa.TurnStarted), [(type(e).__name__, e.seq) for e in got[:6]]
    assert "".join(e.text for e in got if isinstance(e, sa.Delta)).split() == words
    assert isinstance(got[-1], sa.TurnFinished)
    assert [m.content.strip() for m in history] == ["go", " ".join(words)]


@pytest.mark.redis
async def test_a_resume_through_another_worker_replays_the_deltas_its_owner_holds(
    redis_url: str,
) -> None:
    """subscribe(after=seq) on a worker that does not run the session (a browser's
    Last-Event-ID reaching the other uvicorn process) replays every event after seq that
    the owner still holds, deltas included, without a gap, as on the owner itself."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(40))

    model = EchoModel(delay=0.02)
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", model, lease_ttl=2.0) as a,
            open_worker(redis_url, prefix, "b", model, lease_ttl=2.0) as b,
        ):
            await a.spawn("s")
            async with a.ref("s").subscribe() as seen:
                await a.ref("s").submit(text)
                last = 0
                async for event in seen:
                    last = event.seq
                    if isinstance(event, sa.Delta):
                        break
                deltas = 0
                async for event in seen:  # the owner goes on, past what b's stream holds
                    deltas += isinstance(event, sa.Delta)
                    if deltas == 5:
                        break
            seqs: list[int] = []
            async with b.ref("s").subscribe(after=last) as events:
                async for event in events:
                    seqs.append(event.seq)
                    if isinstance(event, sa.TurnFinished):
                        break
            assert b.live() == []
    assert seqs == list(range(last + 1, seqs[-1] + 1))


async def test_the_gateway_hands_out_no_registry_once_its_lifespan_ended() -> None:
    """After the gateway's lifespan ended, gateway.registry is None (no registry, as before
    the lifespan), not the registry it closed; a new lifespan gives a new one."""
    gateway = create_app(agents=trio_agents(0.0))
    assert gateway.registry is None
    with trio.fail_after(10):
        async with gateway.lifespan(None):
            registry = gateway.registry
            assert isinstance(registry, sa.Registry)
            await (await registry.get_or_spawn("x")).send("hello")
        assert gateway.registry is None
        with pytest.raises(sa.SessionStoppedError, match="'x'"):
            await registry.ref("x").send("the closed registry refuses")
        async with gateway.lifespan(None):
            assert isinstance(gateway.registry, sa.Registry)
            assert gateway.registry is not registry
        assert gateway.registry is None
