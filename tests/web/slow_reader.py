"""A client that reads an event stream, a WebSocket or a JSON answer slowly but steadily, as
a phone on a poor network does: a raw socket with a small receive buffer, read a few KB at
a time with a pause between reads (h11 and wsproto parse what it reads)."""

import json
from typing import Any

import h11
import trio
import wsproto
import wsproto.events

#: What the reader takes at a time, and its pause between reads (about 400 KB/s at most).
READ_BYTES = 4096
PAUSE = 0.01

#: The TCP segment size (MSS) that the reader asks of the server, as on an Ethernet path.
SEGMENT_BYTES = 1400


class Reset(Exception):
    """The server reset the connection, or closed it, before the reader had all it wanted;
    ``events`` are the events it got."""

    def __init__(self, events: list[dict[str, Any]], cause: str) -> None:
        seqs = [event["seq"] for event in events]
        super().__init__(
            f"the server {cause} after {len(events)} events (seqs up to {max(seqs, default=0)})"
        )
        self.events = events


async def read_slowly(port: int, target: str, turns: int) -> list[dict[str, Any]]:
    """The events (as JSON) that a slow client of ``GET target`` on 127.0.0.1:``port``
    (an event stream, or a WebSocket when ``target`` has ``/ws``) gets, up to and
    including the ``turns``-th TurnFinished; raises Reset if the server ends first."""
    websocket = "/ws" in target
    host = f"127.0.0.1:{port}"
    events: list[dict[str, Any]] = []
    with trio.socket.socket() as sock:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, READ_BYTES)
        # segments of a real network's size, not loopback's 64 KB, which let the server's
        # kernel buffer megabytes for this connection
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_MAXSEG, SEGMENT_BYTES)
        await sock.connect(("127.0.0.1", port))
        parse = _WebSocketParser(host, target) if websocket else _EventStreamParser(host, target)
        await sock.send(parse.request)
        finished = 0
        while finished < turns:
            try:
                data = await sock.recv(READ_BYTES)
            except ConnectionResetError:
                raise Reset(events, "reset the connection") from None
            if not data:
                raise Reset(events, "closed the connection")
            for event in parse.feed(data):
                events.append(event)
                finished += event["type"] == "TurnFinished"
            await trio.sleep(PAUSE)
    return events


async def get_slowly(port: int, target: str) -> bytes:
    """The body of the answer that a slow client of ``GET target`` on 127.0.0.1:``port``
    gets (status 200); raises ConnectionError if the server ends it first."""
    http = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=target, headers=[("host", f"127.0.0.1:{port}")])
    body = bytearray()
    with trio.socket.socket() as sock:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, READ_BYTES)
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_MAXSEG, SEGMENT_BYTES)
        await sock.connect(("127.0.0.1", port))
        await sock.send(http.send(request) + http.send(h11.EndOfMessage()))
        while True:
            event = http.next_event()
            if isinstance(event, h11.EndOfMessage):
                return bytes(body)
            if isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                body += event.data
            elif event is h11.NEED_DATA:
                try:
                    data = await sock.recv(READ_BYTES)
                except ConnectionResetError:
                    raise ConnectionError(f"reset after {len(body)} bytes of the body") from None
                if not data:
                    raise ConnectionError(f"closed after {len(body)} bytes of the body")
                http.receive_data(data)
                await trio.sleep(PAUSE)


class _EventStreamParser:
    def __init__(self, host: str, target: str) -> None:
        self._http = h11.Connection(h11.CLIENT)
        self.request = self._http.send(
            h11.Request(method="GET", target=target, headers=[("host", host)])
        ) + self._http.send(h11.EndOfMessage())
        self._body = bytearray()
        self._scanned = 0  # (the body before it has no end of a message)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._http.receive_data(data)
        while True:
            event = self._http.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.EndOfMessage):
                break
            if isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                self._body += event.data
        out = []
        while (end := self._body.find(b"\n\n", self._scanned)) >= 0:
            for line in bytes(self._body[:end]).split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(json.loads(line[5:]))
            del self._body[: end + 2]
            self._scanned = 0
        self._scanned = max(0, len(self._body) - 1)
        return out


class _WebSocketParser:
    def __init__(self, host: str, target: str) -> None:
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self.request = self._ws.send(wsproto.events.Request(host=host, target=target))
        self._text: list[str] = []

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._ws.receive_data(data)
        out = []
        for event in self._ws.events():
            if isinstance(event, wsproto.events.TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    out.append(json.loads("".join(self._text)))
                    self._text = []
            elif isinstance(event, wsproto.events.RejectConnection):
                raise AssertionError(f"the WebSocket was refused: {event!r}")
        return out


class SilentWebSocket:
    """A WebSocket client that reads nothing after its handshake (a receive buffer of 4 KB,
    an Ethernet's segments) and sends JSON frames; ``send`` raises ConnectionError once
    the server has reset or closed the connection."""

    def __init__(self, sock: trio.socket.SocketType, ws: wsproto.WSConnection) -> None:
        self._sock = sock
        self._ws = ws

    @classmethod
    async def connect(cls, port: int, target: str) -> "SilentWebSocket":
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, READ_BYTES)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, READ_BYTES)
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_MAXSEG, SEGMENT_BYTES)
        await sock.connect(("127.0.0.1", port))
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        await sock.send(ws.send(wsproto.events.Request(host=f"127.0.0.1:{port}", target=target)))
        head = b""
        while not head.endswith(b"\r\n\r\n"):  # (the handshake's answer, not a byte more)
            byte = await sock.recv(1)
            if not byte:
                raise ConnectionError("closed during the handshake")
            head += byte
        ws.receive_data(head)
        [accepted] = ws.events()
        assert isinstance(accepted, wsproto.events.AcceptConnection), accepted
        return cls(sock, ws)

    async def send(self, data: dict[str, Any]) -> None:
        out = memoryview(self._ws.send(wsproto.events.TextMessage(data=json.dumps(data))))
        while out:
            try:
                sent = await self._sock.send(out)
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise ConnectionError(f"the server ended the connection: {exc!r}") from None
            out = out[sent:]

    def close(self) -> None:
        self._sock.close()
