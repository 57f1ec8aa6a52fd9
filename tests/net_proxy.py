"""A loopback TCP proxy whose established connections can go silent (half-open).

``blackhole()`` stops carrying bytes on every connection open at that moment, in both
directions, without closing any: each end still believes it is connected, as after a
firewall or NAT that lost its state, or a peer behind a dead link. ``blackhole_up()``
stops only what the clients send: the server's replies and pushes still come through.
Connections made afterwards are carried as usual. ``edit`` sees every command a client
sends (a RESP array of words) before the server does: it can change it, or drop the
connection instead of sending it, as a link that fails just then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import trio


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.port = 0
        self._target_port = target_port
        self._live: list[trio.CancelScope] = []  # one a connection, while carried
        self._up: list[trio.CancelScope] = []  # one a connection: what its client sends
        #: The command (its words) to send instead of each one sent; None: drop the
        #: connection instead.
        self.edit: Callable[[list[bytes]], list[bytes] | None] | None = None
        self.commands: list[list[bytes]] = []  # every command as sent, in order

    def blackhole(self) -> int:
        """Silence every connection open now; how many there were."""
        return _cancel_all(self._live)

    def blackhole_up(self) -> int:
        """Silence what the client of every connection open now sends; how many there were."""
        return _cancel_all(self._up)

    async def carry(self, client: trio.SocketStream) -> None:
        """Carry one connection until either end closes it, or until silenced (then hold
        both ends open until the proxy stops; trio closes the client's end after)."""
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self._target_port)
        except OSError:
            return
        silenced, up = trio.CancelScope(), trio.CancelScope()
        self._live.append(silenced)
        self._up.append(up)
        try:
            with silenced:
                async with trio.open_nursery() as nursery:

                    async def pump(
                        source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
                    ) -> None:
                        with scope:
                            try:
                                while data := await source.receive_some(65536):
                                    await sink.send_all(data)
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                pass
                            nursery.cancel_scope.cancel()  # one end closed: close the other
                        if scope.cancelled_caught:  # silenced one way: hold it open
                            await trio.sleep_forever()

                    nursery.start_soon(self._pump_commands, client, server, up, nursery)
                    nursery.start_soon(pump, server, client, trio.CancelScope())
            if silenced.cancelled_caught:  # both ends stay open, and nothing moves
                await trio.sleep_forever()
        finally:
            for scopes, scope in ((self._live, silenced), (self._up, up)):
                if scope in scopes:
                    scopes.remove(scope)
            await trio.aclose_forcefully(server)

    async def _pump_commands(
        self,
        client: trio.SocketStream,
        server: trio.SocketStream,
        scope: trio.CancelScope,
        nursery: trio.Nursery,
    ) -> None:
        """What the client sends, command by command (RESP arrays), as ``edit`` has it."""
        buffer = bytearray()
        with scope:
            try:
                while data := await client.receive_some(65536):
                    buffer += data
                    while (parsed := _command(buffer)) is not None:
                        words, size = parsed
                        del buffer[:size]
                        if self.edit is not None:
                            edited = self.edit(words)
                            if edited is None:
                                nursery.cancel_scope.cancel()
                                return
                            words = edited
                        self.commands.append(words)
                        await server.send_all(_encode(words))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()  # one end closed: close the other
        if scope.cancelled_caught:  # silenced one way: hold it open
            await trio.sleep_forever()


def _command(buffer: bytearray) -> tuple[list[bytes], int] | None:
    """The first whole command in ``buffer`` (a RESP array of bulk strings) and its
    size in bytes; None while it is not whole."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    assert buffer[:1] == b"*", bytes(buffer[:40])
    count, at, words = int(buffer[1:end]), end + 2, []
    for _ in range(count):
        end = buffer.find(b"\r\n", at)
        if end < 0:
            return None
        length = int(buffer[at + 1 : end])
        if len(buffer) < end + 2 + length + 2:
            return None
        words.append(bytes(buffer[end + 2 : end + 2 + length]))
        at = end + 2 + length + 2
    return words, at


def _encode(words: list[bytes]) -> bytes:
    parts = [b"*%d\r\n" % len(words)]
    parts += [b"$%d\r\n%s\r\n" % (len(word), word) for word in words]
    return b"".join(parts)


def _cancel_all(scopes: list[trio.CancelScope]) -> int:
    taken = list(scopes)
    scopes.clear()
    for scope in taken:
        scope.cancel()
    return len(taken)


@asynccontextmanager
async def proxy_to(url: str) -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy in front of the redis at ``url`` (``redis://127.0.0.1:PORT``), and the
    URL through it."""
    proxy = Proxy(int(url.rsplit(":", 1)[1].split("/")[0]))
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, proxy.carry, 0, host="127.0.0.1"))
        proxy.port = listeners[0].socket.getsockname()[1]
        yield proxy, f"redis://127.0.0.1:{proxy.port}"
        nursery.cancel_scope.cancel()
