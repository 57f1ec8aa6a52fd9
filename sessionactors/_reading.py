"""Reading a stored session without waking it: its snapshot and journal tail, folded.

This is what the actor does on wake, less everything that makes it the owner:
no lease is claimed, no task started, nothing written. A read sees the session
as the store has it (what was acknowledged durable), so a session live in
another process is read as of its last journal append; that process is never
disturbed.
"""

from __future__ import annotations

from ._codec import load_events, load_snapshot
from ._errors import SessionNotFoundError, SnapshotCorruptError
from ._events import Event
from ._names import validate_name
from ._records import SessionState
from ._session import LiveSession
from .stores._base import Store, StoredSession

__all__ = ["read_events", "read_session", "read_stored"]


async def read_session(store: Store, name: str) -> SessionState:
    """The session ``name`` as ``store`` holds it, read without waking it.

    Loads the latest snapshot and the journal entries after it and folds them
    (the same fold a wake runs). It claims no lease, starts no task and writes
    nothing, and needs no registry or agent, so it works on a store that a
    server in another process is using (open a SQLite file with
    ``SQLiteStore(path, readonly=True)`` there). ``status`` is the one last
    stored: a session live elsewhere may be further along in memory than its
    last durable write.

    Raises ``SessionNotFoundError`` if the session is not stored,
    ``InvalidSessionNameError`` for a name no session can have,
    ``SnapshotError`` if its stored bytes cannot be read, and ``StoreError``.
    """
    validate_name(name)
    session, _ = await read_stored(store, name)
    return session.to_state()


async def read_stored(store: Store, session_id: str) -> tuple[LiveSession, StoredSession]:
    """The session as the store has it (snapshot + journal tail), without waking it."""
    stored = await store.load(session_id)
    if stored is None:
        raise SessionNotFoundError(
            f"session {session_id!r} does not exist; create it with registry.spawn({session_id!r})",
            session_id=session_id,
        )
    state = load_snapshot(stored.snapshot, session_id=session_id)
    if state.session_id != session_id:
        raise SnapshotCorruptError(
            f"the snapshot stored for session {session_id!r} belongs to "
            f"{state.session_id!r}; the store is inconsistent: restore it or delete the session",
            session_id=session_id,
        )
    session = LiveSession(state)
    for entry in stored.entries:
        for event in load_events(entry.data, session_id=session_id):
            if event.seq > stored.snapshot_seq:
                session.apply(event)
    return session, stored


async def read_events(store: Store, session_id: str, after: int) -> tuple[int, list[Event]]:
    """``(trimmed_upto, events)``: the journaled events with a seq above ``after``.

    The journal keeps the message-level events (messages, turn outcomes, status,
    reviews, edits, metadata), not deltas; events at or below ``trimmed_upto``
    were compacted away.
    """
    trimmed, entries = await store.read_journal(session_id, after)
    events: list[Event] = []
    for entry in entries:
        events += (e for e in load_events(entry.data, session_id=session_id) if e.seq > after)
    return trimmed, events
