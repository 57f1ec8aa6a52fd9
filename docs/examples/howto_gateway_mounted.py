"""How-to: the gateway inside your own Starlette (or FastAPI) app, beside routes of your own."""

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

import sessionactors as sa
import sessionactors.aio
from sessionactors.http import create_app, event_to_json


class EchoModel:
    """An asyncio model: streams the user's words back."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for word in request.messages[-1].content.split(" "):
            await asyncio.sleep(0.01)
            yield sa.TextChunk(word + " ")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    agents = {"echo": sa.Agent(model=EchoModel())}
    store = sa.SQLiteStore("sessions.db")
    async with sessionactors.aio.open_registry(store=store, agents=agents) as registry:
        app.state.registry = registry
        app.state.gateway = create_app(registry, chat_page=False)
        yield  # serving; on shutdown every live session is hibernated to the store


async def gateway(scope: Scope, receive: Receive, send: Send) -> None:
    """The gateway over the registry that this lifespan opened (a mounted app gets no
    lifespan events of its own, so the app's lifespan opens the registry)."""
    await scope["app"].state.gateway(scope, receive, send)


async def ask(request: Request) -> StreamingResponse:
    """A route of your own: one turn's events as server-sent events, in the gateway's form."""
    registry: sessionactors.aio.Registry = request.app.state.registry
    ref = await registry.get_or_spawn(request.path_params["name"], metadata={"tenant": "acme"})
    text = (await request.json())["text"]

    async def events() -> AsyncIterator[str]:
        async with ref.stream(text) as stream:
            async for event in stream:
                yield f"id: {event.seq}\ndata: {json.dumps(event_to_json(event))}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(
    routes=[Route("/ask/{name}", ask, methods=["POST"]), Mount("/api", app=gateway)],
    lifespan=lifespan,
)


async def read_sse(response: httpx.Response) -> list[dict]:
    """The JSON of each SSE message of a response, to its end."""
    return [
        json.loads(line.removeprefix("data:"))
        async for line in response.aiter_lines()
        if line.startswith("data:")
    ]


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)  # a fresh directory: this run's sessions.db starts empty
        await serve_and_call()


async def serve_and_call() -> None:
    # What `uvicorn yourmodule:app` does, on a free port, so that this file can call itself.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        async with client.stream("POST", "/ask/ada", json={"text": "one two three"}) as r:
            events = await read_sse(r)
        print("own route:", [e["type"] for e in events])

        # The gateway's routes, under /api, on the same registry.
        body, sse = {"text": "four five"}, {"accept": "text/event-stream"}
        async with client.stream("POST", "/api/sessions/ada/messages", json=body, headers=sse) as r:
            events = await read_sse(r)
        print("gateway:", [e["type"] for e in events])
        state = (await client.get("/api/sessions/ada")).json()
        print("messages:", len(state["messages"]), "| metadata:", state["metadata"])
    server.should_exit = True
    await serving


if __name__ == "__main__":
    asyncio.run(main())
