"""Cutting a connection whose socket write waits on a client that reads nothing."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from typing import Any, Final

import anyio
import anyio.lowlevel

__all__ = ["WRITE_BYTES", "WriteGuard", "abort_connections", "count_connections"]


def abort_connections(address: tuple[str, int], peer: tuple[str, int] | None = None) -> int:
    """Reset every TCP connection that this process accepted on ``address`` (host, port),
    or only the one from ``peer`` when it is given; how many.

    A write to a client that reads nothing waits until the client reads, and hypercorn's
    trio worker shields that write from cancellation; only the socket's end frees it.
    The connections are found among the process's open file descriptors (their local
    address is ``address``, and they have a peer), shut down so that the write waiting
    on one fails at once, and set to reset on close rather than keep their unsent bytes.
    A wildcard host (``0.0.0.0``, ``::``) matches any local address on that port.
    """
    aborted = 0
    for sock in _connections(address, peer) or ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
            aborted += 1
        except OSError:
            continue
    return aborted


def count_connections(address: tuple[str, int]) -> int | None:
    """How many TCP connections accepted on ``address`` this process holds open, or None
    where its file descriptors cannot be listed (no ``/dev/fd``, as on Windows)."""
    connections = _connections(address)
    return None if connections is None else sum(1 for _ in connections)


def _connections(
    address: tuple[str, int], peer: tuple[str, int] | None = None
) -> Iterator[socket.socket] | None:
    """The process's TCP connections accepted on ``address`` (from ``peer`` only, if
    given), each a socket object over the server's descriptor while it is looked at
    (detached after: the descriptor stays the server's, which closes it); None where the
    descriptors cannot be listed."""
    try:
        fds = [int(name) for name in os.listdir("/dev/fd")]
    except OSError:  # (no /dev/fd, as on Windows)
        return None
    return _accepted(fds, address, peer)


def _accepted(
    fds: list[int], address: tuple[str, int], peer: tuple[str, int] | None
) -> Iterator[socket.socket]:
    host, port = address
    wildcard = host in ("0.0.0.0", "::", "")
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket (or closed since)
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            local = sock.getsockname()
            if local[1] != port or not (wildcard or local[0] == host):
                continue
            remote = sock.getpeername()  # (a listening socket has none: OSError)
            if peer is not None and tuple(remote[:2]) != tuple(peer):
                continue
            yield sock
        except OSError:
            continue
        finally:
            sock.detach()


#: The bytes a write to a client may carry for each bound of waiting: an event stream's
#: body is written in pieces of at most this size, and a larger write (a WebSocket
#: message, which cannot be split) may wait one bound for each of its pieces.
WRITE_BYTES: Final = 1 << 16


class WriteGuard:
    """Ends a response whose client takes less than 64 KB of it in ``bound`` seconds.

    ``send`` wraps the ASGI send. A write may wait ``bound`` seconds for each
    :data:`WRITE_BYTES` it carries (at least one): its allowance, counted from when it
    is the oldest write not done (writes that overlap, as a WebSocket's tasks send at
    once, go out in turn: one waits behind the writes before it, which have their own
    allowances). ``guard`` (a task in the response's task group) waits for the oldest
    write to pass its allowance, then cancels ``cancel_scope`` (enough under asyncio
    servers) and resets the connection (needed under hypercorn's trio worker, which
    shields a socket write from cancellation); ``stalled`` says that it did, and that
    nothing more is to be sent. A write begun later never gives the oldest more time,
    so a client that takes nothing is cut within the oldest write's allowance however
    many writes it causes meanwhile; ``wait_room`` lets a reader of the client's
    requests stop taking them while their answers wait.

    So a client that keeps taking bytes, however slowly, is never cut as long as it
    takes :data:`WRITE_BYTES` in each ``bound`` (about 2 KB/s at the gateway's
    default of 30 s), and one that takes nothing is cut once the oldest write it holds
    up has had its time.
    """

    def __init__(self, scope: Any, send: Any, bound: float) -> None:
        self._scope = scope
        self._send = send
        self.bound = bound
        self._pending: dict[int, float] = {}  # (writes begun and not done: their
        # allowances, oldest first)
        self._begun = 0  # (writes begun: the next one's key)
        self._oldest_since = 0.0  # (when the oldest pending write became the oldest)
        self._room: anyio.Event | None = None  # (set as a write ends, if wait_room waits)
        self._wake: anyio.Event | None = None  # (set when the guard must look again)
        self.stalled = False

    @property
    def pending(self) -> int:
        """How many writes are begun and not done."""
        return len(self._pending)

    async def send(self, message: Any) -> None:
        key = self._begun
        self._begun += 1
        if not self._pending:
            self._oldest_since = anyio.current_time()
        self._pending[key] = max(1, -(-_size(message) // WRITE_BYTES)) * self.bound
        try:
            await self._send(message)
        finally:
            oldest = next(iter(self._pending)) == key
            if oldest:  # the next one is the oldest from now
                self._oldest_since = anyio.current_time()
            del self._pending[key]
            if oldest and self._pending and self._wake is not None:
                self._wake.set()  # (the next one's allowance may end before this one's)
            if self._room is not None:
                self._room.set()

    async def wait_room(self, writes: int) -> None:
        """Wait until fewer than ``writes`` writes are pending."""
        await anyio.lowlevel.checkpoint()
        while len(self._pending) >= writes:
            room = self._room = anyio.Event()
            await room.wait()
        self._room = None

    async def guard(self, cancel_scope: anyio.CancelScope) -> None:
        # (a write begun while it sleeps, a bound at most, ends its allowance after it
        # wakes; only the oldest write ending with others pending wakes it sooner)
        while True:
            if self._pending:
                allowance = next(iter(self._pending.values()))
                left = self._oldest_since + allowance - anyio.current_time()
            else:
                left = self.bound
            if left > 0:
                wake = self._wake = anyio.Event()
                with anyio.move_on_after(left):
                    await wake.wait()
                continue
            self.stalled = True
            cancel_scope.cancel()
            server, client = self._scope.get("server"), self._scope.get("client")
            if server and client:
                abort_connections((server[0], server[1]), (client[0], client[1]))
            return


def _size(message: Any) -> int:
    """The bytes an ASGI message sends to the client (a body, or a WebSocket message)."""
    data = message.get("body") or message.get("bytes") or message.get("text") or b""
    if isinstance(data, str):  # (isascii is O(1): no copy for JSON of ASCII text)
        return len(data) if data.isascii() else len(data.encode())
    return len(data)
