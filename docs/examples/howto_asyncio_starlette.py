"""How-to: a Starlette (or FastAPI) app under uvicorn, with the registry opened in its lifespan."""

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import sessionactors as sa
import sessionactors.aio
from sessionactors.stores import Store


class EchoModel:
    """An asyncio model: streams the user's words back."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for word in request.messages[-1].content.split(" "):
            await asyncio.sleep(0.01)
            yield sa.TextChunk(word + " ")


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; ValueError if the body is not one."""
    body = await request.json()  # (json.JSONDecodeError is a ValueError)
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


async def send_message(request: Request) -> JSONResponse:
    registry: sessionactors.aio.Registry = request.app.state.registry
    name = request.path_params["name"]
    try:
        text = (await json_body(request)).get("text")
        # ref.stream checks the name and text when called (no I/O; not entered, it
        # sends nothing): bad input is answered before get_or_spawn stores a session
        registry.ref(name).stream(text)
    except (TypeError, ValueError) as exc:  # (a bad name too: sa.InvalidSessionNameError)
        return JSONResponse({"error": str(exc)}, status_code=422)
    ref = await registry.get_or_spawn(name)
    try:
        reply = await ref.send(text)
    except sa.SessionBusyError as exc:
        return JSONResponse({"error": str(exc)}, status_code=409)
    return JSONResponse({"text": reply.text.strip()})


async def stream_message(request: Request) -> StreamingResponse | JSONResponse:
    registry: sessionactors.aio.Registry = request.app.state.registry
    name = request.path_params["name"]
    try:
        body = await json_body(request)
        text, key = body.get("text"), body.get("idempotency_key")
        # ref.stream checks the text and key when called: bad input is answered here,
        # before the response starts and before get_or_spawn stores a session for it
        stream = registry.ref(name).stream(text, idempotency_key=key)
    except (TypeError, ValueError) as exc:  # (a bad name too: sa.InvalidSessionNameError)
        return JSONResponse({"error": str(exc)}, status_code=422)
    ref = await registry.get_or_spawn(name)

    async def words() -> AsyncIterator[str]:
        async with stream as events:
            yield ""  # entered: the turn is accepted (see below)
            # once the status line is out, what ends the turn otherwise is said in the
            # body, or a client takes a reply cut short for a whole one
            try:
                heard = False
                async for event in events:
                    heard = True
                    if isinstance(event, sa.Delta):
                        yield event.text
                    elif isinstance(event, sa.TurnFailed):  # (the model failed: its kind
                        yield f"\n[the turn failed: {event.error_kind}]\n"  # only; the
                    elif isinstance(event, sa.TurnCancelled):  # text is for the log)
                        yield "\n[the turn was cancelled]\n"
                if not heard:  # a retry of a key that completed runs nothing: its reply
                    yield (await ref.send(text, idempotency_key=key)).text
            except sa.SessionActorsError as exc:  # its session stopped, its worker died, ...
                yield f"\n[the turn did not finish: {type(exc).__name__}]\n"

    answer = words()
    try:
        # Enter the stream here, up to that first yield: a turn it refuses is answered
        # with its status. (In the body, its error would come after 200 went out.)
        await anext(answer)
    except sa.IdempotencyKeyReusedError as exc:  # the key came with another message
        return JSONResponse({"error": str(exc)}, status_code=422)
    except sa.SessionNotFoundError as exc:  # deleted since get_or_spawn
        return JSONResponse({"error": str(exc)}, status_code=404)
    except sa.SessionBusyError as exc:  # run by another process for now
        return JSONResponse({"error": str(exc)}, status_code=409)
    return StreamingResponse(answer, media_type="text/plain")


def create_app(
    *, store: Store | None = None, agents: Mapping[str, sa.Agent] | None = None
) -> Starlette:
    """The app; a test passes its own store and agents (a fake model, a FaultyStore)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with sessionactors.aio.open_registry(
            store=sa.SQLiteStore("sessions.db") if store is None else store,
            agents={"echo": sa.Agent(model=EchoModel())} if agents is None else agents,
        ) as registry:
            await registry.sessions(limit=1)  # a store this process cannot use fails the startup
            app.state.registry = registry
            yield  # serving; on shutdown every live session is hibernated to the store

    routes = [
        Route("/chat/{name}/messages", send_message, methods=["POST"]),
        Route("/chat/{name}/stream", stream_message, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


app = create_app()  # what `uvicorn yourmodule:app` serves


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)  # a fresh directory: this run's sessions.db starts empty
        await serve_and_call()


async def serve_and_call() -> None:
    # What `uvicorn app:app` does, on a free port, so that this file can call itself.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        r = await client.post("/chat/ada/messages", json={"text": "hello over HTTP"})
        print("reply:", r.json()["text"])
        body = {"text": "streamed word by word"}
        async with client.stream("POST", "/chat/ada/stream", json=body) as r:
            chunks = [chunk async for chunk in r.aiter_text()]
        print("streamed:", "".join(chunks).strip())
        r = await client.post("/chat/bob/stream", json={"text": 42})
        print("bad input:", r.status_code, r.json()["error"])
        r = await client.post("/chat/carol/messages", content=b"not JSON")
        print("not JSON:", r.status_code)
        body = {"text": "a keyed message", "idempotency_key": "k-1"}
        r = await client.post("/chat/ada/stream", json=body)
        r = await client.post("/chat/ada/stream", json=body)  # a retry: the same reply
        print("retried:", r.status_code, r.text.strip())
        r = await client.post("/chat/ada/stream", json={**body, "text": "another message"})
        print("key reused:", r.status_code, r.json()["error"].split(" (turn")[0])
    server.should_exit = True
    await serving

    # The lifespan closed the registry: the conversation is in the store.
    agents = {"echo": sa.Agent(model=EchoModel())}
    store = sa.SQLiteStore("sessions.db")
    async with sessionactors.aio.open_registry(store=store, agents=agents) as registry:
        history = await registry.ref("ada").history()
        print("after a restart:", len(history), "messages")
        print("sessions:", [info.session_id for info in await registry.sessions()])


if __name__ == "__main__":
    asyncio.run(main())
