"""The multi-worker transport of ``RedisStore``: liveness keys, inboxes, event streams.

Requests and answers between workers go over pub/sub (``PUBLISH``, or ``SPUBLISH``
on a Redis Cluster), on a channel per worker incarnation that one connection of
that incarnation subscribes to: one round trip each way, never written to the
append-only file. Pub/sub is at most once: a publish says how many subscribers got
the message, and the multi-worker layer asks again about anything that may have
been lost on the way.

The channel has connections of its own (``_resp``: RESP3 over the same TCP, TLS or
unix socket, with the same credentials as the store's client, to its server, the
Sentinel's current master, or on a cluster the master of the channel's slot): the
subscribing task reads its messages straight off the socket, and sends go out on
the same connection (on a cluster, on one per master published to), so a message
crosses no task between the socket and the multi-worker layer. Every call keeps
the store's timeout and error translation; a send whose connection is lost or
refused goes through the store's client instead, and a subscription that is lost
ends ``listen``, which the multi-worker layer calls again.

A message larger than :data:`_BIG_MESSAGE` (the answer to a read of a long
history) waits in a key of the receiving worker's, and the channel carries only
that key: Redis cuts off a subscriber whose unread output passes 32 MB
(``client-output-buffer-limit pubsub``). The messages after it wait for it, so a
worker sees its messages in the order they were sent.

A session's events go to its stream only while a worker other than its owner
subscribes: the owner sets the session's watch key when a subscriber's request
reaches it, the subscriber's worker renews it, and a worker that wakes the session
hears of it from its claim.

Every call is one round trip through the store's connection (and its error
translation); the Lua scripts keep each step atomic. The multi-worker layer
(``sessionactors.workers``) drives it through its ``Transport`` protocol.
"""

from __future__ import annotations

import binascii
import contextlib
import logging
import math
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar, cast

import coredis
import coredis.pool
import trio
from coredis.commands import Script
from coredis.connection import UnixDomainSocketLocation

from .._codec import MAX_SEQ
from .._errors import StoreConfigurationError, StoreError
from ..workers import StreamItem
from ..workers._wire import join_stamp, split_stamp
from ._base import JournalEntry
from ._redis_connect import Client
from ._resp import Endpoint, RespConnection, connect

_T = TypeVar("_T")

log = logging.getLogger("sessionactors")


class _Redis(Protocol):
    """What the transport uses of its ``RedisStore``: keys and one call with its errors
    translated to ``StoreError``."""

    prefix: str

    def _key(self, kind: str, name: str, suffix: str) -> str: ...
    async def _append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        fence: int | None,
        message: tuple[bytes, bytes] | None,
    ) -> int: ...
    @property
    def _publishes_on_append(self) -> bool: ...
    def _keys(self, session_id: str) -> tuple[str, str, str, str, str]: ...
    def _watch_key(self, session_id: str) -> str: ...
    def _shard(self, session_id: str) -> int: ...
    def _take_watched(self, session_id: str) -> bool: ...
    @property
    def timeout(self) -> float: ...
    async def _run(
        self,
        doing: str,
        session_id: str | None,
        call: Callable[[Client], Awaitable[_T]],
        *,
        block: float = 0.0,
        about: str | None = None,
        streams: Sequence[str] = (),
    ) -> _T: ...


__all__ = ["RedisTransport"]

_READ_COUNT: Final = 1000  # entries per stream per read
_EVENTS_TTL: Final = 24 * 3600.0  # an event stream nobody writes to expires after a day
_END_TTL: Final = 60.0  # an ended stream is kept this long for its readers
#: On a cluster, how long a read waits on the inbox's slot before it looks at the
#: streams of other slots again (milliseconds).
_CLUSTER_POLL_MS: Final = 20

# The pushes of a subscription: (subscribed, a message, unsubscribed by the server).
_PLAIN: Final = (b"subscribe", b"message", b"unsubscribe")
_SHARDED: Final = (b"ssubscribe", b"smessage", b"sunsubscribe")
#: The name of the channel's own connections in ``CLIENT LIST``.
_CLIENT_NAME: Final = "sessionactors-channel"
#: A message longer than this (bytes) goes through a key; the channel carries the key.
_BIG_MESSAGE: Final = 64 * 1024
#: What such a message on the channel starts with: 0xc1 starts no msgpack value.
_BIG_MARK: Final = b"\xc1"
#: How long such a message's key waits for its worker to take it (milliseconds).
_BIG_TTL_MS: Final = 60_000

