"""How-to: serve sessions over HTTP with sessionactors.http, under hypercorn's trio worker."""

import contextlib
import functools
import json

import httpx
import hypercorn.config
import hypercorn.trio
import trio

import sessionactors as sa
from sessionactors.http import create_app
from sessionactors.testing import EchoModel

SSE = {"accept": "text/event-stream"}


async def read_events(response: httpx.Response, until: str) -> list[dict]:
    """The JSON of each SSE message up to the first of type ``until``, and the ids."""
    events = []
    async with contextlib.aclosing(response.aiter_lines()) as lines:
        async for line in lines:
            if line.startswith("data:"):
                events.append(json.loads(line.removeprefix("data:")))
                if events[-1]["type"] == until:
                    break
    return events


async def main() -> None:
    agent = sa.Agent(model=EchoModel(delay=0.01))
    async with sa.open_registry(agents={"echo": agent}) as registry:
        app = create_app(registry, token="s3cret")
        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]  # a free port; the real address comes back below
        config.accesslog = config.errorlog = None
        stop = trio.Event()
        serve = functools.partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait)
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve)
            headers = {"authorization": "Bearer s3cret"}
            async with httpx.AsyncClient(base_url=url, headers=headers) as client:
                # One message, answered as JSON once the turn is durable.
                r = await client.post("/sessions/ada/messages", json={"text": "hello over HTTP"})
                print("reply:", r.json()["text"])

                # The same, as that turn's events, streamed as they happen.
                body = {"text": "one two three"}
                async with client.stream(
                    "POST", "/sessions/ada/messages", json=body, headers=SSE
                ) as r:
                    events = await read_events(r, until="TurnFinished")
                print("events:", [e["type"] for e in events])

                # Resuming after a seq, as a browser does with Last-Event-ID.
                middle = events[1]["seq"]  # the first Delta
                resume = {**SSE, "last-event-id": str(middle)}
                async with client.stream("GET", "/sessions/ada/events", headers=resume) as r:
                    rest = await read_events(r, until="TurnFinished")
                print("after the first Delta:", [e["type"] for e in rest])

                # Errors are JSON with a status; without the token, 401.
                r = await client.get("/sessions/nobody")
                print("error:", r.status_code, r.json()["error"])
                r = await client.get("/sessions", headers={"authorization": ""})
                print("without the token:", r.status_code)
            stop.set()


if __name__ == "__main__":
    trio.run(main)
