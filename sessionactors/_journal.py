"""One session's journal writer: what is durable, what is not yet, and when to compact.

The actor folds every durable event into its state and hands it here; a
commit appends the events not yet stored as one journal entry (one row per
turn, not one per event), and a snapshot replaces the journal once the
journal outweighs it, so a turn's cost stays independent of the history's
length. Waking is the latest snapshot plus the journal tail.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Final

import attrs
import trio

from ._codec import (
    MAX_SNAPSHOT_BYTES,
    SnapshotWriter,
    dump_events,
    dump_info,
    dump_live_info,
    dump_snapshot,
)
from ._config import RegistryConfig
from ._errors import LOST_DATA_CAUSES, SessionNotFoundError, SnapshotError, StoreError
from ._events import Event, HistoryEdited, MetadataChanged, erases
from ._hub import SEQ_GAP
from ._pending import Append
from ._records import SessionState, Status, maker
from ._session import LiveSession
from ._telemetry import Telemetry
from .stores._base import JournalEntry, Store, StoredSession

__all__ = ["Journal", "store_new"]

log = logging.getLogger("sessionactors")

#: A snapshot this large (three quarters of MAX_SNAPSHOT_BYTES) is told in the log: its
#: session is near what a snapshot may hold.
_NEAR_SNAPSHOT_BYTES = MAX_SNAPSHOT_BYTES * 3 // 4

_make_entry: Final = maker(JournalEntry)
#: The events that can make a state smaller (a turn only adds to it).
_SHRINKING: Final = frozenset({HistoryEdited, MetadataChanged})


async def store_new(store: Store, session_id: str, snapshot: bytes, info: bytes, seq: int) -> None:
    """Store a new session whose state is at ``seq`` (0 but for an imported one).

    An imported session's events up to ``seq`` are in no journal of this store: the
    store is told its journal is trimmed up to there, so that a replay from further
    back raises EventsExpiredError, as one past the journal's trimming does, rather
    than replaying nothing. Raises what ``Store.create`` raises.
    """
    await store.create(session_id, snapshot, info)
    if seq:
        await store.write_snapshot(session_id, snapshot, seq, info, trim_upto=seq)


class Journal:
    """The durable side of one actor incarnation (owned by it, like its state)."""

    __slots__ = (
        "_journaled",
        "_marks",
        "_near_told",
        "_since_snapshot",
        "_size",
        "_snapshot_size",
        "_writer",
        "at",
        "base",
        "config",
        "erase_due",
        "erased",
        "fault",
        "floor",
        "killed",
        "lost",
        "per_turn",
        "session_id",
        "settled",
        "status_due",
        "store",
        "telemetry",
        "unsaved",
        "unwritable",
    )

    def __init__(
        self,
        store: Store,
        config: RegistryConfig,
        session_id: str,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.store = store
        self.telemetry = telemetry
        self.config = config
        #: Each turn is journaled as it ends (``durability="turn"``).
        self.per_turn = config.durability == "turn"
        self.session_id = session_id
        #: Durable events not in the store yet (all of them without a journal).
        self.unsaved: list[Event] = []
        #: unsaved[:settled] were answered: a restart without a journal keeps them.
        self.settled = 0
        #: Without a journal: the state as of the answered events folded out of
        #: ``unsaved`` (see ``settle``), which no write holds yet; a restart starts there.
        self.base: SessionState | None = None
        #: The seq of the last event folded into ``base``: replay from memory begins after it.
        self.floor = 0
        #: A status is journaled before anything more is published: after a clean
        #: hibernation (a wake after this process dies would not jump seq otherwise),
        #: and after a wake's seq jump (so that the next wake jumps above it).
        self.status_due = False
        #: The last write of ours that failed (a turn that sees it restarts the actor).
        self.fault: StoreError | None = None
        #: Why the session was stopped at once (``Actor.kill``: its lease lost, which is
        #: a ``FencedOutError``, or deleted): a write that its cancellation cut is
        #: recorded as that in the telemetry (see ``_timed_write``).
        self.killed: BaseException | None = None
        #: A write found the session gone from the store, which held it when this
        #: incarnation began (see ``_lost``): the session ends here, with this error.
        self.lost: SessionNotFoundError | None = None
        #: A status is journaled (whatever the durability) before seq reaches this: a
        #: wake jumps SEQ_GAP past the highest stored seq, so that stays ahead.
        self.at = SEQ_GAP // 2
        self._since_snapshot = 0
        self._size = 0  # bytes journaled since the snapshot
        self._snapshot_size = 0  # bytes of the latest snapshot
        self._writer: SnapshotWriter | None = None  # made for a long history
        #: Events journaled (counted on from the loaded snapshot's mark, see ``loaded``),
        #: and (seq, that count) at each snapshot still counted: replay keeps
        #: journal_keep_events events, counted, not measured in seq.
        self._journaled = 0
        self._marks: deque[tuple[int, int]] | None = None
        #: An edit that takes text out of the history or the metadata (see ``erases``)
        #: came since the last snapshot: the next commit writes the snapshot in place of
        #: the journal append (a checkpoint), and that snapshot trims the whole journal.
        self.erase_due = False
        #: The seq before the last such edit: nothing up to it is replayed any more, from
        #: memory or (once the checkpoint is written) from the store.
        self.erased = 0
        #: The state was too large for a snapshot when last tried, and nothing that can
        #: make it smaller (an edit of the history or of the metadata) came since: a
        #: snapshot is not tried again (to compact, or at the idle timeout) until then.
        self.unwritable = False
        #: A snapshot near MAX_SNAPSHOT_BYTES was told in the log (once an incarnation).
        self._near_told = False

    def add(self, event: Event) -> None:
        """A durable event, folded into the state already: to be stored."""
        self.unsaved.append(event)
        if event.__class__ in _SHRINKING:
            self.unwritable = False
            if erases(event):
                self.erase_due = True
                self.erased = event.seq - 1

    def loaded(self, stored: StoredSession, durable_seq: int, session: LiveSession) -> None:
        """Take the bookkeeping of what a wake read from the store.

        The retention count goes on from the snapshot's (``session.journal_mark_*``): a
        session that hibernates after every turn journals few events in each incarnation,
        and would never trim its journal if each one counted from nothing. (The entries
        after the snapshot are not counted: that only trims later, never too much.)
        """
        self._since_snapshot = len(stored.entries)
        self._size = sum(len(e.data) for e in stored.entries)
        self._snapshot_size = len(stored.snapshot)
        self.at = durable_seq + SEQ_GAP // 2
        events = session.journal_mark_events
        marks = self._marks = deque()
        if session.journal_mark_seq < stored.snapshot_seq:
            marks.append((session.journal_mark_seq, 0))
        marks.append((stored.snapshot_seq, events))
        self._journaled = events

    def settle(self, session: LiveSession) -> None:
        """Every request so far is answered: a restart keeps what they changed.

        Without a journal (``durability="hibernate"``) the answered events wait in
        memory for the next snapshot; once ``snapshot_every`` of them have gathered,
        they are folded into a copy of the state instead (nothing is written), so that
        a session that stays live holds its history, not every event of its life.
        """
        unsaved = self.unsaved
        self.settled = len(unsaved)
        if not self.per_turn and self.settled >= self.config.snapshot_every:
            self.base = session.to_state()
            self.floor = unsaved[-1].seq
            unsaved.clear()
            self.settled = 0

    def replayable(self) -> tuple[int, list[Event]]:
        """The durable events not in the store yet, and the seq after which replay begins
        (the store may still hold events up to it, until the checkpoint of an edit that
        erased them is written)."""
        return max(self.floor, self.erased), self.unsaved

    def holds_unwritten(self) -> bool:
        """Whether answered state is in no write yet (only without a journal)."""
        return not self.per_turn and (bool(self.unsaved) or self.base is not None)

    def must_journal_status(self, seq: int) -> bool:
        """Whether a status must be journaled before the next request publishes."""
        return self.status_due or seq >= self.at

    async def commit(
        self,
        session: LiveSession,
        fence: int | None,
        hub_seq: int,
        *,
        compact: bool = True,
        append: Append | None = None,
    ) -> None:
        """Make the unsaved events durable (with a journal, ``durability="turn"``).

        Then, if ``compact``, snapshot once the journal outweighs the snapshot (as of
        the later of ``hub_seq``, the last seq published, and the state's). That
        snapshot only compacts (what it holds is journaled already): if the store
        refuses it, the journal waits for the next try. ``append`` stands in for the
        store's (see ``Pending.write_outcome``).

        After an edit that takes text out of the history or the metadata
        (``erase_due``), whatever the durability, the snapshot is written in place of
        the append (a checkpoint): it holds the unsaved events, and its write drops the
        whole journal before it, in one atomic step of the store; it fails as an
        append does. Only a state too
        large for a snapshot is journaled instead (the erasure then waits for the next
        snapshot that can be written: ``write_snapshot`` trims the whole journal while
        ``erase_due`` holds).
        """
        events = self.unsaved
        if not events:
            return
        if self.erase_due and not self.unwritable:
            try:
                await self.write_snapshot(
                    session, fence, max(hub_seq, session.event_seq), session.status
                )
                return
            except StoreError as exc:
                self.fault = exc
                raise
            except SnapshotError as exc:  # (too large: ``unwritable`` until it shrinks)
                log.warning(
                    "session %r: the events before an edit of its history stay in the store "
                    "until a snapshot of it can be written: %s",
                    self.session_id,
                    exc,
                )
        if not self.per_turn:
            return
        count = len(events)
        entries = _entries(events)
        try:
            await self._timed(
                "append",
                self.store.append(self.session_id, entries, dump_live_info(session), fence=fence)
                if append is None
                else append(entries, dump_live_info(session), fence),
            )
        except StoreError as exc:
            self.fault = exc
            raise
        except SessionNotFoundError as exc:
            raise self._lost(exc) from exc
        self.at = entries[-1].seq + SEQ_GAP // 2
        del events[:count]
        self._journaled += count
        self._since_snapshot += count
        for entry in entries:
            self._size += len(entry.data)
        if compact and self.compaction_due():
            await self.compact(session, fence, hub_seq)

    def compaction_due(self) -> bool:
        """Whether the journal outweighs the snapshot (see ``commit``)."""
        return (
            self.per_turn
            and not self.unwritable
            and self._since_snapshot >= self.config.snapshot_every
            and self._size >= self._snapshot_size
        )

    async def compact(self, session: LiveSession, fence: int | None, hub_seq: int) -> None:
        """The snapshot that compacts the journal (when ``compaction_due``); a failure
        only leaves the journal to the next try (what it holds is journaled already)."""
        with contextlib.suppress(Exception):  # the entries are stored: only compaction
            seq = max(hub_seq, session.event_seq)
            await self.write_snapshot(session, fence, seq, session.status)

    async def write_snapshot(
        self, session: LiveSession, fence: int | None, seq: int, status: Status
    ) -> None:
        """Replace the stored snapshot with the state as of ``seq`` (>= session.event_seq)."""
        session.event_seq = seq
        marks = self._marks
        if marks is None:
            marks = self._marks = deque()
        # (a checkpoint, or without a journal: nothing journaled before it is kept)
        erase = self.erase_due or not self.per_turn
        trim_upto, passed = (seq, len(marks)) if erase else self._trim_point()
        # the oldest snapshot still counted for retention after this one, kept in the
        # snapshot so that the next incarnation counts on from it (see ``loaded``)
        mark_seq, mark_count = marks[passed] if passed < len(marks) else (seq, self._journaled)
        mark_events = self._journaled - mark_count
        state = attrs.evolve(
            session.to_state(),
            status=status,
            journal_mark_seq=mark_seq,
            journal_mark_events=mark_events,
        )
        writer = self._writer
        if writer is None and len(state.messages) >= SnapshotWriter.MIN_MESSAGES:
            writer = self._writer = SnapshotWriter()
        try:
            snapshot = dump_snapshot(state) if writer is None else writer.dump(state)
        except (ValueError, TypeError) as exc:
            # nothing is written, and retrying cannot help until the state shrinks
            error = SnapshotError(
                f"the state of session {self.session_id!r} cannot be written as a snapshot "
                f"(to hibernate or stop): {exc}",
                session_id=self.session_id,
            )
            if not self.unwritable:  # (told once, whichever write found it: a compaction's)
                log.warning(
                    "%s; until then it stays live: it cannot hibernate, be forked or "
                    "exported, and its journal grows without compaction",
                    error,
                )
            self.unwritable = True
            raise error from exc
        if len(snapshot) > _NEAR_SNAPSHOT_BYTES and not self._near_told:
            self._near_told = True
            log.warning(
                "session %r: its snapshot is %.1f MiB, near the %d MiB a snapshot may be; "
                "past that it cannot hibernate, be forked or exported, nor its journal be "
                "compacted: truncate or compact its history (or keep large values elsewhere)",
                self.session_id,
                len(snapshot) / 2**20,
                MAX_SNAPSHOT_BYTES // 2**20,
            )
        try:
            await self._timed(
                "snapshot",
                self.store.write_snapshot(
                    self.session_id,
                    snapshot,
                    seq,
                    dump_info(session.info(status)),
                    # without a journal ("hibernate"), replay reaches no further back than
                    # this snapshot: say so (EventsExpiredError) rather than a silent gap
                    trim_upto=trim_upto,
                    fence=fence,
                ),
            )
        except SessionNotFoundError as exc:
            raise self._lost(exc) from exc
        session.journal_mark_seq = mark_seq
        session.journal_mark_events = mark_events
        for _ in range(passed):
            marks.popleft()
        if self.per_turn:
            marks.append((seq, self._journaled))
        self.unsaved.clear()
        self.settled = 0
        self.base = None
        self.at = seq + SEQ_GAP // 2
        self._since_snapshot = 0
        self._size = 0
        self._snapshot_size = len(snapshot)
        self.unwritable = False
        self.erase_due = False

    def _trim_point(self) -> tuple[int, int]:
        """The highest seq the journal may drop, with at least journal_keep_events events
        journaled after it (0: drop nothing), and how many marks lie at or below it."""
        keep = self.config.journal_keep_events
        point = passed = 0
        for seq, count in self._marks or ():
            if self._journaled - count < keep:
                break
            point = seq
            passed += 1
        return point, passed

    async def append_now(self, session: LiveSession, event: Event, fence: int | None) -> None:
        """Journal one event at once, whatever the durability policy (a status that
        records a seq jump; without a journal, the next snapshot drops it)."""
        try:
            await self._timed(
                "append",
                self.store.append(
                    self.session_id,
                    [JournalEntry(event.seq, dump_events([event]))],
                    dump_live_info(session),
                    fence=fence,
                ),
            )
        except SessionNotFoundError as exc:
            raise self._lost(exc) from exc
        self.at = event.seq + SEQ_GAP // 2

    def _lost(self, exc: SessionNotFoundError) -> SessionNotFoundError:
        """The error of a write that found the session gone from the store (``exc``, the
        store's): a live session was created or loaded there, so the store lost it."""
        sid = self.session_id
        error = self.lost = SessionNotFoundError(
            f"the store no longer holds session {sid!r}, which this process had loaded: "
            f"its data may have been lost ({LOST_DATA_CAUSES}), or it was deleted behind "
            "the store's back. Nothing was written, and the session stops here; what it "
            "held is gone unless the store is restored from a backup",
            session_id=sid,
        )
        return error

    def _timed(self, operation: str, write: Awaitable[None]) -> Awaitable[None]:
        """``write``, timed for the telemetry if there is one (else ``write`` itself)."""
        telemetry = self.telemetry
        return write if telemetry is None else _timed_write(telemetry, operation, write, self)


def _entries(events: Sequence[Event]) -> list[JournalEntry]:
    """The journal entries of one commit (appended together, atomically): one, unless
    its events outweigh an entry (a turn whose tools returned much text, step after
    step, each result within its bound); then as few as hold them in order. Only an
    event that is too large by itself is refused (``ValueError``)."""
    try:
        return [_make_entry(seq=events[-1].seq, data=dump_events(events))]
    except ValueError:
        if len(events) == 1:
            raise
    out: list[JournalEntry] = []
    start = 0
    while start < len(events):  # a run from ``start`` that fits (halved until it does)
        end = len(events)
        while True:
            try:
                data = dump_events(events[start:end])
                break
            except ValueError:
                if end - start == 1:
                    raise
                end = start + (end - start) // 2
        out.append(_make_entry(seq=events[end - 1].seq, data=data))
        start = end
    return out


async def _timed_write(
    telemetry: Telemetry, operation: str, write: Awaitable[None], journal: Journal
) -> None:
    """Await ``write`` and tell ``telemetry`` how long it took and how it ended: what
    it raised; or, cut by a cancellation because its session was stopped at once (its
    lease lost, deleted: ``journal.killed``), why the session was stopped, which is
    what cut the write (a ``Cancelled`` says nothing of it)."""
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        await write
    except trio.Cancelled as exc:
        error = exc if journal.killed is None else journal.killed
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        telemetry.store_write(operation=operation, seconds=time.perf_counter() - start, error=error)