_POST: Final = """
local who = redis.call('GET', KEYS[1])
if not who then return false end
redis.call('XADD', KEYS[2], '*', 'm', ARGV[1])
if redis.call('PTTL', KEYS[2]) < 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return who
"""
# KEYS: the worker's liveness key and inbox. A key of the two that holds another type
# of value than the store keeps there (a string, a stream) is removed first (the worker
# writes the first again here, and the second holds only wake-ups of its own reader):
# returns the incarnation replaced (false: none) and the type each one held ('' if
# none was removed).
_HEARTBEAT: Final = """
local alive = redis.call('TYPE', KEYS[1]).ok
local inbox = redis.call('TYPE', KEYS[2]).ok
local replaced = false
if alive == 'string' then
  replaced = redis.call('GET', KEYS[1])
elseif alive ~= 'none' then
  redis.call('DEL', KEYS[1])
else
  alive = ''
end
if alive == 'string' then alive = '' end
if inbox ~= 'stream' and inbox ~= 'none' then
  redis.call('DEL', KEYS[2])
else
  inbox = ''
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[4] ~= '' then redis.call('XTRIM', KEYS[2], 'MINID', ARGV[4]) end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {replaced, alive, inbox}
"""
# A worker's inbox key that holds another type of value than the stream the store
# keeps there is removed; returns the type it held (false: it held a stream, or none).
_REPAIR_INBOX: Final = """
local found = redis.call('TYPE', KEYS[1]).ok
if found == 'stream' or found == 'none' then return false end
redis.call('DEL', KEYS[1])
return found
"""
# The live workers: a sorted set scored by when each one's announcement expires
# (the server's clock, in ms). ARGV: worker, its ttl in ms ('' withdraws it), the
# set's own expiry in ms. Returns the workers still live.
_MEMBERS: Final = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if ARGV[2] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
# What each worker runs with, as it said last: a hash of worker -> its words, kept for
# ARGV[3] ms after the last. ARGV: worker, its words ('' withdraws them), ms. Returns
# the whole hash.
_OPTIONS: Final = """
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return redis.call('HGETALL', KEYS[1])
"""
_LEAVE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
# An entry whose id is not above the stream's last is dropped (it is there already, or
# the stream ended); any other refusal (out of memory, say) fails the call, which the
# multi-worker layer then marks as lost: a reader never skips an event in silence.
# ARGV per entry: its id, field and value, and the stamp ('' for none) that goes in a
# field "b" of its own (workers of an earlier version read the value alone). Only a
# stream that took an entry is kept for the publish ttl from now: an ended stream (a
# deleted session's) that a late publish reaches keeps the expiry its end set.
_PUBLISH: Final = """
local pos = 3
for i = 1, #KEYS do
  local n = tonumber(ARGV[pos])
  local added = false
  pos = pos + 1
  for j = 1, n do
    local r
    if ARGV[pos + 3] == '' then
      r = redis.pcall(
        'XADD', KEYS[i], 'MAXLEN', '~', ARGV[1], ARGV[pos], ARGV[pos + 1], ARGV[pos + 2])
    else
      r = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', ARGV[1], ARGV[pos],
        ARGV[pos + 1], ARGV[pos + 2], 'b', ARGV[pos + 3])
    end
    if type(r) == 'table' and r.err then
      if not string.find(r.err, 'equal or smaller', 1, true) then return r end
    else
      added = true
    end
    pos = pos + 4
  end
  if added then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
return 0
"""
_EVENTS_AFTER: Final = """
local oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
return {oldest, redis.call('XRANGE', KEYS[1], ARGV[1], '+')}
"""
# The end marker's id is above every seq (ARGV[2], the largest), so that a reader
# whose position is past what the stream holds (it never published, or was
# trimmed) still reads it; nothing is published to a deleted session's stream.
# The session's events go (its subscribers elsewhere end at the marker, saying the
# session was deleted): the stream, kept a while for them, holds nothing of its text.
# KEYS: the events, the session's meta key (a session of that name stored again:
# no end); the marker is written once, and the stream expires ARGV[1] ms after that
# (a call that finds it marked already, a delete again or a subscriber's watch, keeps
# it no longer). Returns whether the stream is ended.
_MARK_END: Final = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local r = redis.pcall('XADD', KEYS[1], ARGV[2] .. '-0', 'gone', '1')
local marked = true
if type(r) == 'table' and r.err then
  if not string.find(r.err, 'equal or smaller', 1, true) then return r end
  marked = false
