"""open_registry / Registry: names, activation, supervision, hibernation, shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from ._actor import Actor, LeaseHeldError, read_stored, session_task
from ._agent import Agent
from ._cluster import Cluster, start_cluster
from ._codec import dump_info, dump_snapshot, load_info
from ._errors import (
    FencedOutError,
    SessionCrashedError,
    SessionExistsError,
    SessionNotFoundError,
    SessionStoppedError,
    StoreError,
)
from ._history import rewind_end, tool_pairs_intact
from ._hub import Hub, HubConfig
from ._names import validate_name
from ._records import ReviewRequest, SessionInfo, Status, new_id
from ._ref import SessionRef
from ._session import LiveSession
from ._subscription import EventIterator, open_event_iterator
from .stores._base import Store
from .stores._memory import MemoryStore

__all__ = ["Registry", "RegistryConfig", "RegistryStatistics", "open_registry"]

Durability = Literal["turn", "hibernate"]

#: A registry whose live count has fallen to an eighth of a peak at least this
#: high moves new sessions to a fresh generation nursery (see ``_run_generation``).
GENERATION_PEAK = 1024


@attrs.frozen(kw_only=True)
class RegistryConfig:
    """The registry's options (see ``open_registry``)."""

    idle_timeout: float | None = None
    mailbox_size: int = 64
    shutdown_grace: float = 10.0
    max_restarts: int = 3
    restart_window: float = 5.0
    durability: Durability = "turn"
    snapshot_every: int = 1000
    journal_keep_seqs: int = 100_000
    write_bound: float = 30.0
    leases: bool = False
    lease_ttl: float = 30.0
    hub: HubConfig = attrs.field(factory=HubConfig)


@attrs.define
class Counters:
    """The registry's running counters (see ``Registry.statistics``)."""

    spawned: int = 0
    woken: int = 0
    hibernated: int = 0
    idle_hibernations: int = 0
    crashes: int = 0
    restarts: int = 0
    failed: int = 0
    turns_completed: int = 0
    turns_failed: int = 0
    turns_cancelled: int = 0
    leases_lost: int = 0


@attrs.frozen(kw_only=True)
class RegistryStatistics:
    """A snapshot of the registry's counters."""

    live: int
    failed_sessions: int
    subscribers: int
    spawned: int
    woken: int
    hibernated: int
    idle_hibernations: int
    crashes: int
    restarts: int
    failed: int
    turns_completed: int
    turns_failed: int
    turns_cancelled: int
    leases_lost: int


