"""Reading a stored session without waking it: its snapshot and journal tail, folded.

This is what the actor does on wake, less everything that makes it the owner:
no lease is claimed, no task started, nothing written. A read sees the session
as the store has it (what was acknowledged durable), so a session live in
another process is read as of its last journal append; that process is never
disturbed.
"""

from __future__ import annotations

import datetime
import logging
import shlex
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import attrs

from ._codec import load_info, load_journal_entry, load_snapshot, load_snapshot_head
from ._errors import (
    Advice,
    AdviceKind,
    InvalidSessionNameError,
    SessionNotFoundError,
    SnapshotCorruptError,
    SnapshotError,
    advised,
)
from ._events import NO_TIME, Event
from ._listing import (
    LISTING_BATCH,
    check_active_before,
    check_listing,
    info_activity,
    matches,
    page_of,
    told_status,
)
from ._names import damaged_name, delete_command, shell_quoted, validate_name
from ._records import SessionInfo, SessionState, Status
from ._session import LiveSession, state_info
from .stores._base import IdlePageStore, PagedStore, Store, StoredSession

__all__ = [
    "damaged_listed",
    "describe_stored",
    "is_damaged",
    "list_stored",
    "read_events",
    "read_session",
    "read_stored",
    "stored_cleanly",
    "stored_seq",
]

log = logging.getLogger("sessionactors")


async def read_session(store: Store, name: str) -> SessionState:
    """The session ``name`` as ``store`` holds it, read without waking it.

    Loads the latest snapshot and the journal entries after it and folds them
    (the same fold a wake runs). It claims no lease, starts no task and writes
    nothing, and needs no registry or agent, so it works on a store that a
    server in another process is using (open a SQLite file with
    ``SQLiteStore(path, readonly=True)`` there). ``status`` says what the
    session waits for, as the registry's listing does: ``waiting`` while a review
    is pending (hibernated or not), ``running`` while a turn is open without one
    (under way elsewhere, or left open by a process that died mid-turn, which the
    session's next request or subscription resumes), else the one last stored
    (``idle``, ``hibernated``, ``stopped``). A session live elsewhere may be further
    along in memory than its last durable write.

    Raises ``SessionNotFoundError`` if the session is not stored,
    ``InvalidSessionNameError`` for a name no session can have,
    ``SnapshotError`` if its stored bytes cannot be read, and ``StoreError``.
    """
    validate_name(name)
    session, _ = await read_stored(store, name)
    if session.status is Status.NEW:  # a wake's status, perhaps followed by turns
        session.status = session.resting_status()
    session.status = told_status(
        session.status,
        pending_reviews=len(session.reviews),
        open_turn=session.open_turn is not None,
    )
    return session.to_state()


async def read_stored(
    store: Store, session_id: str, *, history: bool = True
) -> tuple[LiveSession, StoredSession]:
    """The session as the store has it (snapshot + journal tail), without waking it;
    its ``updated_at`` is the one its info holds, if the store gives the info (see
    ``StoredSession``): the time its last writer had, whoever reads it, whenever.

    Without ``history``, for a caller that needs the session's status, seqs and open
    turn: a session stored without a journal tail (hibernated, or never woken) comes
    without its messages, which are not decoded (see ``load_snapshot_head``)."""
    stored = await store.load(session_id)
    if stored is None:
        raise advised(
            SessionNotFoundError,
            f"session {session_id!r} does not exist; ",
            Advice(kind=AdviceKind.CREATE),
            session_id=session_id,
        )
    load = load_snapshot if history or stored.entries else load_snapshot_head
    state = load(stored.snapshot, session_id=session_id)
    if state.session_id != session_id:
        raise SnapshotCorruptError(
            f"the snapshot stored for session {session_id!r} belongs to "
            f"{state.session_id!r}; the store is inconsistent: restore it or delete the session",
            session_id=session_id,
        )
    session = LiveSession(state)
    # (a snapshot is stored at its state's seq: a record set back behind the store's
    # back would fold the entries the snapshot holds a second time)
    covered = max(stored.snapshot_seq, state.event_seq)
    for entry in stored.entries:
        for event in load_journal_entry(entry.data, session_id):
            if event.seq > covered:
                session.apply(event)
    # The fold stamps the events that carry no time (a status, a turn's failure, an
    # edit, metadata) with the time of this read; the info says the time its writer
    # folded them at, which listings show.
    written = info_activity(stored.info) if stored.info is not None else 0
    if written:
        session.updated_at = NO_TIME + datetime.timedelta(microseconds=written)
    return session, stored


