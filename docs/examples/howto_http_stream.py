"""How-to: serve one reply per HTTP request as server-sent events, with ref.stream."""

import json
from collections.abc import Awaitable, Callable

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel

Write = Callable[[bytes], Awaitable[None]]


def sse(event: sa.Event, kind: str, data: dict[str, object]) -> bytes:
    # The seq is the SSE id: a browser sends it back as Last-Event-ID when it reconnects.
    return f"id: {event.seq}\nevent: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def post_message(registry: sa.Registry, session_id: str, text: str, write: Write) -> None:
    """The body of ``POST /sessions/{session_id}/messages``: one turn, streamed."""
    ref = await registry.get_or_spawn(session_id)
    async with ref.stream(text) as events:
        async for event in events:
            if isinstance(event, sa.Delta):
                await write(sse(event, "delta", {"text": event.text}))
            elif isinstance(event, sa.TurnFinished):
                await write(sse(event, "done", {"text": event.message.content}))
            elif isinstance(event, sa.TurnFailed):
                # event.error is for the server's log (it may quote a database URL, a
                # provider's answer): the browser gets its kind, and its words only when
                # they are the library's own or marked public by the model's adapter
                told = event.error if event.error_public else "the turn failed"
                await write(sse(event, "error", {"kind": event.error_kind, "error": told}))
            elif isinstance(event, sa.TurnCancelled):
                await write(sse(event, "cancelled", {}))
    # The stream ends after the turn's outcome: the response is complete.


async def get_events(registry: sa.Registry, session_id: str, last_event_id: int, write: Write):
    """The body of ``GET /sessions/{session_id}/events`` with a Last-Event-ID header."""
    ref = registry.ref(session_id)
    async with ref.subscribe(after=last_event_id) as events:
        async for event in events:
            if isinstance(event, sa.Delta):
                await write(sse(event, "delta", {"text": event.text}))
            elif isinstance(event, sa.TurnFinished):
                await write(sse(event, "done", {"text": event.message.content}))
                return


async def main() -> None:
    agent = sa.Agent(model=EchoModel(delay=0.01))
    async with sa.open_registry(agents={"echo": agent}) as registry:
        # A request whose client reads the whole response.
        body: list[bytes] = []

        async def write(chunk: bytes) -> None:
            body.append(chunk)

        await post_message(registry, "web-1", "hello from the browser", write)
        print("events sent:", len(body))
        print("last event:", body[-1].decode().splitlines()[1])

        # A client that goes away after two events: the web server cancels the handler.
        # Only the wait is abandoned: the turn runs on and its reply is kept.
        sent: list[bytes] = []

        async def write_then_disconnect(chunk: bytes) -> None:
            sent.append(chunk)
            if len(sent) == 2:
                raise trio.BrokenResourceError("client disconnected")

        try:
            await post_message(
                registry, "web-1", "a reply nobody reads to the end", write_then_disconnect
            )
        except trio.BrokenResourceError:
            print("client gone after", len(sent), "events")
        last_id = int(sent[-1].decode().split("\n")[0].removeprefix("id: "))

        # It reconnects with Last-Event-ID and gets the rest of the same turn.
        rest: list[bytes] = []

        async def write_rest(chunk: bytes) -> None:
            rest.append(chunk)

        await get_events(registry, "web-1", last_id, write_rest)
        print("after reconnecting:", rest[-1].decode().splitlines()[1])
        history = await registry.ref("web-1").history()
        print("assistant kept:", history[-1].content)


if __name__ == "__main__":
    trio.run(main)
