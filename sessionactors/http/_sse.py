"""Server-sent events: framing, and one response that streams a session's events.

A stream is a subscription's events, a ``select`` function that turns an
event into the frame to send (or nothing) and says whether it is the last
one, and optionally a ``side`` coroutine (the turn's reply) whose failure
ends the stream with an error frame, and which may end it with a last frame
of its own. A failure of the events (a store's, or any other: a bug) ends the
stream with an error frame too, and a clean end of its body.

Two tasks serve it: a reader takes events from the subscription into a outbox
bounded in frames and in bytes, and a writer sends what the outbox holds in
body messages of up to 64 KB (``WRITE_BYTES``; a larger frame in pieces of
that size), so that events that arrive together leave in one socket write, and
a slow client's progress is seen piece by piece. A client that reads too
slowly fills the outbox, and the reader waits for room: a replay (read from
the store a page at a time) waits with it, holding no more than the outbox and
a page; live events fill the subscription's buffer meanwhile, and a client
that falls that far behind is ended like any lagging subscriber (it resumes
with Last-Event-ID). The writer sends a heartbeat comment when it has had
nothing to send for ``heartbeat`` seconds. The response also watches for the
client going away and ends when the app drains. A piece that the client takes
nothing of for two heartbeat intervals ends the stream and resets its
connection: the client stopped reading, or its network is gone. A client that
reads slowly but takes each piece within that time gets its stream, however
large its events.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

import anyio
import attrs

import sessionactors as sa

from .._hub import event_size
from ._json import dumps, event_to_json, failed_told
from ._sockets import WRITE_BYTES, WriteGuard


@attrs.frozen(kw_only=True)
class StreamHooks:
    """What a streaming response needs of its app: its answer to an error raised before
    the first byte (``error_response(error, scope)``, an ASGI response) and the JSON of
    one after it (``error_json(error, scope)``), drain tracking of the stream's scope,
    and the heartbeat interval."""

    error_response: Callable[[BaseException, Any], Any]
    error_json: Callable[[BaseException, Any], dict[str, Any]]
    track: Callable[[anyio.CancelScope], None]
    untrack: Callable[[anyio.CancelScope], None]
    heartbeat: float


__all__ = ["EventStreamResponse", "FrameCache", "Stream", "StreamHooks", "frame"]

log = logging.getLogger("sessionactors.http")

#: select(event) -> (the frame to send or None, whether it is the stream's last event)
Select = Callable[[sa.Event], tuple[bytes | None, bool]]

#: How long (milliseconds) a browser's EventSource waits before it reconnects.
RETRY_MS: Final = 1000

#: Frames an event stream holds for a client that reads slowly, and their bytes (one
#: frame may pass the byte bound: the reader waits for room before the next).
OUTBOX_FRAMES: Final = 256
OUTBOX_BYTES: Final = 1 << 20

#: Heartbeat intervals a write (of up to WRITE_BYTES; a larger one, this for each
#: WRITE_BYTES it carries) may wait on a client that takes nothing before the stream
#: ends and its connection is reset (a lagging client, as one whose subscription fell
#: behind: it resumes with Last-Event-ID).
STALL_HEARTBEATS: Final = 2

HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # no buffering in a reverse proxy (nginx)
]


def frame(data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One SSE message: ``id:`` (when given) and one ``data:`` line of JSON."""
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"data: " + dumps(data) + b"\n\n"


