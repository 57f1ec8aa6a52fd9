"""Reading what a store holds, for assertions: a session's journal as events."""

from __future__ import annotations

from .._codec import load_events
from .._events import Event
from ..stores._base import Store

__all__ = ["journal_events"]


async def journal_events(store: Store, session_id: str, *, after: int = 0) -> list[Event]:
    """The events in ``session_id``'s journal with a seq above ``after``, oldest first.

    They are read from ``store`` as it is now (``store.read_journal``, decoded
    with ``sessionactors.stores.load_events``), without waking the session: what a
    restarted process would find. The journal holds the message-level events
    (``MessageAdded``, the turns' outcomes, statuses, edits), not the deltas;
    entries up to the last snapshot may have been trimmed. Raises
    ``SessionNotFoundError`` if the session is not stored.
    """
    _, entries = await store.read_journal(session_id, after)
    return [event for entry in entries for event in load_events(entry.data) if event.seq > after]
