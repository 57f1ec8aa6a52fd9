"""How-to: the gateway inside your own Starlette (or FastAPI) app, beside routes of your own."""

import asyncio
import json
import os
import tempfile
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route

import sessionactors as sa
import sessionactors.aio
from sessionactors.http import create_app, event_to_json


class EchoModel:
    """An asyncio model: streams the user's words back."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for word in request.messages[-1].content.split(" "):
            await asyncio.sleep(0.01)
            yield sa.TextChunk(word + " ")


# The gateway opens its registry (on the loop that serves the app) in its lifespan. A
# mounted app gets no lifespan events, so the outer app runs it: lifespan=gateway.lifespan
# (in FastAPI: app = FastAPI(lifespan=gateway.lifespan); app.mount("/api", gateway)).
gateway = create_app(
    store=sa.SQLiteStore("sessions.db"),
    agents={"echo": sa.Agent(model=EchoModel())},
    chat_page=False,
)


async def ask(request: Request) -> StreamingResponse | JSONResponse:
    """A route of your own: one turn's events as server-sent events, in the gateway's form."""
    registry = gateway.registry  # the registry that the lifespan opened
    assert isinstance(registry, sessionactors.aio.Registry)  # (served by asyncio: uvicorn)
    ref = await registry.get_or_spawn(request.path_params["name"], metadata={"tenant": "acme"})
    text = (await request.json())["text"]

    async def events() -> AsyncIterator[str]:
        async with ref.stream(text) as stream:
            yield ""  # entered: the turn is accepted
            try:
                async for event in stream:
                    yield f"id: {event.seq}\ndata: {json.dumps(event_to_json(event))}\n\n"
            except sa.SessionActorsError as exc:  # the response has begun: end it with a frame
                error = {"type": "error", "error": type(exc).__name__}  # (its text is the log's)
                yield f"data: {json.dumps(error)}\n\n"

    answer = events()
    try:
        await anext(answer)  # enter the stream here: what refuses the turn gets its status
    except (TypeError, ValueError) as exc:  # a text that is not a string, or is too long
        return JSONResponse({"error": str(exc)}, status_code=422)
    except sa.SessionNotFoundError as exc:  # deleted since get_or_spawn
        return JSONResponse({"error": str(exc)}, status_code=404)
    return StreamingResponse(answer, media_type="text/event-stream")


app = Starlette(
    routes=[Route("/ask/{name}", ask, methods=["POST"]), Mount("/api", app=gateway)],
    lifespan=gateway.lifespan,  # or, in a lifespan of yours: async with gateway.lifespan(app)
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
