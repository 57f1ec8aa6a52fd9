"""Location transparency on a shared store: requests and events across workers.

The multi-worker layer: a plug-in behind the core's router seam
(``sessionactors._router``). With a store that offers a :class:`Transport`
(``RedisStore`` does; ``MemoryStore`` and ``SQLiteStore`` do not, and keep raising
``LeaseHeldError`` for a session live in another process), every worker of a
registry:

* announces itself: a liveness key holding its incarnation (a fresh id per
  registry), renewed every third of ``lease_ttl``, and a channel of that
  incarnation that one connection listens to (pub/sub: nothing is written to the
  store, a send says whether the incarnation listened, and a message can still be
  lost on the way: the asking below finds out);
* forwards a request for a session whose lease another worker holds to the
  channel of that worker's live incarnation (looked up once and kept until a send
  finds nobody listening), naming its own for the answer. The owner runs it through
  its own registry (waking the session if it hibernated it meanwhile) and answers
  with the reply (codec-encoded), the result, or the error's type and message,
  raised again on this side as the same sessionactors error. "Moved" answers (the
  worker no longer owns the session, or is closing) send the request on to the
  session's current owner;
* asks the owner about its request while it waits (every third of ``lease_ttl``
  without word): a ping nobody hears asks the store whether the owner's incarnation
  is still the live one, and the owner answers "working", its answer again (one
  whose send failed or was lost; a read's is not kept, it is read again),
  "unknown" (the request never reached it: sent again), or "forgotten" (it keeps
  the last 10,000 answers, and this request's requester issued it no later than
  one whose answer it dropped: it may have run, so a turn without a key, or any
  request not safe to repeat, fails with SessionCrashedError instead of running
  twice; a copy of it that arrives now is ignored).
  If the incarnation is gone (it died, or restarted), a request with an idempotency
  key and every read is sent again, to the session's next owner; a turn without a
  key fails with SessionCrashedError, since it may or may not have run. With no
  word for two lease lifetimes (the store or the owner does not answer), or with
  every copy sent for that long answered "unknown", the caller gets
  WorkerUnreachableError: no caller waits forever;
* serves a subscription to a session it runs from the session's hub here, as a
  registry without other workers does: its events never reach the store;
* publishes the events of a session it runs only while a worker elsewhere
  subscribes to it: the subscriber asks the owner to "watch" it (a forwarded
  request, answered with the seq it starts from), the owner sets the session's
  watch key, which the subscriber's worker renews every third of ``lease_ttl`` (a
  renewal that finds the session deleted ends its stream, in case its deleter could
  not); a worker that wakes the session learns of the key from its claim; an owner
  stops once the key expired. Events go to one
  stream per session whose entry ids are ``<seq>-0``, so a stale ex-owner's events
  are refused by Redis, from one publisher task fed by a bounded queue: the actor
  never waits on the store. Events that do not fit, or that Redis refuses (out
  of memory, unreachable), are dropped and replaced by a marker, written before
  the session's next event or, without one, as soon as Redis takes it, which
  subscribers see as lag (never as a silent gap). An owner that
  starts publishing first publishes the journal entries the stream lacks;
* serves a subscription to a session it does not run from that stream, so it
  follows its session from worker to worker (a failover, or a wake elsewhere) with
  the same seqs and the same ``after=`` replay: the stream, then the store's journal
  for what the stream does not hold, then live events. One task reads the inbox and
  every mirrored stream with a single blocking read (on a Redis Cluster, one read per
  slot: see the transport);
* goes on with a local subscription whose session leaves this worker (hibernated,
  handed over, or its shard lost) as one fed by that stream, from the last seq it
  delivered (``EventIterator.follow``), without waking the session: it marks the
  session watched first, so whoever wakes it next publishes from its first event on;
  an owner that took it before is asked to publish from that seq, its hub's events
  first (deltas included; the journal fills in what the hub no longer holds). Only
  a subscriber that fell behind, or a stream trimmed past its reader, lags;
* shares the shards fairly (``balance``, the default): every worker lists the live
  workers every third of ``lease_ttl`` (each one announces itself for ``lease_ttl``)
  and gives every shard a preferred worker by rendezvous hashing over them, so a
  worker that joins or leaves moves only about 1/n of the shards. A request for a
  session of a free shard that prefers another live worker is forwarded there, and
  wakes the session there. A worker holding shards that prefer another worker hands
  them over, ``_HANDOVERS`` at a time (listed every round, the next one started as
  soon as one is done, so the pace follows how fast sessions come to rest, not the
  rounds): it holds new requests for
  the shard's sessions, hibernates them once the turns already in their mailboxes
  are done (a turn boundary: nothing acknowledged is cut or run twice), which
  releases the shard; the held requests then go to the shard's next owner (its
  preferred worker wakes it). A shard whose sessions do not all come to rest within
  ``lease_ttl`` (a long turn; a turn waiting on a review is at rest: the session
  hibernates with it) stays, its held requests are served here, and it is tried
  again later. Without a fresh list of the
  workers (the store does not answer), a worker places nothing elsewhere.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, cast

import attrs
import msgpack
import trio

from .._codec import (
    MAX_ARRAY_LEN,
    MAX_MAP_LEN,
    dump_event,
    dump_events,
    dump_snapshot,
    load_event,
    load_events,
    load_snapshot,
)
from .._errors import (
    LeaseHeldError,
    SessionActorsError,
    SessionCrashedError,
    SessionStoppedError,
    SnapshotError,
    StoreConfigurationError,
    StoreError,
    WorkerUnreachableError,
)
from .._events import Event, MessageAdded, ReviewRequested, StatusChanged
from .._hub import Hub
from .._pending import Append, Pending
from .._records import Message, ReviewRequest, SessionState, Status, id_issuer, new_id
from .._ref import Turn, new_turn
from .._requests import (
    AddMessages,
    Call,
    Cancel,
    Delete,
    Hibernate,
    ReplaceHistory,
    Reply,
    ResolveReview,
    Retry,
    Rewind,
    SetMetadata,
    SetSummary,
    Stop,
    Truncate,
)
from .._router import NOT_ROUTED, RouterHost
from .._subscription import EventIterator, open_event_iterator
from ..stores._base import JournalEntry, Store

__all__ = ["Cluster", "ClusterStatistics", "StreamItem", "Transport", "open_cluster"]

#: One entry of a session's event stream: (seq, kind, payload). Kinds: "event"
#: (payload: the codec's bytes), "lost" (payload: the first lost seq, ASCII; the
#: entry's seq is the last lost one) and "gone" (the session was deleted).
StreamItem = tuple[int, str, bytes]

_QUEUE_SIZE: Final = 10_000  # events waiting for the publisher, all sessions together
_BATCH: Final = 1000  # events per publishing round trip
#: Seconds between attempts to write lag markers that the store refused, while no
#: newer event comes to carry them (their readers would otherwise wait without end).
_MARKER_RETRY: Final = 0.5
_MAX_ATTEMPTS: Final = 200  # forwarding attempts (moves, refused posts) before giving up
_ANSWER_ATTEMPTS: Final = 5
_ANSWERS_KEPT: Final = 10_000  # answers kept for a requester that asks again
#: Requesting processes for which a worker remembers the last answer it dropped.
_ISSUERS_KEPT: Final = 10_000
_NOT_KEPT: Final = ("read", "watch")  # requests safe to serve again: their answers are not
_MAX_HINTS: Final = 100_000
#: Requests that may run twice without harm: sent again to the next owner if one dies.
_SAFE_CALLS: Final = (SetSummary, SetMetadata, ReplaceHistory, Cancel, Hibernate)
#: The requests a worker forwards, by their wire tag (never reuse a retired tag).
_CALL_TAGS: Final[dict[str, type[Any]]] = {
    "truncate": Truncate,
    "rewind": Rewind,
    "set_summary": SetSummary,
    "set_metadata": SetMetadata,
    "review": ResolveReview,
    "hibernate": Hibernate,
    "cancel": Cancel,
    "stop": Stop,
    "delete": Delete,
    "retry": Retry,
    "add_messages": AddMessages,
    "replace_history": ReplaceHistory,
}
_TAG_OF: Final = {cls: tag for tag, cls in _CALL_TAGS.items()}
# Errors that are plain builtins when the owner raises them.
_BUILTIN_ERRORS: Final[dict[str, type[Exception]]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "LookupError": LookupError,
    "KeyError": KeyError,
}
_ERROR_ATTRS: Final = ("turn_id", "last_seq", "oldest_seq", "status_code")
_HANDOVERS: Final = 8  # shards a worker hands over at a time (balancing)
_RETRY_ROUNDS: Final = 10  # balancing rounds before a shard that stayed is tried again
_BUSY_TRIES: Final = 3  # hibernations a hand-over tries while a session stays busy


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

    async def lease_owner(self, session_id: str) -> str | None:
        """The worker holding the session's lease, or None."""
        ...

    async def members(self, worker: str, ttl: float | None) -> list[str]:
        """Count ``worker`` among the live workers for ``ttl`` seconds (None: no longer);
        the live workers."""
        ...

    def shard(self, session_id: str) -> int:
        """The shard of a session: the sessions whose leases are held together."""
        ...

    async def watch(self, names: Sequence[str], ttl: float) -> None:
        """Say a worker other than the owner subscribes to the sessions (for 3 * ttl);
        end the event stream of any of them no longer stored (see ``end_events``)."""
        ...

    async def watched(self, names: Sequence[str]) -> set[str]:
        """Those of the sessions some worker still watches."""
        ...

    def take_watched(self, session_id: str) -> bool:
        """Whether this worker's claim of the session found it watched (once per claim)."""
        ...

    async def incarnation(self, worker: str) -> str | None:
        """The live incarnation of ``worker``, or None."""
        ...

    async def send(self, worker: str, incarnation: str, message: bytes) -> bool:
        """Hand ``message`` to that incarnation of ``worker`` if it listens (at most
        once: it may still be lost on the way); whether it listened."""
        ...

    async def listen(
        self,
        worker: str,
        incarnation: str,
        deliver: Callable[[bytes], None],
        subscribed: Callable[[], None],
    ) -> None:
        """Call ``deliver`` with every message sent to this incarnation of ``worker``,
        once ``subscribed`` was called, until the connection fails (``StoreError``)."""
        ...

    async def post(self, worker: str, message: bytes, ttl: float) -> str | None:
        """Append to the worker's inbox (it wakes the worker's reader) if it is alive;
        its incarnation, or None."""
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

    async def first_event_seq(self, session_id: str) -> int:
        """The seq of the oldest entry of the session's event stream (0 if none)."""
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
        """Mark the session's event stream as ended (the session was deleted), unless a
        session of that name is stored again; once."""
        ...