def stored_seq(session: LiveSession, stored: StoredSession) -> int:
    """The highest seq the store holds of the session (``read_stored``'s pair): the
    last seq its last incarnation used, if it was stored cleanly (``stored_cleanly``)."""
    return max(session.event_seq, stored.snapshot_seq, *(entry.seq for entry in stored.entries))


def stored_cleanly(session: LiveSession, stored: StoredSession) -> bool:
    """Whether no incarnation of the session can have published anything the store
    does not show (``read_stored``'s pair): hibernated, or never woken since spawn. A
    wake journals a status before it publishes anything, so that the next wake knows
    whether to jump its seq (see ``Hub.jump``)."""
    return not stored.entries and (
        session.status is Status.HIBERNATED
        or (session.status is Status.NEW and session.event_seq == 0)
    )


async def read_events(store: Store, session_id: str, after: int) -> tuple[int, list[Event]]:
    """``(trimmed_upto, events)``: the journaled events with a seq above ``after``.

    The journal keeps the message-level events (messages, turn outcomes, status,
    reviews, edits, metadata), not deltas; events at or below ``trimmed_upto``
    were compacted away.
    """
    trimmed, entries = await store.read_journal(session_id, after)
    events: list[Event] = []
    for entry in entries:
        events += (e for e in load_journal_entry(entry.data, session_id) if e.seq > after)
    return trimmed, events


def describe_stored(name: str, blob: bytes) -> SessionInfo:
    """The SessionInfo stored for ``name``; SnapshotError if it cannot be read (then a
    listing reads the session's history instead: see ``list_stored``)."""
    if not isinstance(blob, bytes | bytearray | memoryview):  # a damaged store's value
        raise SnapshotCorruptError(
            f"the info of session {name!r} is stored as a {type(blob).__name__}, not bytes",
            session_id=name,
        )
    info = load_info(blob, session_id=name)
    told = told_status(info.status, pending_reviews=info.pending_reviews)
    return info if told is info.status else attrs.evolve(info, status=told)


async def _described_anew(
    store: Store, name: str, unreadable: Callable[[str, str], None] | None = None
) -> SessionInfo:
    """The listing's SessionInfo of ``name``, whose stored info (a copy of what its
    history says, kept for listings) cannot be read: as its history says, read as
    ``read_session`` reads it; ``FAILED`` if that cannot be read either. Either way
    ``unreadable`` is told why (by default: logged as a WARNING)."""
    tell = unreadable or _unreadable_listed
    entry = (
        "its listing entry (the copy of its status, size and metadata kept for listings) "
        "cannot be read"
    )
    try:
        state = await read_session(store, name)
    except (SnapshotError, SessionNotFoundError, InvalidSessionNameError) as exc:
        history = (
            "and the store holds no history of it (an entry left without its session)"
            if isinstance(exc, SessionNotFoundError)
            else f"nor can its history ({exc})"
        )
        tell(
            name,
            f"{entry}, {history}; it is listed as failed: restore it from a backup, or "
            f"delete it (registry.delete({name!r}), or `{delete_command(shlex.quote(name))}`)",
        )
        return SessionInfo(
            session_id=name, agent=None, status=Status.FAILED, message_count=0, updated_at=NO_TIME
        )
    tell(
        name,
        f"{entry}; it is listed as its history says, which reads whole (the session's "
        "next write puts the entry right)",
    )
    return state_info(state)


def _unreadable_listed(name: str, why: str) -> None:
    log.warning("session %r: %s", name, why)


