"""A scriptable fake of an OpenAI-compatible chat completions server.

``FakeOpenAI`` is a plain ASGI app. A test queues :class:`Reply` values with
``push``; each request to the app takes the next one (or a 500 when the
script is exhausted) and is recorded in ``requests``. A reply can stall after
its chunks: the app then waits for the client to go away and records it in
``disconnects``.

``open_fake_openai`` serves the app with hypercorn's trio worker on a free
loopback port and sets its ``base_url``.
"""

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import trio

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]


@attrs.frozen
class Reply:
    """One scripted answer: a status, headers and body pieces sent one by one.

    ``stall`` keeps the response open after the pieces until the client
    disconnects; ``fail_after_pieces`` makes the app raise after sending them,
    which breaks the connection mid-response.
    """

    status: int = 200
    headers: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream"),)
    pieces: tuple[bytes, ...] = ()
    stall: bool = False
    fail_after_pieces: bool = False


@attrs.frozen
class RecordedRequest:
    """What the app received: method, path, headers (lower-case names) and JSON body."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


def sse(*payloads: Any, done: bool = True) -> tuple[bytes, ...]:
    """SSE pieces, one ``data:`` event per payload (JSON-encoded unless bytes)."""
    pieces = [
        p if isinstance(p, bytes) else b"data: " + json.dumps(p).encode() + b"\n\n"
        for p in payloads
    ]
    if done:
        pieces.append(b"data: [DONE]\n\n")
    return tuple(pieces)


def delta(**fields: Any) -> dict[str, Any]:
    """One streamed chat completion chunk whose first choice carries ``fields`` as delta."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": fields, "finish_reason": None}],
    }


def finish(reason: str = "stop") -> dict[str, Any]:
    """The last chunk of a completion, carrying its finish reason."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
    }


def text_reply(*texts: str) -> Reply:
    """A stream that answers with ``texts``, one chunk each, then finishes."""
    return Reply(pieces=sse(delta(role="assistant"), *(delta(content=t) for t in texts), finish()))


def error_reply(status: int, message: str, *, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    """An error response with an OpenAI-style JSON body."""
    body = json.dumps({"error": {"message": message, "type": "error", "code": None}}).encode()
    return Reply(
        status=status,
        headers=(("content-type", "application/json"), *headers),
        pieces=(body,),
    )


@attrs.define(eq=False)
class FakeOpenAI:
    """The ASGI app: answers each request with the next scripted :class:`Reply`."""

    base_url: str = ""
    script: deque[Reply] = attrs.field(factory=deque)
    requests: list[RecordedRequest] = attrs.field(factory=list)
    #: the client address of each request: one per connection used
    clients: list[tuple[str, int]] = attrs.field(factory=list)
    disconnects: int = 0
    disconnected: trio.Event = attrs.field(factory=trio.Event)
    stalled: trio.Event = attrs.field(factory=trio.Event)

    def push(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order."""
        self.script.extend(replies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._record_disconnect()
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.clients.append(tuple(scope["client"]))
        self.requests.append(
            RecordedRequest(
                method=scope["method"],
                path=scope["path"],
                headers={k.decode().lower(): v.decode() for k, v in scope["headers"]},
                body=json.loads(body) if body else None,
            )
        )
        reply = self.script.popleft() if self.script else error_reply(500, "script exhausted")
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(k.encode(), v.encode()) for k, v in reply.headers],
            }
        )
        for piece in reply.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        if reply.fail_after_pieces:
            raise RuntimeError("scripted failure mid-response")
        if reply.stall:
            self.stalled.set()
            while (await receive())["type"] != "http.disconnect":
                pass
            self._record_disconnect()
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _record_disconnect(self) -> None:
        self.disconnects += 1
        self.disconnected.set()


@asynccontextmanager
async def open_fake_openai() -> AsyncIterator[FakeOpenAI]:
    """Serve a fresh :class:`FakeOpenAI` on loopback; its ``base_url`` ends in ``/v1``."""
    app = FakeOpenAI()
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(hypercorn.trio.serve, app, config)
        try:
            app.base_url = binds[0] + "/v1"
            yield app
        finally:
            nursery.cancel_scope.cancel()