@attrs.define(eq=False, repr=False)
class Registry:
    """Spawns, finds and supervises session actors by name. Made by ``open_registry``."""

    store: Store
    agents: Mapping[str, Agent]
    config: RegistryConfig
    _nursery: trio.Nursery = attrs.field(alias="nursery")
    owner_id: str = attrs.field(factory=lambda: new_id("worker"))
    stats: Counters = attrs.field(factory=Counters)
    #: Where session tasks start: the current generation's nursery, or the registry's
    #: own while there is none (see ``_run_generation``).
    _sessions: trio.Nursery = attrs.field(
        default=attrs.Factory(lambda self: self._nursery, takes_self=True), init=False
    )
    #: Set to close the current generation to new sessions (it ends with its last one).
    _generation_retired: trio.Event | None = attrs.field(default=None, init=False)
    #: A generation's task is scheduled and not yet running.
    _generation_pending: bool = attrs.field(default=False, init=False)
    _live: dict[str, Actor] = attrs.field(factory=dict, init=False)
    _hubs: dict[str, Hub] = attrs.field(factory=dict, init=False)
    _live_peak: int = attrs.field(default=64, init=False)
    _hubs_peak: int = attrs.field(default=64, init=False)
    _failed: dict[str, str] = attrs.field(factory=dict, init=False)
    #: Names being deleted, and by how many calls: no request wakes them meanwhile.
    _deleting: dict[str, int] = attrs.field(factory=dict, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    #: Requests and events across workers (stores with a transport, e.g. RedisStore).
    _cluster: Cluster | None = attrs.field(default=None, init=False)

    def __repr__(self) -> str:
        return f"<Registry live={len(self._live)} store={type(self.store).__name__}>"

    # ---- public ---------------------------------------------------------------

    async def spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """Create a new session and start its actor.

        ``agent`` is a key of the registry's ``agents`` (optional when there is
        one); ``system_prompt`` overrides the agent's for this session.
        Raises SessionExistsError if the name is live or stored.
        """
        validate_name(name)
        self._check_open(name)
        key = self._agent_key(agent, name)
        if name in self._live:
            raise _exists_error(name)
        session = LiveSession.new(name, agent=key, metadata=metadata, system_prompt=system_prompt)
        return await self._create(session)

    async def _create(self, session: LiveSession) -> SessionRef:
        name = session.session_id
        if name in self._live:
            raise _exists_error(name)
        try:
            snapshot = dump_snapshot(session.to_state())
            info = dump_info(session.info())
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"session {name!r} cannot be stored: {exc}; metadata must be plain data "
                "(str keys; str, int, float, bool, None, bytes, lists and dicts)"
            ) from exc
        try:
            await self.store.create(name, snapshot, info)
        except SessionExistsError:  # stored: say what to do in the registry's terms
            raise _exists_error(name) from None
        if name in self._live:  # woken meanwhile by a request racing this spawn
            raise _exists_error(name)
        if self._cluster is not None:
            await self._cluster.reset_events(name)  # a deleted namesake's stream
        actor = Actor(self, name, session)
        try:
            await actor.claim()
        except LeaseHeldError:
            if self._cluster is None:
                raise
            self._cluster.held_elsewhere(name)  # woken on another worker already
            return SessionRef(self, name)
        if name in self._live:
            raise _exists_error(name)
        self._live[name] = actor
        self._live_peak = max(self._live_peak, len(self._live))
        self._start(actor)
        self.stats.spawned += 1
        return SessionRef(self, name)

    async def fork(self, name: str, new_name: str, *, at: str | None = None) -> SessionRef:
        """A new session ``new_name`` with ``name``'s history up to message ``at``
        (all of it if None; a tool call keeps its results), agent, metadata,
        system prompt and summary."""
        validate_name(new_name)
        self._check_open(new_name)
        source = await self._ready(name)
        messages = source.messages
        if at is not None:
            index = source.find(at)
            if index < 0:
                from ._errors import MessageNotFoundError

                raise MessageNotFoundError(
                    f"session {name!r} has no message {at!r}; take ids from ref.history()",
                    session_id=name,
                )
            messages = messages[: rewind_end(messages, index)]
        if not tool_pairs_intact(messages):
            # a call still waits for its result (a review, or a tool running now)
            from ._errors import SessionBusyError

            raise SessionBusyError(
                f"session {name!r} has a tool call without its result yet (a pending review "
                "or a running tool), so its history cannot be forked as it is; fork at an "
                "earlier message, or after the call is answered",
                session_id=name,
            )
        session = LiveSession.new(
            new_name,
            agent=source.agent,
            metadata=source.metadata,
            system_prompt=source.system_prompt,
        )
        session.messages = list(messages)
        session.summary = source.summary
        if messages:
            session.status = Status.IDLE
        return await self._create(session)

    async def pending_reviews(self) -> list[ReviewRequest]:
        """Every pending review of every session, live or stored, oldest first."""
        out: list[ReviewRequest] = []
        for info in await self.sessions():
            if info.pending_reviews:
                out.extend((await self._ready(info.session_id)).reviews.values())
        return sorted(out, key=lambda r: r.created_at)

    def ref(self, name: str) -> SessionRef:
        """A handle to ``name``: no I/O. Its first request wakes the session, or
        raises SessionNotFoundError if it is neither live nor stored."""
        validate_name(name)
        return SessionRef(self, name)

    async def get_or_spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """The session ``name``, spawned with these options if it does not exist."""
        validate_name(name)
        if name in self._live or await self.store.exists(name):
            return SessionRef(self, name)
        try:
            return await self.spawn(
                name, agent=agent, system_prompt=system_prompt, metadata=metadata
            )
        except SessionExistsError:
            return SessionRef(self, name)

    async def delete(self, name: str) -> None:
        """Remove the conversation everywhere: actor, subscribers, store.

        Pending requests fail with SessionNotFoundError, and so do requests
        that come while the deletion runs. The name can be spawned afresh
        afterwards. Raises SessionNotFoundError if there was nothing to delete.
        """
        await self._delete(name)

    async def _delete(self, name: str, *, local: bool = False) -> None:
        validate_name(name)
        self._deleting[name] = self._deleting.get(name, 0) + 1
        try:
            await self._delete_now(name, local=local)
        finally:
            left = self._deleting.pop(name) - 1
            if left:
                self._deleting[name] = left

    async def _delete_now(self, name: str, *, local: bool) -> None:
        actor = self._live.get(name)
        if (
            actor is None
            and self._cluster is not None
            and not local
            and (await self._cluster.call(name, "delete", {}))[0]
        ):
            return  # deleted by the worker that ran it
        if actor is not None:
            actor.deleted = True
            actor.close_mailbox()
            if actor.run_scope is not None:
                actor.run_scope.cancel()
            await self._wait_gone(actor)
        hub = self._hubs.pop(name, None)
        if hub is not None:
            hub.close()
        was_failed = self._failed.pop(name, None) is not None
        existed = await self.store.delete(name)
        if self._cluster is not None:
            await self._cluster.end_events(name)  # ends subscriptions on every worker
        if not (existed or actor is not None or was_failed):
            raise SessionNotFoundError(
                f"session {name!r} does not exist, so there is nothing to delete",
                session_id=name,
            )

    def live(self) -> list[str]:
        """The names of the sessions whose actors are running now."""
        return list(self._live)

    async def sessions(self) -> list[SessionInfo]:
        """A SessionInfo for every session, live or stored, sorted by name."""
        infos: dict[str, SessionInfo] = {}
        for name, blob in await self.store.list_sessions():
            infos[name] = load_info(blob, session_id=name)
        for name, actor in self._live.items():
            if actor.is_ready and actor.load_error is None:
                infos[name] = actor.session.info()
        for name in self._failed:
            if name in infos:
                infos[name] = attrs.evolve(infos[name], status=Status.FAILED)
        return [infos[name] for name in sorted(infos)]

    def statistics(self) -> RegistryStatistics:
        """A frozen snapshot of the registry's counters."""
        s = self.stats
        return RegistryStatistics(
            live=len(self._live),
            failed_sessions=len(self._failed),
            subscribers=sum(h.subscriber_count for h in self._hubs.values())
            + (self._cluster.subscriber_count if self._cluster is not None else 0),
            spawned=s.spawned,
            woken=s.woken,
            hibernated=s.hibernated,
            idle_hibernations=s.idle_hibernations,
            crashes=s.crashes,
            restarts=s.restarts,
            failed=s.failed,
            turns_completed=s.turns_completed,
            turns_failed=s.turns_failed,
            turns_cancelled=s.turns_cancelled,
            leases_lost=s.leases_lost,
        )

    # ---- the actor's host -----------------------------------------------------------

    def _agent_for(self, session: LiveSession) -> Agent:
        key = session.agent
        agent = self.agents.get(key) if key is not None else None
        if agent is None:
            raise LookupError(
                f"session {session.session_id!r} runs agent {key!r}, which this registry does "
                f"not have (it has {sorted(self.agents)}); pass it in open_registry(agents=...)"
            )
        return agent

    def _hub_for(self, session_id: str) -> Hub:
        hub = self._hubs.get(session_id)
        if hub is None:
            hub = self._hubs[session_id] = Hub(session_id, self.config.hub)
            self._hubs_peak = max(self._hubs_peak, len(self._hubs))
            if self._cluster is not None:
                hub.tap = self._cluster.tap_for(session_id)
        return hub

    def _detach(self, actor: Actor) -> None:
        name = actor.session_id
        if self._live.get(name) is actor:
            del self._live[name]
            if len(self._live) * 8 < self._live_peak:
                # far below its peak: give back what a wave of sessions left behind
                if self._live_peak >= GENERATION_PEAK:
                    self._retire_generation()
                self._live_peak = _compact(self._live)
        self._release_hub(name)
        _gone_event(actor).set()

    def _replace(self, old: Actor, new: Actor) -> None:
        if self._live.get(old.session_id) is old:
            self._live[old.session_id] = new
        _gone_event(old).set()  # a waiter may come later (ref.stop after ready())

    def _mark_failed(self, actor: Actor, reason: str) -> None:
        self._failed[actor.session_id] = reason
        self.stats.failed += 1
        self._detach(actor)

    # ---- internals for refs ---------------------------------------------------------

    def _check_open(self, name: str) -> None:
        if self._closing:
            raise SessionStoppedError(
                f"the registry is closed, so session {name!r} takes no requests; "
                "open a registry to continue",
                session_id=name,
            )

    def _activate(self, name: str) -> Actor:
        """The live actor of ``name``, starting one (which loads itself) if needed."""
        actor = self._live.get(name)
        if actor is not None:
            return actor
        validate_name(name)
        self._check_open(name)
        if name in self._deleting:
            raise SessionNotFoundError(
                f"session {name!r} is being deleted, so it takes no requests; spawn it "
                "afresh once the deletion is done",
                session_id=name,
            )
        reason = self._failed.get(name)
        if reason is not None:
            raise SessionCrashedError(
                f"session {name!r} crashed too often and is marked failed ({reason}); fix "
                "the cause, then restart the process or delete the session",
                session_id=name,
            )
        actor = Actor(self, name, None)
        self._live[name] = actor
        self._live_peak = max(self._live_peak, len(self._live))
        self._start(actor)
        return actor

    async def _ready(self, name: str, *, local: bool = False) -> LiveSession:
        """The live session, woken if needed; a stopped one is read from the store.

        A session live on another worker is read from there (unless ``local``).
        """
        cluster = None if local else self._cluster
        for _ in range(100):
            if cluster is not None and cluster.owned_elsewhere(name):
                session = await cluster.read(name)
                if session is not None:
                    return session
            try:
                return await self._activate(name).ready()
            except LeaseHeldError:
                if cluster is None:
                    raise
                cluster.held_elsewhere(name)
            except SessionStoppedError:
                if self._closing:
                    raise
                return await self._stored_session(name)
        raise SessionCrashedError(  # pragma: no cover - a session moving without end
            f"session {name!r} kept moving between workers; try again", session_id=name
        )

    def _closed_error(self, actor: Actor) -> Exception:
        name = actor.session_id
        if actor.load_error is not None:
            return actor.load_error
        if actor.deleted:
            return SessionNotFoundError(f"session {name!r} was deleted", session_id=name)
        if self._closing:
            return SessionStoppedError(
                f"the registry is closing, so session {name!r} takes no requests; "
                "send it again once a registry is open",
                session_id=name,
            )
        if actor.stop_requested:
            return SessionStoppedError(
                f"session {name!r} was stopped; spawn a new session to continue",
                session_id=name,
            )
        if name in self._failed:
            return SessionCrashedError(
                f"session {name!r} crashed too often and is marked failed", session_id=name
            )
        return trio.WouldBlock()  # hibernated or restarted: try again

    async def _after_closed_mailbox(self, actor: Actor) -> None:
        error = self._closed_error(actor)
        if not isinstance(error, trio.WouldBlock):
            raise error
        await trio.lowlevel.checkpoint()

    async def _wait_gone(self, actor: Actor) -> None:
        await _gone_event(actor).wait()

    async def _stop(self, actor: Actor) -> bool:
        """Stop ``actor``; False if it left without stopping (it hibernated, or was
        replaced after a crash, first)."""
        actor.stop_requested = True
        actor.close_mailbox()
        await self._wait_gone(actor)
        if actor.stop_error is not None:  # the stop did not happen (see session_task)
            raise actor.stop_error
        if actor.deleted:
            raise SessionNotFoundError(
                f"session {actor.session_id!r} was deleted while it was being stopped",
                session_id=actor.session_id,
            )
        return actor.session.status is Status.STOPPED

    async def _open_subscription(self, name: str, after: int | None) -> EventIterator:
        validate_name(name)
        if self._cluster is not None:  # from the session's event stream, wherever it runs
            return await self._cluster.open_subscription(name, after)
        hub = self._hub_for(name)
        iterator = await open_event_iterator(
            name,
            hub,
            self.store,
            after,
            lambda: self._release_hub(name),
            lambda: self._live[name].unsaved if name in self._live else (),
        )
        if name not in self._live:
            try:
                stopped = (await self._stored_session(name)).status is Status.STOPPED
            except BaseException:
                iterator.close()
                raise
            if stopped:
                iterator.close()
        return iterator

    async def _stored_session(self, name: str) -> LiveSession:
        """The session's state read from the store, without waking it."""
        session, _ = await read_stored(self.store, name)
        return session

    def _release_hub(self, name: str) -> None:
        hub = self._hubs.get(name)
        if hub is not None and hub.subscriber_count == 0 and name not in self._live:
            del self._hubs[name]
            if len(self._hubs) * 8 < self._hubs_peak:
                self._hubs_peak = _compact(self._hubs)

    def _agent_key(self, agent: str | None, name: str) -> str:
        if agent is None:
            if len(self.agents) == 1:
                return next(iter(self.agents))
            raise ValueError(
                f"registry has {len(self.agents)} agents ({sorted(self.agents)}); say which "
                f"one session {name!r} runs with spawn({name!r}, agent=...)"
            )
        if agent not in self.agents:
            raise ValueError(
                f"session {name!r} asks for agent {agent!r}, but the registry's agents are "
                f"{sorted(self.agents)}"
            )
        return agent

    async def _shutdown(self) -> None:
        """No new requests; accepted turns get ``shutdown_grace``; then hibernate all."""
        self._closing = True
        for actor in list(self._live.values()):
            actor.close_mailbox()
        with trio.move_on_after(self.config.shutdown_grace):
            await self._wait_all_gone()
        for actor in list(self._live.values()):
            actor.abort_reason = "closing"
            actor.cancel_turn()
        with trio.move_on_after(self.config.write_bound):
            await self._wait_all_gone()

    async def _renew_leases(self) -> None:
        """Keep the leases of live sessions; stop at once a session whose lease is lost."""
        ttl = self.config.lease_ttl
        while True:
            await trio.sleep(ttl / 3)
            for actor in list(self._live.values()):
                lease = actor.lease
                if lease is None:
                    continue
                try:
                    held = await self.store.renew(actor.session_id, lease, ttl)
                except StoreError:
                    continue  # try again next round; the store decides at expiry
                if not held and actor.lease is lease:
                    self.stats.leases_lost += 1
                    actor.lease = None
                    actor.kill(
                        FencedOutError(
                            f"session {actor.session_id!r} lost its lease (another worker "
                            "took it over); this worker stopped it, so send the request "
                            "again: it goes to the session's new owner",
                            session_id=actor.session_id,
                        )
                    )

    # ---- generations: the nurseries that session tasks run in -------------------------

    def _start(self, actor: Actor) -> None:
        if self._sessions is self._nursery:
            self._open_generation()
        self._sessions.start_soon(session_task, self, actor, name=f"session {actor.session_id!r}")

    def _open_generation(self) -> None:
        """Schedule a new generation; sessions start in the registry's nursery until it runs."""
        if not self._generation_pending and not self._closing:
            self._generation_pending = True
            self._nursery.start_soon(self._run_generation, name="sessions generation")

    def _retire_generation(self) -> None:
        """Close the current generation to new sessions: it ends with its last session,
        and the next session opens a new one.

        A nursery's set of tasks and its cancel status's set of children keep the size
        of their peak (CPython never shrinks a set when items leave it): after a wave of
        100,000 sessions that hibernate, 8 MB. Only a nursery that ends frees them. The
        next generation is opened by the next session that starts, not here, so that
        nothing long-lived is allocated while a wave of sessions is leaving.
        """
        retired = self._generation_retired
        if retired is not None:
            self._generation_retired = None
            self._sessions = self._nursery
            retired.set()

    async def _run_generation(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Host the sessions that start until the generation retires, then end with them.

        A crash is handled inside its session's task; an exception that escapes one
        still cancels every session and leaves the registry, in the shape it would have
        from the registry's own nursery.
        """
        retired = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                self._retire_generation()  # at most one generation takes sessions
                self._sessions, self._generation_retired = nursery, retired
                self._generation_pending = False
                task_status.started()
                try:
                    await retired.wait()
                finally:
                    if self._generation_retired is retired:  # cancelled
                        self._generation_retired = None
                        self._sessions = self._nursery
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def _wait_all_gone(self) -> None:
        while self._live:
            await self._wait_gone(next(iter(self._live.values())))


def _gone_event(actor: Actor) -> trio.Event:
    """The event set once ``actor`` is gone, made when first needed (most never are)."""
    if actor.done is None:
        actor.done = trio.Event()
    return actor.done


def _compact(table: dict[str, Any]) -> int:
    """Shrink a dict that is far below its peak size, in place; its new peak.

    CPython never shrinks a dict as entries leave, so a registry that held 100,000
    sessions would keep their tables. The dict object stays the same one: a new
    object made while a wave of sessions leaves would be allocated among the
    wave's memory and keep a whole allocator arena (1 MiB) alive after it; an empty
    dict gives its table back and allocates nothing.
    """
    if table:
        entries = dict(table)  # sized for what is left
        table.clear()
        table.update(entries)  # takes a copy of that table
    else:
        table.clear()
    return max(len(table), 64)


def _exists_error(name: str) -> SessionExistsError:
    return SessionExistsError(
        f"session {name!r} already exists; use registry.ref({name!r}) to talk to it",
        session_id=name,
    )


@asynccontextmanager
async def open_registry(
    *,
    store: Store | None = None,
    agents: Mapping[str, Agent] | None = None,
    idle_timeout: float | None = None,
    mailbox_size: int = 64,
    shutdown_grace: float = 10.0,
    max_restarts: int = 3,
    restart_window: float = 5.0,
    durability: Durability = "turn",
    replay_events: int = 1000,
    replay_bytes: int = 1 << 20,
    subscriber_buffer: int = 1000,
    snapshot_every: int = 1000,
    journal_keep_seqs: int = 100_000,
    leases: bool | None = None,
    lease_ttl: float = 30.0,
    worker_id: str | None = None,
) -> AsyncIterator[Registry]:
    """Open a registry of session actors; leaving the block shuts it down.

    - ``store``: where sessions are kept (default: a new ``MemoryStore``).
      The registry closes it on exit; stores reopen on next use.
    - ``agents``: name -> Agent; names let a session find its agent after a restart.
    - ``idle_timeout``: seconds without a request before a session hibernates
      (``None``: never).
    - ``mailbox_size``: requests a session queues before senders wait.
    - ``shutdown_grace``: seconds that accepted turns may keep running on exit.
    - ``max_restarts`` crashes within ``restart_window`` seconds are restarted;
      one more marks the session failed.
    - ``durability``: ``"turn"`` (default) returns a reply only once the turn is
      durable in the store; ``"hibernate"`` writes only on hibernation and exit,
      so a process crash loses the turns since the last snapshot.
    - ``replay_events`` / ``replay_bytes``: the per-session replay ring's bounds;
      ``subscriber_buffer``: events a subscriber may fall behind before it is ended.
    - ``snapshot_every``: the fewest journaled events between automatic snapshots
      (a snapshot also waits until the journal outweighs the last one in bytes);
      ``journal_keep_seqs``: how far back (in seq) the journal is kept for replay.
    - ``leases``: whether a live session holds its lease in the store, so that at
      most one worker runs it. Default: yes for stores shared by several workers
      (``RedisStore``), no for ``MemoryStore`` and ``SQLiteStore`` (pass
      ``leases=True`` when several processes share one SQLite file).
      ``lease_ttl``: seconds a lease lasts unless renewed (renewed every third of
      it); a worker that dies loses its leases after ``lease_ttl``. With a store that
      connects workers (``RedisStore``), a request for a session live on another
      worker goes to that worker and its answer comes back (a turn with an
      ``idempotency_key`` is sent again to the next owner if that worker dies), and
      ``subscribe()`` receives the session's events wherever it runs.
    - ``worker_id``: this worker's identity in leases (default: a fresh one). A
      worker restarted with the same id takes its sessions back at once instead
      of waiting for its old leases to expire.
    """
    if agents is None or not agents:
        raise ValueError("open_registry needs agents={name: Agent(...)}, at least one")
    for key, value in agents.items():
        if not isinstance(value, Agent):
            raise TypeError(f"agents[{key!r}] must be an Agent, not {type(value).__name__}")
    if durability not in ("turn", "hibernate"):
        raise ValueError(f"durability must be 'turn' or 'hibernate', not {durability!r}")
    if mailbox_size < 1:
        raise ValueError(f"mailbox_size must be at least 1, not {mailbox_size}")
    if idle_timeout is not None and idle_timeout <= 0:
        raise ValueError(f"idle_timeout must be positive or None, not {idle_timeout}")
    config = RegistryConfig(  # leases settled below, once the store is known
        idle_timeout=idle_timeout,
        mailbox_size=mailbox_size,
        shutdown_grace=shutdown_grace,
        max_restarts=max_restarts,
        restart_window=restart_window,
        durability=durability,
        snapshot_every=snapshot_every,
        journal_keep_seqs=journal_keep_seqs,
        leases=bool(leases),
        lease_ttl=lease_ttl,
        hub=HubConfig(
            replay_events=replay_events,
            replay_bytes=replay_bytes,
            subscriber_buffer=subscriber_buffer,
        ),
    )
    the_store: Store = store if store is not None else MemoryStore()
    if leases is None:
        config = attrs.evolve(config, leases=bool(getattr(the_store, "shared_by_workers", False)))
    if worker_id is not None and not worker_id:
        raise ValueError("worker_id must be a non-empty string or None")
    if lease_ttl <= 0:
        raise ValueError(f"lease_ttl must be positive, not {lease_ttl}")
    try:
        async with trio.open_nursery() as nursery:
            registry = Registry(
                store=the_store, agents=dict(agents), config=config, nursery=nursery
            )
            if worker_id is not None:
                registry.owner_id = worker_id
            registry._generation_pending = True
            await nursery.start(registry._run_generation, name="sessions generation")
            if config.leases:
                nursery.start_soon(registry._renew_leases, name="lease renewal")
                registry._cluster = await start_cluster(registry, nursery)
            try:
                yield registry
            finally:
                await registry._shutdown()
                if registry._cluster is not None:
                    await registry._cluster.aclose()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(config.write_bound):
            await the_store.aclose()
