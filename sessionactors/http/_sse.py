"""Server-sent events: framing, and one response that streams a session's events.

A stream is a subscription's events (read with a heartbeat deadline, which is
safe: a cancelled read loses no event), a ``select`` function that turns an
event into the JSON to send (or nothing) and says whether it is the last one,
and optionally a ``side`` coroutine (the turn's reply) whose failure ends the
stream with an error frame. The response watches for the client going away
and ends the stream when the app drains.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final

import anyio
import attrs

import sessionactors as sa

from ._json import dumps, error_json, event_to_json

if TYPE_CHECKING:
    from ._app import SessionsApp

__all__ = ["EventStreamResponse", "Stream", "error_frame", "event_frame", "frame"]

log = logging.getLogger("sessionactors.http")

Select = Callable[[sa.Event], tuple[dict[str, Any] | None, bool]]

#: How long (milliseconds) a browser's EventSource waits before it reconnects.
RETRY_MS: Final = 1000

HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # no buffering in a reverse proxy (nginx)
]


def frame(data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One SSE message: ``id:`` (when given) and one ``data:`` line of JSON."""
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"data: " + dumps(data) + b"\n\n"


def event_frame(event: sa.Event) -> bytes:
    """An event as SSE: its seq as ``id:``, its JSON form as ``data:``."""
    return frame(event_to_json(event), event.seq)


def error_frame(error: BaseException, status: int | None = None) -> bytes:
    """An error as SSE (no ``id:``): ``{"type": "error", ...}``."""
    return frame({"type": "error", **error_json(error, status=status)})


def select_all(event: sa.Event) -> tuple[dict[str, Any] | None, bool]:
    """Every event, never the last."""
    return event_to_json(event), False


@attrs.define(eq=False)
class Stream:
    """What an event-stream response sends (see the module docstring)."""

    events: AsyncIterator[sa.Event] | None
    select: Select = select_all
    prelude: Sequence[bytes] = ()
    side: Callable[[], Awaitable[None]] | None = None


@attrs.define(eq=False)
class _State:
    failure: BaseException | None = None
    waiting: anyio.CancelScope | None = None
    gone: bool = False  # the client disconnected


class EventStreamResponse:
    """An ASGI response: opens a :class:`Stream`, answers errors as JSON before the
    first byte and as error frames after it."""

    def __init__(
        self, app: SessionsApp, open_stream: Callable[[], AbstractAsyncContextManager[Stream]]
    ) -> None:
        self._app = app
        self._open = open_stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False
        try:
            async with self._open() as stream:
                await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
                started = True
                await self._run(stream, receive, send)
        except Exception as exc:
            if started:  # the stream already ended with what it could say
                log.warning("an event stream ended with %r", exc)
                return
            response = self._app.error_response(exc)
            await response(scope, receive, send)

    async def _run(self, stream: Stream, receive: Any, send: Any) -> None:
        state = _State()
        async with anyio.create_task_group() as group:
            self._app.track(group.cancel_scope)
            try:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            state.gone = True
                            group.cancel_scope.cancel()
                            return

                async def side(wait: Callable[[], Awaitable[None]]) -> None:
                    try:
                        await wait()
                    except Exception as exc:
                        state.failure = exc
                        if state.waiting is not None:
                            state.waiting.cancel()

                group.start_soon(watch)
                if stream.side is not None:
                    group.start_soon(side, stream.side)
                first = f"retry: {RETRY_MS}\n\n".encode() + b"".join(stream.prelude)
                await send({"type": "http.response.body", "body": first, "more_body": True})
                if stream.events is not None:
                    await self._forward(stream, stream.events, state, send)
                group.cancel_scope.cancel()
            finally:
                self._app.untrack(group.cancel_scope)
        if not state.gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _forward(
        self, stream: Stream, events: AsyncIterator[sa.Event], state: _State, send: Any
    ) -> None:
        heartbeat = self._app.heartbeat

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        while True:
            if state.failure is not None:
                await write(error_frame(state.failure))
                return
            event: sa.Event | None = None
            with anyio.CancelScope(deadline=anyio.current_time() + heartbeat) as waiting:
                state.waiting = waiting
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    return
                except sa.SubscriberLaggedError as exc:
                    # the client resumes with Last-Event-ID: the last seq it received
                    await write(error_frame(exc))
                    return
                finally:
                    state.waiting = None
            if event is None:
                if state.failure is None:
                    await write(b": heartbeat\n\n")
                continue
            data, last = stream.select(event)
            if data is not None:
                await write(frame(data, event.seq))
            if last:
                return
