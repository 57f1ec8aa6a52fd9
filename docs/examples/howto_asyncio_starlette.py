"""How-to: a Starlette (or FastAPI) app under uvicorn, with the registry opened in its lifespan."""

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Mapping

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


async def send_message(request: Request) -> JSONResponse:
    registry: sessionactors.aio.Registry = request.app.state.registry
    ref = await registry.get_or_spawn(request.path_params["name"])
    try:
        reply = await ref.send((await request.json())["text"])
    except sa.SessionBusyError as exc:
        return JSONResponse({"error": str(exc)}, status_code=409)
    return JSONResponse({"text": reply.text.strip()})


async def stream_message(request: Request) -> StreamingResponse | JSONResponse:
    registry: sessionactors.aio.Registry = request.app.state.registry
    name, text = request.path_params["name"], (await request.json()).get("text")
    try:
        # ref.stream checks the text when called: bad input is answered here, before
        # the response starts and before get_or_spawn stores a session for it
        stream = registry.ref(name).stream(text)
    except (TypeError, ValueError) as exc:  # (a bad name too: sa.InvalidSessionNameError)
        return JSONResponse({"error": str(exc)}, status_code=422)
    await registry.get_or_spawn(name)

    async def words() -> AsyncIterator[str]:
        # the status line goes out with the first words: what ends the turn otherwise is
        # said in the body, or a client takes a reply cut short for a whole one
        try:
            async with stream as events:
                async for event in events:
                    if isinstance(event, sa.Delta):
                        yield event.text
                    elif isinstance(event, sa.TurnFailed):  # (the model failed: its kind
                        yield f"\n[the turn failed: {event.error_kind}]\n"  # only; the
                    elif isinstance(event, sa.TurnCancelled):  # text is for the log)
                        yield "\n[the turn was cancelled]\n"
        except sa.SessionActorsError as exc:  # its session stopped, its worker died, ...
            yield f"\n[the turn did not finish: {type(exc).__name__}]\n"

    return StreamingResponse(words(), media_type="text/plain")


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
