"""How-to: serve the HTTP gateway under uvicorn; the app opens the registry in its lifespan."""

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator

import httpx
import uvicorn

import sessionactors as sa
from sessionactors.http import create_app


class EchoModel:
    """An asyncio model: streams the user's words back."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for word in request.messages[-1].content.split(" "):
            await asyncio.sleep(0.01)
            yield sa.TextChunk(word + " ")


# What `uvicorn app:app` would serve: the app opens the registry on uvicorn's asyncio
# loop when the server starts, and hibernates every session when it stops.
app = create_app(
    store=sa.SQLiteStore("sessions.db"),
    agents={"echo": sa.Agent(model=EchoModel())},
    idle_timeout=300,
)


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)  # a fresh directory: this run's sessions.db starts empty
        await serve_and_call()


async def serve_and_call() -> None:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        r = await client.post("/sessions/grace/messages", json={"text": "served by uvicorn"})
        print("reply:", r.json()["text"].strip())
        listed = (await client.get("/sessions")).json()
        print("sessions:", [s["session_id"] for s in listed["sessions"]])
        r = await client.post("/sessions/grace/messages", json={"text": 42})
        print("bad input:", r.status_code, r.json()["message"])
    server.should_exit = True
    await serving


if __name__ == "__main__":
    asyncio.run(main())
