"""Events across workers: publishing a session's events to its stream while another
worker subscribes, and serving subscriptions to sessions that run elsewhere from
those streams (mirrors). See ``_cluster`` for the whole picture.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, Protocol, cast

import trio

from .._codec import dump_event, load_event, load_journal_entry
from .._errors import (
    Advice,
    AdviceKind,
    EventsExpiredError,
    LeaseHeldError,
    SessionActorsError,
    SessionNotFoundError,
    SessionStoppedError,
    SnapshotCorruptError,
    SnapshotError,
    StoreError,
    SubscriberLaggedError,
    advised,
)
from .._events import (
    Event,
    ReviewRequested,
    StatusChanged,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    erases,
)
from .._hub import SEQ_GAP, Hub, deleted_error
from .._reading import read_stored, stored_cleanly
from .._records import Status, TurnStatus
from .._router import RouterHost
from .._subscription import (
    EventIterator,
    beyond_error,
    beyond_stored,
    open_event_iterator,
    refuse_beyond,
)
from ..stores._base import JournalEntry, JournalPageStore, Store
from ._transport import StreamItem, Transport, fatal
from ._wire import (
    MAX_WIRE_INT,
    birth,
    creation_stamp,
    dump_error,
    load_outcome,
    pack,
    stamp_of,
    unstamp,
)

__all__ = ["MAX_ATTEMPTS", "Streams"]

log = logging.getLogger("sessionactors")

_QUEUE_SIZE: Final = 10_000  # events waiting for the publisher, all sessions together
_BATCH: Final = 1000  # events per publishing round trip
#: Seconds between attempts to write lag markers that the store refused, while no
#: newer event comes to carry them (their readers would otherwise wait without end).
_MARKER_RETRY: Final = 0.5
MAX_ATTEMPTS: Final = 200  # forwarding attempts (moves, refused posts) before giving up

#: Send a request to the owner of a session and wait for its answer (None: no other
#: worker holds it); check an answer, raising the error it carries.
Forward = Callable[..., Awaitable[dict[str, Any] | None]]
Check = Callable[[dict[str, Any], str], dict[str, Any]]


class Counts(Protocol):
    """Where the streams count the events they drop (the cluster's statistics)."""

    events_lost: int


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


class _Erase:
    """An edit that takes text out of the history or the metadata (see ``erases``), seq
    ``seq``: the session's stream is removed before the edit is published to it (a
    stream left from an earlier watch too), so that it holds nothing from before it."""

    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq


_Item = Event | _CatchUp | _Lost | _Erase

#: Lease lifetimes a session with a turn under way may stay free (its worker died,
#: and no other took it) before its remote subscribers are told that no outcome will
#: come: a retry of the turn under its key, or a request, takes it over before that.
_ORPHANED_AFTER: Final = 2

#: A gap wider than this between two events of a session's stream is a wake's seq
#: jump: the worker that ran the session died, and another woke it (see ``Hub.jump``).
_JUMP: Final = SEQ_GAP // 2

# Why a mirror's subscribers were cut off, as their SubscriberLaggedError says it: the
# session's events were interrupted on their way through the store, not read too slowly.
#: The owner's lag marker: its events did not all reach the stream.
_DROPPED: Final = (
    "the worker that runs it could not pass them all on through the store (the store "
    "failed or did not answer, or did not take them as fast as they came)"
)
#: The stream skips seqs after the mirror's position, and no longer holds them.
_SKIPPED: Final = (
    "the store's event stream of the session no longer holds the events after it (they "
    "were trimmed before this worker read them, or the store lost them)"
)
#: The stream lacked events the journal no longer holds either.
_NOT_KEPT: Final = (
    "the store's event stream of the session lacked some of the events after it, and its "
    "journal no longer holds them"
)
#: A stored event (in the stream or the journal) could not be read.
_UNREADABLE: Final = "the store holds one of the events after it in a form that cannot be read"


class _OpenTurn:
    """A mirrored session's turn under way: its id, the worker seen holding the
    session's lease (None: not seen yet), and since when it is free (None: held)."""

    __slots__ = ("asking", "free_since", "key", "lost", "owner", "passed", "turn_id")

    def __init__(self, turn_id: str, key: str | None = None) -> None:
        self.turn_id = turn_id
        self.key = key  # its idempotency key, if known
        self.owner: str | None = None
        self.free_since: float | None = None
        self.asking = False  # its new owner is asked what became of it
        #: Its new owner said it was lost, and a retry under its key may run it again
        #: (since ``free_since``)
        self.lost = False
        #: The seq of the first event after a wake's seq jump that its new owner
        #: was found to run it past (0: none): the mirror goes on from there.
        self.passed = 0


#: Events after which a mirrored session has no turn under way (one waiting on a
#: review is at rest: it may move between workers without an outcome).
_AT_REST: Final = (TurnFinished, TurnFailed, TurnCancelled, ReviewRequested)


#: What a turn's new owner may say of it once its outcome is durable.
_ENDED: Final = (TurnStatus.WAITING, TurnStatus.FINISHED, TurnStatus.FAILED, TurnStatus.CANCELLED)


def _running_turn(answer: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """The turn under way that an owner's answer to "watch" names, if any, and its
    idempotency key."""
    turn, key = answer.get("turn"), answer.get("key")
    if not isinstance(turn, str):
        return None
    return turn, key if isinstance(key, str) else None


class _Replay:
    """The journal a subscription replays from: the event stream, then the store's
    journal, read a page at a time if the store reads pages (a ``JournalPageStore``)."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        return await self._read(session_id, after, None)

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        return await self._read(session_id, after, (limit, max_bytes))

    async def _read(
        self, session_id: str, after: int, page: tuple[int, int] | None
    ) -> tuple[int, list[JournalEntry]]:
        """What the stream holds after ``after`` if it reaches back there, or else the
        journal after it (its first page, with ``page``: its bounds) and what the stream
        holds up to where that ends (all it holds, if that is the journal's end)."""
        streams = self._streams
        oldest, items = await streams.transport.events_after(session_id, after)
        items, replaced = streams.own_items(session_id, items)
        found = {seq: data for seq, kind, data in items if kind == "event"}
        lost = any(kind == "lost" for _, kind, _ in items)
        # (short: it ends below where the mirror's reading starts, which its owner gave:
        # that owner published none of its events yet, and may have jumped over
        # ``after`` as it woke, its worker having died: it knows, and says so)
        short = max((seq for seq, _, _ in items), default=after) < streams.start(session_id)
        if replaced or (oldest is not None and oldest <= after + 1 and not lost and not short):
            # (replaced: the session was deleted, and its mirror ends once it reads on)
            return after, [JournalEntry(seq, found[seq]) for seq in sorted(found)]
        if not lost:
            # The owner's own buffer may still hold them all, deltas and events not yet
            # durable included (a turn under way that a keyed stream joined)
            held = await streams.held(session_id, after)
            if held is not None:
                held.update(found)
                return after, [JournalEntry(seq, held[seq]) for seq in sorted(held)]
        # The stream does not reach back to ``after``: the journal has the durable events
        # (an entry holds a commit's events; the subscription merges them by seq).
        store = streams.host.store
        if page is None or not isinstance(store, JournalPageStore):
            trimmed, entries = await store.read_journal(session_id, after)
            return trimmed, entries + [JournalEntry(seq, found[seq]) for seq in sorted(found)]
        limit, max_bytes = page
        trimmed, entries = await store.read_journal_page(
            session_id, after, limit=limit, max_bytes=max_bytes
        )
        if entries and (len(entries) >= limit or sum(len(e.data) for e in entries) >= max_bytes):
            top = entries[-1].seq  # more may follow: the next page takes the stream on
            found = {seq: data for seq, data in found.items() if seq <= top}
        streamed = [JournalEntry(seq, found[seq]) for seq in sorted(found)]
        return trimmed, sorted(entries + streamed, key=lambda entry: entry.seq)


class _Followed:
    """When the session a mirror follows was created, once known (None: not yet)."""

    __slots__ = ("born",)

    def __init__(self, born: int | None) -> None:
        self.born = born


class Streams:
    """One worker's event streams: what it publishes, and the mirrors it reads."""

    def __init__(
        self,
        host: RouterHost,
        transport: Transport,
        stats: Counts,
        *,
        forward: Forward,
        check: Check,
        spawn: Callable[[Callable[[], Awaitable[None]], str], None],
        erased: Callable[[str], None],
    ) -> None:
        self.host = host
        self.transport = transport
        self.stats = stats
        self.worker = host.worker_id
        self.ttl = host.config.lease_ttl
        self._forward = forward
        self._check = check
        self._spawn = spawn
        self._erased = erased  # (an edit erased what the session held before it)
        self._mirrors: dict[str, Hub] = {}
        #: Sessions whose events this worker publishes (another worker subscribes), and
        #: whether the stream must first catch up from the journal.
        self._watched: dict[str, bool] = {}
        self._positions: dict[str, int] = {}
        #: The session each mirror follows (its creation time, once known: the first
        #: stamped entry read tells, if the owner's answer did not).
        self._births: dict[str, _Followed] = {}
        #: Mirrors made for a subscription that followed its session, whose stream was
        #: not read yet: seqs missing before its first event are judged by the journal
        #: (a wake after an unclean stop jumps over seqs that were never durable).
        self._unread: set[str] = set()
        #: Mirrored sessions with a turn under way (an event of it read, or named by
        #: the owner's answer; no outcome yet). A turn's outcome comes from the worker
        #: that runs it; if that worker dies first, none ever comes (no other worker
        #: heard of a turn that was not durable yet).
        self._open_turns: dict[str, _OpenTurn] = {}
        #: Mirrors whose stream is not read on while what became of their turn under
        #: way is asked: the stream's next event is a wake's seq jump (their session's
        #: worker died, and another woke it), by seq.
        self._held: dict[str, int] = {}
        # (session, the stamp of its payloads, what to publish)
        self._send, self._receive = trio.open_memory_channel[tuple[str, bytes, _Item]](_QUEUE_SIZE)
        # Lag markers still to write: for events the tap dropped (the queue was full;
        # written by the tap before the session's next event, or when the queue is
        # empty) and for events a failed publish lost (written by the publisher before
        # the session's next queued event, which is newer, or when the queue is empty).
        self._lost: dict[str, tuple[int, int]] = {}
        self._failed: dict[str, tuple[int, int]] = {}
        self._publishing = False
        self._flushed: trio.Event | None = None  # set once the queue is empty (closing)
        #: Sessions whose stream is still to be removed after an edit that erased the
        #: events before it (see ``_Erase``): the queue was full, or the removal failed;
        #: the publisher tries again, as it does with lag markers.
        self._unerased: set[str] = set()
        #: Sessions whose stream the store found damaged (a key of another type): the
        #: events queued for it are dropped, unless it is watched again since.
        self._damaged: set[str] = set()
        #: Mirrored sessions whose owner is to be asked again to publish their events
        #: (see ``_watch_again``): asking failed.
        self._rewatch: set[str] = set()

    @property
    def subscriber_count(self) -> int:
        return sum(hub.subscriber_count for hub in list(self._mirrors.values()))  # (any thread)

    def start(self, name: str) -> int:
        """The seq the mirror of ``name`` reads its stream after (0: none)."""
        return self._positions.get(name, 0)

    def positions(self) -> dict[str, int]:
        """The seq each mirror's stream is read after (a held one's is not read)."""
        held = self._held
        return {name: seq for name, seq in self._positions.items() if name not in held}

    async def flush(self, patience: float) -> None:
        """Wait up to ``patience`` seconds for the queued events to reach their streams."""
        if self._receive.statistics().current_buffer_used or self._publishing:
            flushed = self._flushed = trio.Event()
            with trio.move_on_after(patience):
                await flushed.wait()

    def close(self) -> None:
        """End every mirror's subscriptions (the worker stopped)."""
        for hub in self._mirrors.values():
            hub.close()
        self._mirrors.clear()

    def damaged(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the error of one session's own stored data (its event
        stream's key holds another type of value: ``SnapshotError`` naming it), not of
        the store: then that session's mirror ends with it (its subscribers here raise
        it) and its events are published no more (until another worker subscribes
        again); every other session goes on."""
        if not isinstance(exc, SnapshotError) or exc.session_id is None:
            return False
        name = exc.session_id
        hub = self._mirrors.get(name)
        if hub is not None:
            hub.close(exc)
            self._end_mirror(name, hub)
        if name not in self._damaged and name in self._watched:
            log.warning("the events of session %r are not sent to other workers: %s", name, exc)
        self._damaged.add(name)
        self._watched.pop(name, None)
        self._lost.pop(name, None)
        self._failed.pop(name, None)
        return True

    async def renew(self) -> None:
        """Renew the watch of every mirrored session; stop publishing the sessions that
        nobody elsewhere subscribes to any more."""
        names = list(self._mirrors)
        while True:
            try:
                lapsed = await self.transport.watch(names, self.ttl)
                break
            except SnapshotError as exc:
                if exc.session_id not in names or not self.damaged(exc):
                    raise
                names.remove(exc.session_id)
        for name in lapsed | self._rewatch:
            self._rewatch.discard(name)
            self._spawn(partial(self._watch_again, name), "watch again")
        if self._open_turns:
            await self._check_open_turns()
        if self._watched:
            names = list(self._watched)
            still = await self.transport.watched(names)
            for name in names:
                if name not in still:
                    self._watched.pop(name, None)

    async def _watch_again(self, name: str) -> None:
        """The watch of the session the mirror of ``name`` follows had lapsed (the store
        did not answer for three lease lifetimes) and is set again: a worker that
        claimed the session meanwhile found it unwatched, and publishes none of its
        events, so the mirror would wait in silence. Its owner, if it runs somewhere, is
        asked to publish them from the mirror's position on, as for a subscription that
        follows its session (see ``_follow``): what its hub no longer holds shows as a
        gap, and the mirror's subscribers are told that their events were interrupted.
        On failure it is asked again at the next renewal."""
        if name not in self._mirrors or self.host.is_live(name):
            await trio.lowlevel.checkpoint()
            return
        try:
            owner = await self.transport.lease_owner(name)
            if owner is None or owner == self.worker:
                return  # it runs nowhere: the claim that wakes it finds the watch
            position = self._positions.get(name, 0)
            request = {"op": "watch", "s": name, "after": position}
            answer = await self._forward(name, request, retry_safe=True)
            if answer is not None:
                self._check(answer, name)
        except Exception as exc:
            fatal(exc)
            if name in self._mirrors:
                self._rewatch.add(name)

    async def _check_open_turns(self) -> None:
        """Look at the lease of every mirrored session with a turn under way, in one
        round trip (a failed read is looked at again at the next renewal)."""
        turns = [(name, seen) for name, seen in self._open_turns.items() if not seen.asking]
        try:
            owners = await self.transport.lease_owners([name for name, _ in turns])
        except StoreError as exc:
            fatal(exc)
            return
        now = trio.current_time()
        for (name, seen), owner in zip(turns, owners, strict=True):
            if self._open_turns.get(name) is not seen:
                continue  # its outcome came meanwhile
            if seen.lost:  # no retry under its key came in time
                if now - (seen.free_since or now) >= _ORPHANED_AFTER * self.ttl:
                    self._turn_lost(name, seen)
                elif name in self._held:
                    await self._find_retry(name, seen)  # it may have started since
                continue
            if owner is not None:
                seen.free_since = None
                if seen.owner in (None, owner) and name not in self._held:
                    seen.owner = owner
                else:
                    # Another worker took the session over (a request, or a retry of
                    # the turn under its key; held: it woke the session, and published
                    # since): ask it what became of the turn.
                    seen.asking = True
                    self._spawn(partial(self._ask_outcome, name, seen, owner), "turn outcome")
                continue
            if seen.free_since is None:
                seen.free_since = now
            if now - seen.free_since < _ORPHANED_AFTER * self.ttl:
                continue
            # The worker that ran the turn let the session go before its outcome (it
            # died) and nobody took it since: nothing will publish the turn's outcome.
            # Its subscribers lag at the last event they have, and subscribe again
            # with after=, which wakes the session: the replay shows what it kept (if
            # nothing, the turn was lost: EventsExpiredError).
            self._turn_ended(
                name,
                f"the worker that ran session {name!r} let it go during turn "
                f"{seen.turn_id} (it died) and no worker took the session since, "
                "so nothing will publish the turn's outcome",
                ": that wakes the session, and the replay shows what it kept of the turn "
                "(EventsExpiredError if the turn was lost: then ",
                Advice(kind=AdviceKind.RELOAD_STATE),
                ")",
            )

    async def _ask_outcome(self, name: str, seen: _OpenTurn, owner: str) -> None:
        """The session a mirror follows moved to ``owner`` during turn ``seen``: one that
        runs there is watched there; one that ended there has its outcome; one it never
        heard of was lost (its worker died before it was durable), and will never have
        an outcome: the mirror's subscribers lag, as a lost turn's events no longer hold.
        A mirror held at a wake's seq jump reads on once the turn was found to run on
        or to have ended, and lags at its last event before the jump if it was lost
        (unless a retry under its key started after the jump: see ``_find_retry``)."""
        status: TurnStatus | None = None
        position = self._positions.get(name, 0)
        cut = False  # whether the session, woken there, lost the events after position
        try:
            if owner == self.worker:  # it woke here
                status = (await self.host.outcome_here(name, seen.turn_id)).status
                cut = self.host.lost_here(name, position) is not None
            else:
                request = {"op": "outcome", "s": name, "t": seen.turn_id, "after": position}
                answer = await self._forward(name, request, retry_safe=True)
                if answer is not None:
                    value = self._check(answer, name)["value"]
                    status = load_outcome(name, seen.turn_id, value).status
                    cut = answer.get("lost") is True
        except Exception as exc:
            fatal(exc)
            if self._open_turns.get(name) is seen:  # unknown: it follows the session
                del self._open_turns[name]
                self._read_on(name)
                self._rejoin(name)
            return
        if self._open_turns.get(name) is not seen:
            self._read_on(name)
            self._rejoin(name)
            return  # its outcome, or another turn, came meanwhile
        seen.asking = False
        if (
            cut
            and status not in (None, TurnStatus.LOST)
            and (status is TurnStatus.WAITING or seen.key is None)
        ):
            # The turn went on under its id from what the store held of it (its review,
            # which a worker that died had resolved; it may have ended since): the
            # events the mirror passed on after that were lost, and would read as the
            # start of what came next. (A turn the mirror knows the key of, read from
            # its TurnStarted, ran again under its key, which starts over with a
            # TurnStarted of its own.)
            self._turn_cut(name, seen, owner, status)
            return
        if status is TurnStatus.LOST:
            seen.owner = owner
            if seen.key is None:
                self._turn_lost(name, seen)
            else:  # the worker that sent it may send it again under its key: wait a while
                seen.lost, seen.free_since = True, trio.current_time()
                if name in self._held:
                    await self._find_retry(name, seen)
        elif status in (TurnStatus.QUEUED, TurnStatus.RUNNING) and owner != self.worker:
            seen.owner = owner  # it runs there: watched there
            self._read_on(name, seen)
        else:
            if status is not None:
                # it ended there (or waits on a review), or it runs here: the hub here
                # publishes its outcome
                del self._open_turns[name]
            if status in _ENDED:
                # Its outcome is durable, but the worker that wrote it may have died
                # before publishing it, and the new owner publishes only its own next
                # events: the journal has what the mirror lacks (before the jump, if
                # held at one: the stream has the new owner's).
                await self._fill_from_journal(name, self._held.get(name))
            if status is not None:
                self._read_on(name)
            self._rejoin(name)  # (None: free again, or here: asked here)

    def _hold(self, name: str, seen: _OpenTurn, jump: int) -> None:
        """The next event of the stream of ``name``, ``jump``, is a wake's seq jump while
        turn ``seen`` was under way: its worker died, and another woke the session.
        The mirror reads on only once it knows what became of the turn (the new owner
        is asked): a turn lost with its worker is told to its subscribers as lost,
        never passed over in silence for the new owner's events."""
        self._held[name] = jump
        if seen.asking:
            return  # (asked already: the answer reads on)
        seen.asking = True
        self._spawn(partial(self._settle_held, name, seen), "turn outcome")

    async def _settle_held(self, name: str, seen: _OpenTurn) -> None:
        if seen.lost:  # its new owner said it was lost: has a retry under its key started?
            seen.asking = False
            await self._find_retry(name, seen)
            return
        try:
            owner = await self.transport.lease_owner(name)
        except StoreError as exc:
            fatal(exc)
            owner = None
        if owner is None:  # (free again: the renewals ask once a worker holds it)
            seen.asking = False
            return
        await self._ask_outcome(name, seen, owner)

    async def _find_retry(self, name: str, seen: _OpenTurn) -> None:
        """A mirror held at a wake's seq jump whose turn ``seen`` (with an idempotency
        key) the new owner never heard of reads on once a retry of the turn under its
        key has started after the jump (the worker that sent it sends it again there):
        its subscribers follow the retry. Until then (renewals look again) the mirror
        stays held; if no retry starts within two lease lifetimes, the turn is lost."""
        jump = self._held.get(name)
        position = self._positions.get(name, 0)
        if jump is None:
            return
        try:
            _, found = await self.transport.events_after(name, position)
        except (StoreError, SnapshotError) as exc:
            fatal(exc)
            self.damaged(exc)
            return
        if self._open_turns.get(name) is not seen or self._held.get(name) != jump:
            return  # (settled meanwhile)
        items, _ = self.own_items(name, found)
        for _, kind, payload in items:
            if kind != "event":
                continue
            try:
                event = load_event(payload, session_id=name)
            except SnapshotError:
                continue
            if isinstance(event, TurnStarted) and event.idempotency_key == seen.key:
                del self._open_turns[name]  # the retry is a turn of its own: it is followed
                self._read_on(name)
                return

    def _read_on(self, name: str, seen: _OpenTurn | None = None) -> None:
        """Read the stream of a held mirror on (past its jump, for ``seen``)."""
        jump = self._held.pop(name, None)
        if jump is None:
            return
        if seen is not None:
            seen.passed = jump
        self._poke()

    async def _fill_from_journal(self, name: str, below: int | None = None) -> None:
        """Feed the mirror of ``name`` the durable events after its position (and below
        seq ``below``, if given) that the stream lacks (if the journal no longer holds
        them all, its subscribers lag). A mirror at seq 0 followed a session that had
        published nothing: every event the journal holds is after it."""
        hub = self._mirrors.get(name)
        position = self._positions.get(name, 0)
        if hub is None:
            return
        try:
            trimmed, entries = await self.host.store.read_journal(name, position)
        except SessionActorsError as exc:
            fatal(exc)
            return
        if self._mirrors.get(name) is not hub or self._positions.get(name, 0) != position:
            return  # (fed meanwhile: the stream goes on)
        if trimmed > position:
            hub.lose(_NOT_KEPT)  # they subscribe again with after=, which reads what is kept
            return
        try:
            events = [e for entry in entries for e in load_journal_entry(entry.data, name)]
        except SnapshotCorruptError:
            hub.lose(_UNREADABLE)  # the session's own: its subscribers hear it as they resume
            return
        self._feed(
            name,
            [
                (event.seq, "event", dump_event(event))
                for event in events
                if event.seq > position and (below is None or event.seq < below)
            ],
        )

    def _turn_cut(self, name: str, seen: _OpenTurn, owner: str, status: TurnStatus) -> None:
        where = "this worker" if owner == self.worker else f"worker {owner!r}"
        now = {
            TurnStatus.WAITING: "waits on its review again",
            TurnStatus.QUEUED: "goes on from there",
            TurnStatus.RUNNING: "goes on from there",
        }.get(status, f"went on from there and is {status.value} now")
        self._turn_ended(
            name,
            f"the events of turn {seen.turn_id} of session {name!r} after the last one "
            f"stored were lost: the worker that ran the turn died before it stored them, "
            f"and {where} took the session over, where the turn, as stored, {now}",
            " to go on (if that is refused as expired, EventsExpiredError, the events "
            "after it were lost: then ",
            Advice(kind=AdviceKind.RELOAD_STATE),
            ")",
        )

    def _turn_lost(self, name: str, seen: _OpenTurn) -> None:
        self._turn_ended(
            name,
            (
                f"turn {seen.turn_id} of session {name!r} was lost: the worker that ran "
                f"it died before the turn was durable, and worker {seen.owner!r}, which "
                "took the session over, never heard of it (",
                Advice(kind=AdviceKind.LOST_OUTCOME),
                "send it again), so nothing will publish its outcome",
            ),
            " to go on (if that is refused as expired, EventsExpiredError, the events "
            "after it were lost with the turn: then ",
            Advice(kind=AdviceKind.RELOAD_STATE),
            ")",
        )

    def _turn_ended(
        self, name: str, why: str | tuple[str | Advice, ...], *then: str | Advice
    ) -> None:
        """End the subscriptions of the mirror of ``name`` with SubscriberLaggedError
        (saying ``why``, and ``then`` what subscribing again does): the outcome of the
        turn it watched will never come."""
        self._open_turns.pop(name, None)
        hub = self._mirrors.get(name)
        if hub is not None:
            last = self._positions.get(name, 0)
            error = advised(
                SubscriberLaggedError,
                *((why,) if isinstance(why, str) else why),
                "; ",
                Advice(kind=AdviceKind.RESUME_AFTER, seq=last),
                *then,
                session_id=name,
                last_seq=last,
            )
            hub.close(error)
            self._end_mirror(name, hub)

    def publish_from(self, name: str, since: int | None) -> int:
        """Another worker subscribes to the session, live here: publish its events from
        now on (from ``since`` if its hub still holds the events after it, deltas
        included); the seq it publishes from (-1: not live here)."""
        host = self.host
        seq = host.event_seq_here(name)
        if seq is not None and name not in self._watched:
            self._watched[name] = False
            held = None if since is None else host.events_here(name, since)
            if since is not None and held is not None:
                seq = since
            stamp = birth(host.created_here(name))
            self._enqueue(name, stamp, _CatchUp(seq))
            for event in held or ():
                self._enqueue(name, stamp, event)
        return -1 if seq is None else seq

    def held_here(self, name: str, after: int) -> dict[str, Any]:
        """The answer to another worker's ``held`` request: the events after ``after``
        that the session's hub here still holds, all of them, or None."""
        host = self.host
        lost = host.lost_here(name, after)
        if lost is not None:  # (the subscription there raises it)
            return dump_error(lost)
        events = host.events_here(name, after)
        created = host.created_here(name)
        if events is None or created is None:
            return {"ok": "value", "value": None}
        value = [[event.seq, dump_event(event)] for event in events]
        return {"ok": "value", "value": value, "born": creation_stamp(created)}

    async def held(self, name: str, after: int) -> dict[int, bytes] | None:
        """The events after ``after`` that the session's owner elsewhere still holds, by
        seq, if it holds them all (deltas included); None otherwise, or if the owner
        does not answer soon (a hand-over holds its requests: meanwhile the
        subscription that waits on this replay buffers the session's events)."""
        request = {"op": "held", "s": name, "after": after}
        answer = None
        with trio.move_on_after(self.ttl / 3):
            try:
                answer = await self._forward(name, request, retry_safe=True)
            except SessionActorsError:  # (an owner of an earlier version knows no "held")
                return None
        if answer is not None and answer.get("err") == EventsExpiredError.__name__:
            self._check(answer, name)  # raises it: the events after ``after`` are lost
        if answer is None or "err" in answer or not isinstance(answer.get("value"), list):
            return None
        followed = self._births.get(name)
        born = stamp_of(answer)
        if born is None or (followed is not None and followed.born not in (None, born)):
            return None  # another session of that name than the one followed
        held: dict[int, bytes] = {}
        for seq, data in answer["value"]:
            held[int(seq)] = bytes(data)
        return held

    async def take(self, events: Mapping[str, list[StreamItem]]) -> None:
        """Feed what the reader read of the mirrored streams to their mirrors."""
        for name, found in events.items():
            if name in self._held:
                continue  # (read again once it reads on)
            items, replaced = self.own_items(name, found)
            first = items[0] if items else None
            if (
                first is not None
                and first[1] != "gone"  # (the end marker's seq is above every seq)
                and first[0] > self._positions.get(name, 0) + 1
                and not self._wakes_after(name, first)
            ):
                await self._check_gap(name, first[0])
            self._feed(name, items)
            if items and name not in self._held:
                # (read: a gap now is one in the stream; held at a jump while a turn was
                # under way, it read nothing yet, and its first read again is checked
                # against the journal as this one was)
                self._unread.discard(name)
            if replaced:  # (its session was deleted, and one made again under its name)
                hub = self._mirrors.get(name)
                if hub is not None:
                    self._end_mirror(name, hub, deleted_error(name))
            elif items and self.host.is_live(name):
                self._rejoin(name)

    def own_items(self, name: str, items: Sequence[StreamItem]) -> tuple[list[StreamItem], bool]:
        """The items of the session a mirror follows, unstamped, and whether a session
        made again under its name published the rest (the one it follows was deleted:
        the mirror ends). A deleted namesake's items are skipped."""
        followed = self._births.get(name)
        born = None if followed is None else followed.born
        own: list[StreamItem] = []
        for seq, kind, payload in items:
            stamp, payload = unstamp(payload)
            if stamp is not None and stamp != born:
                if born is None:  # the first the mirror reads
                    born = stamp
                    if followed is not None:
                        followed.born = stamp
                elif stamp > born:
                    return own, True
                else:
                    continue
            own.append((seq, kind, payload))
        return own, False

    # ---- events: publishing ------------------------------------------------------------

    def tap_for(self, name: str) -> Callable[[Event], None]:
        """The function a session's hub calls with every event it publishes: it goes
        to the session's stream while another worker subscribes, nowhere otherwise."""
        watched = self._watched
        take_watched = self.transport.take_watched
        created_here = self.host.created_here
        created: datetime.datetime | None = None
        born = b""

        def tap(event: Event) -> None:
            nonlocal created, born
            if erases(event):
                # before the edit goes to the stream (watched or not: a stream may be
                # left from an earlier watch), nothing before it may stay there, nor in
                # the answers kept for other workers' requests
                self._erased(name)
                self._enqueue(name, born, _Erase(event.seq))
            catch_up = watched.get(name)
            if catch_up is None:
                if not take_watched(name):
                    return  # nobody elsewhere subscribes
                catch_up = True
            now = created_here(name)
            if now is not created:  # (a session made again under its name, too)
                created, born = now, birth(now)
            if catch_up:
                watched[name] = False
                if event.seq > 1:
                    self._enqueue(name, born, _CatchUp(event.seq - 1))
            self._enqueue(name, born, event)

        return tap

    def _enqueue(self, name: str, born: bytes, item: _Item) -> None:
        if isinstance(item, _Erase):
            try:
                self._send.send_nowait((name, born, item))
            except trio.WouldBlock:
                self._unerased.add(name)
            return
        seq = item.seq if isinstance(item, Event) else cast(_CatchUp, item).upto
        lost = self._lost.get(name)
        stats = self._send.statistics()
        if lost is not None:
            if stats.max_buffer_size - stats.current_buffer_used >= 2:
                del self._lost[name]
                self._send.send_nowait((name, born, _Lost(*lost)))
            else:
                self._lose(name, seq, seq)
                return
        try:
            self._send.send_nowait((name, born, item))
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

    async def publish_loop(self) -> None:
        keep = self.host.config.hub.replay_events
        receive = self._receive
        while True:
            batch: list[tuple[str, bytes, _Item]] = []
            if self._failed or self._lost or self._unerased:  # (with or without new events)
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
                if self._unerased and not receive.statistics().current_buffer_used:
                    for name in list(self._unerased):
                        await self._erase(name)
                if not receive.statistics().current_buffer_used and (self._failed or self._lost):
                    created_here = self.host.created_here
                    markers = [
                        (n, birth(created_here(n)), cast(_Item, _Lost(*r)))
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

    async def _publish_batch(self, batch: Sequence[tuple[str, bytes, _Item]], keep: int) -> None:
        groups: dict[str, list[StreamItem]] = {}

        async def flush() -> None:
            while groups:
                try:
                    await self.transport.publish(groups, keep)
                except SnapshotError as exc:
                    # one session's stream is damaged: the others' are published
                    if exc.session_id not in groups or not self.damaged(exc):
                        raise
                    del groups[exc.session_id]
                    continue
                except StoreError as exc:
                    fatal(exc)
                    await self._mark_failed(groups)
                break
            groups.clear()

        for name, born, item in batch:
            if name in self._damaged:
                if name not in self._watched:
                    continue  # queued before its stream was found damaged
                self._damaged.discard(name)  # watched again since: tried again
            if isinstance(item, _CatchUp):
                await flush()
                await self._catch_up(name, born, item.upto, keep)
                continue
            if isinstance(item, _Erase):
                await flush()  # (what came before it goes first, and goes with the stream)
                await self._erase(name)
                continue
            seq = item.last if isinstance(item, _Lost) else item.seq
            failed = self._failed.get(name)
            if failed is not None and seq >= failed[0]:  # newer than the failed ones
                if seq <= failed[1]:
                    continue  # inside a range already marked lost
                del self._failed[name]
                marker = born + str(failed[0]).encode()
                groups.setdefault(name, []).append((failed[1], "lost", marker))
            if isinstance(item, _Lost):
                marker = born + str(item.first).encode()
                groups.setdefault(name, []).append((item.last, "lost", marker))
                continue
            try:
                data = born + dump_event(item)
            except (TypeError, ValueError):
                self._lose(name, item.seq, item.seq, self._failed)
                continue
            groups.setdefault(name, []).append((item.seq, "event", data))
        await flush()

    async def _erase(self, name: str) -> None:
        """Remove the session's stream (its events before an edit that erased them); on
        failure it is tried again once the queue is empty (see ``publish_loop``)."""
        self._unerased.discard(name)
        try:
            await self.transport.reset_events(name)
        except SnapshotError as exc:
            if not self.damaged(exc):
                raise
        except StoreError as exc:
            fatal(exc)
            self._unerased.add(name)
            await trio.sleep(0.05)

    async def _mark_failed(self, groups: Mapping[str, Sequence[StreamItem]]) -> None:
        """Note the items the stream may lack as lost (a marker's range stays whole; only
        events are counted: a marker's were counted when they were dropped)."""
        for name, items in groups.items():
            first = min(
                int(unstamp(data)[1]) if kind == "lost" else seq for seq, kind, data in items
            )
            last = max(seq for seq, _, _ in items)
            lost = sum(kind == "event" for _, kind, _ in items)
            self._lose(name, first, last, self._failed, lost)
        await trio.sleep(0.05)

    async def _catch_up(self, name: str, born: bytes, upto: int, keep: int) -> None:
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
                for event in load_journal_entry(batch.data, name)
                if top < event.seq <= upto
            ]
            gone = min(trimmed, upto)  # entries up to here are no longer in the journal
            if len(entries) > keep:  # keep the stream's bound: the oldest are skipped
                gone = max(gone, entries[-keep - 1].seq)
                entries = entries[-keep:]
            items: list[StreamItem] = []
            if gone > top:
                items.append((gone, "lost", born + str(top + 1).encode()))
            items += [(e.seq, "event", born + e.data) for e in entries if e.seq > gone]
            if items:
                await self.transport.publish({name: items}, keep)
        except SessionActorsError as exc:
            fatal(exc)
            return  # deleted meanwhile, or the store is unreachable: subscribers replay

    # ---- events: subscriptions ---------------------------------------------------------

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        """A subscription to the session's hub here if it runs here; otherwise fed by
        the session's event stream, wherever the session runs."""
        host = self.host
        found = self._mirrors.get(name)
        top = -1  # where the owner elsewhere starts publishing (-1: it runs here)
        born: int | None = None  # when the session it runs was created
        running: tuple[str, str | None] | None = None  # its turn under way (id, key)
        watch: dict[str, Any] = {"op": "watch", "s": name}
        if after is not None:  # (its owner checks it with the store before a wake; a
            # seq past what the wire carries is past every seq, as the largest it carries)
            watch["beyond"] = min(after, MAX_WIRE_INT)
        for _ in range(MAX_ATTEMPTS):
            if host.is_live(name) or (
                # (a mirror may be behind its owner: a seq beyond it is asked of the owner)
                found is not None and (after is None or after <= found.published)
            ):
                break
            if found is not None and not await self.may_run_ahead(name, cast(int, after)):
                break  # stored cleanly, and reached ``after``: the mirror follows it
            answer = await self._forward(name, watch, retry_safe=True)
            if answer is not None:  # its owner publishes its events from ``top`` on
                top = int(self._checked_watch(answer, name, after)["value"])
                born = stamp_of(answer)
                running = _running_turn(answer)
                if top >= 0:
                    break
                continue  # it left that worker before it could publish: look again
            try:  # live nowhere, or its shard is this worker's: it wakes here
                if after is not None:  # (refused without waking it)
                    await self.may_run_ahead(name, after)
                state = await host.read_here(name)
            except SessionStoppedError:
                break  # stopped: the local subscription replays and ends
            except LeaseHeldError:
                continue  # another worker woke it meanwhile: ask that one
            if not host.is_live(name):
                # It left again at once (hibernated): its hub here hears of it only if
                # it wakes here next; follow it from where it was, wherever it wakes.
                if after is not None:
                    refuse_beyond(name, after, state.event_seq)
                return await self._follow(name, state.event_seq if after is None else after, None)
            found = self._mirrors.get(name)
        if after is not None:
            # Beyond the session's last event (a stale or forged seq), a subscription
            # would wait in silence until the session's seq passed it.
            if top >= 0:  # its owner elsewhere said where it is (ahead of the store)
                refuse_beyond(name, after, top)
            elif name in self._mirrors:  # followed by a mirror here, checked by no hub
                last = host.event_seq_here(name)  # (None: it runs nowhere; the mirror
                if last is not None:  # covers ``after``, or the store refused it)
                    refuse_beyond(name, after, last)
            # (a subscription to its hub here, without a mirror, is checked by it)
        return await self._subscribe(name, after, top, born, running=running)

    def _checked_watch(self, answer: dict[str, Any], name: str, after: int | None) -> Any:
        """The owner's answer to a watch, or its error raised; its refusal of a seq past
        what the wire carries (sent as ``MAX_WIRE_INT``) is told of ``after`` itself."""
        try:
            return self._check(answer, name)
        except EventsExpiredError as exc:
            oldest = getattr(exc, "oldest_seq", None)
            if after is None or after <= MAX_WIRE_INT or not isinstance(oldest, int):
                raise
            raise beyond_error(name, after, oldest - 1) from None

    async def may_run_ahead(self, name: str, after: int) -> bool:
        """Raise EventsExpiredError if the store shows that the session (not live here)
        never reached ``after`` (see ``beyond_stored``): a check made with the store,
        before anything wakes it for a subscription, so that a stale or forged seq
        wakes nothing. Otherwise whether it may be live somewhere, ahead of the store
        (its last write was not a clean hibernation or a stop)."""
        if self.host.is_live(name):
            await trio.lowlevel.checkpoint()
            return True
        session, stored = await read_stored(self.host.store, name, history=False)
        error = beyond_stored(name, after, session, stored)
        if error is not None:
            raise error
        return session.status is not Status.STOPPED and not stored_cleanly(session, stored)

    async def _follow(self, name: str, after: int, mine: int | None) -> EventIterator:
        """Go on with a subscription whose session left this worker, from ``after`` (the
        last seq it delivered): from the session's hub here if it woke here again, from
        its event stream otherwise, wherever it runs; a session that runs nowhere is not
        woken (its next owner publishes its events). It ends if the name now holds
        another session than the one it followed (``mine``: when that was created)."""
        top = -1
        born = mine
        replaced = False
        running: tuple[str, str | None] | None = None
        for _ in range(MAX_ATTEMPTS):
            if self.host.is_live(name):
                created = self.host.created_here(name)
                replaced = (
                    mine is not None and created is not None and creation_stamp(created) != mine
                )
                break
            if name in self._mirrors:
                break
            # Watched first: whoever claims the session from now on publishes its events.
            await self.transport.watch([name], self.ttl)
            owner = await self.transport.lease_owner(name)
            if self.host.is_live(name):
                continue  # it woke here meanwhile (its claim may have missed the watch)
            if owner is None or owner == self.worker:
                top = after  # it runs nowhere: its next owner publishes from its wake on
                break
            # Another worker took it before: it publishes from ``after`` (or the journal
            # fills in what its hub no longer holds).
            request = {"op": "watch", "s": name, "after": after}
            answer = await self._forward(name, request, retry_safe=True)
            if answer is not None:
                top = max(after, int(self._check(answer, name)["value"]))
                now = stamp_of(answer)
                replaced = mine is not None and now is not None and now != mine
                born = now if mine is None else mine
                running = _running_turn(answer)
                break
        iterator = await self._subscribe(name, after, top, born, followed=True, running=running)
        if replaced:  # the session it followed was deleted: it ends, saying so
            iterator.close()
            raise deleted_error(name)
        return iterator

    async def _subscribe(
        self,
        name: str,
        after: int | None,
        top: int,
        born: int | None,
        *,
        followed: bool = False,
        running: tuple[str, str | None] | None = None,
    ) -> EventIterator:
        """A subscription from the session's hub here (``top`` < 0) or from its event
        stream, read from ``top`` on (a mirror made now starts there; ``born``: when
        the session it follows was created, if known; ``followed``: for a subscription
        that follows its session from ``top``; ``running``: the turn (id, key) its
        owner said was under way at ``top``, if any)."""
        host = self.host
        found = self._mirrors.get(name)
        if found is None and top < 0:
            iterator = await host.open_subscription_here(name, after)
            created = host.created_here(name)
            mine = None if created is None else creation_stamp(created)
            iterator.follow = lambda seq: self._follow(name, seq, mine)
            return iterator
        if found is None:
            found = self._mirrors[name] = Hub(name, host.config.hub)
            found.on_lag = host.subscriber_lagged  # (counted as the owner's hubs are)
            found.advance(top)
            self._positions[name] = top
            self._births[name] = _Followed(born)
            if running is not None:  # its TurnStarted went by before ``top``
                self._open_turns[name] = _OpenTurn(*running)
            if followed:
                self._unread.add(name)
            self._poke()
        hub: Hub = found
        followed_session = self._births[name]
        iterator = await open_event_iterator(
            name,
            hub,
            cast(Store, _Replay(self)),
            after,
            lambda: self._release_mirror(name, hub),
        )
        # (back here: see _rejoin)
        iterator.follow = lambda seq: self._follow(name, seq, followed_session.born)
        if not host.is_live(name):
            try:
                stopped = (await host.stored_status(name)) is Status.STOPPED
            except SessionNotFoundError:
                iterator.close()
                if not followed:
                    raise
                raise deleted_error(name) from None  # the session it followed was deleted
            except BaseException:
                iterator.close()
                raise
            if stopped:
                iterator.close()
        return iterator

    def _release_mirror(self, name: str, hub: Hub) -> None:
        if self._mirrors.get(name) is hub and hub.subscriber_count == 0:
            self._drop_mirror(name)

    def _drop_mirror(self, name: str) -> None:
        del self._mirrors[name]
        self._positions.pop(name, None)
        self._births.pop(name, None)
        self._unread.discard(name)
        self._open_turns.pop(name, None)
        self._held.pop(name, None)

    def _poke(self) -> None:
        """Have the reader start over, now reading a new mirror's stream too."""

        async def poke() -> None:
            # on failure the reader picks the stream up at its next round anyway
            with contextlib.suppress(StoreError):
                await self.transport.post(self.worker, pack({"op": "wake"}), self.ttl)

        self._spawn(poke, "cluster poke")

    def _wakes_after(self, name: str, item: StreamItem) -> bool:
        """Whether ``item``, the next of the stream of ``name`` after a gap, is the status
        of a wake that skipped the seqs of the gap, from the one after the mirror's
        position on (see ``StatusChanged.skipped_from``): the mirror lacks nothing."""
        _, kind, payload = item
        if kind != "event":
            return False
        try:
            event = load_event(payload, session_id=name)
        except SnapshotError:
            return False  # (told as the mirror reads it)
        return (
            isinstance(event, StatusChanged)
            and event.skipped_from == self._positions.get(name, 0) + 1
        )

    async def _check_gap(self, name: str, first: int) -> None:
        """The stream skips seqs after a mirror's position (its next event is ``first``).
        If it was trimmed past it (it outran the reader, or the store lost it), the
        mirror's subscribers lag. Otherwise the seqs it skips never reached it: a new
        owner's wake jumped over them, or the owner died after it stored a turn and
        before it published that turn's events; what of them is stored, the mirror
        takes from the journal first."""
        position = self._positions.get(name, 0)
        try:
            oldest = await self.transport.first_event_seq(name)
        except (StoreError, SnapshotError) as exc:
            fatal(exc)
            if self.damaged(exc):
                return
            oldest = 0
        if not position or 0 < oldest <= position + 1:
            await self._fill_from_journal(name, first)
            return
        if name in self._unread and await self._never_durable(name, position, first):
            return  # the new owner jumped over them: a followed subscription missed nothing
        hub = self._mirrors.get(name)
        if hub is not None:
            hub.lose(_SKIPPED)  # they subscribe again with after=, which reads the journal

    async def _never_durable(self, name: str, position: int, first: int) -> bool:
        """Whether the journal holds no event with a seq between ``position`` and ``first``."""
        try:
            trimmed, entries = await self.host.store.read_journal(name, position)
            return trimmed <= position and not any(
                position < event.seq < first
                for entry in entries
                for event in load_journal_entry(entry.data, name)
            )
        except SessionActorsError as exc:  # unreadable: count it as a gap
            fatal(exc)
            return False

    def _feed(self, name: str, items: Sequence[StreamItem]) -> None:
        hub = self._mirrors.get(name)
        for seq, kind, payload in items:
            if hub is None or seq <= self._positions.get(name, 0):
                continue
            seen = self._open_turns.get(name)
            if (
                kind == "event"
                and seen is not None
                and seq > seen.passed
                and seq - self._positions.get(name, seq) > _JUMP
            ):
                self._hold(name, seen, seq)  # what became of the turn first
                return
            self._positions[name] = seq
            if kind == "gone":  # (deleted)
                self._end_mirror(name, hub, deleted_error(name))
                return
            hub.advance(seq)
            if kind == "lost":
                hub.lose(_DROPPED)
                continue
            try:
                event = load_event(payload, session_id=name)
            except SnapshotError:
                hub.lose(_UNREADABLE)
                continue
            hub.publish(event)
            if event.__class__ in _AT_REST:
                self._open_turns.pop(name, None)
            else:
                # Any event of a turn says it is under way (a TurnStarted the mirror read,
                # or one before it began, and the rest of a turn after its review).
                turn_id = getattr(event, "turn_id", None)
                if turn_id is not None:
                    seen = self._open_turns.get(name)
                    key = getattr(event, "idempotency_key", None)
                    if (seen is None or seen.turn_id != turn_id) and (
                        seen is None or not seen.lost or (key is not None and key == seen.key)
                    ):  # (a turn lost waits for a retry under its key)
                        self._open_turns[name] = _OpenTurn(turn_id, key)
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
        seen = self._open_turns.get(name)
        if seen is not None:  # first, what became of the turn it watched (lost?)
            if not seen.asking and not seen.lost:
                seen.asking = True
                self._spawn(partial(self._ask_outcome, name, seen, self.worker), "turn outcome")
            return
        self._drop_mirror(name)
        hub.leave()

    def _end_mirror(self, name: str, hub: Hub, error: SessionActorsError | None = None) -> None:
        """End the mirror's subscriptions: cleanly (its session stopped), or raising
        ``error`` after their last event (deleted: ``deleted_error``)."""
        hub.close(error)
        if self._mirrors.get(name) is hub:
            self._drop_mirror(name)

    async def created(self, name: str) -> None:
        # (lag markers of a deleted namesake would take the new session's seqs, and a
        # removal of its stream still to make after an edit, the new session's events:
        # the removal below takes the namesake's)
        self._lost.pop(name, None)
        self._failed.pop(name, None)
        self._unerased.discard(name)
        await self.transport.reset_events(name)

    async def deleted(self, name: str) -> None:
        # Nothing more is written to its stream: not the lag markers still to write for
        # events it published before (written after an end that the store refused, they
        # would reach its subscribers elsewhere as a lag before they hear that it was
        # deleted, and keep its stream for a day), nor a removal after an edit (the end
        # marker's write removes what the stream held; a removal after it, the marker).
        self._lost.pop(name, None)
        self._failed.pop(name, None)
        self._unerased.discard(name)
        # (if this fails, the workers that subscribe end the stream: their next watch
        # finds the session gone)
        with contextlib.suppress(StoreError, SnapshotError):  # (damaged: read by nobody)
            await self.transport.end_events(name)
