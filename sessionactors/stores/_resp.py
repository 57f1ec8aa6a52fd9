"""A small RESP3 connection for the multi-worker channel of ``RedisStore``.

The channel's messages (requests and answers between workers) are the one place
where a round trip's every hop counts: coredis reads each connection in a task of
its own and writes through another, so a message crossed two extra tasks on each
side. Here the task that subscribes reads the socket itself and hands each message
on as it is parsed, and a command is written by the task that sends it; that task
waits only for its reply, which the reading task passes it. A plain socket is read
and written through its descriptor (trio's stream adds a schedule point after every
send and every receive that succeeded at once).

It speaks RESP3 (``HELLO 3``, with ``AUTH`` when credentials are given) over TCP,
TLS or a unix socket, to one server: a subscribed RESP3 connection may still send
commands, so one connection subscribes and publishes. Errors are coredis' own
(``ConnectionError`` for a lost or refused connection, ``ResponseError`` with the
server's words for an error reply), so the store translates them as every other
call's. Nothing else of the store uses it.
"""

from __future__ import annotations

import collections
import os
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import coredis.exceptions
import trio

__all__ = ["Endpoint", "RespConnection", "connect"]

_CRLF: Final = b"\r\n"
_READ_SIZE: Final = 65536


@attrs.frozen(kw_only=True)
class Endpoint:
    """Where and how to connect: ``host``/``port`` or a unix socket ``path``; TLS with
    ``ssl_context``; ``username``/``password`` for ``AUTH``; ``master``: refuse a
    server whose role is not master (a Sentinel's master that was demoted);
    ``write_within``: seconds a command's write may take before the connection is
    given up."""

    host: str = ""
    port: int = 0
    path: str = ""
    ssl_context: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None
    master: bool = False
    write_within: float = 5.0

    def __str__(self) -> str:
        return self.path or f"{self.host}:{self.port}"


@attrs.frozen
class Push:
    """A RESP3 push: ``[kind, ...]`` (``message``, ``subscribe``, ...)."""

    items: list[Any]


@attrs.frozen
class _ErrorReply:
    message: str


class _Incomplete(Exception):
    """The buffer ends inside a value: read more.

    Raised as a new instance each time: one instance raised again and again keeps
    adding to its traceback, which holds every frame it passed (and what they had
    parsed), for as long as the connection lives.
    """


def _count(line: bytes | bytearray) -> int:
    try:
        return int(line)
    except ValueError:
        raise coredis.exceptions.ConnectionError(
            f"redis sent a malformed reply header {bytes(line)[:40]!r}"
        ) from None


