"""A TCP proxy whose connections a test can drop (a network outage) and restore."""

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``target_port``; ``drop()`` cuts every connection
    (with a reset) and refuses new ones until ``restore()``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._up = True
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._start(self._accept)

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                up = self._up and not self._closed
            if not up:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            self._start(self._pipe, client, upstream)
            self._start(self._pipe, upstream, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            self._forget(source, sink)

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            for s in sockets:
                self._sockets.discard(s)
        for s in sockets:
            s.close()

    def drop(self) -> None:
        """Reset every open connection; refuse new ones until ``restore()``."""
        with self._lock:
            self._up = False
            doomed = list(self._sockets)
        for s in doomed:
            _reset(s)

    def restore(self) -> None:
        """Accept and forward connections again."""
        with self._lock:
            self._up = True

    def close(self) -> None:
        """Stop accepting, cut every connection and wait for the threads."""
        self._closed = True
        self._listener.close()
        self.drop()
        for thread in self._threads:
            thread.join(timeout=5)


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


@contextlib.contextmanager
def open_proxy(target_port: int) -> Iterator[Proxy]:
    """A :class:`Proxy` to ``target_port``, closed on exit."""
    proxy = Proxy(target_port)
    try:
        yield proxy
    finally:
        proxy.close()