class FrameCache:
    """The SSE frame of each recent event, made once for all the clients that send it.

    Keyed by (session, seq) and checked by identity: a deleted session's namesake,
    whose seqs start again, never gets another event's frame. Bounded in frames and in
    bytes (the frames' and their events' texts): the oldest go first.
    """

    def __init__(self, size: int = 4096, max_bytes: int = 4 << 20) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._bytes = 0
        self._frames: dict[tuple[str, int], tuple[sa.Event, bytes]] = {}

    def __call__(self, event: sa.Event) -> bytes:
        key = (event.session_id, event.seq)
        frames = self._frames
        cached = frames.get(key)
        if cached is not None and cached[0] is event:
            return cached[1]
        data = frame(event_to_json(event), event.seq)
        if cached is not None:
            self._forget(key)
        frames[key] = (event, data)
        self._bytes += _cost(event, data)
        while len(frames) > self._size or (self._bytes > self._max_bytes and len(frames) > 1):
            self._forget(next(iter(frames)))  # the oldest
        return data

    def _forget(self, key: tuple[str, int]) -> None:
        event, data = self._frames.pop(key)
        self._bytes -= _cost(event, data)


def _cost(event: sa.Event, data: bytes) -> int:
    """What a cached frame holds: its bytes and its event's."""
    return len(data) + event_size(event)


@attrs.define(eq=False)
class Stream:
    """What an event-stream response sends (see the module docstring)."""

    events: AsyncIterator[sa.Event] | None
    select: Select | None = None
    prelude: Sequence[bytes] = ()
    side: Callable[[], Awaitable[bytes | None]] | None = None


class _Outbox:
    """Frames waiting for the writer; ``closed`` once the reader has put its last one."""

    def __init__(self, first: bytes) -> None:
        self.frames: list[bytes] = [first]
        self.size = len(first)
        self.closed = False
        self._filled = anyio.Event()
        self._emptied: anyio.Event | None = None

    def put(self, data: bytes) -> None:
        if not self.closed:
            self.frames.append(data)
            self.size += len(data)
            self._filled.set()

    def close(self, last: bytes | None = None) -> None:
        if self.closed:
            return
        if last is not None:
            self.frames.append(last)
            self.size += len(last)
        self.closed = True
        self._filled.set()

    async def wait_filled(self) -> None:
        await self._filled.wait()

    @property
    def full(self) -> bool:
        return len(self.frames) >= OUTBOX_FRAMES or self.size >= OUTBOX_BYTES

    def take(self) -> bytes:
        """The frames waiting, up to WRITE_BYTES (at least one), as one body."""
        frames = self.frames
        count = 0
        size = 0
        for piece in frames:
            if count and size + len(piece) > WRITE_BYTES:
                break
            count += 1
            size += len(piece)
        data = frames[0] if count == 1 else b"".join(frames[:count])
        del frames[:count]
        self.size -= size
        if not frames:
            self._filled = anyio.Event()
        if self._emptied is not None:
            self._emptied.set()
            self._emptied = None
        return data

    async def wait_room(self) -> None:
        while self.full:
            self._emptied = emptied = anyio.Event()
            await emptied.wait()


