"""Per-session event fan-out: seq numbering, a bounded replay ring, bounded subscribers.

The actor only ever calls ``publish`` (``delta`` for a Delta), which never blocks: a
subscriber whose buffer is full is ended (it will raise SubscriberLaggedError after reading
what it already has) and the others are not slowed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import trio

from ._config import HubConfig
from ._errors import (
    Advice,
    AdviceKind,
    EventsExpiredError,
    SessionActorsError,
    SessionNotFoundError,
    SubscriberLaggedError,
    advised,
)
from ._events import (
    Delta,
    Event,
    MessageAdded,
    ToolResult,
    TurnFinished,
    TurnStarted,
    erases,
    make_delta,
)

__all__ = [
    "SEQ_GAP",
    "Hub",
    "Subscriber",
    "deleted_error",
    "event_size",
    "expired_error",
    "lagged_error",
    "skipped_error",
    "wake_seq",
]

#: How far seq jumps at least when a session wakes from a state that was not
#: hibernated cleanly (the process died): above any seq the lost incarnation can
#: have used. Stored events of one incarnation are no more than about half of it
#: apart (see ``Journal.at``; with durability="hibernate" the events between two
#: stored statuses that far apart were lost with their process).
SEQ_GAP: Final = 1 << 20


def wake_seq(durable: int, *, clean: bool) -> int:
    """The seq a wake of a session jumps to from ``durable``, the last seq the store
    holds of it: no lower than the wall clock in microseconds since 1970, so that no
    two wakes from one stored state (one before the store was restored from a backup
    of it, one after; a deleted session's and a new one's of the same name) number
    their events alike; and ``SEQ_GAP`` above ``durable`` if its last incarnation
    stopped uncleanly (``clean`` False), above the seqs it may have published."""
    return max(durable + (0 if clean else SEQ_GAP), time.time_ns() // 1000)


log = logging.getLogger("sessionactors")


#: A ``Delta`` as the ring keeps it: (seq, turn_id, text). A tuple of a number and
#: strings, which the garbage collector stops tracking at its first look: a ring is
#: mostly deltas (a reply streams many), up to ``replay_events`` of them a session,
#: and a thousand live sessions would otherwise add a million objects to every
#: full collection.
_Kept = tuple[int, str, str]

#: What a kept ``Delta`` holds beside its text, as the ring's byte bound counts it.
_KEPT_BYTES: Final = 96


def event_size(event: Event | _Kept) -> int:
    """A cheap estimate of the memory an event (or a delta as the ring keeps it) holds:
    its texts, and a little more; for the byte bounds of what is held for a reader."""
    if isinstance(event, tuple):
        return _KEPT_BYTES + len(event[2])
    cls = event.__class__
    if cls is MessageAdded or cls is TurnFinished:
        return 160 + len(event.message.content)  # type: ignore[attr-defined]
    if cls is TurnStarted:
        return 160 + len(event.text)  # type: ignore[attr-defined]
    if cls is ToolResult:
        return 160 + len(event.content)  # type: ignore[attr-defined]
    if cls is Delta:
        return 128 + len(event.text)  # type: ignore[attr-defined]
    return 128


_size: Final = event_size


class Subscriber:
    """One subscription's buffer: the hub writes with send_nowait, the reader reads."""

    __slots__ = ("after", "error", "interrupted", "lagged", "left", "receive", "send")

    def __init__(self, buffer: int, after: int | None = None) -> None:
        self.send, self.receive = trio.open_memory_channel[Event](buffer)
        #: The seq the subscription resumes after (None: live from now), for ``jump``.
        self.after = after
        #: Ended because events were lost: it fell behind, or (``interrupted``) they
        #: were lost before they reached the hub.
        self.lagged = False
        #: Why the events were lost before they reached the hub (``Hub.lose``), as its
        #: error says it; None if it fell behind.
        self.interrupted: str | None = None
        #: Ended because the session left this process (see ``Hub.leave``): nothing lost.
        self.left = False
        #: Ended with this error, raised to the reader (see ``Hub.close``).
        self.error: SessionActorsError | None = None


