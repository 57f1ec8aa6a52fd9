"""A small WebSocket client for the tests (trio + wsproto): it closes its socket whichever
side ends the connection."""

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import trio
import wsproto
import wsproto.events


class Closed(Exception):
    """The server closed the WebSocket; ``code`` and ``reason`` are its close code and
    reason."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"closed with code {code}" + (f" ({reason})" if reason else ""))
        self.code = code
        self.reason = reason


class WebSocket:
    def __init__(self, stream: trio.SocketStream, connection: wsproto.WSConnection) -> None:
        self._stream = stream
        self._ws = connection
        self._pending: list[wsproto.events.Event] = []
        self._text: list[str] = []

    async def _flush(self, event: wsproto.events.Event) -> None:
        await self._stream.send_all(self._ws.send(event))

    async def _next_event(self) -> wsproto.events.Event:
        while not self._pending:
            data = await self._stream.receive_some(65536)
            self._ws.receive_data(data or None)
            self._pending.extend(self._ws.events())
        return self._pending.pop(0)

    async def send(self, data: Any) -> None:
        """Send a text frame: ``data`` as is if a str, else as JSON."""
        text = data if isinstance(data, str) else json.dumps(data)
        await self._flush(wsproto.events.TextMessage(data=text))

    async def send_bytes(self, data: bytes) -> None:
        """Send a binary frame."""
        await self._flush(wsproto.events.BytesMessage(data=data))

    async def receive(self) -> dict[str, Any]:
        """The next text frame, parsed as JSON; raises Closed when the server closes."""
        while True:
            event = await self._next_event()
            if isinstance(event, wsproto.events.TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    text, self._text = "".join(self._text), []
                    return json.loads(text)  # type: ignore[no-any-return]
            elif isinstance(event, wsproto.events.CloseConnection):
                if self._ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                    await self._flush(event.response())
                raise Closed(event.code, event.reason or "")
            elif isinstance(event, wsproto.events.Ping):
                await self._flush(event.response())


@asynccontextmanager
async def open_websocket(
    url: str, headers: list[tuple[str, str]] | None = None, *, host: str | None = None
) -> AsyncIterator[WebSocket]:
    """Connect to ``ws://host:port/path?query`` (with extra ``headers``, such as the
    ``Origin`` a browser sends, and ``host`` as its Host header if given, as a proxy
    that rewrites it sends); closes the connection on exit."""
    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    async with stream:
        connection = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        socket = WebSocket(stream, connection)
        await socket._flush(
            wsproto.events.Request(
                host=host or parts.netloc, target=target, extra_headers=list(headers or [])
            )
        )
        event = await socket._next_event()
        if not isinstance(event, wsproto.events.AcceptConnection):
            raise ConnectionError(f"the WebSocket handshake failed: {event!r}")
        try:
            yield socket
        finally:
            if connection.state is wsproto.connection.ConnectionState.OPEN:
                with trio.move_on_after(1):
                    await socket._flush(wsproto.events.CloseConnection(code=1000))
