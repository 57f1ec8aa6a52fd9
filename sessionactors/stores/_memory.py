"""``MemoryStore``: sessions kept in process memory, for tests and exploration.

It is also the reference implementation of the :class:`~sessionactors.stores.Store`
contract: the validation helpers and error messages here are shared by the
other stores, so every store words the same mistake the same way.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence

import attrs
import trio

from .._codec import MAX_SEQ
from .._errors import (
    LOST_DATA,
    Advice,
    AdviceKind,
    FencedOutError,
    SessionExistsError,
    SessionNotFoundError,
    SnapshotCorruptError,
    StoreError,
    advised,
)
from .._listing import after_not_found, info_activity
from ._base import JournalEntry, Lease, StoredSession

__all__ = ["MemoryStore"]


# Shared validation and messages ---------------------------------------------


def _check_ttl(ttl: float) -> None:
    if not (isinstance(ttl, int | float) and math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"lease ttl must be a positive number of seconds, not {ttl!r}")


def _exists_error(session_id: str) -> SessionExistsError:
    return SessionExistsError(
        f"session {session_id!r} is already stored; load it, or delete it first",
        session_id=session_id,
    )


def _not_found_error(session_id: str) -> SessionNotFoundError:
    return SessionNotFoundError(
        f"session {session_id!r} is not stored; create it first",
        session_id=session_id,
    )


def _fence_problem(
    *,
    fence: int,
    owner: str | None,
    current: int | None,
    lease_until: float,
    now: float,
) -> str | None:
    """Why a write carrying ``fence`` must be refused, or ``None`` if it may go ahead."""
    if current is None:
        return "no_lease"
    if fence > current:
        return f"older:{current}"
    if fence != current:
        return f"claimed:{current}"
    if owner is None:
        return "the lease was released"
    if lease_until < now:
        return "the lease has expired (its renewals did not reach the store in time)"
    return None


def _fenced_out_error(session_id: str, fence: int, problem: str) -> FencedOutError:
    """The refusal of a write with ``fence``, saying what the store shows (``problem``:
    ``"older:N"`` for a lease with an older token than the write's (tokens only grow),
    ``"journal:N:M"`` for a journal that ends at seq N before the seq M its writer
    wrote, both proof of lost data; ``"claimed:N"`` for a later claim's token, a
    takeover; ``"no_lease"`` for no lease of the session at all, which a store that
    removes a lease on release (Redis) shows alike for a lease released, expired and
    then taken over and released, or lost with the store's data; otherwise why the
    lease no longer counts, which a takeover and lost data may both explain)."""
    lost = problem.startswith(("older:", "journal:"))
    if problem.startswith("journal:"):
        _, last, wrote = problem.split(":")
        seen = (
            f"the store's journal of session {session_id!r} ends at seq {last}, before "
            f"seq {wrote} that this worker wrote: {LOST_DATA}"
        )
    elif problem == "no_lease":
        seen = (
            f"the store holds no lease of session {session_id!r}: this worker's lease was "
            "released, expired, taken over and released (another worker ran the session "
            f"and hibernated or deleted it), or {LOST_DATA}"
        )
    elif lost:
        seen = (
            f"the store's lease of session {session_id!r} has an older fencing token "
            f"({problem.removeprefix('older:')}): {LOST_DATA}"
        )
    elif problem.startswith("claimed:"):
        seen = (
            f"a later claim holds the lease of session {session_id!r} (fencing token "
            f"{problem.removeprefix('claimed:')}): another worker took the session over"
        )
    else:
        seen = (
            f"the store no longer shows this worker's lease of session {session_id!r} "
            f"({problem}): another worker took the session over, or {LOST_DATA}"
        )
    return FencedOutError(
        f"session {session_id!r}: a write with fencing token {fence} was refused: {seen}; "
        "the session stops here: send the request again, which wakes the session from "
        "what the store holds (here, or on the worker that owns it now)",
        session_id=session_id,
        lost_data=lost,
    )


def _check_seq(session_id: str, seq: object, what: str) -> None:
    """A seq to write must be an integer from 0 to ``MAX_SEQ``."""
    if seq.__class__ is not int or not 0 <= seq <= MAX_SEQ:
        raise StoreError(
            f"session {session_id!r}: {what} {seq!r} is not an integer from 0 to 2**53 - 1"
            " (MAX_SEQ); seqs stay in that range (nothing was written)",
            session_id=session_id,
        )


def _check_entries(session_id: str, entries: Sequence[JournalEntry], last_seq: int) -> int:
    """Check that the seqs strictly increase above ``last_seq``; return the new last seq."""
    for entry in entries:
        _check_seq(session_id, entry.seq, "journal seq")
        if entry.seq <= last_seq:
            raise StoreError(
                f"session {session_id!r}: journal seq {entry.seq} is not above the last "
                f"stored seq {last_seq}; seqs must strictly increase (nothing was written)",
                session_id=session_id,
            )
        last_seq = entry.seq
    return last_seq


def _check_snapshot_seqs(session_id: str, seq: int, trim_upto: int, snapshot_seq: int) -> None:
    _check_seq(session_id, seq, "snapshot seq")
    _check_seq(session_id, trim_upto, "trim_upto")
    if trim_upto > seq:
        raise StoreError(
            f"session {session_id!r}: cannot trim the journal up to {trim_upto}, beyond the "
            f"snapshot's seq {seq}; pass trim_upto <= seq (nothing was written)",
            session_id=session_id,
        )
    if seq < snapshot_seq:
        raise StoreError(
            f"session {session_id!r}: snapshot seq {seq} is older than the stored "
            f"snapshot's seq {snapshot_seq}; snapshots only move forward (nothing was written)",
            session_id=session_id,
        )


def _stored_corrupt(session_id: str, problem: str) -> SnapshotCorruptError:
    return advised(
        SnapshotCorruptError,
        f"the store's record of session {session_id!r} is corrupt: {problem}; it was changed"
        " behind sessionactors' back: restore the session from a backup or delete it with ",
        Advice(kind=AdviceKind.DELETE),
        session_id=session_id,
    )


def _check_stored_seq(session_id: str, seq: object, what: str, least: int = 0) -> int:
    """A seq read back from the store: an integer from ``least`` to ``MAX_SEQ``, or
    corrupt (None: missing)."""
    if seq.__class__ is not int or not least <= seq <= MAX_SEQ:
        found = "missing" if seq is None else repr(str(seq)[:40])
        raise _stored_corrupt(
            session_id, f"{what} is {found}, not an integer from {least} to 2**53 - 1"
        )
    return seq


def _check_stored_entries(
    session_id: str, rows: Sequence[tuple[object, object]], after: int
) -> list[JournalEntry]:
    """Journal rows read back from the store: seqs in range and rising above ``after``,
    data bytes; anything else is corrupt."""
    entries = []
    last = after
    for seq, data in rows:
        last_seen = _check_stored_seq(session_id, seq, "a journal seq", 1)
        if last_seen <= last:
            raise _stored_corrupt(session_id, f"journal seq {last_seen} is not above {last}")
        if data.__class__ is not bytes:
            raise _stored_corrupt(session_id, f"the journal entry at seq {seq} is not bytes")
        last = last_seen
        entries.append(JournalEntry(last_seen, data))
    return entries


def _page(entries: Sequence[JournalEntry], max_bytes: int) -> list[JournalEntry]:
    """The first ``entries`` up to the one that brings their data to ``max_bytes``."""
    page = []
    total = 0
    for entry in entries:
        page.append(entry)
        total += len(entry.data)
        if total >= max_bytes:
            break
    return page


# The store -------------------------------------------------------------------


@attrs.define(eq=False)
class _Session:
    snapshot: bytes
    snapshot_seq: int
    info: bytes
    activity: int
    last_seq: int = 0
    trimmed_upto: int = 0
    journal: list[JournalEntry] = attrs.Factory(list)


@attrs.define(eq=False)
class _Lease:
    owner: str | None
    fence: int
    until: float


@attrs.define(eq=False)
class MemoryStore:
    """A :class:`~sessionactors.stores.Store` that keeps everything in this process's memory.

    Nothing survives the process; it is meant for tests and exploration. Every
    method checkpoints, like a real store's would, and leases expire on wall-clock
    time (``time.time()``), like they do across processes.
    """

    _sessions: dict[str, _Session] = attrs.field(init=False, factory=dict, repr=False)
    # Leases outlive their sessions: a name deleted and created again must still
    # get fencing tokens larger than any issued before.
    _leases: dict[str, _Lease] = attrs.field(init=False, factory=dict, repr=False)
    # (activity, session_id) of every session, ascending: listings read it backwards.
    # The sessions active last sit at its end, where moving them costs least.
    _order: list[tuple[int, str]] = attrs.field(init=False, factory=list, repr=False)
    # Sessions whose info changed since their place in _order was set: a write only
    # notes it, and the next listing reads the activity of each once (a turn's write
    # then decodes no info).
    _moved: set[str] = attrs.field(init=False, factory=set, repr=False)

    def __repr__(self) -> str:
        return f"<MemoryStore with {len(self._sessions)} sessions>"

    def _get(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise _not_found_error(session_id)
        return session

    def _check_fence(self, session_id: str, fence: int | None) -> None:
        if fence is None:
            return
        lease = self._leases.get(session_id)
        problem = _fence_problem(
            fence=fence,
            owner=lease.owner if lease else None,
            current=lease.fence if lease else None,
            lease_until=lease.until if lease else 0.0,
            now=time.time(),
        )
        if problem is not None:
            raise _fenced_out_error(session_id, fence, problem)

    def _set_info(self, session_id: str, session: _Session, info: bytes) -> None:
        session.info = bytes(info)
        self._moved.add(session_id)

    def _reorder(self) -> None:
        """Put the sessions whose info changed in their places in ``_order``."""
        moved = self._moved
        if not moved:
            return
        order = self._order
        sessions = self._sessions
        for session_id in moved:
            session = sessions[session_id]
            activity = info_activity(session.info)
            if activity != session.activity:
                del order[bisect.bisect_left(order, (session.activity, session_id))]
                session.activity = activity
                bisect.insort(order, (activity, session_id))
        moved.clear()

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if session_id in self._sessions:
            raise _exists_error(session_id)
        info = bytes(info)
        activity = info_activity(info)
        self._sessions[session_id] = _Session(
            snapshot=bytes(snapshot), snapshot_seq=0, info=info, activity=activity
        )
        bisect.insort(self._order, (activity, session_id))

    async def load(self, session_id: str) -> StoredSession | None:
        await trio.lowlevel.checkpoint()
        session = self._sessions.get(session_id)
        if session is None:
            return None
        return StoredSession(
            snapshot=session.snapshot,
            snapshot_seq=session.snapshot_seq,
            entries=tuple(e for e in session.journal if e.seq > session.snapshot_seq),
            info=session.info,
        )

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        # every durable turn comes here: the checks of _get, _check_entries and
        # _set_info in one frame (those name what is wrong)
        await trio.lowlevel.checkpoint()
        session = self._sessions.get(session_id)
        if session is None:
            raise _not_found_error(session_id)
        if fence is not None:
            self._check_fence(session_id, fence)
        last = session.last_seq
        copies = []
        for entry in entries:
            # kept as it is when nothing can change it (a frozen entry of bytes)
            if entry.__class__ is not JournalEntry or entry.data.__class__ is not bytes:
                entry = JournalEntry(entry.seq, bytes(entry.data))
            seq = entry.seq
            if seq.__class__ is not int or not last < seq <= MAX_SEQ:
                _check_entries(session_id, [entry], last)  # raises, saying what is wrong
            last = seq
            copies.append(entry)
        session.last_seq = last
        session.journal += copies
        session.info = info if info.__class__ is bytes else bytes(info)
        self._moved.add(session_id)

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        await trio.lowlevel.checkpoint()
        session = self._get(session_id)
        self._check_fence(session_id, fence)
        _check_snapshot_seqs(session_id, seq, trim_upto, session.snapshot_seq)
        session.snapshot = bytes(snapshot)
        session.snapshot_seq = seq
        session.last_seq = max(session.last_seq, seq)
        self._set_info(session_id, session, info)
        if trim_upto > session.trimmed_upto:
            session.trimmed_upto = trim_upto
            session.journal = [e for e in session.journal if e.seq > trim_upto]

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await trio.lowlevel.checkpoint()
        session = self._get(session_id)
        return session.trimmed_upto, [e for e in session.journal if e.seq > after]

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        await trio.lowlevel.checkpoint()
        session = self._get(session_id)
        journal = session.journal
        start = bisect.bisect_right(journal, after, key=lambda e: e.seq)
        return session.trimmed_upto, _page(journal[start : start + max(limit, 1)], max_bytes)

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return [(session_id, s.info) for session_id, s in self._sessions.items()]

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return self._page(None, after, limit)

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return self._page((active_before, ""), after, limit)  # (every name sorts after "")

    def _page(
        self, below: tuple[int, str] | None, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        """The ``limit`` sessions whose place in ``_order`` is below ``below`` (if
        given) and past ``after`` (if given), newest first."""
        self._reorder()
        order = self._order
        end = len(order) if below is None else bisect.bisect_left(order, below)
        if after is not None:
            session = self._sessions.get(after)
            if session is None:
                raise after_not_found(after)
            end = min(end, bisect.bisect_left(order, (session.activity, after)))
        sessions = self._sessions
        return [
            (name, sessions[name].info) for _, name in reversed(order[max(0, end - limit) : end])
        ]

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return session_id in self._sessions

    async def delete(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        lease = self._leases.get(session_id)
        if lease is not None:
            lease.owner = None
            lease.until = 0.0
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._moved.discard(session_id)
        del self._order[bisect.bisect_left(self._order, (session.activity, session_id))]
        return True

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        _check_ttl(ttl)
        await trio.lowlevel.checkpoint()
        now = time.time()
        lease = self._leases.get(session_id)
        if lease is None:
            lease = self._leases[session_id] = _Lease(owner=owner, fence=1, until=now + ttl)
        elif lease.owner is None or lease.owner == owner or lease.until < now:
            lease.owner = owner
            lease.fence += 1
            lease.until = now + ttl
        else:
            return None
        return Lease(owner=owner, fence=lease.fence)

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        _check_ttl(ttl)
        await trio.lowlevel.checkpoint()
        now = time.time()
        held = self._leases.get(session_id)
        if (
            held is None
            or held.owner != lease.owner
            or held.fence != lease.fence
            or held.until < now
        ):
            return False
        held.until = now + ttl
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()
        held = self._leases.get(session_id)
        if held is not None and held.owner == lease.owner and held.fence == lease.fence:
            held.owner = None
            held.until = 0.0

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
