"""The router seam: where a session runs, here or on another worker.

The core knows only this protocol. A registry on a store that connects
workers (a :class:`RoutingStore`, e.g. ``RedisStore``) opens the store's
router; every request then asks it first, and serves the request here when
the router says the session is not live elsewhere. Without one, every session
runs here. The multi-worker layer is a plug-in that implements it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import trio

from ._config import RegistryConfig
from ._errors import EventsExpiredError
from ._events import Event
from ._records import SessionState, Status, TurnOutcome
from ._requests import Call, Cancel, Delete, Stop
from ._subscription import EventIterator
from .stores._base import Store

if TYPE_CHECKING:
    from ._pending import Pending
    from ._ref import Turn

__all__ = ["NOT_ROUTED", "Router", "RouterHost", "RoutingStore"]


class _NotRouted:
    def __repr__(self) -> str:
        return "NOT_ROUTED"


#: A router's answer when the session is live nowhere else: serve it here.
NOT_ROUTED: Final = _NotRouted()


class RouterHost(Protocol):
    """What a router may ask of the registry it serves."""

    @property
    def worker_id(self) -> str: ...
    @property
    def store(self) -> Store: ...
    @property
    def config(self) -> RegistryConfig: ...
    @property
    def closing(self) -> bool: ...
    @property
    def grace_ends(self) -> float:
        """When the shutdown grace ends (trio's clock; infinite before the shutdown)."""
        ...

    @property
    def runs_turns(self) -> bool:
        """Whether the registry has agents: one without runs no turn, so it takes no
        session of its own (its requests go to the workers that do)."""
        ...

    def agent_names(self) -> list[str]:
        """The names of the registry's agents, sorted."""
        ...

    def is_live(self, name: str) -> bool: ...
    def live_names(self) -> list[str]:
        """The names of the sessions live here."""
        ...

    def subscriber_lagged(self, name: str) -> None:
        """A subscriber here of ``name`` (live elsewhere) fell behind and was cut off."""
        ...

    async def submit(self, name: str, text: str, key: str | None, *, ack: bool) -> Turn:
        """Put a turn in the session's mailbox wherever it runs (routed as a ref's)."""
        ...

    async def submit_here(
        self, name: str, text: str, key: str | None, turn_id: str | None = None
    ) -> Turn:
        """Put a turn in the session's mailbox here (waking it), never routing it; a
        new turn runs under ``turn_id`` (issued by the worker that forwarded it) if the
        session could have issued that id, under one of its own otherwise."""
        ...

    def enqueue_here(self, name: str, text: str, turn_id: str | None = None) -> Pending | None:
        """Put a turn without idempotency key in the mailbox of a session live and
        loaded here, at once, never routing it (under ``turn_id`` as ``submit_here``
        would): its result slot; None if that would take a wait or a wake (then
        ``submit_here``)."""
        ...

    async def call_here(self, name: str, request: Call | Cancel | Stop | Delete) -> Any:
        """Serve a request here, never routing it."""
        ...

    async def read_here(self, name: str) -> SessionState:
        """The session's state here, never routing the read."""
        ...

    async def outcome_here(self, name: str, turn_id: str) -> TurnOutcome:
        """What became of the session's turn ``turn_id``, asked here, never routed."""
        ...

    async def stored_status(self, name: str) -> Status:
        """The session's status as the store has it."""
        ...

    def event_seq_here(self, name: str) -> int | None:
        """The seq of the last event the session published here; None if not live here."""
        ...

    def created_here(self, name: str) -> datetime.datetime | None:
        """When the session live and loaded here was created (it tells it apart from
        a deleted session of the same name); None if it is not."""
        ...

    def events_here(self, name: str, after: int) -> list[Event] | None:
        """The events after ``after`` that the session published here, in order, if its
        hub here still holds them all; None otherwise (or if it is not live here)."""
        ...

    def lost_here(self, name: str, after: int) -> EventsExpiredError | None:
        """The error for a subscription resuming after ``after``, if the session, live
        here, woke past that seq (a lost incarnation published it, never stored) or an
        edit erased the events after it (see ``erases``); None otherwise."""
        ...

    async def open_subscription_here(self, name: str, after: int | None) -> EventIterator:
        """A subscription to the session's hub here (and the store's journal)."""
        ...


class Router(Protocol):
    """Decides where a session runs and carries requests and events to it."""

    @property
    def subscriber_count(self) -> int: ...
    def elsewhere(self, name: str) -> bool:
        """Whether another worker is believed to run ``name`` (no I/O)."""
        ...

    def held_elsewhere(self, name: str) -> None:
        """A wake here found ``name``'s lease held by another worker."""
        ...

    async def submit(self, name: str, text: str, key: str | None, *, ack: bool) -> Turn | None:
        """Send a turn to the session's owner; None if it is live nowhere else.

        With ``ack``, return once the owner accepted it; otherwise once answered.
        """
        ...

    async def call(self, name: str, request: Call | Cancel | Stop | Delete) -> Any:
        """Serve a request at the session's owner; NOT_ROUTED if it is live nowhere else."""
        ...

    async def read(self, name: str) -> SessionState | None:
        """The session's state from its owner; None if it is live nowhere else."""
        ...

    async def outcome(self, name: str, turn_id: str) -> TurnOutcome | None:
        """What became of turn ``turn_id``, from the session's owner (which knows its
        mailbox); None if it is live nowhere else."""
        ...

    def tap_for(self, name: str) -> Callable[[Event], None] | None:
        """Called with every event the session publishes here (for subscribers elsewhere)."""
        ...

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        """A subscription to the session's events, wherever it runs."""
        ...

    async def created(self, name: str) -> None:
        """A session of this name was created here (a deleted namesake's events end)."""
        ...

    async def deleted(self, name: str) -> None:
        """The session was deleted: its subscriptions on every worker end."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class RoutingStore(Protocol):
    """A store that connects the workers that share it."""

    async def open_router(self, host: RouterHost, nursery: trio.Nursery) -> Router:
        """Start the router's tasks in ``nursery`` and return it."""
        ...