# ---- wire format -------------------------------------------------------------------


def _pack(body: Mapping[str, Any]) -> bytes:
    # (datetimes: metadata may hold them, and set_metadata carries metadata)
    data: bytes = msgpack.packb(body, use_bin_type=True, datetime=True)
    return data


def _unpack(data: bytes) -> dict[str, Any] | None:
    # (the codec's bounds: metadata, which set_metadata carries and answers with, may
    # hold as many keys and items as the store keeps)
    try:
        body = msgpack.unpackb(
            data, raw=False, timestamp=3, max_map_len=MAX_MAP_LEN, max_array_len=MAX_ARRAY_LEN
        )
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def _dump_reply(name: str, reply: Reply) -> dict[str, Any]:
    turn_id, message, reviews = reply.turn_id, reply.message, reply.reviews
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


def _load_reply(name: str, body: Any) -> Reply:
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
    return Reply(turn_id=turn_id, message=message, reviews=tuple(reviews))


def _dump_call(name: str, request: Call | Cancel | Stop | Delete) -> dict[str, Any]:
    if isinstance(request, AddMessages | ReplaceHistory):  # records: the codec's bytes
        added = [MessageAdded(session_id=name, seq=0, message=m) for m in request.messages]
        return {"t": _TAG_OF[type(request)], "m": dump_events(added) if added else None}
    return {"t": _TAG_OF[type(request)], "f": attrs.asdict(request)}


def _load_call(name: str, body: Any) -> Call | Cancel | Stop | Delete:
    cls = _CALL_TAGS[str(body["t"])]
    request: Call | Cancel | Stop | Delete
    if cls is AddMessages or cls is ReplaceHistory:
        data = body["m"]
        events = [] if data is None else load_events(bytes(data), session_id=name)
        messages = tuple(e.message for e in events if isinstance(e, MessageAdded))
        request = cls(messages=messages)
    else:
        request = cls(**dict(body["f"]))
    return request


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
    placed: int = 0  # requests for a free shard sent to its preferred worker
    handed_over: int = 0  # shards this worker gave up for their preferred worker
    kept: int = 0  # handovers given up: the shard's sessions did not come to rest in time


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


