"""open_registry / Registry: the public face of the sessions of one process.

The registry names, spawns, lists and deletes sessions; its refs send every
request through the dispatcher (``_dispatch``), which serves it from the local
table (``_sessions``) or, through the router seam, at the worker that runs it.
"""

from __future__ import annotations

import copy
import datetime
import functools
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ._agent import Agent
from ._config import Durability, RegistryConfig, make_config
from ._dispatch import Dispatcher
from ._errors import (
    Advice,
    AdviceKind,
    InvalidSessionNameError,
    MessageNotFoundError,
    SessionCrashedError,
    SessionExistsError,
    SessionNotFoundError,
    SnapshotError,
    StoreError,
    advised,
    shown,
)
from ._final import NoPublicConstructor
from ._history import check_before_open_turn, check_copyable, rewind_end
from ._metadata import check_metadata
from ._names import redact, validate_name
from ._reading import describe_stored, is_damaged, list_stored, read_session
from ._records import (
    ReviewRequest,
    SessionInfo,
    SessionState,
    Status,
    check_printable,
    check_unicode,
    new_id,
)
from ._ref import SessionRef, check_text, check_type
from ._router import RoutingStore
from ._session import LiveSession, new_state
from ._sessions import Sessions
from ._telemetry import Telemetry, guarded
from .stores._base import Store
from .stores._memory import MemoryStore

__all__ = ["Registry", "RegistryStatistics", "closed", "create_session", "open_registry"]

log = logging.getLogger("sessionactors")


def closed(registry: Registry) -> bool:
    """Whether ``registry`` takes no more requests: its block is ending, or has ended."""
    return registry._sessions.closing


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
    #: requests refused because their session's mailbox was full (``MailboxFullError``)
    requests_refused: int = 0
    #: sessions woken after an unclean stop: the process that ran them last (another
    #: process, or this one before a lease it lost) stopped without storing them
    #: (``kill -9``, a crash, a lapsed lease), so the turns it had accepted and not
    #: stored are lost; each is logged as it wakes, at WARNING (past ten in a minute at
    #: DEBUG, and counted in one WARNING as the minute ends); a restart after a crash
    #: in this process is counted in ``restarts`` instead
    unclean_wakes: int = 0
    #: live sessions whose turn is under way now (a turn waiting on a review is not):
    #: a count that stays up while ``turns_*`` do not move shows turns that hang
    turns_running: int = 0