async def list_stored(
    store: Store,
    *,
    status: Status | str | None = None,
    metadata: Mapping[str, Any] | None = None,
    limit: int | None = None,
    after: str | None = None,
    active_before: datetime.datetime | None = None,
    describe: Callable[[str, bytes], SessionInfo] = describe_stored,
    damaged: Callable[[bytes], None] | None = None,
    unreadable: Callable[[str, str], None] | None = None,
) -> list[SessionInfo]:
    """A listing of ``store`` as ``Registry.sessions`` documents it, read without waking
    any session; ``describe`` turns a stored ``(name, info)`` into the listed info.

    A stored name that is not UTF-8 (see ``damaged_name``) is left out, and its bytes
    given to ``damaged`` (by default: logged as a WARNING, see ``damaged_listed``). A
    session whose info cannot be read is listed as its history says (see
    ``_described_anew``), and ``unreadable`` is given its name and what was done."""
    wanted, pairs = check_listing(status, metadata, limit, after)
    before = check_active_before(active_before)
    if after is not None:
        validate_name(after)
    # unfiltered, a page reads `limit` sessions; filtered, twice that to start with
    # (doubling while matches are scarce): reading more costs more on a big store
    # (so is a listing of the sessions idle since a time on a store that cannot start
    # a page where they do: it reads the newer ones too, and leaves them out)
    seeks = isinstance(store, IdlePageStore)
    filtered = wanted is not None or pairs or (before is not None and not seeks)
    batch = LISTING_BATCH if limit is None else min(limit * (2 if filtered else 1), LISTING_BATCH)
    out: list[SessionInfo] = []
    async with aclosing(_listed(store, after, batch, before)) as listed:
        async for name, blob in listed:
            if is_damaged(name, damaged):
                continue
            try:
                info = describe(name, blob)
            except SnapshotError:
                info = await _described_anew(store, name, unreadable)
            if matches(info, wanted, pairs) and (
                # (a session live here may have been active since it was last stored)
                active_before is None or info.updated_at < active_before
            ):
                out.append(info)
                if limit is not None and len(out) >= limit:
                    break
    return out


def damaged_listed(raw: bytes) -> None:
    """Log a stored session whose name, ``raw``, is not UTF-8 (damage in the store),
    left out of a listing: what it is and how to remove it."""
    shown = shell_quoted(raw)
    log.warning(
        "a stored session's name is not UTF-8 (damaged data): %s; it is left out of "
        "listings and no request can reach it; remove it with `%s`",
        shown,
        delete_command(shown),
    )


def is_damaged(name: str, damaged: Callable[[bytes], None] | None = None) -> bool:
    """Whether the stored name ``name`` is not UTF-8 (see ``damaged_name``): then its
    bytes are given to ``damaged`` (by default: logged, see ``damaged_listed``), and the
    caller leaves it out, since no request can reach a session under it."""
    raw = damaged_name(name)
    if raw is None:
        return False
    (damaged or damaged_listed)(raw)
    return True


async def _listed(
    store: Store, after: str | None, batch: int, before: int | None
) -> AsyncGenerator[tuple[str, bytes], None]:
    """``(name, info)`` of the stored sessions after ``after``, in listing order; only
    those whose activity time is below ``before``, if given."""
    if not isinstance(store, PagedStore):  # a store of an older protocol: all at once
        every = await store.list_sessions()
        for item in page_of(every, after=after, limit=1 << 62, active_before=before):
            yield item
        return

    async def page(after: str | None, limit: int) -> list[tuple[str, bytes]]:
        if before is not None and isinstance(store, IdlePageStore):
            return await store.list_idle_page(active_before=before, after=after, limit=limit)
        return await store.list_page(after=after, limit=limit)  # (filtered as it is read)

    listed = await page(after, batch)
    # A session that became active while this reads moves to the front: the next
    # page, after a name that moved, starts at the front again. What was listed is
    # not listed twice.
    seen: set[str] = set()
    while True:
        for item in listed:
            if item[0] not in seen and (before is None or info_activity(item[1]) < before):
                seen.add(item[0])
                yield item
        if len(listed) < batch:
            return
        batch = min(batch * 2, LISTING_BATCH)
        listed = await _next_page(page, listed, batch)


async def _next_page(
    page: Callable[[str | None, int], Awaitable[list[tuple[str, bytes]]]],
    listed: list[tuple[str, bytes]],
    batch: int,
) -> list[tuple[str, bytes]]:
    """The page after ``listed``: after its last session, or, if that was deleted
    meanwhile, after the last one of it still stored."""
    for name, _ in reversed(listed):
        try:
            return await page(name, batch)
        except SessionNotFoundError:
            continue
    return await page(None, batch)  # all gone: start again
