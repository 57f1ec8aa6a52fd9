"""Cutting a connection whose socket write waits on a client that reads nothing."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import anyio

__all__ = ["WriteGuard", "abort_connections"]


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
    host, port = address
    wildcard = host in ("0.0.0.0", "::", "")
    try:
        fds = [int(name) for name in os.listdir("/dev/fd")]
    except OSError:  # (no /dev/fd, as on Windows: nothing to do)
        return 0
    aborted = 0
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
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
            aborted += 1
        except OSError:
            continue
        finally:
            sock.detach()  # (the descriptor stays the server's: it closes it)
    return aborted


class WriteGuard:
    """Ends a response whose client takes nothing of it for ``bound`` seconds.

    ``send`` wraps the ASGI send; ``guard`` (a task in the response's task group) waits
    for a write that has not completed within ``bound`` seconds, then cancels
    ``cancel_scope`` (enough under asyncio servers) and resets the connection (needed
    under hypercorn's trio worker, which shields a socket write from cancellation);
    ``stalled`` says that it did, and that nothing more is to be sent.
    """

    def __init__(self, scope: Any, send: Any, bound: float) -> None:
        self._scope = scope
        self._send = send
        self.bound = bound
        self._since: float | None = None
        self.stalled = False

    async def send(self, message: Any) -> None:
        self._since = anyio.current_time()
        try:
            await self._send(message)
        finally:
            self._since = None

    async def guard(self, cancel_scope: anyio.CancelScope) -> None:
        while True:
            since = self._since
            left = self.bound if since is None else since + self.bound - anyio.current_time()
            if left > 0:
                await anyio.sleep(left)
                continue
            self.stalled = True
            cancel_scope.cancel()
            server, client = self._scope.get("server"), self._scope.get("client")
            if server and client:
                abort_connections((server[0], server[1]), (client[0], client[1]))
            return