end
redis.call('XTRIM', KEYS[1], 'MINID', ARGV[2] .. '-0')
if marked or redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""
# A subscriber's worker renews the watch of a stored session and ends the stream of
# one that is gone (deleted while its end could not be marked: its subscribers would
# wait without end). KEYS: as _MARK_END, then the watch key; ARGV[3]: its ttl in ms.
# Returns 0 (watched), 2 (watched, where the watch had lapsed or was not set: a claim
# meanwhile found the session unwatched), or _MARK_END's 1 (gone).
_WATCH: Final = (
    """
if redis.call('EXISTS', KEYS[2]) == 1 then
  local lapsed = redis.call('EXISTS', KEYS[3]) == 0
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
  if lapsed then return 2 end
  return 0
end
"""
    + _MARK_END
)


def _text(value: Any) -> str:
    """A value the store read back as text (a damaged key's bytes need not be UTF-8)."""
    return bytes(value).decode("utf-8", "replace")


def _wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is redis refusing a key that holds another type of value."""
    message = str(exc).lower()
    return "wrongtype" in message or "wrong kind of value" in message


def _log_repaired(worker: str, key: str, found: str) -> None:
    log.warning(
        "worker %r: its key %r held a %s, not what the store keeps there (another "
        "application's keys under the store's prefix, or a key changed behind its "
        "back); removed it, and the worker goes on (it holds only what the worker "
        "writes there again: its liveness, or wake-ups of its own reader)",
        worker,
        key,
        found,
    )


def _tag(key: str) -> str:
    """The hash tag of a key (its key group: the keys of one slot on a cluster)."""
    return key[key.index("{") : key.index("}") + 1]


def _slot(key: bytes) -> int:
    """The cluster slot of a key with a hash tag (CRC16/XMODEM of the tag, as Redis)."""
    tag = key[key.index(b"{") + 1 : key.index(b"}")]
    return binascii.crc_hqx(tag, 0) % 16384


def _first_error(group: BaseExceptionGroup[Any]) -> Exception | None:
    for exc in group.exceptions:
        found = _first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if isinstance(found, Exception):
            return found
    return None


def _ms(seconds: float) -> str:
    return str(max(1, math.ceil(seconds * 1000)))


def _seq_of(identifier: Any) -> int:
    return int(bytes(identifier).split(b"-", 1)[0])


def _item(identifier: Any, fields: Mapping[Any, Any]) -> StreamItem:
    seq = _seq_of(identifier)
    stamp = bytes(fields.get(b"b") or b"")
    data = fields.get(b"d")
    if data is not None:
        return (seq, "event", join_stamp(stamp, bytes(data)))
    lost = fields.get(b"lost")
    if lost is not None:
        return (seq, "lost", join_stamp(stamp, bytes(lost)))
    return (seq, "gone", b"")


def _script_items(reply: Any) -> list[StreamItem]:
    # a script's XRANGE reply: [[id, [field, value, ...]], ...]
    out: list[StreamItem] = []
    for identifier, flat in reply:
        fields = {bytes(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
        out.append(_item(identifier, fields))
    return out


async def _endpoint(client: Client, slot: int | None, patience: float) -> Endpoint:
    """Where the store's client connects, as it was configured (TLS, credentials): its
    server, the Sentinel's current master, or on a cluster the master of ``slot``;
    a write may take ``patience`` seconds (the store's timeout)."""
    pool: Any = client.connection_pool
    options: Mapping[str, Any] = getattr(pool, "connection_kwargs", None) or {}
    master = False
    if slot is not None:
        location: Any = pool.cluster_layout.node_for_slot(slot)
    elif isinstance(pool, coredis.pool.SentinelConnectionPool):
        location, master = await pool.get_primary_location(), True
    else:
        location = pool.location
    username, password = options.get("username"), options.get("password")
    provider = options.get("credential_provider")
    if provider is not None:
        credentials = await provider.get_credentials()
        username, password = credentials.username, credentials.password
    unix = isinstance(location, UnixDomainSocketLocation)
    return Endpoint(
        host="" if unix else str(location.host),
        port=0 if unix else int(location.port),
        path=str(location.path) if unix else "",
        ssl_context=options.get("ssl_context"),
        username=username,
        password=password,
        master=master,
        write_within=patience,
    )


class _Links:
    """The channel's connections while a subscription lives: the subscribed one, which
    publishes too, and on a cluster one to each other master published to, read by
    tasks of the subscription's nursery."""

    def __init__(
        self,
        channel: bytes,
        subscribed: RespConnection,
        nursery: trio.Nursery,
        patience: float,
        *,
        cluster: bool,
    ) -> None:
        self.channel = channel  # the one subscribed to
        self.cluster = cluster  # on a Redis Cluster: SPUBLISH, on a connection per master
        self._subscribed = subscribed
        self._nursery = nursery
        self._patience = patience  # the store's timeout
        self._nodes: dict[str, RespConnection] = {str(subscribed.endpoint): subscribed}
        self._opening: dict[str, trio.Event] = {}

    async def publish(self, client: Client | None, channel: bytes, message: bytes) -> int:
        """Publish on the channel's own connection; a connection that gives no reply
        within half the store's timeout is given up (it may be half-open: the server
        unreachable, the socket still open), and ConnectionError leaves the other half
        to the store's client. ``client`` (the store's) is needed on a cluster only."""
        if not self.cluster:
            connection, command = self._subscribed, b"PUBLISH"
        else:
            assert isinstance(client, coredis.RedisCluster)
            node = client.connection_pool.cluster_layout.node_for_slot(_slot(channel))
            connection = await self._node(client, f"{node.host}:{node.port}", _slot(channel))
            command = b"SPUBLISH"
        with trio.move_on_after(self._patience / 2):
            return int(await connection.command(command, channel, message))
        # (the subscription, if it was this connection, is made again on a new one)
        connection.give_up(f"no reply to {command.decode()} within {self._patience / 2:g} s")
        raise coredis.exceptions.ConnectionError(
            f"redis at {connection.endpoint} gave no reply in time on the worker channel"
        )

    async def _node(self, client: Client, name: str, slot: int) -> RespConnection:
        while True:
            connection = self._nodes.get(name)
            if connection is not None and connection.usable:
                return connection
            opening = self._opening.get(name)
            if opening is None:
                break
            await opening.wait()  # another send opens it
        opening = self._opening[name] = trio.Event()
        try:
            endpoint = await _endpoint(client, slot, self._patience)
            try:
                started = await self._nursery.start(_read_replies, endpoint)
            except RuntimeError as exc:  # the subscription ended meanwhile
                raise coredis.exceptions.ConnectionError(str(exc)) from exc
            connection = cast(RespConnection, started)
            self._nodes[name] = connection
            return connection
        finally:
            del self._opening[name]
            opening.set()


def _ignore(push: list[Any]) -> None:
    pass


async def _read_replies(
    endpoint: Endpoint, task_status: trio.TaskStatus[RespConnection] = trio.TASK_STATUS_IGNORED
) -> None:
    """A publishing connection to another master, read until it is lost (then opened
    again by the next send that needs it)."""
    connection = await connect(endpoint, _CLIENT_NAME)
    try:
        task_status.started(connection)
        with contextlib.suppress(coredis.exceptions.RedisError):
            await connection.read(_ignore)
    finally:
        await connection.aclose()


class RedisTransport:
    """The transport of a :class:`~sessionactors.stores.RedisStore`, under its prefix.

    Keys: ``<prefix>:w:<worker>:alive`` (its incarnation, expiring),
    ``<prefix>:w:<worker>:inbox`` (a stream, for wake-ups of the worker's reader),
    ``<prefix>:w:<worker>:msg:<token>`` (a large message to the worker, expiring),
    ``<prefix>:s:<name>:ev`` (a session's events), names escaped as the store
    escapes them, ``<prefix>:workers`` (the live workers, for placing shards),
    ``<prefix>:worker-options`` (what each worker runs with, to compare), and
    channel ``<prefix>:w:<worker>:in:<incarnation>`` (requests and answers to that
    incarnation).
    """

    def __init__(self, store: _Redis) -> None:
        self._store = store
        self._post = Script[bytes](script=_POST)
        self._heartbeat = Script[bytes](script=_HEARTBEAT)
        self._repair_inbox = Script[bytes](script=_REPAIR_INBOX)
        self._leave = Script[bytes](script=_LEAVE)
        self._members = Script[bytes](script=_MEMBERS)
        self._options = Script[bytes](script=_OPTIONS)
        self._publish = Script[bytes](script=_PUBLISH)
        self._events_after = Script[bytes](script=_EVENTS_AFTER)
        self._end_events = Script[bytes](script=_MARK_END)
        self._watch = Script[bytes](script=_WATCH)
        self._links: _Links | None = None  # while listen() is subscribed

    def _worker(self, worker: str) -> tuple[str, str]:
        return self._store._key("w", worker, "alive"), self._store._key("w", worker, "inbox")

    def _channel(self, worker: str, incarnation: str) -> str:
        return self._store._key("w", worker, f"in:{incarnation}")

    def _events(self, session_id: str) -> str:
        return self._store._key("s", session_id, "ev")

    def _meta(self, session_id: str) -> str:
        """The key a stored session always has (the event stream's key group)."""
        return self._store._keys(session_id)[0]

    async def heartbeat(
        self, worker: str, incarnation: str, ttl: float, keep_from: str | None
    ) -> str | None:
        keys = list(self._worker(worker))
        args = [incarnation, _ms(ttl), _ms(3 * ttl), keep_from or ""]
        reply: Any = await self._store._run(
            "announce",
            None,
            lambda c: self._heartbeat(keys, args, client=c),
            about=f"worker {worker!r}",
        )
        replaced, alive, inbox = reply
        for key, found in zip(keys, (alive, inbox), strict=True):
            if found:
                _log_repaired(worker, key, _text(found))
        return None if replaced is None else _text(replaced)

    async def leave(self, worker: str, incarnation: str) -> None:
        keys = list(self._worker(worker))
        await self._store._run(
            "retire",
            None,
            lambda c: self._leave(keys, [incarnation], client=c),
            about=f"worker {worker!r}",
        )

    async def members(self, worker: str, ttl: float | None) -> list[str]:
        key = f"{self._store.prefix}:workers"  # one key: single-key commands only
        args = [worker, "" if ttl is None else _ms(ttl), _ms(3 * (ttl or 1.0))]
        reply: Any = await self._store._run(
            "list", None, lambda c: self._members([key], args, client=c), about="the workers"
        )
        return [bytes(member).decode("utf-8", "surrogatepass") for member in reply]

    async def options(self, worker: str, said: str | None, ttl: float) -> dict[str, str]:
        key = f"{self._store.prefix}:worker-options"  # one key: single-key commands only
        args = [worker, said or "", _ms(3 * ttl)]
        reply: Any = await self._store._run(
            "list", None, lambda c: self._options([key], args, client=c), about="the workers"
        )
        words = [bytes(part).decode("utf-8", "surrogatepass") for part in reply]
        return dict(zip(words[::2], words[1::2], strict=True))

    def shard(self, session_id: str) -> int:
        return self._store._shard(session_id)

    async def watch(self, names: Sequence[str], ttl: float) -> set[str]:
        args = [_ms(_END_TTL), str(MAX_SEQ), _ms(3 * ttl)]

        async def run(client: Client) -> list[Any]:
            async with cast(Any, client).pipeline(transaction=False) as pipe:
                replies: list[Any] = [
                    self._watch(
                        [self._events(name), self._meta(name), self._store._watch_key(name)],
                        args,
                        client=pipe,
                    )
                    for name in names
                ]
            return [await reply for reply in replies]

        if not names:
            return set()
        found = await self._store._run("watch the events of", None, run, streams=names)
        return {name for name, reply in zip(names, found, strict=True) if reply == 2}

    async def watched(self, names: Sequence[str]) -> set[str]:
        async def run(client: Client) -> list[Any]:
            async with cast(Any, client).pipeline(transaction=False) as pipe:
                replies = [pipe.exists([self._store._watch_key(name)]) for name in names]
            return [await reply for reply in replies]

        if not names:
            return set()
        found = await self._store._run("look up the subscribers of", None, run)
        return {name for name, n in zip(names, found, strict=True) if n}

    def take_watched(self, session_id: str) -> bool:
        return self._store._take_watched(session_id)

    async def lease_owner(self, session_id: str) -> str | None:
        shard = self._store._keys(session_id)[4]  # a session's owner is its shard's
        value: Any = await self._store._run(
            "look up the owner of", session_id, lambda c: c.hget(shard, "owner")
        )
        return None if value is None else bytes(value).decode()

    async def lease_owners(self, session_ids: Sequence[str]) -> list[str | None]:
        shards = [self._store._keys(name)[4] for name in session_ids]

        async def run(client: Client) -> list[Any]:
            async with cast(Any, client).pipeline(transaction=False) as pipe:
                replies = [pipe.hget(shard, "owner") for shard in shards]
            return [await reply for reply in replies]

        if not shards:
            return []
        found = await self._store._run("look up the owners of", None, run)
        return [None if value is None else bytes(value).decode() for value in found]

    async def post(self, worker: str, message: bytes, ttl: float) -> str | None:
        keys = list(self._worker(worker))
        args: list[str | bytes] = [message, _ms(3 * ttl)]
        value: Any = await self._store._run(
            "send a request to",
            None,
            lambda c: self._post(keys, args, client=c),
            about=f"worker {worker!r}",
        )
        return None if value is None else bytes(value).decode()

    async def incarnation(self, worker: str) -> str | None:
        alive = self._worker(worker)[0]
        value: Any = await self._store._run(
            "look up", None, lambda c: c.get(alive), about=f"worker {worker!r}"
        )
        return None if value is None else _text(value)

    async def send(self, worker: str, incarnation: str, message: bytes) -> bool:
        channel = self._channel(worker, incarnation).encode()
        body: bytes | None = None
        if len(message) > _BIG_MESSAGE:  # the key goes on the channel (see the module)
            key = self._store._key("w", worker, f"msg:{secrets.token_hex(8)}")
            body, message = message, _BIG_MARK + key.encode()

        # (a message to this worker's own channel, its check that it still listens,
        # goes the way other workers' messages come: after a Sentinel failover the
        # channel's connection may still reach the old master)
        links = self._links
        tried = False
        if body is None and links is not None and not links.cluster and channel != links.channel:
            # The common case needs no store call around it: publish bounds its wait,
            # and a failed connection leaves the message to the store's client (below).
            try:
                return bool(await links.publish(None, channel, message))
            except coredis.exceptions.RedisError:
                tried = True

        async def run(client: Client) -> int:
            if body is not None:
                await client.set(key, body, px=_BIG_TTL_MS)
            links = self._links
            if links is not None and channel != links.channel and not tried:
                try:
                    return await links.publish(client, channel, message)
                except coredis.exceptions.RedisError:
                    # that connection failed: the store's client sends it (it may come
                    # twice; requests and answers are told apart by their ids)
                    pass
            if isinstance(client, coredis.RedisCluster):  # the channel's slot's master
                return int(await client.spublish(channel, message))
            return int(await client.publish(channel, message))

        return bool(
            await self._store._run("send a message to", None, run, about=f"worker {worker!r}")
        )

    async def append_and_send(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        fence: int | None,
        worker: str,
        incarnation: str,
        message: bytes,
    ) -> bool:
        """Append to the session's journal (the store's ``append``), and once it is
        written send ``message`` as ``send`` does, in the same round trip: redis sends
        it on only after the write is in its append-only file. Whether the incarnation
        listened (False, with the message not sent, where the store cannot: on a
        cluster, with replicas to wait for, or for a message that goes through a key)."""
        store = self._store
        if len(message) > _BIG_MESSAGE or not store._publishes_on_append:
            await store._append(session_id, entries, info, fence, None)
            return False
        channel = self._channel(worker, incarnation).encode()
        return bool(await store._append(session_id, entries, info, fence, (channel, message)))

    async def listen(
        self,
        worker: str,
        incarnation: str,
        deliver: Callable[[bytes], None],
        subscribed: Callable[[], None],
    ) -> None:
        channel = self._channel(worker, incarnation).encode()
        timeout = self._store.timeout

        async def run(client: Client) -> None:
            # A connection of its own (see _resp): the subscription's messages are
            # handed on as they are read, and sends go out on it too.
            cluster = isinstance(client, coredis.RedisCluster)
            command, kinds = (b"SSUBSCRIBE", _SHARDED) if cluster else (b"SUBSCRIBE", _PLAIN)
            confirmed = trio.Event()
            # Messages that wait for a large one's body to be read, in the order sent
            # (None while there is none)
            backlog: deque[bytes] | None = None

            def on_push(push: list[Any]) -> None:
                nonlocal backlog
                kind = push[0]
                if kind == kinds[1]:
                    data = push[2]
                    if backlog is not None:
                        backlog.append(data)
                    elif data[:1] == _BIG_MARK:
                        backlog = deque((data,))
                        nursery.start_soon(drain)
                    else:
                        deliver(data)
                elif kind == kinds[0]:
                    confirmed.set()
                elif kind == kinds[2]:  # (a cluster moved the slot): again
                    raise coredis.exceptions.ConnectionError("unsubscribed by the server")

            async def drain() -> None:
                nonlocal backlog
                assert backlog is not None
                while backlog:
                    data = backlog[0]
                    body = await self._take(data[1:].decode()) if data[:1] == _BIG_MARK else data
                    backlog.popleft()
                    if body is not None:  # (None: lost, as a message on the channel may be)
                        deliver(body)
                backlog = None

            connection: RespConnection | None = None
            try:
                async with trio.open_nursery() as nursery:
                    with trio.move_on_after(timeout):
                        slot = _slot(channel) if cluster else None
                        endpoint = await _endpoint(client, slot, timeout)
                        connection = await connect(endpoint, _CLIENT_NAME)
                        nursery.start_soon(connection.read, on_push)
                        await connection.send(command, channel)
                        await confirmed.wait()
                    if not confirmed.is_set():
                        raise coredis.exceptions.ConnectionError(
                            f"{command.decode()} was not acknowledged in time"
                        )
                    assert connection is not None
                    self._links = _Links(channel, connection, nursery, timeout, cluster=cluster)
                    subscribed()
            except BaseExceptionGroup as group:  # the cause, for the store to translate
                cause = _first_error(group)
                if cause is None:
                    raise
                raise cause from group
            finally:
                self._links = None
                if connection is not None:
                    await connection.aclose()

        await self._store._run(
            "subscribe to the requests for", None, run, block=math.inf, about=f"worker {worker!r}"
        )

    async def _take(self, key: str) -> bytes | None:
        """The body of a large message sent to this worker (None if it is lost: as a
        message on the channel may be, and the multi-worker layer asks again)."""
        try:
            value: Any = await self._store._run(
                "read", None, lambda c: c.getdel(key), about="a large message sent to this worker"
            )
        except StoreConfigurationError:
            raise  # (no retry fixes it: the subscription fails, saying what to allow)
        except StoreError as exc:
            log.warning("a large message to this worker was lost (%s)", exc)
            return None
        return None if value is None else bytes(value)

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

        async def run(client: Client) -> dict[Any, Any]:
            try:
                return await read(client, wait)
            except coredis.exceptions.ResponseError as exc:
                if not _wrong_type(exc):
                    raise
            # The inbox's key, or one of the streams' (that session's error: see
            # ``_run``), holds another type of value: the inbox's is removed (here, or
            # by the heartbeat meanwhile), and the read is made again, without waiting
            held: Any = await self._repair_inbox([inbox], [], client=client)
            if held:
                _log_repaired(worker, inbox, _text(held))
            return await read(client, None)

        async def read(client: Client, wait: int | None) -> dict[Any, Any]:
            if not isinstance(client, coredis.RedisCluster):
                return dict(await client.xread(ids, count=_READ_COUNT, block=wait) or {})
            # A cluster reads one slot per XREAD: the other slots' streams without
            # waiting, then a wait on the inbox's slot, cut short while other slots
            # have streams to look at again.
            by_tag: dict[str, dict[str, str]] = {}
            for key, start in ids.items():
                by_tag.setdefault(_tag(key), {})[key] = start
            mine = by_tag.pop(_tag(inbox))
            found: dict[Any, Any] = {}
            if by_tag:
                async with client.pipeline(transaction=False) as pipe:
                    replies = [pipe.xread(group, count=_READ_COUNT) for group in by_tag.values()]
                for reply in replies:
                    found.update(await reply or {})
            patience = None if found else wait
            if by_tag and patience is not None:
                patience = min(patience, _CLUSTER_POLL_MS)
            found.update(await client.xread(mine, count=_READ_COUNT, block=patience) or {})
            return found

        reply: dict[Any, Any] = await self._store._run(
            "read the inbox of",
            None,
            run,
            block=block or 0.0,
            about=f"worker {worker!r}",
            streams=list(streams),
        )
        messages: list[tuple[str, bytes]] = []
        events: dict[str, list[StreamItem]] = {}
        for raw_key, entries in reply.items():
            got = bytes(raw_key)
            if got == inbox.encode():
                for entry in entries:
                    # (an entry of another form is damage: handed on as b"", which is
                    # no message, so that the reader moves past it)
                    data = entry.field_values.get(b"m")
                    messages.append((bytes(entry.identifier).decode(), bytes(data or b"")))
            elif got in names:
                events[names[got]] = [_item(e.identifier, e.field_values) for e in entries]
        return messages, events

    async def publish(self, batches: Mapping[str, Sequence[StreamItem]], keep: int) -> None:
        calls: dict[str, tuple[list[str], list[str | bytes]]] = {}
        head: list[str | bytes] = [str(max(1, keep)), _ms(_EVENTS_TTL)]
        for name, items in batches.items():
            if not items:
                continue
            key = self._events(name)
            keys, args = calls.setdefault(_tag(key), ([], list(head)))
            keys.append(key)
            args.append(str(len(items)))
            for seq, kind, payload in items:
                field = {"event": "d", "lost": "lost"}.get(kind, "gone")
                stamp, rest = split_stamp(payload)
                args += [f"{seq}-0", field, rest or b"1", stamp]

        async def run(client: Client) -> None:
            if not isinstance(client, coredis.RedisCluster):  # one script for every stream
                keys, args = [], list(head)
                for some_keys, some_args in calls.values():
                    keys += some_keys
                    args += some_args[len(head) :]
                await self._publish(keys, args, client=client)
                return
            for keys, args in calls.values():  # a cluster runs a script on one slot
                await self._publish(keys, args, client=client)

        if calls:
            await self._store._run("publish events of", None, run, streams=list(batches))

    async def last_event_seq(self, session_id: str) -> int:
        key = self._events(session_id)
        reply: Any = await self._store._run(
            "read the events of", session_id, lambda c: c.xrevrange(key, "+", "-", count=1)
        )
        return _seq_of(reply[0].identifier) if reply else 0

    async def first_event_seq(self, session_id: str) -> int:
        key = self._events(session_id)
        reply: Any = await self._store._run(
            "read the events of", session_id, lambda c: c.xrange(key, "-", "+", count=1)
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
        keys = [self._events(session_id), self._meta(session_id)]
        args = [_ms(_END_TTL), str(MAX_SEQ)]
        await self._store._run(
            "end the events of", session_id, lambda c: self._end_events(keys, args, client=c)
        )