def parse(buffer: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """The RESP3 value that starts at ``pos`` and the position after it; raises
    ``_Incomplete`` if the buffer ends first."""
    end = buffer.find(_CRLF, pos)
    if end < 0:
        raise _Incomplete
    kind = buffer[pos]
    line = buffer[pos + 1 : end]
    pos = end + 2
    if kind == 0x24 or kind == 0x21 or kind == 0x3D:  # $ bulk, ! error, = verbatim
        size = _count(line)
        if size < 0:
            return None, pos
        stop = pos + size
        if len(buffer) < stop + 2:
            raise _Incomplete
        data = bytes(buffer[pos:stop])
        if kind == 0x21:
            return _ErrorReply(data.decode("utf-8", "replace")), stop + 2
        return (data[4:] if kind == 0x3D else data), stop + 2
    if kind == 0x2A or kind == 0x3E or kind == 0x7E:  # * array, > push, ~ set
        size = _count(line)
        if size < 0:
            return None, pos
        items = []
        for _ in range(size):
            item, pos = parse(buffer, pos)
            items.append(item)
        return (Push(items) if kind == 0x3E else items), pos
    if kind == 0x3A or kind == 0x28:  # : integer, ( big number
        return _count(line), pos
    if kind == 0x2B:  # + simple string
        return bytes(line), pos
    if kind == 0x2D:  # - error
        return _ErrorReply(bytes(line).decode("utf-8", "replace")), pos
    if kind == 0x25 or kind == 0x7C:  # % map, | attribute (of the value after it)
        size = _count(line)
        found: dict[Any, Any] = {}
        for _ in range(size):
            key, pos = parse(buffer, pos)
            value, pos = parse(buffer, pos)
            found[key if not isinstance(key, list) else tuple(key)] = value
        if kind == 0x7C:
            return parse(buffer, pos)
        return found, pos
    if kind == 0x5F:  # _ null
        return None, pos
    if kind == 0x23:  # # boolean
        return line == b"t", pos
    if kind == 0x2C:  # , double
        return float(line), pos
    raise coredis.exceptions.ConnectionError(
        f"redis sent a reply of unknown type {bytes(buffer[pos - len(line) - 3 : pos])[:40]!r}"
    )


def pack(args: Sequence[bytes | str | int]) -> bytes:
    """A command as RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n" % len(data))
        parts.append(data)
        parts.append(_CRLF)
    return b"".join(parts)


def _raise_for(value: Any) -> Any:
    if isinstance(value, _ErrorReply):
        raise coredis.exceptions.ResponseError(value.message)
    return value


class _Waiter:
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class RespConnection:
    """One open connection: :meth:`command` from any task, while one task runs
    :meth:`read`, which hands every push to its callback and every reply to the
    command waiting for it (replies come in the order the commands were sent)."""

    def __init__(self, stream: trio.abc.Stream, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._stream = stream
        self._buffer = bytearray()
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._writing = trio.StrictFIFOLock()
        self._error: BaseException | None = None
        self._reading = trio.CancelScope()
        # A plain socket (TCP or unix, not TLS) is written and read straight through
        # its descriptor: trio's stream yields once more after every send and every
        # receive that succeeded at once (two schedule points per message, each a
        # pass of the scheduler, on each side of a forwarded request). None once the
        # connection is given up; a closed socket's number is -1 (never another file).
        self._socket: trio.socket.SocketType | None = (
            stream.socket if isinstance(stream, trio.SocketStream) and os.name == "posix" else None
        )

    def __repr__(self) -> str:
        return f"<RespConnection {self.endpoint}>"

    @property
    def usable(self) -> bool:
        return self._error is None

    async def aclose(self) -> None:
        """Close the connection at once; every waiting command fails."""
        self._fail(coredis.exceptions.ConnectionError("the connection was closed"))
        await trio.aclose_forcefully(self._stream)

    async def send(self, *args: bytes | str | int) -> None:
        """Write a command whose answer comes as a push (``SUBSCRIBE``), not a reply."""
        await self._write(pack(args), None)
        await trio.lowlevel.cancel_shielded_checkpoint()  # (the write may not have parked)

    async def command(self, *args: bytes | str | int) -> Any:
        """Run one command and return its reply; an error reply raises ResponseError."""
        waiter = _Waiter()
        await self._write(pack(args), waiter)
        await waiter.done.wait()
        if waiter.error is not None:
            raise coredis.exceptions.ConnectionError(str(waiter.error)) from waiter.error
        return _raise_for(waiter.value)

    async def _write(self, data: bytes, waiter: _Waiter | None) -> None:
        lock = self._writing
        if self._socket is None or lock.locked():
            await lock.acquire()
        else:  # nobody writing: no schedule point before the command goes out
            await trio.lowlevel.checkpoint_if_cancelled()
            lock.acquire_nowait()
        try:
            if self._error is not None:
                raise coredis.exceptions.ConnectionError(
                    f"the connection to redis at {self.endpoint} is lost: {self._error}"
                ) from self._error
            if waiter is not None:
                self._waiting.append(waiter)
            rest: bytes | memoryview = data
            if self._socket is not None:  # what the socket takes at once goes now
                try:
                    sent = os.write(self._socket.fileno(), data)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._fail(exc)
                    raise coredis.exceptions.ConnectionError(
                        f"the connection to redis at {self.endpoint} is lost: {exc}"
                    ) from exc
                if sent == len(data):
                    return
                rest = memoryview(data)[sent:]
            # A write cut short would leave half a command on the connection: a caller
            # that gives up meanwhile does not cut it (its reply is read and dropped);
            # a write that takes longer than the endpoint's ``write_within`` (the
            # server stopped reading) gives the connection up.
            patience = self.endpoint.write_within
            with trio.CancelScope(shield=True), trio.move_on_after(patience) as bound:
                try:
                    await self._stream.send_all(rest)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._fail(exc)
                    raise coredis.exceptions.ConnectionError(
                        f"the connection to redis at {self.endpoint} is lost: {exc}"
                    ) from exc
            if bound.cancelled_caught:
                error = coredis.exceptions.ConnectionError(
                    f"redis at {self.endpoint} took no command for {patience} s"
                )
                self._fail(error)
                raise error
        finally:
            lock.release()

    def give_up(self, reason: str) -> None:
        """Stop using the connection (a server that stopped answering, or a connection
        gone half-open): every waiting command fails and :meth:`read` ends."""
        self._fail(
            coredis.exceptions.ConnectionError(
                f"the connection to redis at {self.endpoint} was given up: {reason}"
            )
        )

    def _fail(self, exc: BaseException) -> None:
        """Give up the connection: every waiting command fails, reading stops."""
        if self._error is None:
            self._error = exc
        self._socket = None
        while self._waiting:
            waiter = self._waiting.popleft()
            waiter.error = self._error
            waiter.done.set()
        self._reading.cancel()

    async def _receive(self) -> None:
        """Append what the socket has to the buffer, waiting for something; it is a
        schedule point."""
        if self._socket is None:
            try:
                data = await self._stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise coredis.exceptions.ConnectionError(
                    f"the connection to redis at {self.endpoint} is lost: {exc}"
                ) from exc
        else:
            waited = False
            while True:
                sock = self._socket
                if sock is None:  # given up meanwhile
                    raise coredis.exceptions.ConnectionError(
                        f"the connection to redis at {self.endpoint} is lost: {self._error}"
                    )
                try:
                    data = os.read(sock.fileno(), _READ_SIZE)
                    break
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise coredis.exceptions.ConnectionError(
                        f"the connection to redis at {self.endpoint} is lost: {exc}"
                    ) from exc
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError as exc:
                    raise coredis.exceptions.ConnectionError(
                        f"the connection to redis at {self.endpoint} is lost: {exc}"
                    ) from exc
                waited = True
            if not waited:  # (a schedule point all the same)
                await trio.lowlevel.checkpoint()
        if not data:
            raise coredis.exceptions.ConnectionError(
                f"redis at {self.endpoint} closed the connection"
            )
        self._buffer += data

    async def reply(self) -> Any:
        """Read the next reply (before :meth:`read` runs: the handshake)."""
        while True:
            try:
                value, end = parse(self._buffer, 0)
            except _Incomplete:
                await self._receive()
                continue
            del self._buffer[:end]
            return _raise_for(value)

    async def read(self, on_push: Callable[[list[Any]], None]) -> None:
        """Read until the connection is lost (ConnectionError) or given up; pushes go
        to ``on_push`` as they are parsed. An error reply nobody waits for (a
        refused ``SUBSCRIBE``) raises ResponseError."""
        try:
            with self._reading:
                while True:
                    buffer = self._buffer
                    pos = 0
                    while pos < len(buffer):
                        try:
                            value, end = parse(buffer, pos)
                        except _Incomplete:
                            break
                        pos = end
                        if isinstance(value, Push):
                            on_push(value.items)
                        elif self._waiting:
                            waiter = self._waiting.popleft()
                            waiter.value = value
                            waiter.done.set()
                        else:
                            _raise_for(value)
                    if pos:
                        del buffer[:pos]
                    await self._receive()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._fail(coredis.exceptions.ConnectionError("the connection was closed"))
        raise coredis.exceptions.ConnectionError(
            f"the connection to redis at {self.endpoint} was given up: {self._error}"
        ) from self._error


async def _connect(endpoint: Endpoint) -> trio.abc.Stream:
    try:
        if endpoint.path:
            return await trio.open_unix_socket(endpoint.path)
        if endpoint.ssl_context is not None:
            return await trio.open_ssl_over_tcp_stream(
                endpoint.host,
                endpoint.port,
                ssl_context=endpoint.ssl_context,
                https_compatible=True,
            )
        return await trio.open_tcp_stream(endpoint.host, endpoint.port)
    except OSError as exc:
        raise coredis.exceptions.ConnectionError(
            f"could not connect to redis at {endpoint}: {exc}"
        ) from exc


async def connect(endpoint: Endpoint, name: str) -> RespConnection:
    """A connection to ``endpoint``, greeted (``HELLO 3``, authenticated, named ``name``
    in ``CLIENT LIST``); the caller bounds the time and closes it
    (:meth:`RespConnection.aclose`)."""
    stream = await _connect(endpoint)
    connection = RespConnection(stream, endpoint)
    try:
        hello: list[bytes | str | int] = [b"HELLO", 3]
        if endpoint.username is not None or endpoint.password is not None:
            hello += [b"AUTH", endpoint.username or "default", endpoint.password or ""]
        hello += [b"SETNAME", name]
        await connection.send(*hello)
        reply = await connection.reply()
        if endpoint.master and isinstance(reply, dict) and reply.get(b"role") != b"master":
            raise coredis.exceptions.ConnectionError(
                f"redis at {endpoint} is no longer the master (its role: {reply.get(b'role')!r})"
            )
    except BaseException:
        await connection.aclose()
        raise
    return connection
