"""Opening a subscription: replay from the hub's ring or the store's journal, then live."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from ._codec import load_event
from ._errors import EventsExpiredError
from ._events import Event
from ._hub import Hub, Subscriber, lagged_error
from .stores._base import Store

__all__ = ["EventIterator", "open_event_iterator"]


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
    ) -> None:
        self._session_id = session_id
        self._hub = hub
        self._sub = sub
        self._replay = deque(replay)
        self._cursor = cursor
        self._on_close = on_close
        self._closed = False

    @property
    def last_seq(self) -> int:
        """The seq of the last event delivered (or where the subscription started)."""
        return self._cursor

    def __aiter__(self) -> EventIterator:
        return self

    async def __anext__(self) -> Event:
        replay = self._replay
        while replay:
            event = replay.popleft()
            if event.seq > self._cursor:
                self._cursor = event.seq
                await trio.lowlevel.checkpoint()
                return event
        receive = self._sub.receive
        while True:
            try:
                event = await receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                if self._sub.lagged:
                    raise lagged_error(self._session_id, self._cursor) from None
                raise StopAsyncIteration from None
            if event.seq > self._cursor:
                self._cursor = event.seq
                return event

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
) -> EventIterator:
    """Subscribe first (so nothing published meanwhile is missed), then gather the replay."""
    sub = hub.subscribe()
    try:
        if after is None:
            return EventIterator(session_id, hub, sub, [], hub.seq, on_close)
        if after < 0:
            raise ValueError(f"after must be a seq (>= 0), not {after}")
        if hub.ring_covers(after):
            return EventIterator(session_id, hub, sub, hub.ring_after(after), after, on_close)
        trimmed, entries = await store.read_journal(session_id, after)
        if trimmed > after:
            raise EventsExpiredError(
                f"events of session {session_id!r} after seq {after} are no longer "
                f"available; the oldest available is seq {trimmed + 1}: reload the history "
                f"with ref.history() and subscribe with after={trimmed}",
                session_id=session_id,
                oldest_seq=trimmed + 1,
            )
        oldest_in_ring = hub.oldest_seq
        replay = [
            event
            for event in (load_event(e.data, session_id=session_id) for e in entries)
            if oldest_in_ring is None or event.seq < oldest_in_ring
        ]
        replay.extend(hub.ring_after(after))
        return EventIterator(session_id, hub, sub, replay, after, on_close)
    except BaseException:
        hub.unsubscribe(sub)
        on_close()
        raise
