"""Reading what a store holds, for assertions: a session's journal as events."""

from __future__ import annotations

import asyncio

import trio

from .._codec import load_events
from .._events import Event
from ..aio._host import acquire_host, release_host
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

    Await it from trio or from asyncio code (an asyncio test of an app on
    ``sessionactors.aio``): from asyncio it reads in the loop's trio run, the one
    the loop's registries use, inside or after their blocks.
    """
    try:
        trio.lowlevel.current_task()
    except RuntimeError:  # (asyncio code: read in the loop's trio run)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "journal_events must be awaited in trio code or in a running asyncio loop"
            ) from None
        host = await acquire_host()
        try:
            return await host.call(_read, store, session_id, after, session_id=session_id)
        finally:
            await release_host(host)
    return await _read(store, session_id, after)


async def _read(store: Store, session_id: str, after: int) -> list[Event]:
    _, entries = await store.read_journal(session_id, after)
    return [event for entry in entries for event in load_events(entry.data) if event.seq > after]
