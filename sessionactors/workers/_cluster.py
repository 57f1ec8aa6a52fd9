"""Location transparency on a shared store: requests and events across workers.

This module runs one worker's side (membership, forwarding, serving, balancing);
``_transport`` holds the seam a store implements, ``_wire`` the format of the
messages between workers, and ``_streams`` the events that cross workers.

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
  without word): a ping nobody hears, or one left without a word for longer than a
  lease (a frozen owner's connections may still take it), asks the store whether the
  owner's incarnation is still the live one, and the owner answers "working", its answer again (one
  whose send failed or was lost; a read's is not kept, it is read again),
  "unknown" (the request never reached it: sent again), or "forgotten" (it keeps
  the last 10,000 answers, each for four lease lifetimes at most, by when its
  requester has heard it or given up, and this request's requester issued it no later than
  one whose answer it dropped: it may have run, so a turn without a key, or any
  request not safe to repeat, fails with SessionCrashedError instead of running
  twice; a copy of it that arrives now is ignored). An answer whose session is
  deleted here, or an edit of which here erases what it held, is kept as the
  error that says so (``_erase_answers``): asked again, it raises that error.
  If the incarnation is gone (it died, or restarted), a request with an idempotency
  key and every read is sent again, to the session's next owner; a turn without a
  key fails with SessionCrashedError, since it may or may not have run (naming
  the turn in ``turn_id``: ``ref.turn_outcome`` says what became of it; a turn
  without a key goes with an id issued here, which the owner runs it under if its
  session could have issued it, so even one whose owner never said a word is
  named). With no
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
  are refused by Redis (each stamped with the session's creation time, so a
  subscriber never takes a session made again under a deleted one's name for it),
  from one publisher task fed by a bounded queue: the actor
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
  workers (the store does not answer), a worker places nothing elsewhere. A
  registry without agents (a gateway that only forwards, the command line, an
  operator's script) runs no turn: it is not listed, so it takes no shard, and it
  places the sessions it is asked for at the listed workers.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import trio

from .._codec import (
    dump_snapshot,
    load_snapshot,
)
from .._errors import (
    Advice,
    AdviceKind,
    LeaseHeldError,
    Part,
    SessionActorsError,
    SessionCrashedError,
    SessionNotFoundError,
    SessionStoppedError,
    SnapshotError,
    StoreConfigurationError,
    StoreError,
    WorkerUnreachableError,
    advised,
)
from .._events import Event
from .._final import NoPublicConstructor
from .._pending import Append, Pending
from .._records import SessionState, TurnOutcome, id_issuer, new_id
from .._ref import Turn, joined, new_turn
from .._requests import (
    Call,
    Cancel,
    Delete,
    Hibernate,
    ReplaceHistory,
    Reply,
    ResolveReview,
    Retry,
    SetMetadata,
    SetSummary,
    Stop,
)
from .._router import NOT_ROUTED, RouterHost
from .._subscription import EventIterator
from .._turns import new_turn_id, session_tag
from ._streams import MAX_ATTEMPTS, Streams
from ._transport import Transport, fatal
from ._wire import (
    creation_stamp,
    dump_call,
    dump_error,
    dump_outcome,
    dump_reply,
    load_call,
    load_error,
    load_outcome,
    load_reply,
    pack,
    unpack,
)

__all__ = ["Cluster", "ClusterStatistics", "open_cluster"]

log = logging.getLogger("sessionactors")

_ANSWER_ATTEMPTS: Final = 5
_ANSWERS_KEPT: Final = 10_000  # answers kept for a requester that asks again
#: Lease lifetimes an answer is kept for at most: a requester that has not heard it by
#: then has given up (two lifetimes without word), so nobody can ask for it any more.
_ANSWER_LIFETIMES: Final = 4
#: Requesting processes for which a worker remembers the last answer it dropped.
_ISSUERS_KEPT: Final = 10_000
#: Requests safe to serve again: their answers are not kept.
_NOT_KEPT: Final = ("read", "watch", "outcome", "held")
_MAX_HINTS: Final = 100_000
#: Requests that may run twice without harm: sent again to the next owner if one dies.
_SAFE_CALLS: Final = (SetSummary, SetMetadata, ReplaceHistory, Cancel, Hibernate, Stop)
_HANDOVERS: Final = 8  # shards a worker hands over at a time (balancing)
_RETRY_ROUNDS: Final = 10  # balancing rounds before a shard that stayed is tried again
_BUSY_TRIES: Final = 3  # hibernations a hand-over tries while a session stays busy


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

    __slots__ = (
        "accepted",
        "early_error",
        "joined_at",
        "local",
        "owner",
        "pending",
        "replayed",
        "settled",
        "since",
        "turn_id",
    )

    def __init__(self) -> None:
        self.settled = trio.Event()
        self.accepted = False
        self.local = False
        self.early_error: BaseException | None = None
        self.pending = Pending()
        self.turn_id = ""
        self.owner = ""  # the worker that accepted it
        self.replayed = False
        #: It joined its key's turn under way at the owner: that turn's events follow
        #: seq ``since``; the owner had published up to ``joined_at`` (see ``Turn``).
        self.since: int | None = None
        self.joined_at = 0


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


def said_options(host: RouterHost) -> str:
    """What a worker runs with that every worker on a store must run with alike: a
    session runs with the agents and options of whichever worker runs it (its turns
    kept as that worker's ``durability`` says), as JSON."""
    config = host.config
    return json.dumps(
        {
            "agents": host.agent_names(),
            "durability": config.durability,
            "idle_timeout": config.idle_timeout,
            "snapshot_every": config.snapshot_every,
            "journal_keep_events": config.journal_keep_events,
            "replay_events": config.hub.replay_events,
            "shutdown_grace": config.shutdown_grace,
        },
        sort_keys=True,
    )


def options_differ(ours: str, theirs: str) -> str | None:
    """How another worker's options (``theirs``, as ``said_options`` says them) differ
    from ``ours``, in words; None if they do not (or cannot be read)."""
    try:
        mine, other = json.loads(ours), json.loads(theirs)
    except ValueError:
        return None
    if not isinstance(other, dict):
        return None
    differ = [
        f"{key}={other[key]!r} (here {mine[key]!r})"
        for key in mine
        if key in other and other[key] != mine[key]
    ]
    return ", ".join(differ) or None


class Cluster(metaclass=NoPublicConstructor):
    """One worker's side of the cluster: inbox, forwarding, event streams, mirrors."""

    _made_by = "open_cluster(host, transport, nursery) makes it"

    def __init__(self, host: RouterHost, transport: Transport, *, balance: bool = True) -> None:
        self.host = host
        self.transport = transport
        self.balance = balance
        self.worker = host.worker_id
        self.incarnation = new_id("inc")
        self.ttl = host.config.lease_ttl
        #: How long a request waits for a session that keeps moving: a worker that shuts
        #: down keeps its sessions while its turns finish (judged by this worker's own
        #: shutdown grace), then hibernates them within about a lease's time.
        self._patience = host.config.shutdown_grace + 2 * self.ttl
        self.stats = ClusterStatistics()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._waiters: dict[str, trio.MemorySendChannel[dict[str, Any]]] = {}
        #: Requests being forwarded (``_forward`` calls under way), and the event that
        #: tells a closing worker that none is left.
        self._forwarding = 0
        self._drained: trio.Event | None = None
        self._owners: dict[str, str] = {}  # session -> owner hint ("": another, unknown)
        self._said = said_options(host)
        self._told: dict[str, str] = {}  # worker -> its options, once said to differ
        self._incarnations: dict[str, str] = {}  # worker -> its live incarnation, as last seen
        self._listening: trio.CancelScope | None = None
        #: Subscriptions made so far; the heartbeat's last wake to its own channel
        #: (its number, and the subscription it went to), and the last wake heard.
        self._subscriptions = 0
        self._wake_sent: tuple[int, int] | None = None
        self._wake_heard = 0
        self._serving: set[str] = set()  # ids of the requests being served here
        #: The latest answers, by request id, with their session ("" once erased: see
        #: _erase_answers) and the time they were given (oldest first); and the ids of
        #: each session's answers kept.
        self._answered: dict[str, tuple[str, bytes, float]] = {}
        self._answers_of: dict[str, set[str]] = {}
        #: Answers sent with their turn's outcome (see _answer_with_outcome), by request
        #: id, until their serving task keeps them.
        self._sent_answers: dict[str, bytes] = {}
        # requesting process -> the place (``id_issuer``) of the latest of its requests
        # whose answer was dropped from _answered: those up to it may have been answered
        self._forgotten: dict[str, int] = {}
        self.streams = Streams(
            host,
            transport,
            self.stats,
            forward=self._forward,
            check=self._check,
            spawn=self._spawn,
            erased=self._erase_answers,
        )
        self._inbox_last = "0-0"
        self._read_since_trim = 0
        self._keep_from: str | None = None
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
        return self.streams.subscriber_count

    # ---- running -------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce this worker, then serve its inbox and publish its events until cancelled."""
        # One look before it starts: is this worker id free? (a store that fails to
        # answer now only skips the look, and the registry opens without waiting for
        # the announcement below)
        answered = True
        refused: StoreConfigurationError | None = None
        try:
            await self._check_unique()
        except StoreError as exc:
            fatal(exc)
            answered = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.streams.publish_loop, name="cluster events")
                announced = False
                if answered:
                    # Announced before the registry opens (a store that answered just now
                    # answers this too; within a bound): the announcement's own check of
                    # the worker id then fails the opening, not the registry once open.
                    with trio.move_on_after(self.ttl):
                        try:
                            await nursery.start(self._announce, name="cluster announce")
                        except StoreConfigurationError as exc:
                            refused = exc  # (raised as itself, not in the nursery's group)
                            nursery.cancel_scope.cancel()
                        else:
                            announced = True
                if refused is None:
                    task_status.started()
                    if not announced:
                        nursery.start_soon(self._announce, name="cluster announce")
            if refused is not None:
                raise refused
        except BaseExceptionGroup as group:
            # A refusal from one of the worker's tasks (its announcement's check of the
            # worker id, made after the registry opened without it) comes out typed, as
            # itself, not in the nursery's group.
            error = group.exceptions[0]
            if len(group.exceptions) != 1 or not isinstance(error, StoreConfigurationError):
                raise
            try:
                raise error from error.__cause__
            finally:
                del error, group
        finally:
            self._nursery = None
            for send in list(self._waiters.values()):
                send.close()
            self.streams.close()

    async def _announce(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on this incarnation's channel, announce it, then run the worker's loops."""
        nursery = self._nursery
        assert nursery is not None
        if not self._subscriptions:  # (not yet listening: an earlier try ran out of time)
            await nursery.start(self._listen_loop, name="cluster requests")
        # The other incarnation the first announcement replaced is kept across tries: a
        # try cut short by a store error (in the wake, or in the put-back) announced this
        # one already, so the next announcement replaces only this one, and the check
        # must still ask about that other one.
        other: str | None = None
        while True:
            try:
                # Start after what an earlier incarnation with this worker id left
                # (its requesters see the new incarnation and send again).
                await self._skip_stale_inbox()
                replaced = await self.transport.heartbeat(
                    self.worker, self.incarnation, self.ttl, None
                )
                if replaced is not None and replaced != self.incarnation:
                    other = replaced
                await self._check_replaced(other)
                break
            except StoreError as exc:
                fatal(exc)
                await trio.sleep(min(1.0, self.ttl / 3))
        nursery.start_soon(self._heartbeat_loop, name="cluster heartbeat")
        nursery.start_soon(self._read_loop, name="cluster inbox")
        await nursery.start(self._balance_loop, name="cluster balance")
        task_status.started()

    async def _check_replaced(self, replaced: str | None) -> None:
        """Raise StoreConfigurationError if this worker's first announcement replaced that
        of another live incarnation under its worker id: one that started at the same
        moment, after ``_check_unique`` looked (it listened before it announced itself,
        so it answers now). Its announcement is put back."""
        if replaced is not None and await self._is_live(replaced):
            await self.transport.heartbeat(self.worker, replaced, self.ttl, None)
            raise StoreConfigurationError(_worker_id_taken(self.worker))

    async def _check_unique(self) -> None:
        """Raise StoreConfigurationError if another live worker runs under this worker
        id: two would both take its leases (each session live in both, their writes
        fenced out in turn) and their requests would reach either. An earlier
        incarnation that died listens no more: its id is free (a restart)."""
        if await self._is_live(await self.transport.incarnation(self.worker)):
            raise StoreConfigurationError(_worker_id_taken(self.worker))

    async def _is_live(self, other: str | None) -> bool:
        """Whether ``other``, another incarnation under this worker id, is live: it
        listens on its channel (one that died does not)."""
        if other is None or other == self.incarnation:
            return False
        return await self.transport.send(self.worker, other, pack({"op": "wake"}))

    async def aclose(self) -> None:
        """Wait (within the shutdown grace) for the answers to the requests this worker
        forwarded, then flush the events and retire this worker (requests that still
        reach it until its nursery ends are answered "moved")."""
        self._closing = True
        try:
            # The requests this worker's callers sent elsewhere run on there: their
            # answers get what is left of the shutdown grace, as this worker's own
            # turns do (one window for both, from the registry's shutdown)
            grace = self.host.config.shutdown_grace
            with trio.move_on_at(min(self.host.grace_ends, trio.current_time() + grace)):
                while self._forwarding:
                    self._drained = trio.Event()
                    await self._drained.wait()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(min(5.0, self.ttl)):
                await self._withdraw()
                await self.streams.flush(min(2.0, self.ttl))
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
                    fatal(exc)
                    await trio.sleep(min(1.0, self.ttl / 10))

    async def _heartbeat_loop(self) -> None:
        for count in itertools.count(1):
            await trio.sleep(self.ttl / 3)
            self._expire_answers()
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
                    wake = pack({"op": "wake", "n": count})
                    if await self.transport.send(self.worker, self.incarnation, wake):
                        self._wake_sent = (count, subscription)
                    else:
                        listening.cancel()
            except StoreError as exc:
                fatal(exc)
                self._keep_from = self._keep_from or keep_from
            try:
                await self.streams.renew()
            except StoreError as exc:
                fatal(exc)

    async def _read_loop(self) -> None:
        block = max(0.05, min(self.ttl / 3, 5.0))
        while True:
            try:
                messages, events = await self.transport.read(
                    self.worker, self._inbox_last, self.streams.positions(), block
                )
            except StoreError as exc:
                fatal(exc)  # e.g. a user without blocking reads: never retried in silence
                await trio.sleep(min(1.0, block))
                continue
            except SnapshotError as exc:
                # one session's stream is damaged: its mirror ends, the others are read
                if not self.streams.damaged(exc):
                    raise
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
            await self.streams.take(events)

    def _dispatch(self, data: bytes) -> None:
        body = unpack(data)
        if body is None:
            log.warning(
                "worker %r: ignored a message of %d bytes in its inbox that is not one "
                "the workers send (an entry written behind the store's back, or another "
                "application's under the store's prefix)",
                self.worker,
                len(data),
            )
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
            pending = self.host.enqueue_here(name, text, _turn_id_sent(body))
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
                data = pack({"ok": "reply", "reply": dump_reply(name, reply), "re": rid})
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
                    self._keep(str(body.get("id")), name, sent)
                    return
                await self._answer(body, {"ok": "reply", "reply": dump_reply(name, reply)})
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
                turn = await host.submit_here(name, str(body["text"]), key, _turn_id_sent(body))
                if body.get("ack"):
                    since, joined_at = joined(turn)  # (a turn under way that its key joined)
                    ack = {"ok": "ack", "turn_id": turn.id, "replayed": turn.replayed}
                    if since is not None:
                        ack.update(since=since, joined_at=joined_at)
                    await self._answer(body, ack)
                reply = await turn.reply()
                await self._answer(body, {"ok": "reply", "reply": dump_reply(name, reply)})
            elif op == "read":
                state = await host.read_here(name)
                await self._answer(body, {"ok": "state", "state": dump_snapshot(state)})
            elif op == "outcome":
                outcome = await host.outcome_here(name, str(body["t"]))
                after = body.get("after")  # (a mirror's position: did the session lose it?)
                lost = isinstance(after, int) and host.lost_here(name, after) is not None
                await self._answer(
                    body, {"ok": "value", "value": dump_outcome(outcome), "lost": lost}
                )
            elif op == "watch":  # another worker subscribes: publish from now on
                beyond = body.get("beyond")  # (its subscription's ``after``, if any)
                if beyond is not None:  # refused before a wake, if the store says so
                    await self.streams.may_run_ahead(name, int(beyond))
                state = await host.read_here(name)  # wakes it here (or says it moved)
                published = _published(host, name, state)
                await self.transport.watch([name], self.ttl)  # for its next owners too
                # (a subscription that follows the session from ``after`` on: the events
                # since then that the hub still holds go first, deltas too)
                since = body.get("after")
                top = self.streams.publish_from(name, None if since is None else int(since))
                answer = {"ok": "value", "value": top, "born": creation_stamp(state.created_at)}
                if top > published:  # events went by meanwhile: the state after them
                    with contextlib.suppress(SessionActorsError):
                        state = await host.read_here(name)
                        published = _published(host, name, state)
                running = state.open_turn
                if running is not None and not state.reviews and top <= published:
                    # a turn under way: the subscriber's mirror watches it from the start
                    # (every event after this state reaches it: it reads from ``top`` on)
                    answer["turn"] = running.turn_id
                    answer["key"] = running.idempotency_key
                await self._answer(body, answer)
            elif op == "held":  # another worker's replay, before its stream begins
                await self._answer(body, self.streams.held_here(name, int(body["after"])))
            elif op == "call":
                value = await host.call_here(name, load_call(name, body["req"]))
                if isinstance(value, Reply):
                    value = dump_reply(name, value)
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
                await self._answer(body, dump_error(_stopped_here_error(name, self.worker, exc)))
        except Exception as exc:
            await self._answer(body, dump_error(exc))

    async def _answer(self, request: Mapping[str, Any], body: dict[str, Any]) -> None:
        """Post an answer; a final one is also kept, for a requester that asks again
        (its post failed, or the store lost it before the requester read it), except
        a read's (a whole state, safe to read again: its requester hears "unknown"
        and asks again)."""
        rid = str(request.get("id"))
        body["re"] = rid
        data = pack(body)
        if body.get("ok") != "ack" and request.get("op") not in _NOT_KEPT:
            self._keep(rid, str(request.get("s")), data)
        await self._post_answer(str(request.get("from")), str(request.get("fi")), data)

    def _keep(self, rid: str, name: str, data: bytes) -> None:
        """Keep the final answer to request ``rid`` of session ``name`` for a requester
        that asks again."""
        answered = self._answered
        answered[rid] = (name, data, trio.current_time())
        self._answers_of.setdefault(name, set()).add(rid)
        if len(answered) > _ANSWERS_KEPT:
            self._drop_oldest_answer()

    def _expire_answers(self) -> None:
        """Drop the answers kept longer than ``_ANSWER_LIFETIMES`` lease lifetimes (at
        each heartbeat, a third of a lifetime apart): a session's words stay in a
        worker's memory no longer than a requester may ask for them (on a worker that
        ran the session before too, which no later edit or delete reaches)."""
        answered = self._answered
        oldest = trio.current_time() - _ANSWER_LIFETIMES * self.ttl
        while answered and next(iter(answered.values()))[2] < oldest:
            self._drop_oldest_answer()

    def _drop_oldest_answer(self) -> None:
        dropped = next(iter(self._answered))
        of, _, _ = self._answered.pop(dropped)
        rids = self._answers_of.get(of)
        if rids is not None:
            rids.discard(dropped)
            if not rids:
                del self._answers_of[of]
        self._forget(dropped)

    def _erase_answers(self, name: str, deleted: bool = False) -> None:
        """Replace the answers kept for the requests of session ``name`` (a reply, its
        metadata: what the session held) by an error that says what became of them:
        the session was ``deleted``, or an edit erased what they held. Each keeps its
        place, so a requester that asks again is told that, and a copy of its request
        that arrives now is still ignored: nothing runs twice."""
        rids = self._answers_of.pop(name, None)
        if not rids:
            return
        if deleted:
            error: SessionActorsError = SessionNotFoundError(
                f"session {name!r} was deleted after worker {self.worker!r}, which ran it, "
                "answered this request, and the answer, lost on the way, went with it; the "
                "request is not run again",
                session_id=name,
            )
        else:
            error = advised(
                SessionCrashedError,
                f"session {name!r}: worker {self.worker!r}, which runs it, ran this request, "
                "but its answer was lost on the way and is no longer kept there (an edit of "
                "the session erased what it held before); look at the history or the metadata ",
                Advice(kind=AdviceKind.OR_TURN_OUTCOME),
                " before sending it again",
                session_id=name,
            )
        body = dump_error(error)
        answered = self._answered
        for rid in rids:
            kept = answered.get(rid)
            if kept is not None:
                answered[rid] = ("", pack({**body, "re": rid}), kept[2])

    async def _post_answer(self, to: str, incarnation: str, data: bytes) -> None:
        for attempt in range(_ANSWER_ATTEMPTS):
            try:
                if await self.transport.send(to, incarnation, data):
                    return
            except StoreError as exc:
                fatal(exc)
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
        kept = self._answered.get(rid)
        if kept is not None:
            data = kept[1]
        else:
            if rid in self._serving:
                state = "working"
            elif self._maybe_forgotten(rid):
                state = "forgotten"  # never "unknown": that would have it sent again
            else:
                state = "unknown"
            data = pack({"re": rid, "ok": state})
        try:
            await self.transport.send(str(ping.get("from")), str(ping.get("fi")), data)
        except StoreError as exc:
            fatal(exc)  # otherwise it asks again

    # ---- the requester's side ------------------------------------------------------

    def elsewhere(self, name: str) -> bool:
        """Whether this worker believes another one runs ``name``, or should (its shard
        is being handed over, or prefers another worker); no I/O."""
        shard = self.transport.shard(name)
        if shard in self._leaving:
            return True
        if not self.host.runs_turns:
            # every request goes by the forward, which sends it to a worker or, while
            # none is live, serves it here (a read) or refuses it (a turn); a session
            # woken here to be read goes to a worker as soon as one is listed
            if self.host.is_live(name) and self._preferred_worker(shard) != self.worker:
                self._start_handover(shard)
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

        A turn without a key goes with a turn id issued here, which the owner runs it
        under if its session could have issued it (an owner that takes another one, or
        of a version that ignores it, answers with its own): an error of this side
        names the turn by it, the answer's wins. A key may join a turn under way, which
        has its own id: a keyed turn is named by what its owner answers, and its key.
        """
        request = {"op": "turn", "s": name, "text": text, "key": key, "ack": ack}
        if key is None:
            request["t"] = new_turn_id(session_tag(name))
        if not ack:  # carried by the caller's task: a caller that gives up abandons it
            answer = await self._forward(name, request, retry_safe=key is not None, runs_turn=True)
            if answer is None:
                return None
            pending = Pending()
            try:
                reply = load_reply(name, self._check(answer, name)["reply"])
            except Exception as exc:
                pending.set_error(exc)
                return new_turn("", name, pending)
            pending.set_result(reply)
            return new_turn(reply.turn_id, name, pending)
        nursery = self._running(name)
        forwarded = _Forwarded()
        nursery.start_soon(self._carry_turn, name, request, forwarded)
        await forwarded.settled.wait()
        if forwarded.local:
            return None
        if forwarded.early_error is not None:
            raise forwarded.early_error
        return new_turn(
            forwarded.turn_id,
            name,
            forwarded.pending,
            replayed=forwarded.replayed,
            known=True,
            since=forwarded.since,
            joined_at=forwarded.joined_at,
        )

    async def _carry_turn(self, name: str, request: dict[str, Any], forwarded: _Forwarded) -> None:
        text, ack = str(request["text"]), bool(request["ack"])
        key: str | None = request["key"]

        def on_ack(body: Mapping[str, Any]) -> None:
            turn_id = str(body["turn_id"])
            if forwarded.accepted and turn_id != forwarded.turn_id:
                # sent on to the session's next worker, which runs it under this id:
                # a stream of the turn follows it there (see ``ref.stream``)
                forwarded.pending.renamed = turn_id
            forwarded.turn_id = turn_id
            forwarded.owner = str(body.get("_owner", "?"))
            forwarded.replayed = bool(body.get("replayed"))
            since = body.get("since")
            if isinstance(since, int):
                forwarded.since = since
                forwarded.joined_at = int(body.get("joined_at") or 0)
            forwarded.accepted = True
            forwarded.settled.set()

        try:
            answer = await self._forward(
                name,
                request,
                retry_safe=key is not None,
                on_ack=on_ack if ack else None,
                runs_turn=True,
            )
            if answer is None:
                if not forwarded.settled.is_set():
                    forwarded.local = True
                    return
                # accepted by an owner that died or closed; the session is free now: run
                # it here (under an id of this worker's: a stream follows it)
                turn = await self.host.submit(name, text, key, ack=False)
                forwarded.pending.renamed = turn.id
                forwarded.pending.set_result(await turn.reply())
                return
            result = load_reply(name, self._check(answer, name)["reply"])
            forwarded.turn_id = forwarded.turn_id or result.turn_id
            forwarded.pending.set_result(result)
        except Exception as exc:
            if ack and not forwarded.accepted:
                forwarded.early_error = exc
            forwarded.pending.set_error(exc)
        finally:
            if not forwarded.pending.done and not forwarded.local:  # (this worker closed)
                forwarded.pending.set_error(
                    _abandoned_error(name, forwarded.owner, forwarded.turn_id)
                    if forwarded.accepted
                    else _closing_error(name)
                )
            forwarded.settled.set()

    async def read(self, name: str) -> SessionState | None:
        """The session's state from its owner; None if the session is free."""
        answer = await self._forward(name, {"op": "read", "s": name}, retry_safe=True)
        if answer is None:
            return None
        state = load_snapshot(bytes(self._check(answer, name)["state"]), session_id=name)
        return state

    async def outcome(self, name: str, turn_id: str) -> TurnOutcome | None:
        """What became of turn ``turn_id``, from the session's owner; None if the
        session is free."""
        request = {"op": "outcome", "s": name, "t": turn_id}
        answer = await self._forward(name, request, retry_safe=True)
        if answer is None:
            return None
        return load_outcome(name, turn_id, self._check(answer, name)["value"])

    async def call(self, name: str, request: Call | Cancel | Stop | Delete) -> Any:
        """Run a request other than a turn at the session's owner; NOT_ROUTED when no
        other worker holds the session."""
        body = {"op": "call", "s": name, "req": dump_call(name, request)}
        answer = await self._forward(
            name,
            body,
            retry_safe=isinstance(request, _SAFE_CALLS),
            runs_turn=isinstance(request, ResolveReview | Retry),
            review_id=request.review_id if isinstance(request, ResolveReview) else "",
        )
        if answer is None:
            return NOT_ROUTED
        value = self._check(answer, name)["value"]
        if isinstance(request, ResolveReview | Retry):
            return load_reply(name, value)
        return value

    def _running(self, name: str) -> trio.Nursery:
        if self._nursery is None or self._closing:
            raise _closing_error(name)
        return self._nursery

    def _check(self, answer: dict[str, Any], name: str) -> dict[str, Any]:
        if "err" in answer:
            raise load_error(answer, name, str(answer.get("_owner", "?")))
        return answer

    async def _forward(
        self,
        name: str,
        request: dict[str, Any],
        *,
        retry_safe: bool,
        on_ack: Callable[[Mapping[str, Any]], None] | None = None,
        runs_turn: bool = False,
        review_id: str = "",
    ) -> dict[str, Any] | None:
        """Send ``request`` to the owner of ``name`` and wait for its answer.

        None if no other worker holds the session (the caller runs it here). A request
        that ``runs_turn`` (a turn, a review's resolution, a retry) is refused with
        ``WorkerUnreachableError`` instead when this registry runs no turns
        (``review_id``: the review the request resolves, if it does).
        """
        self._running(name)
        self._forwarding += 1
        try:
            return await self._forward_until_answered(
                name, request, retry_safe, on_ack, runs_turn, review_id
            )
        finally:
            self._forwarding -= 1
            if not self._forwarding and self._drained is not None:
                self._drained.set()

    async def _forward_until_answered(
        self,
        name: str,
        request: dict[str, Any],
        retry_safe: bool,
        on_ack: Callable[[Mapping[str, Any]], None] | None,
        runs_turn: bool,
        review_id: str = "",
    ) -> dict[str, Any] | None:
        shard = self.transport.shard(name)
        # The turn: the id issued here for it, or the one an owner accepted it under
        # (its ack's; a keyed turn sent again to the next owner takes the id that one
        # gives it), and the turn's key: what the caller is told to ask by if the
        # answer never comes
        is_turn = request.get("op") == "turn"
        accepted = str(request.get("t") or "") if is_turn else ""
        key = str(request.get("key") or "") if is_turn else ""

        def acked(body: Mapping[str, Any]) -> None:
            nonlocal accepted
            accepted = str(body.get("turn_id") or accepted)
            if on_ack is not None:
                on_ack(body)

        unheard_since: float | None = None  # since when the owner says it never got it
        unheard_copies = 0
        # "Moved" answers are bounded by time, not counted: a worker that shuts down
        # answers so until its turns in flight are done (its shutdown grace)
        moving_since: float | None = None
        moves = 0
        attempt = -1
        while True:
            attempt += 1
            if attempt - moves >= MAX_ATTEMPTS:
                raise advised(
                    SessionCrashedError,
                    f"session {name!r}: could not reach the worker that runs it after "
                    f"{MAX_ATTEMPTS} attempts (its worker kept dying or refusing messages); "
                    "retry later",
                    session_id=name,
                    turn_id=accepted,
                )
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
                    if runs_turn and not self.host.runs_turns:
                        raise _no_worker_error(name, key)
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
                if not await self.transport.send(owner, incarnation, pack(body)):
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
                answer = await self._wait_answer(
                    name, owner, incarnation, rid, receive, acked, accepted, key
                )
            except WorkerUnreachableError:
                self._forget_owner(name, owner, incarnation)  # the next request looks again
                raise
            finally:
                del self._waiters[rid]
            moved = bool(
                answer.get("moved") or (retry_safe and answer.get("err") == "FencedOutError")
            )
            if not moved:
                moving_since = None  # (a run of "moved" answers is timed from its first)
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
                        turn_id=accepted,
                        idempotency_key=key,
                    )
                self.stats.moved += 1
                continue
            unheard_since, unheard_copies = None, 0
            if answer.get("ok") == "forgotten":  # it may have run: its answer is gone
                if not retry_safe:
                    raise advised(
                        SessionCrashedError,
                        f"session {name!r}: worker {owner!r}, which runs it, may have run "
                        "this request, but its answer was lost on the way and is no longer "
                        "kept there; look at the history ",
                        Advice(kind=AdviceKind.OR_TURN_OUTCOME, turn_id=accepted),
                        " before sending it again (a turn sent with ",
                        Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
                        " runs once however often it is sent)",
                        session_id=name,
                        turn_id=accepted,
                    )
                continue
            if answer is _OWNER_DIED:
                self._forget_owner(name, owner, incarnation)
                self.stats.owner_deaths += 1
                if not retry_safe:
                    raise _owner_died_error(name, owner, accepted, review_id)
                continue
            if moved:
                self._owners.pop(name, None)
                self.stats.moved += 1
                moves += 1
                now = trio.current_time()
                moving_since = now if moving_since is None else moving_since
                if now - moving_since > self._patience:
                    raise SessionStoppedError(
                        f"session {name!r}: worker {owner!r}, which runs it, has answered "
                        f"that it moved for {now - moving_since:.1f} s (it is shutting "
                        "down with a turn still running, or the session keeps moving), so "
                        "this request did not run; send it again",
                        session_id=name,
                    )
                await trio.sleep(min(self.ttl / 10, 0.002 * moves))
                continue
            answer["_owner"] = owner
            return answer

    def _forget_owner(self, name: str, owner: str, incarnation: str) -> None:
        """Look the owner of ``name``, and that worker's incarnation, up again next time
        (it died, froze, or gave no word)."""
        self._owners.pop(name, None)
        if self._incarnations.get(owner) == incarnation:
            del self._incarnations[owner]

    async def _wait_answer(
        self,
        name: str,
        owner: str,
        incarnation: str,
        rid: str,
        receive: trio.MemoryReceiveChannel[dict[str, Any]],
        on_ack: Callable[[Mapping[str, Any]], None],
        accepted: str,
        key: str,
    ) -> dict[str, Any]:
        """The owner's answer, _OWNER_DIED, or {"ok": "unknown"} (the owner never got
        the request); WorkerUnreachableError after two lease lifetimes without word,
        naming the turn ``accepted`` (an earlier copy's, or this one's ack's) and its
        ``key``."""
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
                        raise _abandoned_error(name, owner, accepted) from None
                    heard = trio.current_time()
                    if answer.get("ok") == "ack":
                        acked = True
                        accepted = str(answer.get("turn_id") or "")
                        answer["_owner"] = owner
                        on_ack(answer)
                    elif answer.get("ok") == "unknown" and acked:
                        return _OWNER_DIED  # it had the turn and forgot it: it restarted
                    elif answer.get("ok") != "working":
                        return answer
            ping = ping or pack(
                {"op": "ping", "q": rid, "from": self.worker, "fi": self.incarnation}
            )
            try:
                # not heard: gone, or between two subscriptions (it hears the next ping);
                # heard, but silent for longer than a lease: frozen, or cut off from the
                # store with its connections open (gone too once its liveness lapsed)
                heard_ping = await self.transport.send(owner, incarnation, ping)
                if (
                    not heard_ping or trio.current_time() - heard > self.ttl
                ) and await self.transport.incarnation(owner) != incarnation:
                    return _OWNER_DIED
            except StoreError as exc:
                fatal(exc)
                failure = exc
            silence = trio.current_time() - heard
            if silence > 2 * self.ttl:
                why = "the store did not answer" if failure else "it did not answer"
                raise _unreachable_error(name, owner, silence, why, accepted, key) from failure

    # ---- balancing: shards go to their preferred workers ---------------------------------

    def _preferred_worker(self, shard: int) -> str:
        """The live worker that ``shard`` prefers (this one without a fresh list). A
        registry without agents is not listed, and places every session at the live
        workers, balancing or not."""
        if (
            not self._members
            or not self._moves_shards
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
        found = tuple(sorted({*members, self.worker} if self.host.runs_turns else {*members}))
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
            if self.host.runs_turns:
                await self.transport.options(self.worker, None, self.ttl)

    async def _balance_loop(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """List the live workers every third of ``lease_ttl``; hand over shards that
        prefer another one. Started once the first listing is done: the registry's first
        requests are placed by it (a registry without agents places all of them)."""
        while not self.host.closing:
            try:
                ttl = self.ttl if self.host.runs_turns else None  # (None: not listed)
                members = await self.transport.members(self.worker, ttl)
            except StoreError as exc:
                fatal(exc)  # without a fresh list, nothing is placed elsewhere
            else:
                self._members_at = trio.current_time()
                self._set_members(members)
                if self._moves_shards and not self._closing:
                    self._start_handovers()
                if ttl is not None:
                    try:  # (a check only: tried again with the next listing)
                        said = await self.transport.options(self.worker, self._said, ttl)
                    except StoreError as exc:
                        fatal(exc)
                    else:
                        self._compare_options(members, said)
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            await trio.sleep(self.ttl / 3)
        task_status.started()  # (closing before the first listing)
        await self._withdraw()

    def _compare_options(self, members: Sequence[str], said: Mapping[str, str]) -> None:
        """Log at ERROR, once for each, a live worker that runs with other agents or
        options than this one: a session runs as the worker that runs it says."""
        for worker in members:
            theirs = said.get(worker)
            if worker == self.worker or theirs is None or self._told.get(worker) == theirs:
                continue
            self._told[worker] = theirs
            differ = options_differ(self._said, theirs)
            if differ is not None:
                log.error(
                    "worker %r runs with other agents or options than this worker (%r): "
                    "%s; a session runs with those of whichever worker runs it (its turns "
                    "kept as that worker's durability says), so open every worker's "
                    "registry with the same agents and options",
                    worker,
                    self.worker,
                    differ,
                )

    def _start_handovers(self) -> None:
        """Hand over the shards held here that prefer another worker, a few at a time
        (the next as soon as one is done), those with the fewest live sessions first."""
        self._due.clear()
        if all(member == self.worker for member in self._members):
            return  # (no other worker listed)
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
        while len(self._leaving) < _HANDOVERS and self._due:
            shard = self._due.popleft()
            if self._moves_shards and self._preferred_worker(shard) != self.worker:
                self._start_handover(shard)  # (unless the workers changed since the round)

    @property
    def _moves_shards(self) -> bool:
        """Whether shards held here go to the workers they prefer: with balancing, and
        always from a registry without agents (it holds a session only to read it)."""
        return self.balance or not self.host.runs_turns

    def _start_handover(self, shard: int) -> None:
        """Hand ``shard`` over, unless it is under way or this worker closes."""
        nursery = self._nursery
        if shard in self._leaving or self._closing or self.host.closing or nursery is None:
            return
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

    # ---- events -----------------------------------------------------------------------

    def tap_for(self, name: str) -> Callable[[Event], None]:
        return self.streams.tap_for(name)

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        return await self.streams.open_subscription(name, after)

    async def created(self, name: str) -> None:
        await self.streams.created(name)

    async def deleted(self, name: str) -> None:
        self._erase_answers(name, deleted=True)
        await self.streams.deleted(name)

    def _spawn(self, fn: Callable[[], Awaitable[None]], name: str) -> None:
        """Run ``fn`` in the background while the worker runs (not at all otherwise)."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, name=name)


def _turn_id_sent(request: Mapping[str, Any]) -> str | None:
    """The turn id the requester issued for a forwarded turn (None from one of a version
    that sends none); the session takes it only if it could have issued it."""
    turn_id = request.get("t")
    return turn_id if isinstance(turn_id, str) else None


def _worker_id_taken(worker: str) -> str:
    return (
        f"another live worker on this store runs as worker_id {worker!r}: give each "
        "worker process its own worker_id (reuse one only to restart the worker that "
        "had it, once that one stopped)"
    )


def _unreachable_error(
    name: str, owner: str, silence: float, why: str, turn_id: str, key: str
) -> WorkerUnreachableError:
    """For a request to ``owner`` that got no word for ``silence`` seconds (``why``):
    ``turn_id``, the turn it accepted (if it said so), and ``key``, the turn's
    idempotency key, are what its caller asks by or sends again with."""
    told: list[Part] = [
        f"session {name!r}: no word from worker {owner!r}, which runs it, for {silence:.1f} s "
        f"({why}); "
    ]
    if turn_id:
        told += [
            f"turn {turn_id!r} may or may not have run there: ",
            Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=turn_id),
        ]
        told += (
            [", or send it again with the same "]
            if key
            else [" and send it again if it did not run"]
        )
    else:
        told += ["the request may or may not have run there: send it again"]
        told += [" with the same "] if key else []
    if key:
        told += [
            Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
            " (it runs once however often it is sent)",
        ]
    else:
        told += [
            " (a turn sent with ",
            Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
            " runs once however often it is sent)",
        ]
    return advised(
        WorkerUnreachableError,
        *told,
        session_id=name,
        turn_id=turn_id,
        idempotency_key=key,
    )


def _no_worker_error(name: str, key: str) -> WorkerUnreachableError:
    """For a turn sent through a registry without agents while no worker is live."""
    return advised(
        WorkerUnreachableError,
        f"session {name!r}: no worker that runs turns is live (this registry has no "
        "agents: it sends turns to the workers on its store), so the request did not run; "
        "start a worker, or send it again once one is running",
        session_id=name,
        idempotency_key=key,
    )


def _owner_died_error(
    name: str, owner: str, turn_id: str, review_id: str = ""
) -> SessionCrashedError:
    """For a request, not safe to send again, whose ``owner`` died before answering
    (``turn_id``: the turn it accepted, if it said so: what the caller asks about;
    ``review_id``: the review it resolves, if it does)."""
    if review_id:  # (resolved again the same way, a review's call runs once)
        return advised(
            SessionCrashedError,
            f"session {name!r}: worker {owner!r}, which ran it, died before answering, so "
            f"the resolution of review {review_id!r} may or may not have run; ",
            Advice(kind=AdviceKind.RESOLVE_REVIEW, review_id=review_id),
            " again, the same way: a call that is not idempotent never runs twice (a "
            "review that was resolved there is not pending any more: then look at the "
            "history)",
            session_id=name,
        )
    if not turn_id:
        return advised(
            SessionCrashedError,
            f"session {name!r}: worker {owner!r}, which ran it, died before answering, so "
            "this request may or may not have run; retry it (send it with ",
            Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
            " to make retries safe)",
            session_id=name,
        )
    return advised(
        SessionCrashedError,
        f"session {name!r}: worker {owner!r}, which ran it, died before answering, so turn "
        f"{turn_id!r} may or may not have run; ",
        Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=turn_id),
        " before sending it again (send it with ",
        Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
        " to make retries safe)",
        session_id=name,
        turn_id=turn_id,
    )


def _abandoned_error(name: str, owner: str, turn_id: str) -> SessionStoppedError:
    """For a request sent to ``owner`` whose answer this closing worker no longer waits
    for (``turn_id``: the turn the owner accepted, if it said so)."""
    return advised(
        SessionStoppedError,
        f"the registry closed before worker {owner!r}, which runs session {name!r}, "
        "answered this request (its shutdown grace ran out): it may have run there, or "
        "may still; look at the history ",
        Advice(kind=AdviceKind.OR_TURN_OUTCOME, turn_id=turn_id),
        " before sending it again (a turn sent with ",
        Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
        " runs once however often it is sent)",
        session_id=name,
        turn_id=turn_id,
    )


def _published(host: RouterHost, name: str, state: SessionState) -> int:
    """The seq the session's hub here had published as of ``state``, just read here (the
    state's own seq is its messages': a turn's deltas go by after it)."""
    return max(state.event_seq, host.event_seq_here(name) or 0)


def _stopped_here_error(name: str, worker: str, exc: SessionStoppedError) -> SessionStoppedError:
    """``exc``, a turn of ``name`` that this worker's closing registry cut off or could
    not store, as its caller on another worker is told of it: that caller's registry is
    open, and a turn it sends again goes to the session's next owner."""
    if exc._reason == "cut":
        text = (
            f"the turn of session {name!r} was cut off when worker {worker!r}, which ran it, "
            "stopped (its shutdown grace ran out); what it streamed is kept, marked "
            "interrupted: send it again, and it goes to the worker that runs the session next"
        )
    elif exc._reason == "unsaved":
        text = (
            f"worker {worker!r}, which ran session {name!r}, stopped before its store "
            "confirmed the turn (it did not answer in time), so the turn may be lost: send "
            "it again, and it goes to the worker that runs the session next (with an "
            "idempotency key, a retry cannot run it twice)"
        )
    else:
        return exc
    return SessionStoppedError(text, session_id=name, turn_id=exc.turn_id)


def _closing_error(name: str) -> SessionStoppedError:
    return advised(
        SessionStoppedError,
        f"the registry is closing, so the request to session {name!r} was not answered; ",
        Advice(kind=AdviceKind.REOPEN),
        session_id=name,
    )


async def open_cluster(
    host: RouterHost, transport: Transport, nursery: trio.Nursery, *, balance: bool = True
) -> Cluster:
    """Start a registry's multi-worker router over ``transport`` in ``nursery``; with
    ``balance``, the workers share the shards fairly (see the module docstring)."""
    cluster = Cluster._create(host, transport, balance=balance)
    await nursery.start(cluster.run)
    return cluster
