"""Opening a subscription: replay from the hub's ring or the store's journal, then live.

A replay from a store that reads its journal in pages (``JournalPageStore``) is read a
page at a time, when the reader has taken the page before: a subscription holds a page
of the journal, not the whole journal after its ``after``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from typing import Final, Protocol, runtime_checkable

import trio

from ._codec import load_journal_entry
from ._errors import Advice, AdviceKind, EventsExpiredError, advised
from ._events import Event, StatusChanged
from ._hub import SEQ_GAP, Hub, Subscriber, expired_error, lagged_error, skipped_error
from ._reading import stored_cleanly, stored_seq
from ._records import Status
from ._session import LiveSession
from .stores._base import JournalEntry, Store, StoredSession

__all__ = [
    "EventIterator",
    "beyond_error",
    "beyond_stored",
    "open_event_iterator",
    "refuse_beyond",
]

#: A page of a replay from the store: at most this many journal entries, and no entry
#: after the one that brings their data to REPLAY_PAGE_BYTES.
REPLAY_PAGE_ENTRIES: Final = 256
REPLAY_PAGE_BYTES: Final = 1 << 19


@runtime_checkable
class _PageReader(Protocol):
    """What reads a journal in pages: a ``JournalPageStore``, or the multi-worker layer's
    replay of a session that runs elsewhere (its event stream, then the store's pages)."""

    read_journal_page: Callable[..., Awaitable[tuple[int, list[JournalEntry]]]]


async def _read_page(
    store: Store, session_id: str, after: int
) -> tuple[int, list[JournalEntry], bool]:
    """``(trimmed_upto, entries, more)``: the next journal entries after ``after`` (a
    page, if the store reads pages), and whether more may follow them."""
    if isinstance(store, _PageReader):
        trimmed, entries = await store.read_journal_page(
            session_id, after, limit=REPLAY_PAGE_ENTRIES, max_bytes=REPLAY_PAGE_BYTES
        )
        size = sum(len(entry.data) for entry in entries)
        return trimmed, entries, len(entries) >= REPLAY_PAGE_ENTRIES or size >= REPLAY_PAGE_BYTES
    trimmed, entries = await store.read_journal(session_id, after)
    return trimmed, entries, False


def _check_not_ended(sub: Subscriber) -> None:
    """Raise the error that ended the subscription while a page of its replay was read
    (its session deleted): the page may be of another session, made since under its
    name, and the subscription ends before it, as the session's events do."""
    if sub.error is not None:
        raise sub.error


class _Pages:
    """The rest of a replay from the store, merged with the events memory held when the
    subscription opened (the ring, durable events not stored yet) and those published
    since (taken from the subscriber's buffer as each page is read, or a replayed event
    with a larger seq would make the iterator skip them)."""

    def __init__(
        self,
        session_id: str,
        store: Store,
        sub: Subscriber,
        after: int,
        held: dict[int, Event],
        store_wait: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._session_id = session_id
        self._store = store
        self._store_wait = store_wait
        self._sub = sub
        self._after = after
        #: The last journal seq read.
        self._position = after
        self._held = held
        #: Events held beyond which the reader has fallen behind the live session.
        self._most = len(held) + sub.send.statistics().max_buffer_size
        #: The last seq of the replay so far, while it may still cross a wake's jump.
        self._prev: int | None = after
        self.done = False

    async def next(self, cursor: int) -> list[Event]:
        """The next events of the replay, in seq order (the last ones once ``done``)."""
        session_id = self._session_id
        with self._store_wait():
            trimmed, entries, more = await _read_page(self._store, session_id, self._position)
        _check_not_ended(self._sub)
        if trimmed > self._position:  # (trimmed after the first page: see open_event_iterator)
            raise expired_error_at(session_id, cursor, trimmed)
        return self.take(entries, more, cursor)

    def take(self, entries: list[JournalEntry], more: bool, cursor: int) -> list[Event]:
        held = self._held
        after = self._after
        top = self._position
        for entry in entries:  # an entry holds one commit's events
            for event in load_journal_entry(entry.data, self._session_id):
                top = max(top, event.seq)
                if event.seq > after:
                    held.setdefault(event.seq, event)
        if entries:
            self._position = entries[-1].seq
        while True:
            try:
                event = self._sub.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            held[event.seq] = event
        more = more and bool(entries)
        if more:  # what memory holds above this page waits for the pages before it
            seqs = sorted(seq for seq in held if seq <= top)
        else:
            seqs = sorted(held)
            self.done = True
        batch = [held.pop(seq) for seq in seqs]
        batch = [event for event in batch if event.seq > after]
        if self._prev is not None:
            self._prev = _check_jumps(self._session_id, after, self._prev, batch)
        if more and len(held) > self._most:
            raise lagged_error(self._session_id, cursor)
        return batch


class EventIterator:
    """Events with seq above a cursor: first the replay, then the live buffer."""

    def __init__(
        self,
        session_id: str,
        hub: Hub,
        sub: Subscriber,
        replay: list[Event],
        cursor: int,
        on_close: Callable[[], None],
        pages: _Pages | None = None,
    ) -> None:
        self._session_id = session_id
        self._pages = pages
        self._hub = hub
        self._sub = sub
        self._replay = deque(replay)
        self._cursor = cursor
        self._on_close = on_close
        self._closed = False
        #: Where the subscription goes on when its session leaves this process (a
        #: multi-worker router sets it): called with the last seq delivered, it returns
        #: the subscription that continues from there. Without it, that ends as lagged.
        self.follow: Callable[[int], Awaitable[EventIterator]] | None = None

    @property
    def last_seq(self) -> int:
        """The seq of the last event delivered (or where the subscription started)."""
        return self._cursor

    def __aiter__(self) -> EventIterator:
        return self

    async def __anext__(self) -> Event:
        while True:
            replay = self._replay
            pages = self._pages
            if not replay and pages is not None:
                replay.extend(await pages.next(self._cursor))
                if pages.done:
                    self._pages = None
                continue
            if replay:
                # checkpoint before taking an event: a cancelled read must lose nothing
                await trio.lowlevel.checkpoint()
            while replay:
                event = replay.popleft()
                if event.seq > self._cursor:
                    self._cursor = event.seq
                    return event
            receive = self._sub.receive
            while True:
                try:
                    event = await receive.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    sub = self._sub
                    if sub.error is not None:
                        raise sub.error from None
                    if sub.lagged or (sub.left and self.follow is None):
                        raise lagged_error(
                            self._session_id, self._cursor, sub.interrupted
                        ) from None
                    if not sub.left or self._closed:
                        raise StopAsyncIteration from None
                    break
                if event.seq > self._cursor:
                    self._cursor = event.seq
                    return event
            await self._go_on()

    async def _go_on(self) -> None:
        """The session left this process: go on with the subscription ``follow`` opens
        from the last seq delivered (on failure, the next read tries again)."""
        assert self.follow is not None
        nxt = await self.follow(self._cursor)
        if self._closed:  # (closed meanwhile, by another task)
            nxt.close()
            return
        hub, sub, on_close = self._hub, self._sub, self._on_close
        self._hub, self._sub, self._on_close = nxt._hub, nxt._sub, nxt._on_close
        self._replay.extend(nxt._replay)
        self._pages = nxt._pages
        self.follow = nxt.follow
        nxt._closed = True  # what it held is this iterator's now
        hub.unsubscribe(sub)
        on_close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hub.unsubscribe(self._sub)
            self._on_close()


async def open_event_iterator(
    session_id: str,
    hub: Hub,
    store: Store,
    after: int | None,
    on_close: Callable[[], None],
    unsaved: Callable[[], tuple[int, Iterable[Event]]] = lambda: (0, ()),
    store_wait: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
) -> EventIterator:
    """Subscribe first (so nothing published meanwhile is missed), then gather the replay.

    ``unsaved`` gives the session's durable events that are not in the store yet, and
    the seq after which they begin (the events before it are in no replay any more).
    ``store_wait`` is entered around each later read of the store (see
    ``Sessions.store_wait``).
    """
    sub = hub.subscribe(after)
    try:
        if after is None:
            # from the last event published: one given its seq already but withheld until
            # it is stored (a turn's outcome, a hibernation's status) comes live
            return EventIterator(session_id, hub, sub, [], hub.published, on_close)
        if after < 0:
            raise ValueError(f"after must be a seq (>= 0), not {after}")
        if hub.lost(after):  # (a wake that comes later ends it: see Hub.jump)
            raise hub.lost_error(after)
        # A hub still at seq 0 was made for a subscriber of a session that is not live
        # (hibernated, stopped): it knows nothing of the session's past, so ask the store.
        if hub.seq and hub.ring_covers(after):
            return EventIterator(session_id, hub, sub, hub.ring_after(after), after, on_close)
        # What memory holds now (the ring, durable events not stored yet), then the journal;
        # not an event withheld until its write is done (a turn's outcome, a status): it
        # comes live once stored, or never, if the write fails
        published = hub.published
        floor, pending = unsaved()
        found: dict[int, Event] = {e.seq: e for e in pending if after < e.seq <= published}
        found.update((e.seq, e) for e in hub.ring_after(after))
        trimmed, entries, more = await _read_page(store, session_id, after)
        _check_not_ended(sub)
        trimmed = max(trimmed, floor)
        if trimmed > after:
            raise expired_error_at(session_id, after, trimmed)
        pages = _Pages(session_id, store, sub, after, found, store_wait)
        replay = pages.take(entries, more, after)
        return EventIterator(
            session_id, hub, sub, replay, after, on_close, None if pages.done else pages
        )
    except BaseException:
        hub.unsubscribe(sub)
        on_close()
        raise


def expired_error_at(session_id: str, after: int, trimmed: int) -> EventsExpiredError:
    return advised(
        EventsExpiredError,
        f"events of session {session_id!r} after seq {after} are no longer "
        f"available; the oldest available is seq {trimmed + 1}: ",
        Advice(kind=AdviceKind.RELOAD_STATE),
        session_id=session_id,
        oldest_seq=trimmed + 1,
    )


def shown_seq(seq: int) -> str:
    """A caller's seq as a message tells it: in digits, or by its size if it has more
    than Python writes out (``sys.get_int_max_str_digits()``)."""
    try:
        return str(seq)
    except ValueError:
        return f"({'a negative' if seq < 0 else 'an'} integer of {seq.bit_length()} bits)"


def beyond_error(session_id: str, after: int, last: int) -> EventsExpiredError:
    """The error for a subscription after ``after``, beyond ``last``, the seq of the
    session's last event: the seq was never the session's."""
    return advised(
        EventsExpiredError,
        f"session {session_id!r} has no event after seq {shown_seq(after)}: its last "
        "event is seq "
        f"{last} (a seq of another session of that name, since deleted, or from before "
        "its store was restored from a backup); ",
        Advice(kind=AdviceKind.RELOAD_STATE),
        session_id=session_id,
        oldest_seq=last + 1,
    )


def refuse_beyond(session_id: str, after: int, last: int) -> None:
    """Raise ``beyond_error`` if ``after`` lies beyond ``last``, the seq of the
    session's last event."""
    if after > last:
        raise beyond_error(session_id, after, last)


def beyond_stored(
    session_id: str, after: int, session: LiveSession, stored: StoredSession
) -> EventsExpiredError | None:
    """The error for a subscription after ``after`` to a session that runs nowhere
    (``read_stored``'s pair) if no incarnation of it can have reached that seq: one
    beyond the store's seq when the session was stored cleanly or is stopped, or
    beyond the jump its next wake makes. None if one may have: a seq the store holds,
    or one above it that a last incarnation, stopped uncleanly, may have published and
    not stored (a turn's deltas; lost if that incarnation is gone, see ``Hub.jump``)."""
    durable = stored_seq(session, stored)
    if after <= durable:
        return None
    unclean = session.status is not Status.STOPPED and not stored_cleanly(session, stored)
    if unclean and after < durable + SEQ_GAP:
        return None
    return beyond_error(session_id, after, durable)


def _check_jumps(session_id: str, after: int, prev: int, replay: list[Event]) -> int | None:
    """EventsExpiredError if ``replay`` (the replay's events after seq ``prev``) crosses a
    wake's seq jump that this hub did not make or no longer remembers, and ``after`` is
    one of the seqs it skipped: no event of this history has it (a lost incarnation
    published it, or another history: a deleted namesake's, one a restored store lost).
    The first event after a jump records it: a status whose ``skipped_from`` says where
    the skipped seqs begin (``after`` just below that event is no skipped seq of
    consequence: nothing lies between). A jump recorded before that field existed
    shows as a gap of more than SEQ_GAP / 2, the first event after it journaled at the
    jump + 1, SEQ_GAP above the durable seq it jumped from. The last seq checked, or
    None once a jump has been checked (none later is)."""
    for event in replay:
        if event.__class__ is StatusChanged and event.skipped_from:
            skipped_from: int = event.skipped_from
            if skipped_from <= after < event.seq - 1:
                raise skipped_error(session_id, after, skipped_from, event.seq)
            return None
        if event.seq - prev > SEQ_GAP // 2:
            if after > event.seq - SEQ_GAP - 1:
                raise expired_error(session_id, after, event.seq)
            return None
        prev = event.seq
    return prev
