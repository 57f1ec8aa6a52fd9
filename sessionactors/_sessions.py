"""The table of sessions live in this process: activation, hubs, stops, shutdown.

It is the actors' :class:`~sessionactors._actor.Host`. It knows nothing of
other workers: the dispatcher asks the router before it comes here.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Final

import trio

from ._actor import Actor, Counters, Resolved, failed_error
from ._agent import Agent
from ._codec import dump_info, dump_snapshot
from ._config import RegistryConfig
from ._errors import (
    LOST_DATA,
    Advice,
    AdviceKind,
    FencedOutError,
    LeaseHeldError,
    LeasesUnrenewedError,
    Private,
    SessionActorsError,
    SessionBusyError,
    SessionCrashedError,
    SessionExistsError,
    SessionNotFoundError,
    SessionStoppedError,
    StoreError,
    advised,
    stopped_error,
    unanswered_error,
)
from ._hub import SEQ_GAP, Hub, deleted_error, expired_error
from ._journal import store_new
from ._metadata import check_info_room
from ._names import validate_name
from ._reading import read_stored, stored_seq
from ._records import SessionState, Status
from ._router import Router
from ._session import LiveSession, state_info
from ._subscription import EventIterator, beyond_stored, open_event_iterator, refuse_beyond
from ._supervisor import session_task
from ._telemetry import Telemetry
from .stores._base import LeaseBatchStore, Store

__all__ = ["GENERATION_PEAK", "Sessions", "exists_error"]

log = logging.getLogger("sessionactors")

#: How many sessions a line about many of them names (the others are counted).
_NAMED: Final = 10

#: Seconds in which at most ``_NAMED`` wakes after an unclean stop are logged one WARNING
#: each: the others are logged at DEBUG, and told in one WARNING as the seconds end.
_UNCLEAN_WINDOW: Final = 60.0

#: A table whose live count has fallen to an eighth of a peak at least this
#: high moves new sessions to a fresh generation nursery (see ``_run_generation``).
GENERATION_PEAK = 1024


class Sessions:
    """Live actors by name, their hubs, and the nurseries their tasks run in."""

    def __init__(
        self,
        store: Store,
        agents: Mapping[str, Agent],
        config: RegistryConfig,
        worker_id: str,
        nursery: trio.Nursery,
    ) -> None:
        self.store = store
        self.agents = agents
        self.config = config
        self.worker_id = worker_id
        self.stats = Counters()
        #: What the registry reports to (``open_registry(telemetry=...)``), or None.
        self.telemetry: Telemetry | None = None
        self.router: Router | None = None
        self.live: dict[str, Actor] = {}
        self.hubs: dict[str, Hub] = {}
        self.failed: dict[str, str | Private] = {}  # session -> why it is marked failed
        #: Turns refused here before they started, with why (see ``Host.refused``).
        self.refused: dict[str, str] = {}
        #: Reviews resolved here, by id (see ``Host.reviewed``).
        self.reviewed: dict[str, Resolved] = {}
        #: Sessions failed by their store (it may come back): when they may start again.
        self.retry_at: dict[str, float] = {}
        #: Sessions whose acknowledged state could not be written as they left.
        self.unwritten_state: dict[str, Exception] = {}
        #: Names being deleted, and by how many calls: no request wakes them meanwhile.
        self.deleting: dict[str, int] = {}
        self._closing = False
        self._grace_ends = math.inf
        self.given_up = False
        #: The scopes of callers waiting on a call of the store they make themselves
        #: (see ``store_wait``), cut when the registry gives up.
        self._store_waits: set[trio.CancelScope] = set()
        self._dead = False  # (the test kit's crash: the process is gone)
        self._nursery = nursery
        #: Where session tasks start: the current generation's nursery, or the
        #: registry's own while there is none (see ``_run_generation``).
        self._sessions = nursery
        self._generation_retired: trio.Event | None = None
        self._generation_pending = False
        self._live_peak = 64
        self._hubs_peak = 64
        #: Wakes after an unclean stop (see ``unclean_woke``): when the window of the
        #: latest ends (trio time), how many of it were logged one WARNING each, and
        #: the names of the others, not told yet.
        self._unclean_ends = -math.inf
        self._unclean_told = 0
        self._unclean_quiet: list[str] = []

    # ---- the actors' host -----------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def grace_ends(self) -> float:
        return self._grace_ends

    def agent_for(self, session: LiveSession) -> Agent:
        key = session.agent
        agent = self.agents.get(key) if key is not None else None
        if agent is None:
            has = (
                f"it has {sorted(self.agents)}"
                if self.agents
                else "it was opened without agents, to read and manage sessions"
            )
            if self.router is None:
                who, fix = "this registry", "to run its turns, pass it in"
            else:  # (named: the request may have come through another worker)
                who = f"worker {self.worker_id!r}"
                fix = "every worker on a store needs the same agents: pass it in that worker's"
            raise LookupError(
                f"session {session.session_id!r} runs agent {key!r}, which {who} does not "
                f"have ({has}); {fix} open_registry(agents={{{key!r}: Agent(...)}})"
            )
        return agent

    def hub_for(self, session_id: str) -> Hub:
        hub = self.hubs.get(session_id)
        if hub is None:
            hub = self.hubs[session_id] = Hub(session_id, self.config.hub)
            self._hubs_peak = max(self._hubs_peak, len(self.hubs))
            if self.router is not None:
                hub.tap = self.router.tap_for(session_id)
            if self.telemetry is not None:
                hub.on_lag = self.lagged
        return hub

    def lagged(self, session_id: str) -> None:
        """A subscriber of the session fell behind and was cut off: tell the telemetry."""
        if self.telemetry is not None:
            self.telemetry.subscriber_lagged(session_id=session_id)

    def detach(self, actor: Actor) -> None:
        name = actor.session_id
        if self.live.get(name) is actor:
            del self.live[name]
            if len(self.live) * 8 < self._live_peak:
                # far below its peak: give back what a wave of sessions left behind
                if self._live_peak >= GENERATION_PEAK:
                    self._retire_generation()
                self._live_peak = _compact(self.live)
        hub = self.hubs.get(name)
        if hub is not None and hub.subscriber_count:
            error = actor.load_error
            if error is not None and not isinstance(error, SessionBusyError):
                # Its wake failed: the name is not stored, or stopped, or the store or
                # the snapshot failed. Subscriptions opened while it loaded end as they
                # would have at their start (a stopped session's cleanly, else with the
                # error), and ``ref.stream`` then raises its turn's error: nothing will
                # publish to this hub until a wake succeeds.
                hub.close(None if isinstance(error, SessionStoppedError) else error)
            elif actor.kill_error is not None and actor.kill_error is actor.journal.lost:
                # The store lost the session: nothing will publish to this hub again
                # (a wake would find no such session). Its subscriptions end, saying so.
                hub.close(actor.kill_error)
            elif self.router and not self._closing:
                # With other workers the session may wake elsewhere, where this hub
                # hears nothing: its subscriptions end, and the router's follow them
                # (see ``EventIterator.follow``).
                hub.leave()
            elif self.router is None and isinstance(actor.kill_error, FencedOutError):
                # Its lease was lost: another worker runs the session now, and without
                # a router nothing of it reaches this hub. Its subscriptions end, saying
                # so, instead of waiting for events published elsewhere.
                hub.close(actor.kill_error)
        self.release_hub(name)
        _gone_event(actor).set()

    def replace(self, old: Actor, new: Actor) -> None:
        if self.live.get(old.session_id) is old:
            self.live[old.session_id] = new
        _gone_event(old).set()  # a waiter may come later (ref.stop after ready())

    def unwritten(self, session_id: str, error: Exception) -> None:
        if self._dead:
            return  # nobody is left to tell
        log.error(
            "session %r left without writing its state (turns acknowledged since its "
            "last snapshot are lost): %s",
            session_id,
            error,
        )
        self.unwritten_state[session_id] = error

    def mark_failed(
        self, actor: Actor, reason: str | Private, retry_after: float | None = None
    ) -> None:
        self.failed[actor.session_id] = reason
        if retry_after is not None:
            self.retry_at[actor.session_id] = trio.current_time() + retry_after
        self.stats.failed += 1
        self.detach(actor)

    def is_failed(self, name: str) -> bool:
        """Whether ``name`` is marked failed (a mark for its store's failures lapses)."""
        if name not in self.failed:
            return False
        at = self.retry_at.get(name)
        if at is not None and trio.current_time() >= at:
            del self.failed[name], self.retry_at[name]
            return False
        return True

    def failed_error(self, name: str) -> SessionCrashedError:
        """What a request to a session marked failed gets."""
        at = self.retry_at.get(name)
        wait = None if at is None else max(0.0, at - trio.current_time())
        return failed_error(name, self.failed[name], wait)

    # ---- activation -------------------------------------------------------------------

    def check_open(self, name: str) -> None:
        if self._closing:
            raise advised(
                SessionStoppedError,
                f"the registry is closed, so session {name!r} takes no requests; ",
                Advice(kind=AdviceKind.OPEN_REGISTRY),
                session_id=name,
            )

    def activate(self, name: str) -> Actor:
        """The live actor of ``name``, starting one (which loads itself) if needed."""
        actor = self.live.get(name)
        if actor is not None:
            return actor
        validate_name(name)
        self.check_open(name)
        if name in self.deleting:
            raise _deleting_error(name)
        if self.is_failed(name):
            raise self.failed_error(name)
        actor = Actor(self, name, None)
        self.live[name] = actor
        self._live_peak = max(self._live_peak, len(self.live))
        self._start(actor)
        return actor

    async def loaded(self, name: str) -> None:
        """Wait until an actor of ``name`` that is still loading has loaded: a request to
        a name that is not stored starts one, which then finds nothing and leaves, and
        must not pass for the session meanwhile."""
        actor = self.live.get(name)
        if actor is not None and not actor.is_ready:
            with contextlib.suppress(SessionActorsError):  # it left, or it is broken:
                await actor.ready()  # the callers look again

    async def create(self, state: SessionState) -> None:
        """Store a new session as ``state`` (as ``LiveSession.to_state`` makes one);
        SessionExistsError if it exists.

        Its actor starts with its first request, as a hibernated session's does (a
        virtual actor): a spawn does nothing the session needs only once it is used,
        and makes no live session, only the state it stores.
        """
        name = state.session_id
        await self.loaded(name)
        self.check_open(name)  # (a close begun meanwhile: nothing is stored)
        if name in self.live:
            raise exists_error(name)
        try:
            snapshot = dump_snapshot(state)
            described = state_info(state)
            info = dump_info(described)
            check_info_room(described, len(info))  # (room for what its later writes hold)
        except (TypeError, ValueError) as exc:  # the codec's message says what, where
            raise type(exc)(f"session {name!r} cannot be stored: {exc}") from exc
        try:
            # (not under store_wait: a cancel scope would cost a spawn a seventh of its
            # time; a spawn waits on a store that never answers, as a turn's write does)
            await store_new(self.store, name, snapshot, info, state.event_seq)
        except SessionExistsError:  # stored: say what to do in the registry's terms
            raise exists_error(name) from None
        if name in self.live:  # woken meanwhile by a request racing this spawn
            raise exists_error(name)
        if self.router is not None:
            await self.router.created(name)  # a deleted namesake's events end
        self.stats.spawned += 1

    async def ready(self, name: str) -> LiveSession:
        """The session here, woken if needed; a stopped one is read from the store."""
        try:
            return await self.activate(name).ready()
        except SessionStoppedError:
            if self._closing:
                raise
            return await self.stored_session(name)

    async def stored_session(self, name: str, *, history: bool = True) -> LiveSession:
        """The session's state read from the store, without waking it (without
        ``history``, perhaps without its messages: see ``read_stored``)."""
        with self.store_wait(name):
            session, _ = await read_stored(self.store, name, history=history)
        return session

    def closed_error(self, actor: Actor) -> Exception | None:
        """Why ``actor``'s mailbox is closed, or None if a new actor may serve (retry)."""
        name = actor.session_id
        if actor.load_error is not None:
            return actor.load_error
        if actor.deleted:
            return SessionNotFoundError(f"session {name!r} was deleted", session_id=name)
        if self._closing:
            return advised(
                SessionStoppedError,
                f"the registry is closing, so session {name!r} takes no requests; ",
                Advice(kind=AdviceKind.REOPEN),
                session_id=name,
            )
        if actor.stopping:
            return stopped_error(name, "stop")
        if self.is_failed(name):
            return self.failed_error(name)
        return None  # hibernated or restarted: try again

    async def wait_gone(self, actor: Actor) -> None:
        await _gone_event(actor).wait()

    # ---- stop and delete -------------------------------------------------------------

    async def stop(self, actor: Actor) -> bool:
        """Stop ``actor``; False if it left without stopping (it hibernated, or was
        replaced after a crash, first)."""
        actor.request_stop()
        await self.wait_gone(actor)
        if actor.stop_error is not None:  # the stop did not happen (see the supervisor)
            raise actor.stop_error
        if actor.deleted:
            raise SessionNotFoundError(
                f"session {actor.session_id!r} was deleted while it was being stopped",
                session_id=actor.session_id,
            )
        if actor.kill_error is not None:
            raise actor.kill_error
        return actor.session.status is Status.STOPPED

    async def delete_here(self, name: str, kill_error: SessionNotFoundError) -> bool:
        """Remove the session here and from the store; whether there was anything.

        With leases and no router, a session that is not live here may be live in
        another process, which this one cannot stop: the delete takes its lease first
        (``LeaseHeldError`` while another process holds it), as the CLI's does.
        """
        actor = self.live.get(name)
        lease = None
        if actor is not None:
            actor.kill(kill_error)
            await self.wait_gone(actor)
        elif self.config.leases and self.router is None:
            with self.store_wait(name):
                lease = await self.store.claim(name, self.worker_id, self.config.lease_ttl)
            if lease is None:
                raise LeaseHeldError(
                    f"session {name!r} is live on another worker (another registry, in "
                    "this process or another, holds the session's lease), so it cannot be "
                    "deleted from here; delete it "
                    "through that worker, or retry once it hibernates the session or its "
                    "lease expires",
                    session_id=name,
                )
        hub = self.hubs.pop(name, None)
        if hub is not None:
            hub.close(deleted_error(name))
        was_failed = self.failed.pop(name, None) is not None
        self.retry_at.pop(name, None)
        try:
            with self.store_wait(name):
                existed = await self.store.delete(name)  # (the lease goes with it)
        except BaseException:
            if lease is not None:  # not deleted: give the lease back
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(self.config.write_bound),
                    contextlib.suppress(Exception),
                ):
                    await self.store.release(name, lease)
            raise
        return existed or actor is not None or was_failed

    # ---- subscriptions ----------------------------------------------------------------

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        """A subscription served from this process's hub (and the store's journal)."""
        if name in self.deleting:  # its hub is closed, or will be: nothing to follow
            raise _deleting_error(name)
        with self.store_wait(name):
            return await self._open_subscription(name, after)

    async def _open_subscription(self, name: str, after: int | None) -> EventIterator:
        """``open_subscription``'s work, under ``store_wait``."""
        hub = self.hub_for(name)
        iterator = await open_event_iterator(
            name,
            hub,
            self.store,
            after,
            lambda: self.release_hub(name),
            lambda: self.live[name].journal.replayable() if name in self.live else (0, ()),
            lambda: self.store_wait(name),
        )
        try:
            stored = None if after is None else await self._check_after(name, after, hub)
            if stored is None and name not in self.live:
                stored = await self.stored_session(name, history=False)
            # (looked at after the store reads: a session woken meanwhile is followed
            # through its hub here, and its wake resumes a turn it left)
            if stored is not None and name not in self.live:
                if stored.status is Status.STOPPED:
                    iterator.close()
                elif _left_mid_turn(stored) and stored.agent in self.agents and self.router is None:
                    # Its process died mid-turn: nothing else would wake it, and the
                    # turn (resumed by the wake) ends only then. The subscription came
                    # first, so it sees all of it. (With other workers, the router wakes
                    # it. A registry without its agent, an observer, could not resume the
                    # turn: it leaves the session to one that can.)
                    with contextlib.suppress(SessionActorsError):  # (deleted, closing, failed)
                        self.activate(name)
        except BaseException:
            iterator.close()
            raise
        return iterator

    async def _check_after(self, name: str, after: int, hub: Hub) -> LiveSession | None:
        """Raise EventsExpiredError if ``after`` lies beyond the session's last event (a
        client's stale or forged seq: of a deleted session of that name, or from before
        its store was restored from a backup), to which a subscription would wait in
        silence until the session's seq passed it; return the stored session if it was
        read for this (for the caller to reuse), else None.

        A session live here knows its last seq; one that is not (or is still waking)
        is read from the store, without waking it or waiting for its wake: only a seq
        beyond the store's waits for a wake under way, and one inside a turn that died
        with its process wakes the session, if this registry has its agent, for its
        jump to name the seq its events go on from. With other workers, a session
        that is not live here may be further along elsewhere (deltas are not stored):
        the router asked its owner."""
        if after <= hub.seq:  # (a seq the hub gave, or jumped over: see Hub.lost)
            return None
        actor = self.live.get(name)
        if actor is not None and actor.is_ready:
            refuse_beyond(name, after, max(actor.session.event_seq, hub.seq))
            return None
        session, stored = await read_stored(self.store, name, history=False)
        durable = stored_seq(session, stored)
        if after <= max(durable, hub.seq):
            return session
        last = await self._last_seq_here(name, hub)  # (waking, or woken meanwhile)
        if last is not None:
            refuse_beyond(name, after, last)
            return session
        if self.router is not None and session.status is not Status.STOPPED:
            return session
        error = beyond_stored(name, after, session, stored)
        if error is None:
            # Its last incarnation stopped uncleanly and may have published seqs above
            # the store's (a turn's deltas), which the next wake jumps over (Hub.jump):
            # lost. With leases that incarnation may be live in another process, which
            # this one cannot ask (claiming the lease to learn it could fence a live
            # owner out): the subscription waits, as any here does for a session live
            # elsewhere, and a wake here tells the loss (the jump).
            if self.config.leases:
                return session
            if session.agent in self.agents:
                # woken here, its hub jumps to the seq its events go on from: the error
                # names that, for a subscription after the seq before it to follow on
                with contextlib.suppress(SessionActorsError):  # (deleted, closing, failed)
                    self.activate(name)
                last = await self._last_seq_here(name, hub)
                if hub.lost(after):
                    raise hub.lost_error(after)
                if last is not None:  # (woken, not over that seq: as for any live one)
                    refuse_beyond(name, after, last)
                    return session
            # (an observer, without its agent: the jump is a later wake's, elsewhere)
            error = expired_error(name, after, durable + SEQ_GAP + 1)
        raise error

    async def _last_seq_here(self, name: str, hub: Hub) -> int | None:
        """The seq of the last event of the session (whose hub is ``hub``) if it is
        live here (once loaded, if it is loading), else None."""
        actor = self.live.get(name)
        if actor is None:
            return None
        if not actor.is_ready:
            with contextlib.suppress(SessionActorsError):  # (its wake failed: not live)
                await actor.ready()
            actor = self.live.get(name)
            if actor is None or not actor.is_ready:
                return None
        return max(actor.session.event_seq, hub.seq)

    def release_hub(self, name: str) -> None:
        hub = self.hubs.get(name)
        if hub is not None and hub.subscriber_count == 0 and name not in self.live:
            del self.hubs[name]
            if len(self.hubs) * 8 < self._hubs_peak:
                self._hubs_peak = _compact(self.hubs)

    @property
    def subscriber_count(self) -> int:
        return sum(h.subscriber_count for h in list(self.hubs.values()))  # (any thread)

    def unclean_woke(self, session_id: str) -> bool:
        """Whether to log the wake of ``session_id`` after an unclean stop at WARNING:
        yes for the first ``_NAMED`` in ``_UNCLEAN_WINDOW`` seconds. After an outage
        that stopped many sessions at once (a store that did not answer for longer
        than their leases), each wakes so as its next request comes: the others of
        the window are told in one line as it ends (``_tell_unclean``)."""
        now = trio.current_time()
        if now >= self._unclean_ends:
            self._unclean_ends = now + _UNCLEAN_WINDOW
            self._unclean_told = 0
        if self._unclean_told < _NAMED:
            self._unclean_told += 1
            return True
        if not self._unclean_quiet:
            self._nursery.start_soon(self._tell_unclean, name="unclean wakes")
        self._unclean_quiet.append(session_id)
        return False

    async def _tell_unclean(self) -> None:
        """As the window ends (or the registry closes), one WARNING for the wakes
        after an unclean stop that were logged at DEBUG only."""
        try:
            await trio.sleep_until(self._unclean_ends)
        finally:
            quiet, self._unclean_quiet = self._unclean_quiet, []
            count = len(quiet)
            log.warning(
                "%d more %s woke after an unclean stop within %g s of the first one logged "
                "above (%s), each logged at DEBUG: as for those above, the turns that their "
                "last process had accepted and the store holds nothing of are lost, and "
                "ref.turn_outcome(turn_id) reads lost for them; "
                "registry.statistics().unclean_wakes counts every one",
                count,
                "session" if count == 1 else "sessions",
                _UNCLEAN_WINDOW,
                _first_names(quiet),
            )

    # ---- shutdown and leases -----------------------------------------------------------

    async def shutdown(self, *, hurry: bool = False) -> None:
        """No new requests; accepted turns get ``shutdown_grace`` (none if ``hurry``);
        then hibernate all, waiting for the store at most ``write_bound``; then give
        up on the sessions still there."""
        if not self._dead:
            self._closing = True
            self._grace_ends = trio.current_time() + (0 if hurry else self.config.shutdown_grace)
            for actor in list(self.live.values()):
                actor.close()
            with trio.move_on_at(self._grace_ends):
                await self._wait_all_gone()
            for actor in list(self.live.values()):
                actor.abort()
            with trio.move_on_after(self.config.write_bound):
                await self._wait_all_gone()
        self.give_up()

    def give_up(self) -> None:
        """End every session where it is (write nothing more, answer every waiter) and
        every subscription: no subscription waits on a closed registry."""
        self.given_up = True
        for actor in list(self.live.values()):
            if actor.run_scope is not None:  # (one not started yet ends as it starts)
                actor.run_scope.cancel()
        for hub in self.hubs.values():
            hub.close()
        for scope in self._store_waits:
            scope.cancel()

    @contextlib.contextmanager
    def store_wait(self, name: str | None) -> Iterator[None]:
        """Around a call of the store that a caller makes itself, not a session's task (a
        delete's write, a listing, a read of a session that is not live): if
        the registry gives up on its sessions meanwhile (its close is over, the store
        did not answer), the call is cut and raises SessionStoppedError naming
        ``name``, as a request waiting on a session's write does."""
        scope = trio.CancelScope()
        if self.given_up:
            scope.cancel()
        self._store_waits.add(scope)
        try:
            with scope:
                yield
        finally:
            self._store_waits.discard(scope)
        if scope.cancelled_caught:
            raise unanswered_error(name)

    @property
    def dead(self) -> bool:
        """Whether the test kit's ``crash`` stands for this process's death."""
        return self._dead

    def interrupted(self) -> None:
        """Something not an Exception escaped a session (KeyboardInterrupt, say): leave
        the registry's block at once, which shuts the other sessions down in a hurry."""
        self._nursery.cancel_scope.cancel()

    def die(self) -> None:
        """Stand for the death of this process (the test kit's ``crash``): every session
        stops where it is, nothing more is written, and the registry's exit writes
        nothing either."""
        self._closing = self._dead = True
        self.give_up()

    async def _wait_all_gone(self) -> None:
        while self.live:
            await self.wait_gone(next(iter(self.live.values())))

    async def renew_leases(self) -> None:
        """Keep the leases of live sessions; stop at once a session whose lease is lost.

        A store that renews in batches (``LeaseBatchStore``: one round trip for all,
        whatever their number) gets one call per round; any other store one per session.
        A lease whose renewals fail (the store does not answer) is kept until a renewal
        sent more than lease_ttl after the last one the store confirmed fails too: the
        lease may have lapsed in the store by then, and another worker may run the
        session, so it is lost here too. (A renewal sent earlier that failed, by a
        timeout say, may still have reached the store in time.)
        """
        ttl = self.config.lease_ttl
        while True:
            await trio.sleep(ttl / 3)
            sent = trio.current_time()
            held = {a.session_id: a.lease for a in self.live.values() if a.lease is not None}
            lost: set[str] = set()
            unanswered: set[str] = set()
            if isinstance(self.store, LeaseBatchStore):
                try:
                    lost = await self.store.renew_many(held, ttl)
                except LeasesUnrenewedError as exc:  # (some renewed: a cluster's master down)
                    log.warning("%s; tried again each round until the leases lapse", exc)
                    lost, unanswered = set(exc.lost), set(exc.unanswered)
                except StoreError as exc:
                    # (the store's error says what it could not renew)
                    log.warning("%s; tried again each round until the leases lapse", exc)
                    unanswered = set(held)  # try again next round, until they lapse
            else:
                failure: StoreError | None = None
                for name, lease in held.items():
                    try:
                        if not await self.store.renew(name, lease, ttl):
                            lost.add(name)
                    except StoreError as exc:
                        log.debug("could not renew the lease of session %r: %s", name, exc)
                        unanswered.add(name)
                        failure = failure or exc
                if failure is not None:  # one line a round, however many failed
                    log.warning(
                        "could not renew the leases of %s (%s): %s; tried again each round "
                        "until the leases lapse",
                        _sessions(len(unanswered)),
                        _first_names(unanswered),
                        failure,
                    )
            taken: list[str] = []
            lapsed: list[str] = []
            for name, lease in held.items():
                actor = self.live.get(name)
                if actor is None or actor.lease is not lease:
                    continue  # gone, or woken again with a lease of its own
                if name in lost:
                    self._lease_lost(actor)
                    taken.append(name)
                elif name not in unanswered:
                    actor.renewed = sent
                elif sent - actor.renewed > ttl:
                    self._lease_lost(actor, lapsed=True)
                    lapsed.append(name)
            # one line a round for each kind, however many sessions stopped
            if taken:
                log.warning(
                    "leases lost for %s (%s): the store no longer shows this worker's "
                    "leases of them (another worker took them over, or the store lost or "
                    "rolled back data); stopped here",
                    _sessions(len(taken)),
                    _first_names(taken),
                )
            if lapsed:
                log.warning(
                    "leases lapsed unrenewed for %s (%s): the store did not answer for "
                    "lease_ttl (%g s), so another worker may run them now; stopped here",
                    _sessions(len(lapsed)),
                    _first_names(lapsed),
                    ttl,
                )

    def _lease_lost(self, actor: Actor, *, lapsed: bool = False) -> None:
        """Stop a session whose lease another worker took (or, ``lapsed``, may have
        taken: the store did not answer its renewals): its turn, model and tool calls
        included, are cancelled at once. (Logged here at DEBUG; the renewal round logs
        the sessions it stopped in one line.)"""
        sid = actor.session_id
        if lapsed:
            log.debug("session %r: its lease lapsed unrenewed; stopped here", sid)
            why = (
                f"session {sid!r} lost its lease: the store did not answer its renewals "
                f"for lease_ttl ({self.config.lease_ttl:g} s), so another worker may run "
                "it now; this worker stopped it, so send the request again once the "
                "store answers"
            )
        else:
            log.debug(
                "session %r stopped here: the store no longer shows this worker's lease of "
                "it (another worker took it over, or the store lost or rolled back data)",
                sid,
            )
            why = (
                f"session {sid!r} lost its lease: the store no longer shows this worker's "
                f"lease of it: another worker took it over, or {LOST_DATA}; this worker "
                "stopped it, so send the request again: it wakes the session from what "
                "the store holds (here, or on the worker that owns it now)"
            )
        self.stats.leases_lost += 1
        actor.lease = None  # renewed and released no more; its fence stays on its writes
        actor.kill(FencedOutError(why, session_id=sid))

    # ---- generations: the nurseries that session tasks run in -------------------------

    def _start(self, actor: Actor) -> None:
        if self._sessions is self._nursery:
            self._open_generation()
        self._sessions.start_soon(session_task, self, actor, name=f"session {actor.session_id!r}")

    def _open_generation(self) -> None:
        """Schedule a new generation; sessions start in the registry's nursery until it runs."""
        if not self._generation_pending and not self._closing:
            self._generation_pending = True
            self._nursery.start_soon(self.run_generation, name="sessions generation")

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

    async def run_generation(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Host the sessions that start until the generation retires, then end with them.

        A crash is handled inside its session's task; an exception that escapes one
        still cancels every session and leaves the registry, in the shape it would have
        from the registry's own nursery.
        """
        self._generation_pending = True
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
            # (the registry's nursery is being cancelled for it: the generation's own
            # Cancelled beside it goes, so that the one exception comes out as itself)
            _, rest = group.split(trio.Cancelled)
            if rest is not None and len(rest.exceptions) == 1:
                raise rest.exceptions[0] from None
            raise


def _deleting_error(name: str) -> SessionNotFoundError:
    return advised(
        SessionNotFoundError,
        f"session {name!r} is being deleted, so it takes no requests; ",
        Advice(kind=AdviceKind.SPAWN_AFRESH),
        " once the deletion is done",
        session_id=name,
    )


def _left_mid_turn(session: LiveSession) -> bool:
    """Whether the stored ``session`` has a turn that began and has no outcome, with
    nothing left to wait for: its process died in the middle of it (a turn paused on a
    review waits for a person, and is stored open on purpose)."""
    return session.open_turn is not None and not session.reviews


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


def exists_error(name: str) -> SessionExistsError:
    return SessionExistsError(
        f"session {name!r} already exists; use registry.ref({name!r}) to talk to it",
        session_id=name,
    )


def _sessions(count: int) -> str:
    return "1 session" if count == 1 else f"{count} sessions"


def _first_names(names: Collection[str]) -> str:
    """The first ``_NAMED`` of ``names`` in order, and how many more there are."""
    ordered = sorted(names)
    named = ", ".join(repr(name) for name in ordered[:_NAMED])
    more = len(ordered) - _NAMED
    return f"{named} and {more} more" if more > 0 else named