class Hub:
    """Event fan-out for one session; outlives the actor while it has subscribers."""

    __slots__ = (
        "_config",
        "_ring",
        "_ring_bytes",
        "_skipped",
        "_subs",
        "on_lag",
        "published",
        "seq",
        "session_id",
        "tap",
        "unrecorded",
    )

    def __init__(self, session_id: str, config: HubConfig, seq: int = 0) -> None:
        self.session_id = session_id
        self.seq = seq
        #: The seq of the last event published (or known durable: ``advance``, ``jump``):
        #: an event with a larger seq, assigned already, is withheld until it is stored.
        self.published = seq
        self._config = config
        # events, deltas kept as _Kept (a tuple with its size per event would be one
        # more object to keep)
        self._ring: deque[Event | _Kept] | None = None
        self._ring_bytes = 0
        self._subs: set[Subscriber] = set()
        # The seqs wakes jumped over (see ``jump``), as (last before, last skipped,
        # whether the last incarnation stopped cleanly), the latest last.
        self._skipped: list[tuple[int, int, bool]] = []
        #: The last seq before the latest jump while no stored event records the jump
        #: (see ``StatusChanged.skipped_from``), else None: the actor records it with
        #: the first status it journals.
        self.unrecorded: int | None = None
        #: Called with every published event (a cluster's publisher), or None.
        self.tap: Callable[[Event], None] | None = None
        #: Called with the session's name when a subscriber is cut off, or None.
        self.on_lag: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return f"<Hub {self.session_id!r} seq={self.seq} subscribers={len(self._subs)}>"

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    def next_seq(self) -> int:
        """Assign the next seq; the event must then be published, in seq order."""
        self.seq += 1
        return self.seq

    def advance(self, seq: int) -> None:
        """Make sure the next seq assigned is above ``seq`` (after a wake)."""
        if seq > self.seq:
            self.seq = seq
        if seq > self.published:
            self.published = seq

    def jump(self, seq: int, *, clean: bool) -> None:
        """Advance to ``seq`` as the session wakes (see ``wake_seq``): the seqs skipped
        are no events of this history (its last incarnation, stopped uncleanly
        (``clean`` False), may have published ephemeral ones, which are lost; another
        history of the session, lost with a restored store or deleted with a namesake,
        may have used them). A subscription waiting to resume after one of them (it
        came before the wake) is ended with EventsExpiredError (see ``lost``)."""
        if seq > self.seq:
            ring = self._ring
            oldest = _seq(ring[0]) if ring else self.seq
            # (a jump below the ring's oldest event is told by the store, see ``lost``)
            skipped = [s for s in self._skipped if s[1] >= oldest]
            skipped.append((self.seq, seq, clean))
            self._skipped = skipped
            self.unrecorded = self.seq
            self.seq = seq
            for sub in tuple(self._subs):
                if sub.after is not None and self.lost(sub.after):
                    sub.error = self.lost_error(sub.after)
                    sub.send.close()
                    self._subs.discard(sub)
        if seq > self.published:
            self.published = seq

    def _skip_of(self, after: int) -> tuple[int, int, bool] | None:
        for skip in self._skipped:
            if skip[0] < after < skip[1]:
                return skip
        return None

    def lost(self, after: int) -> bool:
        """Whether ``after`` is a seq that a wake jumped over, above the last durable one:
        the events after it are of no history this hub follows (a lost incarnation
        published it, with its turn in flight, whose outcome will never come; or a
        history the session no longer has)."""
        return self._skip_of(after) is not None

    def lost_error(self, after: int) -> EventsExpiredError:
        """The error for a subscription after ``after``, a seq ``lost`` says is gone."""
        skip = self._skip_of(after)
        assert skip is not None
        if skip[2]:
            return skipped_error(self.session_id, after, skip[0] + 1, skip[1] + 1, clean=True)
        return expired_error(self.session_id, after, skip[1] + 1)

    def delta(self, turn_id: str, text: str) -> None:
        """Publish a ``Delta`` of the session's next seq: ``publish`` of it, where the
        event is made only if someone hears it (the ring keeps a delta as a tuple)."""
        seq = self.seq = self.seq + 1
        if self.tap is not None or self._subs:
            self.publish(
                make_delta(session_id=self.session_id, seq=seq, turn_id=turn_id, text=text)
            )
            return
        self.published = seq
        self._keep((seq, turn_id, text), _KEPT_BYTES + len(text))

    def publish(self, event: Event) -> None:
        """Keep the event for replay and hand it to every subscriber, never blocking."""
        if self.tap is not None:
            self.tap(event)
        self.published = event.seq
        if event.__class__ is Delta:
            text = event.text
            self._keep((event.seq, event.turn_id, text), _KEPT_BYTES + len(text))
        else:
            if erases(event):
                self._forget(event.seq)
            self._keep(event, _size(event))
        if self._subs:
            for sub in tuple(self._subs):
                try:
                    sub.send.send_nowait(event)
                except trio.WouldBlock:
                    self._evict(sub)
                except trio.BrokenResourceError:
                    self._subs.discard(sub)

    def _keep(self, kept: Event | _Kept, size: int) -> None:
        """Keep ``kept`` (``size`` bytes) in the replay ring, within its bounds."""
        ring = self._ring
        if ring is None:
            ring = self._ring = deque()
        ring.append(kept)
        ring_bytes = self._ring_bytes + size
        config = self._config
        if len(ring) > config.replay_events:  # (one over: it held at most that many)
            ring_bytes -= _size(ring.popleft())
        if ring_bytes > config.replay_bytes:
            most_bytes = config.replay_bytes
            while ring and ring_bytes > most_bytes:
                ring_bytes -= _size(ring.popleft())
        self._ring_bytes = ring_bytes

    def _forget(self, seq: int) -> None:
        """Drop the ring's events before ``seq``: an edit that takes text out of the
        history or the metadata (see ``erases``) leaves nothing before it to replay, so
        a subscription after an earlier seq reads on from the store, which refuses it
        (EventsExpiredError) once the edit's snapshot is written, as the journal's floor
        does until then."""
        ring = self._ring
        if not ring:
            return
        ring_bytes = self._ring_bytes
        while ring and _seq(ring[0]) < seq:
            ring_bytes -= _size(ring.popleft())
        self._ring_bytes = ring_bytes

    def lose(self, why: str) -> None:
        """Events were lost upstream, before they reached the hub (``why`` says how, as
        the subscribers' error tells it): end every subscription with
        SubscriberLaggedError saying that its events were interrupted (it did not fall
        behind, and is not counted as lagged), and forget the ring."""
        subs = tuple(self._subs)
        if subs:
            log.warning(
                "the events of session %r were interrupted: %s; %d subscriber%s here "
                "cut off (each resumes after the last event it had)",
                self.session_id,
                why,
                len(subs),
                "" if len(subs) == 1 else "s",
            )
        for sub in subs:
            sub.lagged = True
            sub.interrupted = why
            sub.send.close()
            self._subs.discard(sub)
        self._ring = None
        self._ring_bytes = 0

    def leave(self) -> None:
        """The session left this process (it may wake on another worker): end every
        subscription after the events it has, marked as left, not lagged."""
        for sub in self._subs:
            sub.left = True
            sub.send.close()
        self._subs.clear()

    def _evict(self, sub: Subscriber) -> None:
        log.info("a subscriber of session %r fell behind and was cut off", self.session_id)
        sub.lagged = True
        sub.send.close()
        self._subs.discard(sub)
        if self.on_lag is not None:
            self.on_lag(self.session_id)

    def ring_covers(self, after: int) -> bool:
        """Whether every event with seq > ``after`` that this hub published is in the ring."""
        for skipped in self._skipped:
            if skipped[0] <= after < skipped[1]:
                after = skipped[1]  # (nothing durable in between: see ``jump``)
        if after >= self.seq:
            return True
        if not self._ring:
            return False
        return _seq(self._ring[0]) <= after + 1

    def ring_after(self, after: int) -> list[Event]:
        """The ring's events with seq > ``after``, in order."""
        if not self._ring:
            return []
        sid = self.session_id
        return [
            make_delta(session_id=sid, seq=kept[0], turn_id=kept[1], text=kept[2])
            if isinstance(kept, tuple)
            else kept
            for kept in self._ring
            if _seq(kept) > after
        ]

    @property
    def oldest_seq(self) -> int | None:
        return _seq(self._ring[0]) if self._ring else None

    def subscribe(self, after: int | None = None) -> Subscriber:
        sub = Subscriber(self._config.subscriber_buffer, after)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.discard(sub)
        sub.send.close()
        sub.receive.close()

    def close(self, error: SessionActorsError | None = None) -> None:
        """End every subscription: cleanly (session stopped, registry closed), or with
        ``error`` (session deleted: ``deleted_error``), which each reader then raises
        after the events it has."""
        for sub in self._subs:
            sub.error = error
            sub.send.close()
        self._subs.clear()


