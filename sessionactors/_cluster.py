"""Location transparency on a shared store: requests and events across workers.

With a store that offers a :class:`Transport` (``RedisStore`` does; ``MemoryStore``
and ``SQLiteStore`` do not, and keep raising ``SessionBusyError`` for a session
live in another process), every worker of a registry:

* announces itself: a liveness key holding its incarnation (a fresh id per
  registry), renewed every third of ``lease_ttl``, and an inbox (a stream named
  by ``registry.owner_id``) that one task reads;
* forwards a request for a session whose lease another worker holds to that
  worker's inbox, naming its own inbox for the answer. The owner runs it through
  its own registry (waking the session if it hibernated it meanwhile) and answers
  with the reply (codec-encoded), the result, or the error's type and message,
  raised again on this side as the same sessionactors error. "Moved" answers (the
  worker no longer owns the session, or is closing) send the request on to the
  session's current owner;
* watches the owner while it waits (every third of ``lease_ttl``): if its
  incarnation is gone (it died, or restarted), a request with an idempotency key
  and every read is sent again, to the session's next owner; a turn without a key
  fails with SessionCrashedError, since it may or may not have run;
* publishes the events of the sessions it runs to one stream per session whose
  entry ids are ``<seq>-0``, so a stale ex-owner's events are refused by Redis,
  from one publisher task fed by a bounded queue: the actor never waits on the
  store. Events that do not fit are dropped and replaced by a marker, which
  subscribers see as lag (never as a silent gap). A new incarnation first
  publishes the journal entries its dead predecessor had not published;
* serves every subscription from those streams, a local session's included, so
  a subscription follows its session from worker to worker (hibernation here and
  a wake there, or a failover) with the same seqs and the same ``after=`` replay:
  the stream, then the store's journal for what the stream no longer holds, then
  live events. One task reads the inbox and every mirrored stream with a single
  blocking read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import attrs
import msgpack
import trio

from ._actor import LeaseHeldError, Pending
from ._codec import dump_event, dump_snapshot, load_event, load_events, load_snapshot
from ._errors import (
    SessionActorsError,
    SessionCrashedError,
    SessionStoppedError,
    SnapshotError,
    StoreError,
)
from ._events import Event, MessageAdded, ReviewRequested, StatusChanged
from ._hub import Hub
from ._records import Message, ReviewRequest, Status, new_id
from ._ref import SessionRef, Turn
from ._session import LiveSession
from ._subscription import EventIterator, open_event_iterator
from .stores._base import JournalEntry, Store

if TYPE_CHECKING:
    from ._registry import Registry
    from .stores._redis import RedisStore

__all__ = ["Cluster", "ClusterStatistics", "RedisTransport", "Transport", "start_cluster"]

#: One entry of a session's event stream: (seq, kind, payload). Kinds: "event"
#: (payload: the codec's bytes), "lost" (payload: the first lost seq, ASCII; the
#: entry's seq is the last lost one) and "gone" (the session was deleted).
StreamItem = tuple[int, str, bytes]

_QUEUE_SIZE: Final = 10_000  # events waiting for the publisher, all sessions together
_BATCH: Final = 1000  # events per publishing round trip
_READ_COUNT: Final = 1000  # entries per stream per read
_MAX_ATTEMPTS: Final = 200  # forwarding attempts (moves, refused posts) before giving up
_ANSWER_ATTEMPTS: Final = 5
_EVENTS_TTL: Final = 24 * 3600.0  # an event stream nobody writes to expires after a day
_MAX_HINTS: Final = 100_000
_SAFE_CALLS: Final = frozenset({"set_summary", "cancel", "hibernate"})
# Errors that are plain builtins when the owner raises them.
_BUILTIN_ERRORS: Final[dict[str, type[Exception]]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "LookupError": LookupError,
    "KeyError": KeyError,
}
_ERROR_ATTRS: Final = ("turn_id", "last_seq", "oldest_seq", "status_code")


class Transport(Protocol):
    """What a store offers for talking between workers (see the module docstring)."""

    async def heartbeat(
        self, worker: str, incarnation: str, ttl: float, keep_from: str | None
    ) -> None:
        """Say ``worker`` (this ``incarnation``) is alive for ``ttl`` seconds; drop
        inbox entries before id ``keep_from``."""
        ...

    async def leave(self, worker: str, incarnation: str) -> None:
        """Say the worker is gone (if this incarnation is the live one)."""
        ...

    async def incarnation(self, worker: str) -> str | None:
        """The live incarnation of ``worker``, or None if it is not alive."""
        ...

    async def lease_owner(self, session_id: str) -> str | None:
        """The worker holding the session's lease, or None."""
        ...

    async def post(self, worker: str, message: bytes, ttl: float) -> str | None:
        """Append to the worker's inbox if it is alive; its incarnation, or None."""
        ...

    async def read(
        self,
        worker: str,
        inbox_after: str,
        streams: Mapping[str, int],
        block: float | None,
    ) -> tuple[list[tuple[str, bytes]], dict[str, list[StreamItem]]]:
        """Inbox messages after id ``inbox_after`` and events of the ``streams``
        (session -> seq) after their seqs, waiting up to ``block`` seconds."""
        ...

    async def publish(self, batches: Mapping[str, Sequence[StreamItem]], keep: int) -> None:
        """Append to the sessions' event streams (entries not above a stream's last
        are dropped), each kept to about ``keep`` entries."""
        ...

    async def last_event_seq(self, session_id: str) -> int:
        """The seq of the newest entry of the session's event stream (0 if none)."""
        ...

    async def events_after(
        self, session_id: str, after: int
    ) -> tuple[int | None, list[StreamItem]]:
        """``(seq of the stream's oldest entry or None, entries after ``after``)``."""
        ...

    async def reset_events(self, session_id: str) -> None:
        """Remove the session's event stream (a new session of that name)."""
        ...

    async def end_events(self, session_id: str) -> None:
        """Mark the session's event stream as ended (the session was deleted)."""
        ...