class Registry(metaclass=NoPublicConstructor):
    """Spawns, finds and supervises session actors by name. Made by ``open_registry``."""

    _made_by = "open one with `async with sessionactors.open_registry(...) as registry:`"

    __slots__ = ("_dispatcher", "_sessions")

    def __init__(self, sessions: Sessions, dispatcher: Dispatcher) -> None:
        self._sessions = sessions
        self._dispatcher = dispatcher

    def __repr__(self) -> str:
        shown = f"<Registry live={len(self._sessions.live)} store={type(self.store).__name__}"
        return f"{shown} closed>" if closed(self) else f"{shown}>"

    @property
    def store(self) -> Store:
        """Where this registry keeps its sessions."""
        return self._sessions.store

    @property
    def agents(self) -> Mapping[str, Agent]:
        """The agents sessions run with, by name."""
        return self._sessions.agents

    @property
    def config(self) -> RegistryConfig:
        """The registry's options, as validated by ``open_registry``."""
        return self._sessions.config

    @property
    def worker_id(self) -> str:
        """This registry's identity in leases."""
        return self._sessions.worker_id

    def _ref(self, name: str) -> SessionRef:
        return SessionRef._create(self._dispatcher, name)

    # ---- sessions -------------------------------------------------------------------

    async def spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """Create a new session: it is stored at once, and its actor starts with its
        first request (until then it holds no task and no memory here).

        ``agent`` is a key of the registry's ``agents`` (optional when there is
        one; any name in a registry without agents, which stores the session for
        a registry with that agent to run); ``system_prompt`` overrides the
        agent's for this session.
        ``metadata`` is plain data (as for ``SessionRef.set_metadata``) of at most
        ``MAX_METADATA_BYTES`` (64 KiB) encoded: ids, labels and flags, not documents.
        Raises SessionExistsError if the name is live or stored, and TypeError or
        ValueError naming the session and what is wrong (a ``system_prompt`` longer
        than a message may be, 1,048,576 characters, metadata over its limit, or
        metadata the store cannot hold), before anything is stored.
        """
        validate_name(name)
        self._sessions.check_open(name)
        key = self._agent_key(agent, name)
        checked = _checked_options(name, system_prompt, metadata)
        return await self._spawn_checked(name, key, system_prompt, checked)

    async def _spawn_checked(
        self, name: str, key: str, system_prompt: str | None, metadata: dict[str, Any] | None
    ) -> SessionRef:
        """Store a new session of options checked already (``_checked_options``)."""
        state = new_state(name, agent=key, metadata=metadata, system_prompt=system_prompt)
        return await self._start_session(state)

    async def _start_session(self, state: SessionState) -> SessionRef:
        await self._sessions.create(state)
        return self._ref(state.session_id)

    async def fork(self, name: str, new_name: str, *, at: str | None = None) -> SessionRef:
        """A new session ``new_name`` with ``name``'s history up to message ``at``
        (all of it if None; a tool call keeps its results), agent, metadata,
        system prompt and summary.

        Raises SessionBusyError if the fork would hold the message of a turn under
        way (or waiting on a review) without its reply: fork at an earlier message,
        or after the turn ends."""
        validate_name(new_name)
        if at is not None:
            check_type(name, "at", at, str)
        self._sessions.check_open(new_name)
        source = await self._dispatcher.read(name)
        messages = list(source.messages)
        if at is not None:
            index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].id == at), -1)
            if index < 0:
                raise MessageNotFoundError(
                    f"session {name!r} has no message {shown(at)}; take ids from ref.history()",
                    session_id=name,
                )
            messages = messages[: rewind_end(messages, index)]
        check_copyable(
            name,
            messages,
            "its history cannot be forked as it is",
            "fork at an earlier message, or after the call is answered",
        )
        check_before_open_turn(name, source.messages, source.open_turn, len(messages))
        state = new_state(
            new_name,
            agent=source.agent,
            metadata=source.metadata,
            system_prompt=source.system_prompt,
        )
        state = attrs.evolve(
            state,
            messages=tuple(messages),
            summary=source.summary,
            status=Status.IDLE if messages else Status.NEW,
        )
        return await self._start_session(state)

    def ref(self, name: str) -> SessionRef:
        """A handle to ``name``: no I/O. Its first request wakes the session, or
        raises SessionNotFoundError if it is neither live nor stored."""
        validate_name(name)
        return self._ref(name)

    async def get_or_spawn(
        self,
        name: str,
        *,
        agent: str | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionRef:
        """The session ``name``, spawned with these options if it does not exist.

        An existing session is returned as it is (its system prompt and metadata
        unchanged), but one that runs another agent than ``agent`` (when given)
        raises SessionExistsError: a session keeps the agent it was spawned with.
        ``system_prompt`` and ``metadata`` are checked as ``spawn`` checks them
        whether or not the session exists: what spawn would refuse is refused.
        """
        validate_name(name)
        wanted = None if agent is None else self._agent_key(agent, name)
        checked = _checked_options(name, system_prompt, metadata)  # (whichever way it goes)
        actor = self._sessions.live.get(name)
        # (an actor still loading may be a read of a name that is not stored: spawn
        # waits for it to find nothing)
        found = actor is not None and actor.is_ready
        if not found:
            with self._sessions.store_wait(name):
                found = await self.store.exists(name)
        if found:
            return await self._existing(name, wanted)
        try:
            self._sessions.check_open(name)
            key = self._agent_key(agent, name)
            return await self._spawn_checked(name, key, system_prompt, checked)
        except SessionExistsError:
            return await self._existing(name, wanted)

    async def _existing(self, name: str, agent: str | None) -> SessionRef:
        """get_or_spawn's ref to the existing session ``name``, which must run ``agent``
        (any, if None)."""
        if agent is not None:
            actor = self._sessions.live.get(name)
            if actor is not None and actor.is_ready:  # (a session's agent never changes)
                have = actor.session.agent
            else:
                have = (await self._dispatcher.read(name)).agent
            if have != agent:
                asked = shown(agent)
                raise advised(
                    SessionExistsError,
                    f"session {name!r} already exists and runs agent {have!r}, not "
                    f"{asked}; a session keeps its agent: ",
                    Advice(kind=AdviceKind.TALK_TO_IT),
                    f", or choose another name for a session of agent {asked}",
                    session_id=name,
                )
        return self._ref(name)

    async def delete(self, name: str) -> None:
        """Remove the conversation everywhere: actor, subscribers, store.

        Pending requests fail with SessionNotFoundError, and so do requests
        and subscriptions that come while the deletion runs; open subscriptions,
        on every worker, raise SessionNotFoundError after their last event, saying
        that the session was deleted. The name can be spawned afresh afterwards.
        On a SQLiteStore, what the session held is gone from the file and its
        ``-wal`` when this returns (see the store). Raises
        SessionNotFoundError if there was nothing to delete, and LeaseHeldError
        (changing nothing) for a session live in another process that this
        registry does not route to (a SQLite file shared with leases): delete it
        through that process, or once it hibernates the session.
        """
        await self._dispatcher.delete(name)

    def live(self) -> list[str]:
        """The names of the sessions whose actors are running now."""
        return list(self._sessions.live)

    async def sessions(
        self,
        *,
        status: Status | str | None = None,
        metadata: Mapping[str, Any] | None = None,
        limit: int | None = None,
        after: str | None = None,
        active_before: datetime.datetime | None = None,
    ) -> list[SessionInfo]:
        """SessionInfos of the stored sessions, newest activity first.

        The order: by ``updated_at`` (the time of the last message or metadata
        change the store has recorded), newest first; sessions of the same time by
        name, descending. ``status`` (a ``Status`` or its value, ``"idle"``) keeps
        the sessions in that status, ``metadata`` those whose metadata has every
        key given with an equal value. ``limit`` returns at most that many;
        ``after=name`` continues after that session (pass the last name of the
        previous page), and raises ``SessionNotFoundError`` if it is not stored.
        A session that becomes active while pages are read moves to the front:
        list again from the start to see it. One call lists a session once, even
        if it moved while the call read the store.

        ``active_before`` (an aware datetime) keeps the sessions whose
        ``updated_at`` is before it, the sessions idle since then, in the same order
        and paged with ``after=`` alike: what a retention job deletes
        (``active_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=90)``).
        A naive datetime raises ``ValueError``, another type ``TypeError``, before
        the store is read. On a store that starts a page at an activity time
        (``IdlePageStore``: memory, SQLite, Redis) such a page costs about what the
        first page of the listing does, however many sessions were active since; a
        ``PagedStore`` without ``list_idle_page`` gives the same answer, but its pages
        of the sessions active since are read first, and left out.

        Stores that list a page at a time (``PagedStore``: memory, SQLite, Redis)
        are read in pages, so a page costs the same however many sessions are
        stored; a filter reads pages until it has ``limit`` matches. A store with
        only ``list_sessions`` is read whole on every call. Sessions live in this
        registry are described as they are now (a running one as ``running``, one
        that crashed past its restart intensity as ``failed``); the others as
        stored, by what they wait for: ``waiting`` while a review is pending (after
        a hibernation or a restart too: ``status="waiting"`` finds every session
        that waits for a person), ``running`` for a turn that a process left open
        when it died (the next request or subscription resumes it), else
        the status of their last durable write (``idle``, ``hibernated``: see
        ``Status``). On a store that other processes run sessions of too (``leases``:
        Redis, a SQLite file opened ``shared=True``) every session is described as
        stored, those live here included, so that the listing reads the same on
        every worker (behind a load balancer, whichever answers): a turn under way
        shows once it ends (with ``durability="turn"``), as ``sessions list`` shows
        it; ``ref.state()`` asks the worker that runs the session for its status
        now. A session whose
        stored description (the copy of its status, size and metadata kept for
        listings) cannot be read is listed as its history says, read as
        ``read_session`` reads it, with a WARNING (its next write puts the
        description right); one whose history cannot be read either is listed with
        status ``FAILED`` and logged, so one bad record never fails the listing;
        one whose stored name
        is not UTF-8 (damage in the store's file) names no session a request can
        reach: it is left out, with a WARNING that says how to remove it.

        Each SessionInfo carries the session's whole metadata, so a page costs
        what its sessions' metadata weighs: at most ``MAX_METADATA_BYTES`` each (see
        ``SessionRef.set_metadata``).
        """
        with self._sessions.store_wait(None):
            return await list_stored(
                self.store,
                status=status,
                metadata=metadata,
                limit=limit,
                after=after,
                active_before=active_before,
                # (where other workers run sessions too, as every one of them lists it)
                describe=describe_stored if self.config.leases else self._describe,
            )

    def _describe(self, name: str, blob: bytes) -> SessionInfo:
        """The listing's SessionInfo of ``name``: as it is live here, else as stored."""
        sessions = self._sessions
        actor = sessions.live.get(name)
        if actor is not None and actor.is_ready and actor.load_error is None:
            info = actor.session.info()
            if info.metadata:  # handed out: changing it must change nothing here
                info = attrs.evolve(info, metadata=copy.deepcopy(info.metadata))
        else:
            info = describe_stored(name, blob)
        if sessions.is_failed(name):
            info = attrs.evolve(info, status=Status.FAILED)
        return info

    async def pending_reviews(self) -> list[ReviewRequest]:
        """Every pending review of every session, live or stored, oldest first.

        A session deleted while they are gathered is left out; one whose state
        cannot be read is logged and left out: neither fails the others.
        """
        out: list[ReviewRequest] = []
        # every session in the store's own order: no sorting, no paging
        for name, blob in await self.store.list_sessions():
            if is_damaged(name):  # (no session can be reached under it)
                continue
            read: Callable[[str], Awaitable[SessionState]] = self._dispatcher.read
            try:
                waits = self._describe(name, blob).pending_reviews > 0
            except SnapshotError:  # its listing entry is unreadable: its history tells
                # (read, not woken: a turn left open would run on)
                waits, read = True, functools.partial(read_session, self.store)
            if waits:
                try:
                    out.extend((await read(name)).reviews)
                except SessionNotFoundError:
                    continue  # deleted since it was listed: it waits on nothing now
                except (SnapshotError, SessionCrashedError, InvalidSessionNameError) as exc:
                    # its own fault only
                    log.warning("pending reviews of session %r are unreadable: %s", name, exc)
        return sorted(out, key=lambda r: r.created_at)

    def statistics(self) -> RegistryStatistics:
        """A frozen snapshot of the registry's counters.

        It may be called from another thread (a metrics exporter's, such as
        OpenTelemetry's periodic reader or a Prometheus collector): there
        ``failed_sessions`` also counts the sessions whose failure mark has lapsed
        (their ``retry_after`` passed) while no request has come for them yet.
        """
        sessions = self._sessions
        s = sessions.stats
        router = self._dispatcher.router
        marked = list(sessions.failed)  # (one step: the registry's thread may change it)
        actors = list(sessions.live.values())  # (the same)
        try:
            failed_sessions = sum(1 for name in marked if sessions.is_failed(name))
        except RuntimeError:  # not in the registry's trio thread: no clock to lapse marks by
            failed_sessions = len(marked)
        return RegistryStatistics(
            live=len(sessions.live),
            failed_sessions=failed_sessions,
            subscribers=sessions.subscriber_count
            + (router.subscriber_count if router is not None else 0),
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
            requests_refused=s.requests_refused,
            unclean_wakes=s.unclean_wakes,
            turns_running=sum(1 for actor in actors if actor.running),
        )

    def _agent_key(self, agent: str | None, name: str) -> str:
        agents = self._sessions.agents
        if not agents:  # a registry that manages sessions: any agent name, run elsewhere
            if isinstance(agent, str) and agent:
                return agent
            raise ValueError(
                f"registry has no agents, so say which agent session {name!r} will run "
                f"with: spawn({name!r}, agent='support'); a registry opened with that "
                "agent runs its turns"
            )
        if agent is None:
            if len(agents) == 1:
                return next(iter(agents))
            raise ValueError(
                f"registry has {len(agents)} agents ({sorted(agents)}); say which "
                f"one session {name!r} runs with spawn({name!r}, agent=...)"
            )
        if not isinstance(agent, str) or agent not in agents:
            asked = shown(agent) if isinstance(agent, str) else f"{agent!r:.60}"
            raise ValueError(
                f"session {name!r} asks for agent {asked}, but the registry's agents are "
                f"{sorted(agents)}; name one of them (agent={min(agents)!r}), or add "
                f"{asked} to open_registry(agents=...)"
            )
        return agent


def _checked_options(name: str, system_prompt: object, metadata: object) -> dict[str, Any] | None:
    """The metadata of a new session ``name``, checked (``check_metadata``), if its
    ``system_prompt`` and ``metadata`` can be stored; else TypeError or ValueError
    naming the session and what is wrong."""
    if system_prompt is not None:  # (as long as a message may be)
        check_text(name, system_prompt, "system_prompt")
    return None if metadata is None else check_metadata(name, metadata)


async def create_session(registry: Registry, state: SessionState) -> SessionRef:
    """Store ``state`` whole as a new session, as ``registry.spawn`` stores a new one
    (the command line's import): SessionExistsError if the name is live or stored."""
    name = state.session_id
    validate_name(name)
    registry._sessions.check_open(name)
    return await registry._start_session(LiveSession(state).to_state())


@asynccontextmanager
async def _unwrapped() -> AsyncIterator[None]:
    """A single exception out of the registry's nursery comes out as itself.

    The block's body runs inside the nursery, so an error raised there (or by a
    task of the registry) arrives wrapped in an ExceptionGroup; only failures that
    really happened together stay grouped, as trio-websocket does for its
    nursery-shaped context managers.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        exc = group.exceptions[0]  # (a group the block raised comes out as that group)
        try:
            raise exc from exc.__cause__  # the group is no context of its own
        finally:
            del exc, group


#: What the open registries without leases write (a store's ``writes_to``, such as
#: a file's path, or the store object's id): another registry on one of them would
#: run its sessions too, and the two would overwrite each other.
_STORES_IN_USE: set[tuple[str, object]] = set()


def _store_key(store: Store) -> tuple[str, object]:
    """What ``store`` writes: its ``writes_to`` if it says (two objects of one file are
    one store), else the object itself."""
    place = getattr(store, "writes_to", None)
    return ("id", id(store)) if place is None else ("place", place)


def _claim_store(store: Store) -> tuple[str, object]:
    """Mark what ``store`` writes as used by an open registry without leases (its key,
    for the close to free: worked out once, as a path may resolve otherwise later)."""
    key = _store_key(store)
    if key in _STORES_IN_USE:
        place = "" if key[0] == "id" else f" of {key[1]!r}"
        raise ValueError(
            f"open_registry: this {type(store).__name__}{place} is already used by an open "
            "registry without leases, which runs its sessions; two would overwrite each "
            "other's writes. Open one registry per store, or leases=True in every registry "
            "that shares it"
        )
    _STORES_IN_USE.add(key)
    return key


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
    journal_keep_events: int = 100_000,
    journal_keep_seqs: int | None = None,
    leases: bool | None = None,
    lease_ttl: float = 30.0,
    worker_id: str | None = None,
    telemetry: Telemetry | None = None,
) -> AsyncIterator[Registry]:
    """Open a registry of session actors; leaving the block shuts it down.

    The shutdown takes no new requests, gives accepted turns ``shutdown_grace``,
    then hibernates every live session. A cancellation from outside the block
    shuts it down at once (no grace: the turn in flight is cut), still writing
    what was answered before the cancellation goes on.

    - ``store``: where sessions are kept (default: a new ``MemoryStore``).
      The registry closes it on exit; stores reopen on next use. One open
      registry writes a store at a time, unless each has ``leases=True``
      (a second one without raises ``ValueError``; two ``SQLiteStore`` objects of
      one file are one store).
    - ``agents``: name -> Agent; names let a session find its agent after a restart.
      Only turns need them: without agents (the default), the registry reads and
      manages the store (listings, state and history, metadata, deletes, spawns
      that name their agent), and a turn raises ``AgentNotFoundError``.
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
      ``journal_keep_events``: how many journaled events, at least, are kept for
      ``subscribe(after=...)`` replay when a snapshot compacts the journal (counted
      in events, so a wake's seq jump trims nothing early);
      ``journal_keep_seqs`` is its older name.
    - ``leases``: whether a live session holds its lease in the store, so that at
      most one worker runs it. Default: yes for stores shared by several workers
      (``RedisStore``), no for ``MemoryStore`` and ``SQLiteStore`` (pass
      ``leases=True`` when several processes share one SQLite file).
      ``lease_ttl``: seconds a lease lasts unless renewed (renewed every third of
      it); a worker that dies loses its leases after ``lease_ttl``, and one whose
      renewals the store does not answer for longer than ``lease_ttl`` stops those
      sessions (their leases may have lapsed there: its requests in flight raise
      ``FencedOutError``).
      With a store that connects workers (``RedisStore``), a request for a session
      live on another worker goes to that worker and its answer comes back (a turn
      with an ``idempotency_key`` is sent again to the next owner if that worker
      dies), and ``subscribe()`` receives the session's events wherever it runs.
    - ``worker_id``: this worker's identity in leases (default: a fresh one). A
      worker restarted with the same id takes its sessions back at once instead
      of waiting for its old leases to expire. On a store that connects workers
      (``RedisStore``), opening a registry under the id of another worker that is
      still live there raises ``StoreConfigurationError``.
    - ``telemetry``: what the registry reports its turns, model and tool calls,
      store writes and cut-off subscribers to (``sessionactors.otel.OpenTelemetry()``
      for OpenTelemetry traces and metrics); default ``None``: nothing is reported.

    Every option is checked here: a wrong type or range raises ``TypeError`` or
    ``ValueError`` naming it, before anything starts.
    """
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise RuntimeError(
            "sessionactors.open_registry runs under trio (trio.run, hypercorn's trio worker); "
            "from asyncio (asyncio.run, FastAPI, uvicorn) use sessionactors.aio.open_registry"
        ) from None
    if agents is None:
        agents = {}
    if not isinstance(agents, Mapping):
        raise TypeError(f"open_registry: agents must be a mapping, not {type(agents).__name__}")
    for key, value in agents.items():
        if not isinstance(key, str):
            raise TypeError(
                f"open_registry: agents' names must be str, not {type(key).__name__} ({key!r:.60})"
            )
        if not key:
            raise ValueError("open_registry: agents' names must be non-empty; name each agent")
        check_unicode(key, f"open_registry: the name of agents[{key!r}]")
        check_printable(key, f"open_registry: the name of agents[{key!r}]")
        if not isinstance(value, Agent):
            raise TypeError(f"agents[{key!r}] must be an Agent, not {type(value).__name__}")
    config = make_config(
        idle_timeout=idle_timeout,
        mailbox_size=mailbox_size,
        shutdown_grace=shutdown_grace,
        max_restarts=max_restarts,
        restart_window=restart_window,
        durability=durability,
        replay_events=replay_events,
        replay_bytes=replay_bytes,
        subscriber_buffer=subscriber_buffer,
        snapshot_every=snapshot_every,
        journal_keep_events=journal_keep_events if journal_keep_seqs is None else journal_keep_seqs,
        leases=leases,
        lease_ttl=lease_ttl,
        worker_id=worker_id,
    )
    if telemetry is not None and not isinstance(telemetry, Telemetry):
        raise TypeError(
            "open_registry: telemetry must be a sessionactors.Telemetry (such as "
            f"sessionactors.otel.OpenTelemetry()), not {type(telemetry).__name__}"
        )
    if store is not None and (isinstance(store, type) or not isinstance(store, Store)):
        if isinstance(store, type):  # (a class has the methods too)
            hint = f"{store.__name__} is the class; make one: {store.__name__}(...)"
        elif isinstance(store, str | bytes | os.PathLike):
            # (every form of a URL shown with *** for its password, bytes too)
            text = os.fspath(store)
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            given = repr(redact(text))
            if not isinstance(store, str):
                given = f"{type(store).__name__} {given}"
            hint = (
                f"{given} is a URL or a path; build the store yourself, "
                "e.g. sa.SQLiteStore('sessions.db') or RedisStore('redis://host:6379/0')"
            )
        else:
            methods = [n for n, v in vars(Store).items() if callable(v) and n[0] != "_"]
            missing = sorted(n for n in methods if not callable(getattr(store, n, None)))
            hint = f"{type(store).__name__} lacks {', '.join(missing)}"
        raise TypeError(
            "open_registry: store must be a store such as sa.SQLiteStore(path), "
            f"sa.MemoryStore() or sessionactors.stores.RedisStore(url): {hint}"
        )
    if telemetry is not None:
        telemetry = guarded(telemetry)
    the_store: Store = store if store is not None else MemoryStore()
    if leases is None:
        config = attrs.evolve(config, leases=bool(getattr(the_store, "shared_by_workers", False)))
    claimed = None if config.leases else _claim_store(the_store)
    opened: Registry | None = None  # (told to the telemetry, which must hear it closed)
    try:
        async with _unwrapped(), trio.open_nursery() as nursery:
            sessions = Sessions(
                the_store, dict(agents), config, worker_id or new_id("worker"), nursery
            )
            sessions.telemetry = telemetry
            dispatcher = Dispatcher(sessions)
            registry = Registry._create(sessions, dispatcher)
            if telemetry is not None:
                telemetry.registry_opened(registry)
                opened = registry
            await nursery.start(sessions.run_generation, name="sessions generation")
            if config.leases:
                nursery.start_soon(sessions.renew_leases, name="lease renewal")
                if isinstance(the_store, RoutingStore):
                    router = await the_store.open_router(dispatcher, nursery)
                    sessions.router = dispatcher.router = router
            try:
                yield registry
            finally:
                # Cancelled from outside (a deadline around the block): shut down at
                # once, as if the grace were 0, but write what was answered first.
                hurry = trio.current_effective_deadline() == -math.inf
                try:
                    with trio.CancelScope(shield=hurry):
                        await sessions.shutdown(hurry=hurry)
                except BaseException:
                    # cut while it waited (a cancellation, a second Ctrl-C): at once now
                    try:
                        with trio.CancelScope(shield=True):
                            await sessions.shutdown(hurry=True)
                    finally:  # (cut again, by a third Ctrl-C: give up at once)
                        sessions.give_up()
                    raise
                if dispatcher.router is not None and not sessions.dead:
                    await dispatcher.router.aclose()  # (a crashed worker does not leave)
                nursery.cancel_scope.cancel()
    finally:
        # (here, once every session's task has ended: also when the close was cut
        # short by a cancellation or an error, the telemetry hears it)
        if opened is not None and telemetry is not None:
            telemetry.registry_closed(opened)
        if claimed is not None:
            _STORES_IN_USE.discard(claimed)
        with trio.CancelScope(shield=True), trio.move_on_after(config.write_bound):
            await the_store.aclose()
    if sessions.unwritten_state:
        names = sorted(sessions.unwritten_state)
        first = sessions.unwritten_state[names[0]]
        raise StoreError(
            f"the registry closed without writing the state of session(s) {names} "
            f"({first}): with durability='hibernate' their turns since the last snapshot "
            "are lost; make the store writable, and use durability='turn' for turns that "
            "must survive a failing store"
        ) from first
