"""The asyncio face of a registry: the same methods, records, events and errors.

Each asynchronous method hands the trio method of the same name to the host's
trio run and waits, in asyncio, for its answer. Subscriptions run as a trio
task that reads the trio subscription and passes its events to asyncio
through a buffer bounded in events and in bytes.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import inspect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import MappingProxyType
from typing import Any, Final, NoReturn, TypeVar

import attrs
import trio

import sessionactors as sa

from .._config import RegistryConfig
from .._hub import event_size, lagged_error
from .._ref import check_after, check_message, entered_twice, known_reply, not_in_block
from .._registry import closed
from ..stores import Store
from ._adapters import adapt_agent
from ._host import Host, Task, acquire_host, ended_error, release_host

__all__ = ["Registry", "SessionRef", "Turn", "open_registry"]


def _forward(host: Host, target: object, name: str, session_id: str | None) -> Any:
    """An async method of the trio object that this class does not spell out yet (one
    the core added since), called through the host like the others (about session
    ``session_id``, None for the registry's)."""
    if name.startswith("_"):
        raise AttributeError(name)
    method = getattr(target, name)  # AttributeError as the trio object gives it
    if not inspect.iscoroutinefunction(method):
        raise AttributeError(
            f"{type(target).__name__}.{name} is not an async method; sessionactors.aio "
            "forwards only those"
        )

    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> Any:
        return await host.call(functools.partial(method, *args, **kwargs), session_id=session_id)

    return call


T = TypeVar("T")


def trio_turn(turn: Turn) -> sa.Turn:
    """The trio ``Turn`` behind an asyncio one (for the HTTP gateway, which asks
    ``sessionactors._ref.joined`` about it)."""
    return turn._turn


def trio_registry(registry: Registry) -> sa.Registry:
    """The trio registry behind ``registry``, for a synchronous call on it (the test
    kit's ``crash``): only on the loop's thread, where its trio run lives (``RuntimeError``
    from elsewhere, ``SessionStoppedError`` once the loop's trio run has ended)."""
    registry._host.check_loop()
    return registry._registry


async def on_trio(
    registry: Registry, fn: Callable[[sa.Registry], Awaitable[T]], session_id: str | None
) -> T:
    """``await fn(trio_registry)`` in the trio run behind ``registry``, about session
    ``session_id``, answered in asyncio (for the HTTP gateway, which reads the store
    of either kind of registry)."""
    return await registry._host.call(fn, registry._registry, session_id=session_id)


#: Events a subscription passes to asyncio ahead of its reader, and their bytes (as
#: ``event_size`` estimates them; one event may pass the byte bound).
_EVENTS_AHEAD: Final = 256
_BYTES_AHEAD: Final = 1 << 20


@attrs.define(eq=False, repr=False)
class Turn:
    """A submitted turn; ``await turn.reply()`` waits, in asyncio, for its outcome."""

    _host: Host = attrs.field(alias="host")
    _turn: sa.Turn = attrs.field(alias="turn")

    def __repr__(self) -> str:
        return f"<aio Turn {self._turn.id!r} of session {self._turn.session_id!r}>"

    @property
    def id(self) -> str:
        """The turn's id (the ``turn_id`` of its events)."""
        return self._turn.id

    @property
    def session_id(self) -> str:
        """The session the turn belongs to."""
        return self._turn.session_id

    @property
    def replayed(self) -> bool:
        """True when an idempotency key had already completed: the stored reply, no new turn."""
        return self._turn.replayed

    @property
    def done(self) -> bool:
        """Whether the outcome is known."""
        return self._turn.done

    async def reply(self) -> sa.Reply:
        """Wait for the turn's reply; cancelling the wait abandons it (the turn runs on).

        A done turn answers at once, also after its registry's block.
        """
        if self._turn.done:
            return known_reply(self._turn)
        return await self._host.call(self._turn.reply, session_id=self._turn.session_id)


@attrs.define(eq=False, repr=False)
class SessionRef:
    """A handle to a session by name, for asyncio code; holding one keeps nothing alive.

    It offers the methods of :class:`sessionactors.SessionRef`, with the same
    arguments, results and errors.
    """

    _host: Host = attrs.field(alias="host")
    _ref: sa.SessionRef = attrs.field(alias="ref")

    def __repr__(self) -> str:
        return f"<aio SessionRef {self._ref.session_id!r}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SessionRef):
            return NotImplemented
        return self._ref == other._ref

    def __getattr__(self, name: str) -> Any:
        return _forward(self._host, self._ref, name, self._ref.session_id)

    def __hash__(self) -> int:
        return hash(self._ref)

    @property
    def session_id(self) -> str:
        """The session's name."""
        return self._ref.session_id

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return await self._host.call(fn, *args, session_id=self._ref.session_id)

    async def send(self, text: str, *, idempotency_key: str | None = None) -> sa.Reply:
        """Run one turn and wait for its reply (after it is durable)."""
        return await self._call(
            functools.partial(self._ref.send, text, idempotency_key=idempotency_key)
        )

    async def submit(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Put a turn in the mailbox, waiting for room; don't wait for the reply."""
        turn = await self._call(
            functools.partial(self._ref.submit, text, idempotency_key=idempotency_key)
        )
        return Turn(self._host, turn)

    def submit_nowait(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Like ``submit``, but raise MailboxFullError instead of waiting for room.

        It runs at once on the loop's thread, where the trio run lives too.
        """
        self._host.check_loop()
        return Turn(self._host, self._ref.submit_nowait(text, idempotency_key=idempotency_key))

    def subscribe(self, after: int | None = None) -> AbstractAsyncContextManager[EventStream]:
        """Events of this session, live from now on or replayed from ``after``
        (see :meth:`sessionactors.SessionRef.subscribe`): ``async with
        ref.subscribe() as events: async for event in events: ...``."""
        check_after(self.session_id, after)
        return _Subscription(
            self._host, self.session_id, lambda: self._ref.subscribe(after), "ref.subscribe()"
        )

    def stream(
        self, text: str, *, idempotency_key: str | None = None
    ) -> AbstractAsyncContextManager[EventStream]:
        """Submit a turn and iterate over that turn's events only, ending with its outcome.

        A turn that pauses for a review is followed through it, as
        ``sessionactors.SessionRef.stream`` says: a handler that must not hold its
        response while a person decides ends it at ``ReviewRequested``.
        A text or key that ``send`` refuses raises its error here, when called.
        """
        check_message(self.session_id, text, idempotency_key)
        return _Subscription(
            self._host,
            self.session_id,
            lambda: self._ref.stream(text, idempotency_key=idempotency_key),
            "ref.stream(text)",
        )

    async def history(self) -> list[sa.Message]:
        """The messages so far, without waiting behind queued turns."""
        return await self._call(self._ref.history)

    async def state(self) -> sa.SessionState:
        """The session's whole state, without waiting behind queued turns."""
        return await self._call(self._ref.state)

    async def cancel(self, turn_id: str | None = None) -> bool:
        """Cancel the turn in flight, out of band (only if it is turn ``turn_id``, when
        given); whether it was cancelled (see :meth:`sessionactors.SessionRef.cancel`)."""
        return await self._call(self._ref.cancel, turn_id)

    async def hibernate(self) -> None:
        """Snapshot the session to the store and end its task, after the queued requests."""
        await self._call(self._ref.hibernate)

    async def stop(self) -> None:
        """Finish the session; later requests raise SessionStoppedError."""
        await self._call(self._ref.stop)

    async def review(self, review_id: str, approve: bool, note: str | None = None) -> sa.Reply:
        """Approve or deny a pending review; the turn goes on, and this returns its reply."""
        return await self._call(functools.partial(self._ref.review, review_id, approve, note))

    async def pending_reviews(self) -> list[sa.ReviewRequest]:
        """The reviews this session waits on."""
        return await self._call(self._ref.pending_reviews)

    async def truncate(self, keep_last: int) -> int:
        """Drop all but the last ``keep_last`` messages, from the user message that began
        the turn the cut falls in (as ``SessionRef.truncate``); returns how many were
        removed."""
        return await self._call(self._ref.truncate, keep_last)

    async def rewind(self, message_id: str) -> int:
        """Drop every message after ``message_id``; returns how many were removed."""
        return await self._call(self._ref.rewind, message_id)

    async def set_summary(self, text: str) -> None:
        """Set the summary the model sees after the system prompt ("" clears it)."""
        await self._call(self._ref.set_summary, text)

    async def turn_outcome(self, turn_id: str) -> sa.TurnOutcome:
        """What became of turn ``turn_id`` (see :meth:`sessionactors.SessionRef.turn_outcome`)."""
        return await self._call(self._ref.turn_outcome, turn_id)

    async def retry(self) -> sa.Reply:
        """Run the last turn again if it failed or was cancelled; its reply."""
        return await self._call(self._ref.retry)

    async def set_metadata(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``changes`` into the metadata (``None`` removes a key; the result at most
        ``MAX_METADATA_BYTES`` encoded); returns it now."""
        metadata: dict[str, Any] = await self._call(self._ref.set_metadata, changes)
        return metadata

    async def add_messages(self, messages: Iterable[sa.Message]) -> None:
        """Append messages to the history without calling the model (see
        :meth:`sessionactors.SessionRef.add_messages`)."""
        await self._call(self._ref.add_messages, messages)

    async def replace_history(self, messages: Iterable[sa.Message]) -> None:
        """Replace the whole history with ``messages`` (see
        :meth:`sessionactors.SessionRef.replace_history`)."""
        await self._call(self._ref.replace_history, messages)


@attrs.define(eq=False, repr=False)
class Registry:
    """A registry for asyncio code, made by :func:`open_registry`.

    It offers the methods of :class:`sessionactors.Registry`, with the same
    arguments, results and errors; its refs are :class:`SessionRef`. Its
    properties, ``worker_id``, ``config``, ``store`` and ``agents``, are values
    fixed when it opened: they are read without a call into the trio run, from
    any thread, also after the block.
    """

    _host: Host = attrs.field(alias="host")
    _registry: sa.Registry = attrs.field(alias="registry")
    _agents: Mapping[str, sa.Agent] = attrs.field(alias="agents")

    def __repr__(self) -> str:
        shown = f"<aio Registry live={len(self._registry.live())}"
        return f"{shown} closed>" if closed(self._registry) else f"{shown}>"

    def __getattr__(self, name: str) -> Any:
        return _forward(self._host, self._registry, name, None)

    @property
    def worker_id(self) -> str:
        """This registry's identity in leases (``open_registry(worker_id=...)``, or a
        fresh one)."""
        return self._registry.worker_id

    @property
    def config(self) -> RegistryConfig:
        """The registry's options, as validated by ``open_registry``."""
        return self._registry.config

    @property
    def store(self) -> Store:
        """Where this registry keeps its sessions: the store given to ``open_registry``
        (or the ``MemoryStore`` made for it). Its methods are trio code, run by the
        registry in its trio run; from asyncio, reach the sessions through the
        registry's methods."""
        return self._registry.store

    @property
    def agents(self) -> Mapping[str, sa.Agent]:
        """The agents sessions run with, by name, as given to ``open_registry`` (their
        models and tools as written, not as run on the loop); read-only."""
        return self._agents

    async def _call(
        self, session_id: str | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``await fn(*args, **kwargs)`` in the trio run, about session ``session_id``."""
        return await self._host.call(functools.partial(fn, *args, **kwargs), session_id=session_id)

    def _wrap(self, ref: sa.SessionRef) -> SessionRef:
        return SessionRef(self._host, ref)

    async def spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """Create a new session and start its actor (SessionExistsError if it exists)."""
        ref = await self._call(
            name,
            self._registry.spawn,
            name,
            agent=agent,
            system_prompt=system_prompt,
            metadata=metadata,
        )
        return self._wrap(ref)

    async def get_or_spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """The session ``name``, spawned with these options if it does not exist."""
        ref = await self._call(
            name,
            self._registry.get_or_spawn,
            name,
            agent=agent,
            system_prompt=system_prompt,
            metadata=metadata,
        )
        return self._wrap(ref)

    def ref(self, name: str) -> SessionRef:
        """A handle to ``name``: no I/O; its first request wakes the session."""
        return self._wrap(self._registry.ref(name))

    async def fork(self, name: str, new_name: str, *, at: str | None = None) -> SessionRef:
        """A new session ``new_name`` with ``name``'s history up to message ``at``."""
        return self._wrap(await self._call(new_name, self._registry.fork, name, new_name, at=at))

    async def delete(self, name: str) -> None:
        """Remove the conversation everywhere: actor, subscribers, store."""
        await self._call(name, self._registry.delete, name)

    def live(self) -> list[str]:
        """The names of the sessions whose actors are running now."""
        return self._registry.live()

    async def sessions(
        self,
        *,
        status: sa.Status | str | None = None,
        metadata: Mapping[str, Any] | None = None,
        limit: int | None = None,
        after: str | None = None,
        active_before: datetime.datetime | None = None,
    ) -> list[sa.SessionInfo]:
        """SessionInfos of the stored sessions, newest activity first, filtered and
        paged as ``sessionactors.Registry.sessions`` does (``active_before=``: those
        idle since then)."""
        infos: list[sa.SessionInfo] = await self._call(
            None,
            self._registry.sessions,
            status=status,
            metadata=metadata,
            limit=limit,
            after=after,
            active_before=active_before,
        )
        return infos

    async def pending_reviews(self) -> list[sa.ReviewRequest]:
        """Every pending review of every session, live or stored, oldest first."""
        reviews: list[sa.ReviewRequest] = await self._call(None, self._registry.pending_reviews)
        return reviews

    def statistics(self) -> sa.RegistryStatistics:
        """A frozen snapshot of the registry's counters."""
        return self._registry.statistics()


class EventStream:
    """The events of an asyncio subscription (``async for event in events``)."""

    def __init__(self, host: Host) -> None:
        self._host = host
        self._events: deque[sa.Event] = deque()
        self._bytes = 0  # the events' estimated size
        self._ended = False
        self._error: BaseException | None = None
        # the asyncio readers wait (one each: several tasks may read one subscription)
        self._readers: list[asyncio.Future[None]] = []
        self._room: trio.Event | None = None  # the trio pump waits
        self._cut: sa.SubscriberLaggedError | None = None  # ended with its reader behind

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> sa.Event:
        events = self._events
        while not events:
            if self._ended:
                error, self._error = self._error, None
                if error is not None:
                    raise error
                raise StopAsyncIteration
            reader = self._host.loop.create_future()
            self._readers.append(reader)
            try:
                await reader
            finally:
                if reader in self._readers:  # (cancelled before an event came)
                    self._readers.remove(reader)
        event = events.popleft()
        self._bytes = bytes_ahead = self._bytes - event_size(event) if events else 0
        room = self._room
        if (
            room is not None
            and len(events) <= _EVENTS_AHEAD // 2
            and bytes_ahead <= _BYTES_AHEAD // 2
        ):
            self._room = None
            self._host.run_sync_soon(room.set)
        return event

    # ---- the trio side ----------------------------------------------------------

    async def _put(self, event: sa.Event) -> None:
        self._events.append(event)
        self._bytes += event_size(event)
        self._wake_reader()
        while len(self._events) >= _EVENTS_AHEAD or self._bytes >= _BYTES_AHEAD:
            self._room = room = trio.Event()
            try:
                await room.wait()
            except trio.Cancelled:
                # Cut off while its reader is behind (the block left, or the registry's
                # trio run ending): the events it had not taken yet are lost, so a reader
                # that goes on hears that it fell behind, after the events held here; and
                # it must not wake this pump in a trio run that may have ended.
                self._room = None
                self._cut = lagged_error(event.session_id, event.seq)
                raise

    def _end(self, error: BaseException | None) -> None:
        self._ended = True
        self._error = error if error is not None else self._cut
        self._wake_reader()

    def _wake_reader(self) -> None:
        readers = self._readers
        if readers:
            self._readers = []
            for reader in readers:
                if not reader.done():
                    reader.set_result(None)


class _Subscription:
    """``async with`` a trio subscription (or stream) from asyncio."""

    def __init__(
        self,
        host: Host,
        session_id: str,
        open_events: Callable[[], AbstractAsyncContextManager[AsyncIterator[sa.Event]]],
        form: str,
    ) -> None:
        self._host = host
        self._session_id = session_id
        self._open_events = open_events
        self._form = form
        self._stream = EventStream(host)
        self._entered: asyncio.Future[None] = host.loop.create_future()
        self._task: Task | None = None

    async def __aenter__(self) -> EventStream:
        if self._task is not None:
            raise entered_twice(self._session_id, self._form)
        self._task = self._host.start(self._pump)
        try:
            await self._entered
        except BaseException:
            await self._task.aclose()
            raise
        return self._stream

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        await self._task.aclose()

    def __aiter__(self) -> NoReturn:
        raise not_in_block(self._form)

    async def _pump(self, scope: trio.CancelScope) -> None:
        stream, entered = self._stream, self._entered
        error: BaseException | None = None
        try:
            async with self._open_events() as events:
                if not entered.done():
                    entered.set_result(None)
                async for event in events:
                    await stream._put(event)
        except trio.Cancelled:
            raise
        except BaseException as exc:  # to the asyncio reader, as itself
            error = exc
        finally:
            if not entered.done():  # (cancelled before it began: the trio run is ending)
                entered.set_exception(error or ended_error(self._session_id))
            else:
                stream._end(error)


async def _close(close: trio.Event, closed: asyncio.Future[None], task: Task, host: Host) -> None:
    """Close the registry gracefully (its ``close`` set), waiting until it has closed;
    a cancellation meanwhile cuts the grace short."""
    host.run_sync_soon(close.set)
    try:
        await asyncio.shield(closed)
    except asyncio.CancelledError:
        if closed.done():
            raise
        await _cut(closed, task)
        raise


async def _cut(closed: asyncio.Future[None], task: Task) -> None:
    """Shut the registry down at once, without the grace (its trio task cancelled, as a
    cancellation of its block does in trio), waiting until it has; the caller's
    cancellation is what propagates then."""
    await task.aclose()
    if closed.done() and not closed.cancelled():
        closed.exception()  # seen


@asynccontextmanager
async def open_registry(**options: Any) -> AsyncIterator[Registry]:
    """Open a registry from asyncio code; leaving the block shuts it down.

    It takes the arguments of :func:`sessionactors.open_registry` and must be
    entered inside a running asyncio loop. The registry lives in trio's guest
    mode on that loop (started by the first registry of the loop, ended by its
    last). The agents' models, summarizers and tool functions are asyncio code
    and run in asyncio tasks of the loop, except the library's own and those
    marked with :func:`trio_native`. The store is trio code, as under
    ``sessionactors.open_registry``, unless wrapped by :func:`asyncio_store`: then
    its calls run in asyncio tasks of the loop too. Leaving the block shuts the
    registry down as ``sessionactors.open_registry`` does: the accepted turns get
    ``shutdown_grace`` seconds, then every live session is hibernated. A
    cancellation while it shuts down cuts the grace short, and one from outside
    the block while it runs (a timeout around it, its task cancelled, Ctrl-C under
    ``asyncio.run``) shuts it down at once, as if ``shutdown_grace`` were 0, as in
    trio.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "sessionactors.aio.open_registry must be entered in a running asyncio loop "
            "(asyncio.run, uvicorn); under trio (trio.run, hypercorn's trio worker) use "
            "sessionactors.open_registry"
        ) from None
    host = await acquire_host()
    try:
        agents = options.get("agents")
        given: Mapping[str, sa.Agent] = MappingProxyType(
            dict(agents) if isinstance(agents, Mapping) else {}
        )
        if isinstance(agents, Mapping):
            options["agents"] = {
                key: adapt_agent(host, agent) if isinstance(agent, sa.Agent) else agent
                for key, agent in agents.items()
            }
        loop = host.loop
        ready: asyncio.Future[sa.Registry] = loop.create_future()
        closed: asyncio.Future[None] = loop.create_future()
        close = trio.Event()

        async def run(scope: trio.CancelScope) -> None:
            try:
                async with sa.open_registry(**options) as registry:
                    if ready.done():  # the opener stopped waiting: close again at once
                        return
                    ready.set_result(registry)
                    await close.wait()
            except BaseException as exc:
                error: BaseException = exc
                if isinstance(exc, trio.Cancelled):
                    error = RuntimeError("the registry was cancelled")
                if not ready.done():
                    ready.set_exception(error)
                elif not closed.done():
                    closed.set_exception(error)
                if isinstance(exc, trio.Cancelled):
                    raise
            else:
                if not closed.done():
                    closed.set_result(None)

        task = host.start(run)
        try:
            registry = await ready
        except BaseException:
            closed.cancel()  # nobody will wait for the close: it has no error to report
            await task.aclose()
            raise
        try:
            yield Registry(host, registry, given)
        except asyncio.CancelledError:
            # cancelled from outside the block (a timeout around it, its task cancelled,
            # Ctrl-C under asyncio.run): no grace
            await _cut(closed, task)
            raise
        except BaseException:
            await _close(close, closed, task, host)
            raise
        else:
            await _close(close, closed, task, host)
    finally:
        await release_host(host)