class EventStreamResponse:
    """An ASGI response: opens a :class:`Stream` of session ``session``'s events,
    answers errors as JSON before the first byte and as error frames after it."""

    def __init__(
        self,
        hooks: StreamHooks,
        session: str,
        open_stream: Callable[[], AbstractAsyncContextManager[Stream]],
    ) -> None:
        self._hooks = hooks
        self._session = session
        self._open = open_stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False
        try:
            async with self._open() as stream:
                await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
                started = True
                await self._run(stream, scope, receive, send)
        except Exception as exc:
            if started:  # the stream already ended with what it could say
                _log_cut(self._session, exc)
                return
            response = self._hooks.error_response(exc, scope)
            await response(scope, receive, send)

    async def _run(self, stream: Stream, scope: Any, receive: Any, send: Any) -> None:
        def error_frame(error: BaseException) -> bytes:
            """An error as SSE (no ``id:``): ``{"type": "error", ...}``; one that is not
            the library's (a bug, a store that raised what is not the library's) by its
            kind, logged whole."""
            error = _unwrapped(error)
            if isinstance(error, sa.SessionActorsError):
                return frame({"type": "error", **self._hooks.error_json(error, scope)})
            _log_cut(self._session, error)
            return _failed_frame(self._session, error)

        outbox = _Outbox(f"retry: {RETRY_MS}\n\n".encode() + b"".join(stream.prelude))
        gone = False
        writes = WriteGuard(scope, send, STALL_HEARTBEATS * self._hooks.heartbeat)
        async with anyio.create_task_group() as group:
            self._hooks.track(group.cancel_scope)
            try:
                group.start_soon(writes.guard, group.cancel_scope)

                async def watch() -> None:
                    nonlocal gone
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            gone = True
                            group.cancel_scope.cancel()
                            return

                async def side(wait: Callable[[], Awaitable[bytes | None]]) -> None:
                    try:
                        last = await wait()
                    except Exception as exc:
                        outbox.close(error_frame(exc))
                    else:
                        if last is not None:
                            outbox.close(last)

                group.start_soon(watch)
                if stream.side is not None:
                    group.start_soon(side, stream.side)
                if stream.events is not None and stream.select is not None:
                    group.start_soon(_read, stream.events, stream.select, outbox, error_frame)
                else:
                    outbox.close()
                await self._write(outbox, writes.send)
                group.cancel_scope.cancel()
            finally:
                self._hooks.untrack(group.cancel_scope)
        if writes.stalled:  # a client that takes nothing: its connection is reset
            log.warning(
                "session %r: an event stream's client took nothing of a write for %s s; ended it",
                self._session,
                writes.bound,
            )
        elif not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _write(self, outbox: _Outbox, send: Any) -> None:
        heartbeat = self._hooks.heartbeat
        while True:
            if outbox.frames:
                data = outbox.take()
                for start in range(0, len(data), WRITE_BYTES):  # (a large frame in pieces)
                    piece = data[start : start + WRITE_BYTES]  # (the whole: data itself)
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                continue
            if outbox.closed:
                return
            with anyio.move_on_after(heartbeat) as waiting:
                await outbox.wait_filled()
            if waiting.cancelled_caught:
                body = b": heartbeat\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": True})


def _log_cut(session: str, error: BaseException) -> None:
    """Log the failure that ended an event stream of ``session`` after its answer began
    (with an error frame, if it could still send one: its client resumes with
    Last-Event-ID), by its kind and message: one of the library's (a store's) in a line,
    any other (a bug) with its traceback, as the gateway logs a failed request."""
    error = _unwrapped(error)
    told = " ".join(str(error).split())
    what = f"{type(error).__name__}: {told}" if told else type(error).__name__
    if isinstance(error, sa.SessionActorsError):
        log.warning("session %r: an event stream ended after it began: %s", session, what)
    else:
        log.error(
            "session %r: an event stream failed after it began: %s", session, what, exc_info=error
        )


def _unwrapped(error: BaseException) -> BaseException:
    """``error``, out of the exception groups of one exception that hold it (the failure
    of one of a response's tasks)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _failed_frame(session: str, error: BaseException) -> bytes:
    """The error frame of a failure that is not the library's: its kind, not its
    message (the log has it), and 500, as the gateway answers such a request."""
    kind = type(error).__name__
    message = f"session {session!r}: {failed_told(error)}"
    return frame({"type": "error", "error": kind, "message": message, "status": 500})


async def _read(
    events: AsyncIterator[sa.Event],
    select: Select,
    outbox: _Outbox,
    error_frame: Callable[[BaseException], bytes],
) -> None:
    try:
        async for event in events:
            data, last = select(event)
            if data is not None:
                outbox.put(data)
            if last:
                break
            if outbox.full:
                await outbox.wait_room()
    except Exception as exc:
        # fell behind (SubscriberLaggedError), or the session's events ended with an
        # error (its wake failed, a store failed): the client resumes with Last-Event-ID,
        # the last seq it received; any other failure (a bug) is told by its kind
        outbox.close(error_frame(exc))
    else:
        outbox.close()