def _seq(kept: Event | _Kept) -> int:
    return kept[0] if isinstance(kept, tuple) else kept.seq


def expired_error(session_id: str, after: int, oldest_seq: int) -> EventsExpiredError:
    """The events after ``after`` were published by an incarnation of the session that
    stopped before it stored them (its process died mid-turn); ``oldest_seq``: the first
    seq after the wake's jump."""
    return advised(
        EventsExpiredError,
        f"events of session {session_id!r} after seq {after} are lost: the process that "
        "published them stopped before it stored them, and the turns they belong to were "
        "lost with it",
        Advice(kind=AdviceKind.LOST_TURNS),
        f"; the oldest available is seq {oldest_seq}: ",
        Advice(kind=AdviceKind.RELOAD_STATE),
        session_id=session_id,
        oldest_seq=oldest_seq,
    )


def deleted_error(session_id: str) -> SessionNotFoundError:
    """What a subscription of a deleted session raises after its last event."""
    return SessionNotFoundError(
        f"session {session_id!r} was deleted: its events end here; a session spawned "
        "again under its name is another session (subscribe to it anew)",
        session_id=session_id,
    )


def skipped_error(
    session_id: str, after: int, skipped_from: int, oldest_seq: int, *, clean: bool | None = None
) -> EventsExpiredError:
    """The error for a subscription after ``after``, one of the seqs from
    ``skipped_from`` that a wake of the session skipped (see ``wake_seq``): no event of
    its history has it; ``oldest_seq``, the seq after the jump. ``clean``: whether the
    incarnation before the wake stopped cleanly (None: not known)."""
    elsewhere = (
        "another session of that name (since deleted), or a history the session no "
        "longer has (its store was restored from an older backup)"
    )
    if not clean:
        elsewhere = f"a turn lost with a process that died before storing it, {elsewhere}"
    return advised(
        EventsExpiredError,
        f"session {session_id!r} has no event after seq {after} in its history: the "
        f"seqs from {skipped_from} to {oldest_seq - 1} were skipped as it woke, so seq "
        f"{after} is of {elsewhere}; the oldest available is seq {oldest_seq}: ",
        Advice(kind=AdviceKind.RELOAD_STATE),
        session_id=session_id,
        oldest_seq=oldest_seq,
    )


def lagged_error(
    session_id: str, last_seq: int, interrupted: str | None = None
) -> SubscriberLaggedError:
    """The error of a subscription ended after ``last_seq``: it fell behind, or the events
    were ``interrupted`` before they reached its hub (see ``Hub.lose``), saying how."""
    if interrupted is not None:
        return advised(
            SubscriberLaggedError,
            f"the events of session {session_id!r} were interrupted after seq {last_seq}: "
            f"{interrupted}; this subscriber did not fall behind: ",
            Advice(kind=AdviceKind.RESUME_AFTER, seq=last_seq),
            " to resume",
            session_id=session_id,
            last_seq=last_seq,
        )
    return advised(
        SubscriberLaggedError,
        f"subscriber of session {session_id!r} fell behind and was ended after seq {last_seq}; ",
        Advice(kind=AdviceKind.RESUME_AFTER, seq=last_seq),
        " to resume",
        session_id=session_id,
        last_seq=last_seq,
    )