def transport_for(store: Store) -> Transport | None:
    """The store's transport: its ``cluster_transport()``, RedisStore's, or None."""
    make = getattr(store, "cluster_transport", None)
    if callable(make):
        return cast(Transport, make())
    import sys

    redis_module = sys.modules.get("sessionactors.stores._redis")
    if redis_module is not None and isinstance(store, redis_module.RedisStore):
        return RedisTransport(store)
    return None


async def start_cluster(registry: Registry, nursery: trio.Nursery) -> Cluster | None:
    """Start the registry's cluster tasks in ``nursery`` if its store has a transport."""
    transport = transport_for(registry.store)
    if transport is None:
        await trio.lowlevel.checkpoint()
        return None
    cluster = Cluster(registry, transport)
    await nursery.start(cluster.run)
    return cluster


# ---- Redis -------------------------------------------------------------------------

_POST: Final = """
local who = redis.call('GET', KEYS[1])
if not who then return false end
redis.call('XADD', KEYS[2], '*', 'm', ARGV[1])
if redis.call('PTTL', KEYS[2]) < 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return who
"""
_HEARTBEAT: Final = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[4] ~= '' then redis.call('XTRIM', KEYS[2], 'MINID', ARGV[4]) end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
_LEAVE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
_PUBLISH: Final = """
local pos = 3
for i = 1, #KEYS do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for j = 1, n do
    redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', ARGV[1], ARGV[pos], ARGV[pos + 1], ARGV[pos + 2])
    pos = pos + 3
  end
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return 0
"""
_EVENTS_AFTER: Final = """
local oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
return {oldest, redis.call('XRANGE', KEYS[1], ARGV[1], '+')}
"""
_END_EVENTS: Final = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then seq = tonumber(string.match(last[1][1], '^(%d+)')) end
redis.call('XADD', KEYS[1], string.format('%d-0', seq + 1), 'gone', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


def _ms(seconds: float) -> str:
    return str(max(1, math.ceil(seconds * 1000)))


def _seq_of(identifier: Any) -> int:
    return int(bytes(identifier).split(b"-", 1)[0])


def _item(identifier: Any, fields: Mapping[Any, Any]) -> StreamItem:
    seq = _seq_of(identifier)
    data = fields.get(b"d")
    if data is not None:
        return (seq, "event", bytes(data))
    lost = fields.get(b"lost")
    if lost is not None:
        return (seq, "lost", bytes(lost))
    return (seq, "gone", b"")


def _script_items(reply: Any) -> list[StreamItem]:
    # a script's XRANGE reply: [[id, [field, value, ...]], ...]
    out: list[StreamItem] = []
    for identifier, flat in reply:
        fields = {bytes(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
        out.append(_item(identifier, fields))
    return out


class RedisTransport:
    """The transport of a :class:`~sessionactors.stores.RedisStore`, under its prefix.

    Keys: ``<prefix>:w:<worker>:alive`` (its incarnation, expiring),
    ``<prefix>:w:<worker>:inbox`` (a stream) and ``<prefix>:s:<name>:ev`` (a
    session's events), names escaped as the store escapes them.
    """

    def __init__(self, store: RedisStore) -> None:
        from coredis.commands import Script

        from .stores._redis import _encode_name

        self._store = store
        self._encode = _encode_name
        self._post = Script[bytes](script=_POST)
        self._heartbeat = Script[bytes](script=_HEARTBEAT)
        self._leave = Script[bytes](script=_LEAVE)
        self._publish = Script[bytes](script=_PUBLISH)
        self._events_after = Script[bytes](script=_EVENTS_AFTER)
        self._end_events = Script[bytes](script=_END_EVENTS)

    def _worker(self, worker: str) -> tuple[str, str]:
        base = f"{self._store.prefix}:w:{self._encode(worker)}"
        return f"{base}:alive", f"{base}:inbox"

    def _events(self, session_id: str) -> str:
        return f"{self._store.prefix}:s:{self._encode(session_id)}:ev"

    async def heartbeat(
        self, worker: str, incarnation: str, ttl: float, keep_from: str | None
    ) -> None:
        keys = list(self._worker(worker))
        args = [incarnation, _ms(ttl), _ms(3 * ttl), keep_from or ""]
        await self._store._run(
            "announce worker", None, lambda c: self._heartbeat(keys, args, client=c)
        )

    async def leave(self, worker: str, incarnation: str) -> None:
        keys = list(self._worker(worker))
        await self._store._run(
            "retire worker", None, lambda c: self._leave(keys, [incarnation], client=c)
        )

    async def incarnation(self, worker: str) -> str | None:
        alive = self._worker(worker)[0]
        value: Any = await self._store._run("look up worker", None, lambda c: c.get(alive))
        return None if value is None else bytes(value).decode()

    async def lease_owner(self, session_id: str) -> str | None:
        lease = self._store._keys(session_id)[3]
        value: Any = await self._store._run(
            "look up the owner of", session_id, lambda c: c.hget(lease, "owner")
        )
        return None if value is None else bytes(value).decode()

    async def post(self, worker: str, message: bytes, ttl: float) -> str | None:
        keys = list(self._worker(worker))
        args: list[str | bytes] = [message, _ms(3 * ttl)]
        value: Any = await self._store._run(
            "send a request to", None, lambda c: self._post(keys, args, client=c)
        )
        return None if value is None else bytes(value).decode()

    async def read(
        self,
        worker: str,
        inbox_after: str,
        streams: Mapping[str, int],
        block: float | None,
    ) -> tuple[list[tuple[str, bytes]], dict[str, list[StreamItem]]]:
        inbox = self._worker(worker)[1]
        ids: dict[str, str] = {inbox: inbox_after}
        names: dict[bytes, str] = {}
        for name, seq in streams.items():
            key = self._events(name)
            ids[key] = f"{seq}-0"
            names[key.encode()] = name
        wait = None if block is None else max(1, int(block * 1000))
        reply: Any = await self._store._run(
            "read the inbox of", None, lambda c: c.xread(ids, count=_READ_COUNT, block=wait)
        )
        messages: list[tuple[str, bytes]] = []
        events: dict[str, list[StreamItem]] = {}
        for raw_key, entries in (reply or {}).items():
            got = bytes(raw_key)
            if got == inbox.encode():
                for entry in entries:
                    data = entry.field_values.get(b"m")
                    if data is not None:
                        messages.append((bytes(entry.identifier).decode(), bytes(data)))
            elif got in names:
                events[names[got]] = [_item(e.identifier, e.field_values) for e in entries]
        return messages, events

    async def publish(self, batches: Mapping[str, Sequence[StreamItem]], keep: int) -> None:
        keys: list[str] = []
        args: list[str | bytes] = [str(max(1, keep)), _ms(_EVENTS_TTL)]
        for name, items in batches.items():
            if not items:
                continue
            keys.append(self._events(name))
            args.append(str(len(items)))
            for seq, kind, payload in items:
                field = {"event": "d", "lost": "lost"}.get(kind, "gone")
                args += [f"{seq}-0", field, payload or b"1"]
        if keys:
            await self._store._run(
                "publish events of", None, lambda c: self._publish(keys, args, client=c)
            )

    async def last_event_seq(self, session_id: str) -> int:
        key = self._events(session_id)
        reply: Any = await self._store._run(
            "read the events of", session_id, lambda c: c.xrevrange(key, "+", "-", count=1)
        )
        return _seq_of(reply[0].identifier) if reply else 0

    async def events_after(
        self, session_id: str, after: int
    ) -> tuple[int | None, list[StreamItem]]:
        key = self._events(session_id)
        start = f"({after}-0" if after >= 0 else "-"
        reply: Any = await self._store._run(
            "read the events of",
            session_id,
            lambda c: self._events_after([key], [start], client=c),
        )
        first, entries = reply
        oldest = _seq_of(first[0][0]) if first else None
        return oldest, _script_items(entries)

    async def reset_events(self, session_id: str) -> None:
        key = self._events(session_id)
        await self._store._run("reset the events of", session_id, lambda c: c.delete([key]))

    async def end_events(self, session_id: str) -> None:
        key = self._events(session_id)
        ttl = [_ms(60.0)]
        await self._store._run(
            "end the events of", session_id, lambda c: self._end_events([key], ttl, client=c)
        )


# ---- wire format -------------------------------------------------------------------


def _pack(body: Mapping[str, Any]) -> bytes:
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def _unpack(data: bytes) -> dict[str, Any] | None:
    try:
        body = msgpack.unpackb(data, raw=False, max_map_len=64, max_array_len=100_000)
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def _dump_reply(
    name: str, result: tuple[str, Message | None, Sequence[ReviewRequest]]
) -> dict[str, Any]:
    turn_id, message, reviews = result
    return {
        "turn_id": turn_id,
        "message": (
            None
            if message is None
            else dump_event(MessageAdded(session_id=name, seq=0, turn_id=turn_id, message=message))
        ),
        "reviews": [
            dump_event(ReviewRequested(session_id=name, seq=0, turn_id=turn_id, review=r))
            for r in reviews
        ],
    }


def _load_reply(name: str, body: Any) -> tuple[str, Message | None, tuple[ReviewRequest, ...]]:
    turn_id = str(body["turn_id"])
    message: Message | None = None
    if body["message"] is not None:
        event = load_event(bytes(body["message"]), session_id=name)
        assert isinstance(event, MessageAdded)
        message = event.message
    reviews: list[ReviewRequest] = []
    for data in body["reviews"]:
        event = load_event(bytes(data), session_id=name)
        assert isinstance(event, ReviewRequested)
        reviews.append(event.review)
    return turn_id, message, tuple(reviews)


def _error_classes() -> dict[str, type[SessionActorsError]]:
    found: dict[str, type[SessionActorsError]] = {}
    todo: list[type[SessionActorsError]] = [SessionActorsError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def _dump_error(exc: BaseException) -> dict[str, Any]:
    extra = {}
    for name in _ERROR_ATTRS:
        value = getattr(exc, name, None)
        if isinstance(value, str | int) and not isinstance(value, bool):
            extra[name] = value
    return {"err": type(exc).__name__, "msg": str(exc), "attrs": extra}


def _load_error(body: Mapping[str, Any], name: str, owner: str) -> Exception:
    kind = str(body["err"])
    message = str(body.get("msg", ""))
    builtin = _BUILTIN_ERRORS.get(kind)
    if builtin is not None:
        error: Exception = builtin(message)
    else:
        cls = _error_classes().get(kind)
        if cls is None:
            error = SessionCrashedError(
                f"session {name!r}: its owner, worker {owner!r}, failed with {kind}: {message}",
                session_id=name,
            )
        else:
            rebuilt = cls.__new__(cls)  # its own __init__ may want more than a message
            Exception.__init__(rebuilt, message)
            rebuilt.session_id = name
            for attr, value in dict(body.get("attrs") or {}).items():
                if attr in _ERROR_ATTRS:
                    setattr(rebuilt, attr, value)
            error = rebuilt
    error.add_note(f"raised by worker {owner!r}, which runs session {name!r}")
    return error


# ---- the cluster ----------------------------------------------------------------------


@attrs.define
class ClusterStatistics:
    """Counters of one worker's cluster traffic."""

    forwarded: int = 0  # requests this worker sent to another
    served: int = 0  # requests this worker ran for another
    moved: int = 0  # answers that sent a request on to another owner
    owner_deaths: int = 0  # waits that ended because the owner died
    unreachable: int = 0  # requests not sent: the lease holder was not alive
    events_lost: int = 0  # events dropped before reaching the stream (lag markers)


class _Forwarded:
    """A turn sent to another worker, settled by the task that carries it."""

    __slots__ = ("accepted", "early_error", "local", "pending", "replayed", "settled", "turn_id")

    def __init__(self) -> None:
        self.settled = trio.Event()
        self.accepted = False
        self.local = False
        self.early_error: BaseException | None = None
        self.pending = Pending()
        self.turn_id = ""
        self.replayed = False


class _CatchUp:
    """Publish the journal entries up to ``upto`` that the stream lacks (a new incarnation)."""

    __slots__ = ("upto",)

    def __init__(self, upto: int) -> None:
        self.upto = upto


class _Lost:
    """A lag marker: events ``first``..``last`` were dropped before the stream."""

    __slots__ = ("first", "last")

    def __init__(self, first: int, last: int) -> None:
        self.first = first
        self.last = last


_Item = Event | _CatchUp | _Lost
_OWNER_DIED: Final[dict[str, Any]] = {"died": True}


class _Replay:
    """The ``read_journal`` a subscription replays from: the event stream, then the journal."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        oldest, items = await self._cluster.transport.events_after(session_id, after)
        found = {seq: data for seq, kind, data in items if kind == "event"}
        lost = any(kind == "lost" for _, kind, _ in items)
        if oldest is not None and oldest <= after + 1 and not lost:
            return after, [JournalEntry(seq, found[seq]) for seq in sorted(found)]
        # The stream does not reach back to ``after``: the journal has the durable events.
        trimmed, entries = await self._cluster.registry.store.read_journal(session_id, after)
        for entry in entries:
            found.setdefault(entry.seq, entry.data)
        return trimmed, [JournalEntry(seq, found[seq]) for seq in sorted(found)]


class Cluster:
    """One worker's side of the cluster: inbox, forwarding, event streams, mirrors."""

    def __init__(self, registry: Registry, transport: Transport) -> None:
        self.registry = registry
        self.transport = transport
        self.worker = registry.owner_id
        self.incarnation = new_id("inc")
        self.ttl = registry.config.lease_ttl
        self.stats = ClusterStatistics()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._waiters: dict[str, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._owners: dict[str, str] = {}  # session -> owner hint ("": another, unknown)
        self._alive: dict[str, tuple[float, str | None]] = {}
        self._mirrors: dict[str, Hub] = {}
        self._positions: dict[str, int] = {}
        self._inbox_last = "0-0"
        self._read_since_trim = 0
        self._keep_from: str | None = None
        self._send, self._receive = trio.open_memory_channel[tuple[str, _Item]](_QUEUE_SIZE)
        # Lag markers still to write: for events the tap dropped (the queue was full;
        # written by the tap before the session's next event, or when the queue is
        # empty) and for events a failed publish lost (written by the publisher before
        # the session's next queued event, which is newer, or when the queue is empty).
        self._lost: dict[str, tuple[int, int]] = {}
        self._failed: dict[str, tuple[int, int]] = {}
        self._publishing = False
        self._flushed: trio.Event | None = None  # set once the queue is empty (closing)

    def __repr__(self) -> str:
        return f"<Cluster worker={self.worker!r}>"

    @property
    def subscriber_count(self) -> int:
        return sum(hub.subscriber_count for hub in self._mirrors.values())

    # ---- running -------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce this worker, then serve its inbox and publish its events until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._publish_loop, name="cluster events")
                task_status.started()  # no I/O before this: opening a registry stays cheap
                while True:
                    try:
                        # Start after what an earlier incarnation with this worker id left
                        # (its requesters see the new incarnation and send again).
                        await self._skip_stale_inbox()
                        await self.transport.heartbeat(
                            self.worker, self.incarnation, self.ttl, None
                        )
                        break
                    except StoreError:
                        await trio.sleep(min(1.0, self.ttl / 3))
                nursery.start_soon(self._heartbeat_loop, name="cluster heartbeat")
                nursery.start_soon(self._read_loop, name="cluster inbox")
        finally:
            self._nursery = None
            for send in list(self._waiters.values()):
                send.close()
            for hub in self._mirrors.values():
                hub.close()
            self._mirrors.clear()

    async def aclose(self) -> None:
        """Flush the events, retire this worker and turn away what its inbox still holds."""
        self._closing = True
        with trio.CancelScope(shield=True), trio.move_on_after(min(5.0, self.ttl)):
            if self._receive.statistics().current_buffer_used or self._publishing:
                flushed = self._flushed = trio.Event()
                with trio.move_on_after(min(2.0, self.ttl)):
                    await flushed.wait()
            try:
                await self.transport.leave(self.worker, self.incarnation)
                messages, _ = await self.transport.read(self.worker, self._inbox_last, {}, None)
            except StoreError:
                return
            for _, data in messages:
                body = _unpack(data)
                if body is not None and "op" in body and body["op"] != "wake":
                    await self._answer(body, {"moved": True})

    async def _skip_stale_inbox(self) -> None:
        messages, _ = await self.transport.read(self.worker, "0-0", {}, None)
        while messages:
            self._inbox_last = messages[-1][0]
            messages, _ = await self.transport.read(self.worker, self._inbox_last, {}, None)

    async def _heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.ttl / 3)
            keep_from, self._keep_from = self._keep_from, None
            try:
                await self.transport.heartbeat(self.worker, self.incarnation, self.ttl, keep_from)
            except StoreError:
                self._keep_from = self._keep_from or keep_from

    async def _read_loop(self) -> None:
        block = max(0.05, min(self.ttl / 3, 5.0))
        while True:
            try:
                messages, events = await self.transport.read(
                    self.worker, self._inbox_last, dict(self._positions), block
                )
            except StoreError:
                await trio.sleep(min(1.0, block))
                continue
            for message_id, data in messages:
                self._inbox_last = message_id
                self._dispatch(data)
            if messages:
                self._read_since_trim += len(messages)
                if self._read_since_trim >= 256:
                    self._read_since_trim = 0
                    ms, _, n = self._inbox_last.partition("-")
                    self._keep_from = f"{ms}-{int(n or 0) + 1}"
            for name, items in events.items():
                self._feed(name, items)

    def _dispatch(self, data: bytes) -> None:
        body = _unpack(data)
        if body is None:
            return
        if "re" in body:
            send = self._waiters.get(str(body["re"]))
            if send is not None:
                with contextlib.suppress(
                    trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
                ):
                    send.send_nowait(body)
            return
        if body.get("op") == "wake" or self._nursery is None:
            return
        self._nursery.start_soon(self._serve, body, name="cluster request")

    # ---- the owner's side ----------------------------------------------------------

    async def _serve(self, body: dict[str, Any]) -> None:
        """Run a request another worker sent, and answer it."""
        self.stats.served += 1
        registry = self.registry
        try:
            op = str(body["op"])
            name = str(body["s"])
            ref = SessionRef(registry, name, local=True)
            if name not in registry._live:
                # Hibernated (or lost) since the requester looked: it is live nowhere,
                # so the requester wakes it itself.
                raise LeaseHeldError(f"session {name!r} is not live here", session_id=name)
            if op == "turn":
                key = body.get("key")
                turn = await ref.submit(str(body["text"]), idempotency_key=key)
                if body.get("ack"):
                    await self._answer(
                        body, {"ok": "ack", "turn_id": turn.id, "replayed": turn.replayed}
                    )
                reply = await turn.reply()
                result = (reply.turn_id, reply.message, reply.reviews)
                await self._answer(body, {"ok": "reply", "reply": _dump_reply(name, result)})
            elif op == "read":
                session = await registry._ready(name, local=True)
                state = session.to_state()
                hub = registry._hubs.get(name)
                if hub is not None and hub.seq > state.event_seq:
                    state = attrs.evolve(state, event_seq=hub.seq)
                await self._answer(body, {"ok": "state", "state": dump_snapshot(state)})
            elif op == "call":
                value = await self._serve_call(ref, name, str(body["kind"]), dict(body["args"]))
                await self._answer(body, {"ok": "value", "value": value})
            else:
                raise ValueError(f"unknown cluster request {op!r}")
        except LeaseHeldError:
            self.stats.moved += 1
            await self._answer(body, {"moved": True})
        except SessionStoppedError as exc:
            if registry._closing:  # not run here: the session's next owner will
                await self._answer(body, {"moved": True})
            else:
                await self._answer(body, _dump_error(exc))
        except Exception as exc:
            await self._answer(body, _dump_error(exc))

    async def _serve_call(self, ref: SessionRef, name: str, kind: str, args: dict[str, Any]) -> Any:
        if kind == "stop":
            await ref.stop()
            return None
        if kind == "cancel":
            return await ref.cancel()
        if kind == "hibernate":
            await ref.hibernate()
            return None
        if kind == "delete":
            await self.registry._delete(name, local=True)
            return None
        result = await ref._request(kind, args)
        if kind == "review":
            return _dump_reply(name, cast(Any, result))
        return result

    async def _answer(self, request: Mapping[str, Any], body: dict[str, Any]) -> None:
        body["re"] = request.get("id")
        data = _pack(body)
        for attempt in range(_ANSWER_ATTEMPTS):
            try:
                await self.transport.post(str(request.get("from")), data, self.ttl)
                return
            except StoreError:
                await trio.sleep(0.05 * (attempt + 1))

    # ---- the requester's side ------------------------------------------------------

    def owned_elsewhere(self, name: str) -> bool:
        """Whether this worker believes another one runs ``name`` (no I/O)."""
        return name in self._owners and name not in self.registry._live

    def held_elsewhere(self, name: str) -> None:
        """Note that another worker holds ``name``'s lease (owner not known yet)."""
        if len(self._owners) >= _MAX_HINTS:
            del self._owners[next(iter(self._owners))]
        self._owners.setdefault(name, "")

    async def submit(self, name: str, text: str, key: str | None, *, ack: bool) -> Turn | None:
        """Send a turn to the session's owner; None if the session is free (wake it here).

        With ``ack``, return once the owner has accepted the turn (its mailbox had
        room); otherwise once its reply is known.
        """
        nursery = self._running(name)
        forwarded = _Forwarded()
        nursery.start_soon(self._carry_turn, name, text, key, ack, forwarded)
        await forwarded.settled.wait()
        if forwarded.local:
            return None
        if forwarded.early_error is not None:
            raise forwarded.early_error
        return Turn(
            id=forwarded.turn_id,
            session_id=name,
            pending=forwarded.pending,
            replayed=forwarded.replayed,
        )

    async def _carry_turn(
        self, name: str, text: str, key: str | None, ack: bool, forwarded: _Forwarded
    ) -> None:
        def on_ack(body: Mapping[str, Any]) -> None:
            forwarded.turn_id = str(body["turn_id"])
            forwarded.replayed = bool(body.get("replayed"))
            forwarded.accepted = True
            forwarded.settled.set()

        request = {"op": "turn", "s": name, "text": text, "key": key, "ack": ack}
        try:
            answer = await self._forward(
                name, request, retry_safe=key is not None, on_ack=on_ack if ack else None
            )
            if answer is None:
                if not forwarded.settled.is_set():
                    forwarded.local = True
                    return
                # accepted by an owner that died; the session is free now: run it here
                reply = await SessionRef(self.registry, name).send(text, idempotency_key=key)
                forwarded.pending.set_result((reply.turn_id, reply.message, reply.reviews))
                return
            result = _load_reply(name, self._check(answer, name)["reply"])
            forwarded.turn_id = forwarded.turn_id or result[0]
            forwarded.pending.set_result(result)
        except Exception as exc:
            if ack and not forwarded.accepted:
                forwarded.early_error = exc
            forwarded.pending.set_error(exc)
        finally:
            if not forwarded.pending.done and not forwarded.local:
                forwarded.pending.set_error(_closing_error(name))
            forwarded.settled.set()

    async def read(self, name: str) -> LiveSession | None:
        """The session's state from its owner; None if the session is free."""
        answer = await self._forward(name, {"op": "read", "s": name}, retry_safe=True)
        if answer is None:
            return None
        state = load_snapshot(bytes(self._check(answer, name)["state"]), session_id=name)
        return LiveSession(state)

    async def call(self, name: str, kind: str, args: Mapping[str, Any]) -> tuple[bool, Any]:
        """Run a request other than a turn at the session's owner: (sent, result).

        ``sent`` is False when no other worker holds the session.
        """
        request = {"op": "call", "s": name, "kind": kind, "args": dict(args)}
        answer = await self._forward(name, request, retry_safe=kind in _SAFE_CALLS)
        if answer is None:
            return False, None
        value = self._check(answer, name)["value"]
        if kind == "review":
            return True, _load_reply(name, value)
        return True, value

    def _running(self, name: str) -> trio.Nursery:
        if self._nursery is None or self._closing:
            raise _closing_error(name)
        return self._nursery

    def _check(self, answer: dict[str, Any], name: str) -> dict[str, Any]:
        if "err" in answer:
            raise _load_error(answer, name, str(answer.get("_owner", "?")))
        return answer

    async def _forward(
        self,
        name: str,
        request: dict[str, Any],
        *,
        retry_safe: bool,
        on_ack: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> dict[str, Any] | None:
        """Send ``request`` to the owner of ``name`` and wait for its answer.

        None if no other worker holds the session (the caller runs it here).
        """
        self._running(name)
        for attempt in range(_MAX_ATTEMPTS):
            owner = self._owners.get(name) or None
            if owner is None:
                owner = await self.transport.lease_owner(name)
                if owner is None or owner == self.worker:
                    self._owners.pop(name, None)
                    return None
                self.held_elsewhere(name)
                self._owners[name] = owner
            rid = new_id("rq")
            send, receive = trio.open_memory_channel[dict[str, Any]](4)
            self._waiters[rid] = send
            try:
                body = {**request, "id": rid, "from": self.worker}
                incarnation = await self.transport.post(owner, _pack(body), self.ttl)
                if incarnation is None:  # not alive: its leases lapse within lease_ttl
                    self.stats.unreachable += 1
                    self._owners.pop(name, None)
                    await trio.sleep(min(self.ttl / 10, 0.01 * (attempt + 1)))
                    continue
                self.stats.forwarded += 1
                answer = await self._wait_answer(name, owner, incarnation, receive, on_ack)
            finally:
                del self._waiters[rid]
            if answer is _OWNER_DIED:
                self._owners.pop(name, None)
                self.stats.owner_deaths += 1
                if not retry_safe:
                    raise SessionCrashedError(
                        f"session {name!r}: worker {owner!r}, which ran it, died before "
                        "answering, so this request may or may not have run; retry it (send "
                        "it with idempotency_key=... to make retries safe)",
                        session_id=name,
                    )
                continue
            if answer.get("moved") or (retry_safe and answer.get("err") == "FencedOutError"):
                self._owners.pop(name, None)
                self.stats.moved += 1
                await trio.sleep(min(self.ttl / 10, 0.002 * attempt))
                continue
            answer["_owner"] = owner
            return answer
        raise SessionCrashedError(
            f"session {name!r}: could not reach the worker that runs it after "
            f"{_MAX_ATTEMPTS} attempts (it kept moving or its worker kept dying); retry later",
            session_id=name,
        )

    async def _wait_answer(
        self,
        name: str,
        owner: str,
        incarnation: str,
        receive: trio.MemoryReceiveChannel[dict[str, Any]],
        on_ack: Callable[[Mapping[str, Any]], None] | None,
    ) -> dict[str, Any]:
        while True:
            with trio.move_on_after(self.ttl / 3):
                try:
                    answer = await receive.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    raise _closing_error(name) from None
                if answer.get("ok") == "ack":
                    if on_ack is not None:
                        on_ack(answer)
                    continue
                return answer
            if not await self._owner_alive(owner, incarnation):
                return _OWNER_DIED

    async def _owner_alive(self, owner: str, incarnation: str) -> bool:
        now = trio.current_time()
        cached = self._alive.get(owner)
        if cached is None or now - cached[0] > self.ttl / 6:
            try:
                current = await self.transport.incarnation(owner)
            except StoreError:
                return True  # cannot tell: keep waiting (the caller owns time)
            cached = self._alive[owner] = (trio.current_time(), current)
            if len(self._alive) > 1000:
                del self._alive[next(iter(self._alive))]
        return cached[1] == incarnation

    # ---- events: publishing ------------------------------------------------------------

    def tap_for(self, name: str) -> Callable[[Event], None]:
        """The function a session's hub calls with every event it publishes."""
        first = True

        def tap(event: Event) -> None:
            nonlocal first
            if first:
                first = False
                if event.seq > 1:
                    self._enqueue(name, _CatchUp(event.seq - 1))
            self._enqueue(name, event)

        return tap

    def _enqueue(self, name: str, item: _Item) -> None:
        seq = item.seq if isinstance(item, Event) else cast(_CatchUp, item).upto
        lost = self._lost.get(name)
        stats = self._send.statistics()
        if lost is not None:
            if stats.max_buffer_size - stats.current_buffer_used >= 2:
                del self._lost[name]
                self._send.send_nowait((name, _Lost(*lost)))
            else:
                self._lose(name, seq, seq)
                return
        try:
            self._send.send_nowait((name, item))
        except trio.WouldBlock:
            self._lose(name, seq, seq)

    def _lose(
        self,
        name: str,
        first: int,
        last: int,
        into: dict[str, tuple[int, int]] | None = None,
        count: int = 1,
    ) -> None:
        ranges = self._lost if into is None else into
        self.stats.events_lost += count
        lost = ranges.get(name)
        if lost is not None:
            first, last = min(first, lost[0]), max(last, lost[1])
        ranges[name] = (first, last)

    async def _publish_loop(self) -> None:
        keep = self.registry.config.hub.replay_events
        receive = self._receive
        while True:
            first = await receive.receive()
            self._publishing = True
            try:
                batch = [first]
                while len(batch) < _BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._publish_batch(batch, keep)
                if not receive.statistics().current_buffer_used and (self._failed or self._lost):
                    markers = [
                        (n, cast(_Item, _Lost(*r)))
                        for ranges in (self._failed, self._lost)
                        for n, r in ranges.items()
                    ]
                    self._failed.clear()
                    self._lost.clear()
                    await self._publish_batch(markers, keep)
            finally:
                self._publishing = False
                if self._flushed is not None and not receive.statistics().current_buffer_used:
                    self._flushed.set()

    async def _publish_batch(self, batch: Sequence[tuple[str, _Item]], keep: int) -> None:
        groups: dict[str, list[StreamItem]] = {}

        async def flush() -> None:
            if groups:
                try:
                    await self.transport.publish(groups, keep)
                except StoreError:
                    await self._mark_failed(groups)
                groups.clear()

        for name, item in batch:
            if isinstance(item, _CatchUp):
                await flush()
                await self._catch_up(name, item.upto, keep)
                continue
            seq = item.last if isinstance(item, _Lost) else item.seq
            failed = self._failed.get(name)
            if failed is not None and seq >= failed[0]:  # newer than the failed ones
                if seq <= failed[1]:
                    continue  # inside a range already marked lost
                del self._failed[name]
                groups.setdefault(name, []).append((failed[1], "lost", str(failed[0]).encode()))
            if isinstance(item, _Lost):
                groups.setdefault(name, []).append((item.last, "lost", str(item.first).encode()))
                continue
            try:
                data = dump_event(item)
            except (TypeError, ValueError):
                self._lose(name, item.seq, item.seq, self._failed)
                continue
            groups.setdefault(name, []).append((item.seq, "event", data))
        await flush()

    async def _mark_failed(self, groups: Mapping[str, Sequence[StreamItem]]) -> None:
        for name, items in groups.items():
            seqs = [seq for seq, _, _ in items]
            self._lose(name, min(seqs), max(seqs), self._failed, len(items))
        await trio.sleep(0.05)

    async def _catch_up(self, name: str, upto: int, keep: int) -> None:
        """Publish what the stream lacks up to ``upto`` from the journal (a dead
        predecessor's durable events); nothing if the stream was never fed."""
        try:
            top = await self.transport.last_event_seq(name)
            if top == 0 or top >= upto:
                return
            trimmed, batches = await self.registry.store.read_journal(name, top)
            entries = [  # one stream item per event (a journal entry holds a commit's)
                JournalEntry(event.seq, dump_event(event))
                for batch in batches
                for event in load_events(batch.data, session_id=name)
                if top < event.seq <= upto
            ]
            gone = min(trimmed, upto)  # entries up to here are no longer in the journal
            if len(entries) > keep:  # keep the stream's bound: the oldest are skipped
                gone = max(gone, entries[-keep - 1].seq)
                entries = entries[-keep:]
            items: list[StreamItem] = []
            if gone > top:
                items.append((gone, "lost", str(top + 1).encode()))
            items += [(e.seq, "event", e.data) for e in entries if e.seq > gone]
            if items:
                await self.transport.publish({name: items}, keep)
        except SessionActorsError:
            return  # deleted meanwhile, or the store is unreachable: subscribers replay

    # ---- events: subscriptions ---------------------------------------------------------

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        """A subscription fed by the session's event stream, wherever the session runs."""
        registry = self.registry
        found = self._mirrors.get(name)
        if found is None:
            top = await self.transport.last_event_seq(name)
            found = self._mirrors.get(name)
            if found is None:
                found = self._mirrors[name] = Hub(name, registry.config.hub)
                found.advance(top)
                self._positions[name] = top
                self._poke()
        hub: Hub = found
        iterator = await open_event_iterator(
            name,
            hub,
            cast(Store, _Replay(self)),
            after,
            lambda: self._release_mirror(name, hub),
        )
        if name not in registry._live:
            try:
                stopped = (await registry._stored_session(name)).status is Status.STOPPED
            except BaseException:
                iterator.close()
                raise
            if stopped:
                iterator.close()
        return iterator

    def _release_mirror(self, name: str, hub: Hub) -> None:
        if self._mirrors.get(name) is hub and hub.subscriber_count == 0:
            del self._mirrors[name]
            self._positions.pop(name, None)

    def _poke(self) -> None:
        """Have the reader start over, now reading a new mirror's stream too."""
        if self._nursery is None:
            return

        async def poke() -> None:
            # on failure the reader picks the stream up at its next round anyway
            with contextlib.suppress(StoreError):
                await self.transport.post(self.worker, _pack({"op": "wake"}), self.ttl)

        self._nursery.start_soon(poke, name="cluster poke")

    def _feed(self, name: str, items: Sequence[StreamItem]) -> None:
        hub = self._mirrors.get(name)
        for seq, kind, payload in items:
            if hub is None or seq <= self._positions.get(name, 0):
                continue
            self._positions[name] = seq
            if kind == "gone":
                self._end_mirror(name, hub)
                return
            hub.advance(seq)
            if kind == "lost":
                hub.lose()
                continue
            try:
                event = load_event(payload, session_id=name)
            except SnapshotError:
                hub.lose()
                continue
            hub.publish(event)
            if isinstance(event, StatusChanged) and event.status is Status.STOPPED:
                self._end_mirror(name, hub)
                return

    def _end_mirror(self, name: str, hub: Hub) -> None:
        hub.close()
        if self._mirrors.get(name) is hub:
            del self._mirrors[name]
            self._positions.pop(name, None)

    async def reset_events(self, name: str) -> None:
        await self.transport.reset_events(name)

    async def end_events(self, name: str) -> None:
        with contextlib.suppress(StoreError):  # remote subscribers then stay open
            await self.transport.end_events(name)


def _closing_error(name: str) -> SessionStoppedError:
    return SessionStoppedError(
        f"the registry is closing, so the request to session {name!r} was not answered; "
        "send it again once a registry is open",
        session_id=name,
    )
