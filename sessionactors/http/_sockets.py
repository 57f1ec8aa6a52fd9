"""Cutting a connection whose socket write waits on a client that reads nothing."""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["abort_connections"]


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
