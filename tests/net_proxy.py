"""A loopback TCP proxy whose established connections can go silent (half-open).

``blackhole()`` stops carrying bytes on every connection open at that moment, in both
directions, without closing any: each end still believes it is connected, as after a
firewall or NAT that lost its state, or a peer behind a dead link. Connections made
afterwards are carried as usual.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.port = 0
        self._target_port = target_port
        self._live: list[trio.CancelScope] = []  # one a connection, while carried

    def blackhole(self) -> int:
        """Silence every connection open now; how many there were."""
        scopes, self._live = self._live, []
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    async def carry(self, client: trio.SocketStream) -> None:
        """Carry one connection until either end closes it, or until silenced (then hold
        both ends open until the proxy stops; trio closes the client's end after)."""
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self._target_port)
        except OSError:
            return
        silenced = trio.CancelScope()
        self._live.append(silenced)
        try:
            with silenced:
                async with trio.open_nursery() as nursery:

                    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
                        try:
                            while data := await source.receive_some(65536):
                                await sink.send_all(data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                        nursery.cancel_scope.cancel()  # one end closed: close the other

                    nursery.start_soon(pump, client, server)
                    nursery.start_soon(pump, server, client)
            if silenced.cancelled_caught:  # both ends stay open, and nothing moves
                await trio.sleep_forever()
        finally:
            if silenced in self._live:
                self._live.remove(silenced)
            await trio.aclose_forcefully(server)


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