class _Handover:
    """A shard this worker hands over: its requests wait for ``done``; ``moved`` says
    whether the shard left (its sessions hibernated) or stays here."""

    __slots__ = ("done", "moved")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.moved = False


def _weight(shard: int, worker: str) -> int:
    """The rendezvous weight of ``worker`` for ``shard``: the heaviest live worker is
    the shard's preferred one."""
    digest = hashlib.blake2b(f"{shard}|{worker}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


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
        # The stream does not reach back to ``after``: the journal has the durable events
        # (an entry holds a commit's events; the subscription merges them by seq).
        trimmed, entries = await self._cluster.host.store.read_journal(session_id, after)
        return trimmed, entries + [JournalEntry(seq, found[seq]) for seq in sorted(found)]


class Cluster:
    """One worker's side of the cluster: inbox, forwarding, event streams, mirrors."""

    def __init__(self, host: RouterHost, transport: Transport, *, balance: bool = True) -> None:
        self.host = host
        self.transport = transport
        self.balance = balance
        self.worker = host.worker_id
        self.incarnation = new_id("inc")
        self.ttl = host.config.lease_ttl
        self.stats = ClusterStatistics()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._waiters: dict[str, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._owners: dict[str, str] = {}  # session -> owner hint ("": another, unknown)
        self._incarnations: dict[str, str] = {}  # worker -> its live incarnation, as last seen
        self._listening: trio.CancelScope | None = None
        #: Subscriptions made so far; the heartbeat's last wake to its own channel
        #: (its number, and the subscription it went to), and the last wake heard.
        self._subscriptions = 0
        self._wake_sent: tuple[int, int] | None = None
        self._wake_heard = 0
        self._serving: set[str] = set()  # ids of the requests being served here
        self._answered: dict[str, bytes] = {}  # the latest answers, by request id
        #: Answers sent with their turn's outcome (see _answer_with_outcome), by request
        #: id, until their serving task keeps them.
        self._sent_answers: dict[str, bytes] = {}
        # requesting process -> the place (``id_issuer``) of the latest of its requests
        # whose answer was dropped from _answered: those up to it may have been answered
        self._forgotten: dict[str, int] = {}
        self._mirrors: dict[str, Hub] = {}
        #: Sessions whose events this worker publishes (another worker subscribes), and
        #: whether the stream must first catch up from the journal.
        self._watched: dict[str, bool] = {}
        self._positions: dict[str, int] = {}
        #: Mirrors made for a subscription that followed its session, whose stream was
        #: not read yet: seqs missing before its first event are judged by the journal
        #: (a wake after an unclean stop jumps over seqs that were never durable).
        self._unread: set[str] = set()
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
        # Balancing: the live workers as last listed (and when), each shard's preferred
        # worker among them, the shards being handed over, and when a shard that
        # stayed may be tried again.
        self._members: tuple[str, ...] = ()
        self._members_at = -math.inf
        self._preferred: dict[int, str] = {}
        self._leaving: dict[int, _Handover] = {}
        self._kept: dict[int, float] = {}
        self._due: collections.deque[int] = collections.deque()  # shards to hand over next

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
                await nursery.start(self._listen_loop, name="cluster requests")
                while True:
                    try:
                        # Start after what an earlier incarnation with this worker id left
                        # (its requesters see the new incarnation and send again).
                        await self._skip_stale_inbox()
                        await self.transport.heartbeat(
                            self.worker, self.incarnation, self.ttl, None
                        )
                        break
                    except StoreError as exc:
                        _fatal(exc)
                        await trio.sleep(min(1.0, self.ttl / 3))
                nursery.start_soon(self._heartbeat_loop, name="cluster heartbeat")
                nursery.start_soon(self._read_loop, name="cluster inbox")
                nursery.start_soon(self._balance_loop, name="cluster balance")
        finally:
            self._nursery = None
            for send in list(self._waiters.values()):
                send.close()
            for hub in self._mirrors.values():
                hub.close()
            self._mirrors.clear()

    async def aclose(self) -> None:
        """Flush the events and retire this worker (requests that still reach it until
        its nursery ends are answered "moved")."""
        self._closing = True
        with trio.CancelScope(shield=True), trio.move_on_after(min(5.0, self.ttl)):
            await self._withdraw()
            if self._receive.statistics().current_buffer_used or self._publishing:
                flushed = self._flushed = trio.Event()
                with trio.move_on_after(min(2.0, self.ttl)):
                    await flushed.wait()
            with contextlib.suppress(StoreError):
                await self.transport.leave(self.worker, self.incarnation)

    async def _skip_stale_inbox(self) -> None:
        messages, _ = await self.transport.read(self.worker, "0-0", {}, None)
        while messages:
            self._inbox_last = messages[-1][0]
            messages, _ = await self.transport.read(self.worker, self._inbox_last, {}, None)

    async def _listen_loop(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Receive this incarnation's requests and answers; subscribe again whenever
        the connection is lost (messages sent meanwhile are asked about again)."""
        started = False

        def subscribed() -> None:
            nonlocal started
            self._subscriptions += 1
            if not started:
                started = True
                task_status.started()

        while True:
            with trio.CancelScope() as self._listening:
                try:
                    await self.transport.listen(
                        self.worker, self.incarnation, self._dispatch, subscribed
                    )
                except StoreError as exc:
                    _fatal(exc)
                    await trio.sleep(min(1.0, self.ttl / 10))

    async def _heartbeat_loop(self) -> None:
        for count in itertools.count(1):
            await trio.sleep(self.ttl / 3)
            keep_from, self._keep_from = self._keep_from, None
            try:
                await self.transport.heartbeat(self.worker, self.incarnation, self.ttl, keep_from)
                # A subscription the server dropped in silence is made again, and so is
                # one that went deaf (its connection half-open: the server still counts
                # it, but the last wake sent to it never came through).
                listening = self._listening
                sent, self._wake_sent = self._wake_sent, None
                if (
                    listening is not None
                    and sent is not None
                    and sent[1] == self._subscriptions  # (judged on the one it went to)
                    and self._wake_heard != sent[0]
                ):
                    listening.cancel()  # (the next round's wake goes to the new one)
                    listening = None
                if listening is not None:
                    subscription = self._subscriptions
                    wake = _pack({"op": "wake", "n": count})
                    if await self.transport.send(self.worker, self.incarnation, wake):
                        self._wake_sent = (count, subscription)
                    else:
                        listening.cancel()
            except StoreError as exc:
                _fatal(exc)
                self._keep_from = self._keep_from or keep_from
            try:
                await self.transport.watch(list(self._mirrors), self.ttl)
                if self._watched:
                    names = list(self._watched)
                    still = await self.transport.watched(names)
                    for name in names:
                        if name not in still:  # nobody elsewhere subscribes any more
                            self._watched.pop(name, None)
            except StoreError as exc:
                _fatal(exc)

    async def _read_loop(self) -> None:
        block = max(0.05, min(self.ttl / 3, 5.0))
        while True:
            try:
                messages, events = await self.transport.read(
                    self.worker, self._inbox_last, dict(self._positions), block
                )
            except StoreError as exc:
                _fatal(exc)  # e.g. a user without blocking reads: never retried in silence
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
                first = items[0] if items else None
                if (
                    first is not None
                    and first[1] != "gone"  # (the end marker's seq is above every seq)
                    and first[0] > self._positions.get(name, 0) + 1
                ):
                    await self._check_gap(name, first[0])
                if items:
                    self._unread.discard(name)
                self._feed(name, items)
                if items and self.host.is_live(name):
                    self._rejoin(name)

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
        op = body.get("op")
        if op == "wake":
            self._wake_heard = body.get("n") or self._wake_heard
            return
        if self._nursery is None:
            return
        if op == "ping":
            self._nursery.start_soon(self._pong, body, name="cluster pong")
            return
        rid = str(body.get("id"))
        if rid in self._serving or rid in self._answered or self._maybe_forgotten(rid):
            return  # a request sent again while its first copy runs or was answered
        self._serving.add(rid)
        queued = self._queue_turn(body) if op == "turn" else None
        self._nursery.start_soon(self._serve, rid, body, queued, name="cluster request")

    # ---- the owner's side ----------------------------------------------------------

    def _queue_turn(self, body: Mapping[str, Any]) -> Pending | None:
        """A forwarded turn put in the mailbox of its session, live here, at once (the
        actor starts it while the serving task starts); None when that takes a wait,
        a wake, a handover or an idempotency key (the serving task submits it)."""
        name, text = body.get("s"), body.get("text")
        if (
            body.get("ack")
            or body.get("key") is not None
            or self._closing
            or self.host.closing
            or not isinstance(name, str)
            or not isinstance(text, str)
            or self.transport.shard(name) in self._leaving
        ):
            return None
        try:
            pending = self.host.enqueue_here(name, text)
        except Exception:  # (the serving task meets it again, and answers it)
            return None
        append_and_send = getattr(self.transport, "append_and_send", None)
        if pending is not None and append_and_send is not None:
            pending.write_outcome = self._answer_with_outcome(name, body, append_and_send)
        return pending

    def _answer_with_outcome(
        self, name: str, request: Mapping[str, Any], append_and_send: Any
    ) -> Callable[[Reply], Append | None]:
        """For a turn queued at once: the journal write of its outcome that also sends
        its answer, in the same round trip to the store (a transport that offers
        ``append_and_send``); its serving task then only keeps the answer."""
        rid = str(request.get("id"))
        to, incarnation = str(request.get("from")), str(request.get("fi"))

        def write(reply: Reply) -> Append | None:
            try:  # (as _answer packs it)
                data = _pack({"ok": "reply", "reply": _dump_reply(name, reply), "re": rid})
            except Exception:  # (never the turn's fault: its serving task answers it)
                return None

            async def append(entries: Sequence[Any], info: bytes, fence: int | None) -> None:
                if await append_and_send(name, entries, info, fence, to, incarnation, data):
                    self._sent_answers[rid] = data

            return append

        return write

    async def _serve(self, rid: str, body: dict[str, Any], queued: Pending | None) -> None:
        """Run a request another worker sent, and answer it."""
        try:
            await self._serve_request(body, queued)
        finally:
            self._serving.discard(rid)

    async def _serve_request(self, body: dict[str, Any], queued: Pending | None = None) -> None:
        self.stats.served += 1
        host = self.host
        try:
            op = str(body["op"])
            name = str(body["s"])
            if queued is not None:
                # In the mailbox already, before any hand-over of its shard began (a
                # hand-over's hibernation queues behind it): it runs here, and only here.
                try:
                    reply = await queued.wait()
                finally:
                    sent = self._sent_answers.pop(str(body.get("id")), None)
                if sent is not None:  # sent with the outcome's journal write
                    self._keep(str(body.get("id")), sent)
                    return
                await self._answer(body, {"ok": "reply", "reply": _dump_reply(name, reply)})
                return
            handover = self._leaving.get(self.transport.shard(name))
            if handover is not None:  # its shard is leaving: wait, then send it on
                await handover.done.wait()
                if handover.moved:
                    self.stats.moved += 1
                    await self._answer(body, {"moved": True})
                    return
            # Not live here (hibernated, or a session of a shard this worker holds):
            # it wakes here, as its shard's owner; a claim refused says "moved".
            if op == "turn":
                key = body.get("key")
                turn = await host.submit_here(name, str(body["text"]), key)
                if body.get("ack"):
                    await self._answer(
                        body, {"ok": "ack", "turn_id": turn.id, "replayed": turn.replayed}
                    )
                reply = await turn.reply()
                await self._answer(body, {"ok": "reply", "reply": _dump_reply(name, reply)})
            elif op == "read":
                state = await host.read_here(name)
                await self._answer(body, {"ok": "state", "state": dump_snapshot(state)})
            elif op == "watch":  # another worker subscribes: publish from now on
                await host.read_here(name)  # wakes it here (or says it moved)
                await self.transport.watch([name], self.ttl)  # for its next owners too
                seq = host.event_seq_here(name)
                if seq is not None and name not in self._watched:
                    self._watched[name] = False
                    # A subscription that follows the session from ``after`` on: the
                    # events since then that the hub still holds go first, deltas too.
                    since = body.get("after")
                    held = None if since is None else host.events_here(name, int(since))
                    if since is not None and held is not None:
                        seq = int(since)
                    self._enqueue(name, _CatchUp(seq))
                    for event in held or ():
                        self._enqueue(name, event)
                await self._answer(body, {"ok": "value", "value": -1 if seq is None else seq})
            elif op == "call":
                value = await host.call_here(name, _load_call(name, body["req"]))
                if isinstance(value, Reply):
                    value = _dump_reply(name, value)
                await self._answer(body, {"ok": "value", "value": value})
            else:
                raise ValueError(f"unknown cluster request {op!r}")
        except LeaseHeldError:
            self.stats.moved += 1
            await self._answer(body, {"moved": True})
        except SessionStoppedError as exc:
            # Not run here (closing): the session's next owner runs it. A turn that had
            # started (cut off by the shutdown) is in the history: never run it again.
            if host.closing and not exc.turn_id:
                await self._answer(body, {"moved": True})
            else:
                await self._answer(body, _dump_error(exc))
        except Exception as exc:
            await self._answer(body, _dump_error(exc))

    async def _answer(self, request: Mapping[str, Any], body: dict[str, Any]) -> None:
        """Post an answer; a final one is also kept, for a requester that asks again
        (its post failed, or the store lost it before the requester read it), except
        a read's (a whole state, safe to read again: its requester hears "unknown"
        and asks again)."""
        rid = str(request.get("id"))
        body["re"] = rid
        data = _pack(body)
        if body.get("ok") != "ack" and request.get("op") not in _NOT_KEPT:
            self._keep(rid, data)
        await self._post_answer(str(request.get("from")), str(request.get("fi")), data)

    def _keep(self, rid: str, data: bytes) -> None:
        """Keep the final answer to request ``rid`` for a requester that asks again."""
        answered = self._answered
        answered[rid] = data
        if len(answered) > _ANSWERS_KEPT:
            dropped = next(iter(answered))
            del answered[dropped]
            self._forget(dropped)

    async def _post_answer(self, to: str, incarnation: str, data: bytes) -> None:
        for attempt in range(_ANSWER_ATTEMPTS):
            try:
                if await self.transport.send(to, incarnation, data):
                    return
            except StoreError as exc:
                _fatal(exc)
            # nobody listened (the requester subscribes again within moments if its
            # connection dropped); its ping fetches the answer otherwise
            await trio.sleep(min(self.ttl / 3, 0.05 * (attempt + 1)))

    def _forget(self, rid: str) -> None:
        """Note that the answer to request ``rid`` is no longer kept."""
        issuer = id_issuer(rid)
        if issuer is None:
            return
        process, place = issuer
        forgotten = self._forgotten
        forgotten[process] = max(place, forgotten.pop(process, -1))  # (now the newest)
        if len(forgotten) > _ISSUERS_KEPT:
            del forgotten[next(iter(forgotten))]

    def _maybe_forgotten(self, rid: str) -> bool:
        """Whether request ``rid`` may have been answered here and its answer dropped:
        its requester issued it no later than a request whose answer was dropped."""
        if not self._forgotten:  # (the common case: no answer dropped yet)
            return False
        issuer = id_issuer(rid)
        return issuer is not None and issuer[1] <= self._forgotten.get(issuer[0], -1)

    async def _pong(self, ping: Mapping[str, Any]) -> None:
        """Tell a requester how its request ``q`` stands here."""
        rid = str(ping.get("q"))
        data = self._answered.get(rid)
        if data is None:
            if rid in self._serving:
                state = "working"
            elif self._maybe_forgotten(rid):
                state = "forgotten"  # never "unknown": that would have it sent again
            else:
                state = "unknown"
            data = _pack({"re": rid, "ok": state})
        try:
            await self.transport.send(str(ping.get("from")), str(ping.get("fi")), data)
        except StoreError as exc:
            _fatal(exc)  # otherwise it asks again

    # ---- the requester's side ------------------------------------------------------

    def elsewhere(self, name: str) -> bool:
        """Whether this worker believes another one runs ``name``, or should (its shard
        is being handed over, or prefers another worker); no I/O."""
        shard = self.transport.shard(name)
        if shard in self._leaving:
            return True
        if self.host.is_live(name):
            return False
        return name in self._owners or self._preferred_worker(shard) != self.worker

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
        if not ack:  # carried by the caller's task: a caller that gives up abandons it
            request = {"op": "turn", "s": name, "text": text, "key": key, "ack": False}
            answer = await self._forward(name, request, retry_safe=key is not None)
            if answer is None:
                return None
            pending = Pending()
            try:
                reply = _load_reply(name, self._check(answer, name)["reply"])
            except Exception as exc:
                pending.set_error(exc)
                return new_turn("", name, pending)
            pending.set_result(reply)
            return new_turn(reply.turn_id, name, pending)
        nursery = self._running(name)
        forwarded = _Forwarded()
        nursery.start_soon(self._carry_turn, name, text, key, ack, forwarded)
        await forwarded.settled.wait()
        if forwarded.local:
            return None
        if forwarded.early_error is not None:
            raise forwarded.early_error
        return new_turn(forwarded.turn_id, name, forwarded.pending, replayed=forwarded.replayed)

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
                turn = await self.host.submit(name, text, key, ack=False)
                forwarded.pending.set_result(await turn.reply())
                return
            result = _load_reply(name, self._check(answer, name)["reply"])
            forwarded.turn_id = forwarded.turn_id or result.turn_id
            forwarded.pending.set_result(result)
        except Exception as exc:
            if ack and not forwarded.accepted:
                forwarded.early_error = exc
            forwarded.pending.set_error(exc)
        finally:
            if not forwarded.pending.done and not forwarded.local:
                forwarded.pending.set_error(_closing_error(name))
            forwarded.settled.set()

    async def read(self, name: str) -> SessionState | None:
        """The session's state from its owner; None if the session is free."""
        answer = await self._forward(name, {"op": "read", "s": name}, retry_safe=True)
        if answer is None:
            return None
        state = load_snapshot(bytes(self._check(answer, name)["state"]), session_id=name)
        return state

    async def call(self, name: str, request: Call | Cancel | Stop | Delete) -> Any:
        """Run a request other than a turn at the session's owner; NOT_ROUTED when no
        other worker holds the session."""
        body = {"op": "call", "s": name, "req": _dump_call(name, request)}
        answer = await self._forward(name, body, retry_safe=isinstance(request, _SAFE_CALLS))
        if answer is None:
            return NOT_ROUTED
        value = self._check(answer, name)["value"]
        if isinstance(request, ResolveReview | Retry):
            return _load_reply(name, value)
        return value

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
        shard = self.transport.shard(name)
        unheard_since: float | None = None  # since when the owner says it never got it
        unheard_copies = 0
        for attempt in range(_MAX_ATTEMPTS):
            handover = self._leaving.get(shard)
            if handover is not None:  # handing the shard over: wait for its next owner
                await handover.done.wait()
            owner = self._owners.get(name) or None
            if owner is None:
                owner = await self.transport.lease_owner(name)
                if owner is None:  # a free shard: it wakes at its preferred worker
                    owner = self._preferred_worker(shard)
                    if owner != self.worker:
                        self.stats.placed += 1
                if owner == self.worker:
                    self._owners.pop(name, None)
                    return None
                self.held_elsewhere(name)
                self._owners[name] = owner
            incarnation = self._incarnations.get(owner)
            if incarnation is None:
                incarnation = await self.transport.incarnation(owner)
                if incarnation is None:  # not alive: its leases lapse within lease_ttl
                    self.stats.unreachable += 1
                    self._owners.pop(name, None)
                    self._drop_member(owner)
                    await trio.sleep(min(self.ttl / 10, 0.01 * (attempt + 1)))
                    continue
                self._incarnations[owner] = incarnation
            rid = new_id("rq")
            sent_at = trio.current_time()
            send, receive = trio.open_memory_channel[dict[str, Any]](4)
            self._waiters[rid] = send
            try:
                body = {**request, "id": rid, "from": self.worker, "fi": self.incarnation}
                if not await self.transport.send(owner, incarnation, _pack(body)):
                    # Nobody listens there: a new incarnation, one that is gone, or one
                    # between two subscriptions (looked up again next time).
                    self._incarnations.pop(owner, None)
                    current = await self.transport.incarnation(owner)
                    if current is None or current == incarnation:
                        self.stats.unreachable += 1
                        self._owners.pop(name, None)
                        await trio.sleep(min(self.ttl / 10, 0.01 * (attempt + 1)))
                    else:
                        self._incarnations[owner] = current
                    continue
                self.stats.forwarded += 1
                answer = await self._wait_answer(name, owner, incarnation, rid, receive, on_ack)
            finally:
                del self._waiters[rid]
            if answer.get("ok") == "unknown":  # it never got the request: send it again
                # (a copy lost on the way); every copy lost for two lease lifetimes
                # (the owner cannot read them, or they never reach it): give up
                unheard_since = sent_at if unheard_since is None else unheard_since
                unheard_copies += 1
                unheard = trio.current_time() - unheard_since
                if unheard > 2 * self.ttl:
                    raise WorkerUnreachableError(
                        f"session {name!r}: worker {owner!r}, which runs it, never got this "
                        f"request in {unheard:.1f} s ({unheard_copies} copies lost), so it did "
                        "not run there; send it again",
                        session_id=name,
                    )
                self.stats.moved += 1
                continue
            unheard_since, unheard_copies = None, 0
            if answer.get("ok") == "forgotten":  # it may have run: its answer is gone
                if not retry_safe:
                    raise SessionCrashedError(
                        f"session {name!r}: worker {owner!r}, which runs it, may have run "
                        "this request, but its answer was lost on the way and is no longer "
                        "kept there; look at the history (or ref.turn_outcome) before sending "
                        "it again (a turn sent with idempotency_key=... runs once however "
                        "often it is sent)",
                        session_id=name,
                    )
                continue
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
        rid: str,
        receive: trio.MemoryReceiveChannel[dict[str, Any]],
        on_ack: Callable[[Mapping[str, Any]], None] | None,
    ) -> dict[str, Any]:
        """The owner's answer, _OWNER_DIED, or {"ok": "unknown"} (the owner never got
        the request); WorkerUnreachableError after two lease lifetimes without word."""
        heard = trio.current_time()
        acked = False
        failure: StoreError | None = None
        ping = b""  # made when first needed: most answers come before
        while True:
            with trio.move_on_after(self.ttl / 3):
                while True:
                    try:
                        answer = await receive.receive()
                    except (trio.EndOfChannel, trio.ClosedResourceError):
                        raise _closing_error(name) from None
                    heard = trio.current_time()
                    if answer.get("ok") == "ack":
                        acked = True
                        if on_ack is not None:
                            on_ack(answer)
                    elif answer.get("ok") == "unknown" and acked:
                        return _OWNER_DIED  # it had the turn and forgot it: it restarted
                    elif answer.get("ok") != "working":
                        return answer
            ping = ping or _pack(
                {"op": "ping", "q": rid, "from": self.worker, "fi": self.incarnation}
            )
            try:
                # not heard: gone, or between two subscriptions (it hears the next ping)
                if (
                    not await self.transport.send(owner, incarnation, ping)
                    and await self.transport.incarnation(owner) != incarnation
                ):
                    return _OWNER_DIED
            except StoreError as exc:
                _fatal(exc)
                failure = exc
            silence = trio.current_time() - heard
            if silence > 2 * self.ttl:
                raise WorkerUnreachableError(
                    f"session {name!r}: no word from worker {owner!r}, which runs it, for "
                    f"{silence:.1f} s ("
                    + ("the store did not answer" if failure else "it did not answer")
                    + "); the request may or may not have run there: send it again (a turn "
                    "sent with idempotency_key=... runs once however often it is sent)",
                    session_id=name,
                ) from failure

    # ---- balancing: shards go to their preferred workers ---------------------------------

    def _preferred_worker(self, shard: int) -> str:
        """The live worker that ``shard`` prefers (this one without a fresh list)."""
        if (
            not self.balance
            or len(self._members) < 2
            or trio.current_time() - self._members_at > self.ttl
        ):
            return self.worker
        found = self._preferred.get(shard)
        if found is None:
            found = self._preferred[shard] = max(
                self._members, key=lambda worker: _weight(shard, worker)
            )
        return found

    def _set_members(self, members: Sequence[str]) -> None:
        found = tuple(sorted({*members, self.worker}))
        if found != self._members:
            self._members = found
            self._preferred.clear()

    def _drop_member(self, worker: str) -> None:
        """A worker found not alive: place nothing there until it is listed again."""
        if worker in self._members and worker != self.worker:
            self._set_members([m for m in self._members if m != worker])

    async def _withdraw(self) -> None:
        """No longer count as a live worker (closing): nothing is placed here any more."""
        self._members = ()
        with contextlib.suppress(StoreError):
            await self.transport.members(self.worker, None)

    async def _balance_loop(self) -> None:
        """List the live workers every third of ``lease_ttl``; hand over shards that
        prefer another one."""
        while not self.host.closing:
            try:
                members = await self.transport.members(self.worker, self.ttl)
            except StoreError as exc:
                _fatal(exc)  # without a fresh list, nothing is placed elsewhere
            else:
                self._members_at = trio.current_time()
                self._set_members(members)
                if self.balance and not self._closing:
                    self._start_handovers()
            await trio.sleep(self.ttl / 3)
        await self._withdraw()

    def _start_handovers(self) -> None:
        """Hand over the shards held here that prefer another worker, a few at a time
        (the next as soon as one is done), those with the fewest live sessions first."""
        self._due.clear()
        if len(self._members) < 2 or self._nursery is None:
            return
        now = trio.current_time()
        held: dict[int, int] = {}
        for name in self.host.live_names():
            shard = self.transport.shard(name)
            held[shard] = held.get(shard, 0) + 1
        due = sorted(
            (count, shard)
            for shard, count in held.items()
            if shard not in self._leaving
            and self._kept.get(shard, -math.inf) <= now
            and self._preferred_worker(shard) != self.worker
        )
        self._due.extend(shard for _, shard in due)
        self._next_handovers()

    def _next_handovers(self) -> None:
        """Start handing over due shards while fewer than ``_HANDOVERS`` are in flight."""
        nursery = self._nursery
        while len(self._leaving) < _HANDOVERS and self._due and nursery is not None:
            shard = self._due.popleft()
            if (
                shard in self._leaving
                or self._closing
                or self.host.closing
                or not self.balance
                or self._preferred_worker(shard) == self.worker
            ):
                continue  # (the workers changed since the round listed it)
            self._leaving[shard] = _Handover()
            nursery.start_soon(self._hand_over, shard, name=f"cluster handover {shard}")

    async def _hand_over(self, shard: int) -> None:
        """Hibernate the shard's sessions here at their next turn boundary (new requests
        for them wait meanwhile), which releases the shard; or give up after ``lease_ttl``,
        or at once if a session stays busy (requests keep coming in)."""
        handover = self._leaving[shard]
        host = self.host
        try:
            with trio.move_on_after(max(1.0, self.ttl)):
                busy = 0
                while True:
                    names = [n for n in host.live_names() if self.transport.shard(n) == shard]
                    if not names:
                        handover.moved = True
                        break
                    stayed: list[str] = []
                    async with trio.open_nursery() as nursery:
                        for name in names:
                            nursery.start_soon(self._hibernate_here, name, stayed)
                    busy += bool(stayed)
                    if busy >= _BUSY_TRIES:
                        break
                    await trio.sleep(0.01)  # (a session that left is gone from the table soon)
        finally:
            del self._leaving[shard]
            handover.done.set()
            if handover.moved:
                self.stats.handed_over += 1
                self._kept.pop(shard, None)
            else:
                self.stats.kept += 1
                self._kept[shard] = trio.current_time() + _RETRY_ROUNDS * self.ttl / 3
            self._next_handovers()

    async def _hibernate_here(self, name: str, stayed: list[str]) -> None:
        """Hibernate a session here once the requests in its mailbox are done; note it in
        ``stayed`` if it stays live (a request came in meanwhile)."""
        with contextlib.suppress(SessionActorsError):  # gone meanwhile, or fenced out
            if await self.host.call_here(name, Hibernate()) is False:
                stayed.append(name)

    # ---- events: publishing ------------------------------------------------------------

    def tap_for(self, name: str) -> Callable[[Event], None]:
        """The function a session's hub calls with every event it publishes: it goes
        to the session's stream while another worker subscribes, nowhere otherwise."""
        watched = self._watched
        take_watched = self.transport.take_watched

        def tap(event: Event) -> None:
            catch_up = watched.get(name)
            if catch_up is None:
                if not take_watched(name):
                    return  # nobody elsewhere subscribes
                catch_up = True
            if catch_up:
                watched[name] = False
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
        keep = self.host.config.hub.replay_events
        receive = self._receive
        while True:
            batch: list[tuple[str, _Item]] = []
            if self._failed or self._lost:  # markers to write, with or without new events
                with trio.move_on_after(_MARKER_RETRY):
                    batch.append(await receive.receive())
            else:
                batch.append(await receive.receive())
            self._publishing = True
            try:
                while len(batch) < _BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                if batch:
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
                except StoreError as exc:
                    _fatal(exc)
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
        """Note the items the stream may lack as lost (a marker's range stays whole; only
        events are counted: a marker's were counted when they were dropped)."""
        for name, items in groups.items():
            first = min(int(data) if kind == "lost" else seq for seq, kind, data in items)
            last = max(seq for seq, _, _ in items)
            lost = sum(kind == "event" for _, kind, _ in items)
            self._lose(name, first, last, self._failed, lost)
        await trio.sleep(0.05)

    async def _catch_up(self, name: str, upto: int, keep: int) -> None:
        """Publish what the stream lacks up to ``upto`` from the journal (a dead
        predecessor's durable events); nothing if the stream was never fed."""
        try:
            top = await self.transport.last_event_seq(name)
            if top == 0 or top >= upto:
                return
            trimmed, batches = await self.host.store.read_journal(name, top)
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
        except SessionActorsError as exc:
            _fatal(exc)
            return  # deleted meanwhile, or the store is unreachable: subscribers replay

    # ---- events: subscriptions ---------------------------------------------------------

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        """A subscription to the session's hub here if it runs here; otherwise fed by
        the session's event stream, wherever the session runs."""
        host = self.host
        found = self._mirrors.get(name)
        top = -1  # where the owner elsewhere starts publishing (-1: it runs here)
        for _ in range(_MAX_ATTEMPTS):
            if found is not None or host.is_live(name):
                break
            answer = await self._forward(name, {"op": "watch", "s": name}, retry_safe=True)
            if answer is not None:  # its owner publishes its events from ``top`` on
                top = int(self._check(answer, name)["value"])
                break
            try:  # live nowhere, or its shard is this worker's: it wakes here
                await host.read_here(name)
            except SessionStoppedError:
                break  # stopped: the local subscription replays and ends
            except LeaseHeldError:
                continue  # another worker woke it meanwhile: ask that one
            if not host.is_live(name):
                break
            found = self._mirrors.get(name)
        return await self._subscribe(name, after, top)

    async def _follow(self, name: str, after: int) -> EventIterator:
        """Go on with a subscription whose session left this worker, from ``after`` (the
        last seq it delivered): from the session's hub here if it woke here again, from
        its event stream otherwise, wherever it runs; a session that runs nowhere is not
        woken (its next owner publishes its events)."""
        top = -1
        for _ in range(_MAX_ATTEMPTS):
            if self.host.is_live(name) or name in self._mirrors:
                break
            # Watched first: whoever claims the session from now on publishes its events.
            await self.transport.watch([name], self.ttl)
            owner = await self.transport.lease_owner(name)
            if owner is None or owner == self.worker:
                top = after  # it runs nowhere: its next owner publishes from its wake on
                break
            # Another worker took it before: it publishes from ``after`` (or the journal
            # fills in what its hub no longer holds).
            request = {"op": "watch", "s": name, "after": after}
            answer = await self._forward(name, request, retry_safe=True)
            if answer is not None:
                top = max(after, int(self._check(answer, name)["value"]))
                break
        return await self._subscribe(name, after, top, followed=True)

    async def _subscribe(
        self, name: str, after: int | None, top: int, *, followed: bool = False
    ) -> EventIterator:
        """A subscription from the session's hub here (``top`` < 0) or from its event
        stream, read from ``top`` on (a mirror made now starts there; ``followed``: for
        a subscription that follows its session from ``top``)."""
        host = self.host
        found = self._mirrors.get(name)
        if found is None and top < 0:
            iterator = await host.open_subscription_here(name, after)
            iterator.follow = lambda seq: self._follow(name, seq)
            return iterator
        if found is None:
            found = self._mirrors[name] = Hub(name, host.config.hub)
            found.advance(top)
            self._positions[name] = top
            if followed:
                self._unread.add(name)
            self._poke()
        hub: Hub = found
        iterator = await open_event_iterator(
            name,
            hub,
            cast(Store, _Replay(self)),
            after,
            lambda: self._release_mirror(name, hub),
        )
        iterator.follow = lambda seq: self._follow(name, seq)  # (back here: see _rejoin)
        if not host.is_live(name):
            try:
                stopped = (await host.stored_status(name)) is Status.STOPPED
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
            self._unread.discard(name)

    def _poke(self) -> None:
        """Have the reader start over, now reading a new mirror's stream too."""
        if self._nursery is None:
            return

        async def poke() -> None:
            # on failure the reader picks the stream up at its next round anyway
            with contextlib.suppress(StoreError):
                await self.transport.post(self.worker, _pack({"op": "wake"}), self.ttl)

        self._nursery.start_soon(poke, name="cluster poke")

    async def _check_gap(self, name: str, first: int) -> None:
        """The stream skips seqs after a mirror's position (its next event is ``first``):
        if it was trimmed past it (it outran the reader, or the store lost it), the
        mirror's subscribers lag."""
        position = self._positions.get(name, 0)
        if not position:
            return  # a new mirror: its subscribers' replay came from the journal
        try:
            oldest = await self.transport.first_event_seq(name)
        except StoreError as exc:
            _fatal(exc)
            oldest = 0
        if 0 < oldest <= position + 1:
            return
        if name in self._unread and await self._never_durable(name, position, first):
            return  # the new owner jumped over them: a followed subscription missed nothing
        hub = self._mirrors.get(name)
        if hub is not None:
            hub.lose()  # they subscribe again with after=, which reads the journal

    async def _never_durable(self, name: str, position: int, first: int) -> bool:
        """Whether the journal holds no event with a seq between ``position`` and ``first``."""
        try:
            trimmed, entries = await self.host.store.read_journal(name, position)
            return trimmed <= position and not any(
                position < event.seq < first
                for entry in entries
                for event in load_events(entry.data, session_id=name)
            )
        except SessionActorsError as exc:  # unreadable: count it as a gap
            _fatal(exc)
            return False

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

    def _rejoin(self, name: str) -> None:
        """The session runs here again: once the hub here holds every event after the
        mirror's, the mirror's subscriptions follow it (they go on from the hub here)."""
        hub = self._mirrors.get(name)
        position = self._positions.get(name)
        if hub is None or position is None or self.host.events_here(name, position) is None:
            return
        del self._mirrors[name]
        self._positions.pop(name, None)
        self._unread.discard(name)
        hub.leave()

    def _end_mirror(self, name: str, hub: Hub) -> None:
        hub.close()
        if self._mirrors.get(name) is hub:
            del self._mirrors[name]
            self._positions.pop(name, None)
            self._unread.discard(name)

    async def created(self, name: str) -> None:
        await self.transport.reset_events(name)

    async def deleted(self, name: str) -> None:
        # (if this fails, the workers that subscribe end the stream: their next watch
        # finds the session gone)
        with contextlib.suppress(StoreError):
            await self.transport.end_events(name)


def _fatal(exc: BaseException) -> None:
    """Raise ``exc`` again if no retry can fix it (the store's configuration)."""
    if isinstance(exc, StoreConfigurationError):
        raise exc


def _closing_error(name: str) -> SessionStoppedError:
    return SessionStoppedError(
        f"the registry is closing, so the request to session {name!r} was not answered; "
        "send it again once a registry is open",
        session_id=name,
    )


async def open_cluster(
    host: RouterHost, transport: Transport, nursery: trio.Nursery, *, balance: bool = True
) -> Cluster:
    """Start a registry's multi-worker router over ``transport`` in ``nursery``; with
    ``balance``, the workers share the shards fairly (see the module docstring)."""
    cluster = Cluster(host, transport, balance=balance)
    await nursery.start(cluster.run)
    return cluster
