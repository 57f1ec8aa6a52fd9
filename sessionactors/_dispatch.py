"""The dispatcher: every request of a ref goes here, and on to where its session runs.

It asks the router (when the registry has one) whether another worker runs the
session, and otherwise serves the request from the local table, waking the
session if needed. One retry loop (``_route``) covers every way a request can
miss its target: the session moved to another worker, or its mailbox closed
between the lookup and the send (it hibernated, or restarted after a crash).
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
import trio

from ._actor import Actor, CallMail, TurnMail, deleted_error, other_words, waiting_reply
from ._config import RegistryConfig
from ._errors import (
    Advice,
    AdviceKind,
    EventsExpiredError,
    LeaseHeldError,
    MailboxFullError,
    SessionCrashedError,
    SessionNotFoundError,
    SessionStoppedError,
    advised,
    reply_removed_error,
)
from ._events import Event
from ._names import validate_name
from ._nesting import Within, refuse_within, within
from ._pending import Pending
from ._records import SessionState, Status, TurnOutcome, TurnStatus
from ._ref import Turn, new_turn
from ._requests import Call, Cancel, Delete, Hibernate, Reply, Stop
from ._router import NOT_ROUTED, Router
from ._sessions import Sessions
from ._subscription import EventIterator, expired_error_at
from ._turns import session_tag, turn_id_time
from .stores._base import Store

__all__ = ["Dispatcher"]

#: How often a request may miss its session (moved, or its mailbox closed) before
#: its caller gets SessionCrashedError.
_MAX_ATTEMPTS: Final = 100


class _Again:
    """A local attempt found the session's mailbox closed: look it up again."""


_AGAIN: Final = _Again()


class Dispatcher:
    """Routes the typed requests of refs; the router's host for requests from elsewhere."""

    __slots__ = ("router", "sessions")

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.router: Router | None = None

    def runs_here(self, name: str) -> bool:
        """Whether session ``name`` is live in this registry (not on another worker)."""
        return name in self.sessions.live

    # ---- the one retry loop -------------------------------------------------------------

    async def _route(
        self,
        name: str,
        here: Callable[[], Awaitable[Any]],
        remote: Callable[[Router], Awaitable[Any]] | None = None,
    ) -> Any:
        """Serve ``here``, or at the session's owner elsewhere (``remote``, when the
        registry has a router); look the session up again after a miss."""
        router = self.router if remote is not None else None
        for _ in range(_MAX_ATTEMPTS):
            if router is not None and router.elsewhere(name):
                result = await remote(router)  # type: ignore[misc]
                if result is not NOT_ROUTED:
                    return result
            try:
                result = await here()
            except LeaseHeldError:
                if router is None:
                    raise
                router.held_elsewhere(name)  # live on another worker: go there
                continue
            if result is not _AGAIN:
                return result
            await trio.lowlevel.checkpoint()
        raise advised(
            SessionCrashedError,
            f"session {name!r} kept moving between workers or closing its mailbox while "
            "this request looked for it; send the request again",
            session_id=name,
        )

    def refuse_wait(self, name: str, *, turn: bool = True) -> None:
        """Raise SessionBusyError if the running code is part of a turn that a request
        in the mailbox of session ``name`` would wait behind, forever (see ``_nesting``;
        ``turn``: the request is a turn)."""
        refuse_within(self.sessions, name, turn=turn)

    # ---- turns ---------------------------------------------------------------------------

    async def submit(self, name: str, text: str, key: str | None, *, ack: bool) -> Turn:
        """A turn in the session's mailbox (here or at its owner), waiting for room.

        With ``ack`` the caller returns now; without, it waits on the reply next (a
        turn forwarded to another worker then returns once answered).
        """
        if not ack:
            self.refuse_wait(name)
        if self.router is None:
            turn = await self._submit_here(name, text, key, ack=ack)
            if turn is not _AGAIN:  # the common case: served here at the first try
                return turn  # type: ignore[no-any-return]
        turn = await self._route(
            name,
            lambda: self._submit_here(name, text, key, ack=ack),
            None
            if self.router is None
            else (lambda router: _or_not_routed(router.submit(name, text, key, ack=ack))),
        )
        return turn  # type: ignore[no-any-return]

    def enqueue(self, name: str, text: str) -> Pending | None:
        """A turn without idempotency key in the mailbox of a session served here, at
        once: its result slot; None if that takes a wait or another worker (``submit``).

        No schedule point and no ``Turn``: ``ref.send`` parks once, on the reply.
        """
        if self.router is not None:
            return None
        sessions = self.sessions
        chain = refuse_within(sessions, name)
        return _enqueue(sessions.activate(name), text, chain=chain)  # (live, or waking)

    def enqueue_here(self, name: str, text: str, turn_id: str | None = None) -> Pending | None:
        """A turn without idempotency key in the mailbox of a session live and loaded
        here, at once, never routed (a request another worker forwarded, under the
        ``turn_id`` it names if the session takes it: see ``Actor.new_turn_id``): its
        result slot; None if that takes a wait or a wake (``submit_here``)."""
        actor = self.sessions.live.get(name)
        if actor is None or not actor.is_ready:
            return None
        return _enqueue(actor, text, turn_id, forwarded=True)

    async def submit_here(
        self, name: str, text: str, key: str | None, turn_id: str | None = None
    ) -> Turn:
        """A turn in the mailbox here, never routed (a request another worker forwarded,
        under the ``turn_id`` it names if it is a new turn that the session takes)."""
        turn: Turn = await self._route(
            name,
            lambda: self._submit_here(name, text, key, ack=True, given=turn_id, forwarded=True),
        )
        return turn

    async def _submit_here(
        self,
        name: str,
        text: str,
        key: str | None,
        *,
        ack: bool,
        given: str | None = None,
        forwarded: bool = False,
    ) -> Any:
        actor = self.sessions.activate(name)  # the live one, or a new one that wakes
        if not actor.is_ready and (key is not None or self.router is not None):
            # a key is looked up in the loaded state, and a router must hear of a
            # session live elsewhere; any other turn joins the mailbox of a waking
            # session at once, in the order of the calls (a failed wake fails it)
            await actor.ready()
        while key is not None:
            turn = _joined(actor, name, key, text)
            if turn is not None:
                await trio.lowlevel.checkpoint()
                return turn
            room = actor.room_waits.get(key) if actor.room_waits else None
            if room is None:
                break
            # a request with this key waits for room: join it once it is queued (or
            # take its place if its caller gave up)
            await room.wait()
            ack = False  # it checkpointed
        pending = Pending()
        turn_id = actor.new_turn_id(given)
        chain = () if forwarded else within()
        if ack and chain:
            # submitted: no one waits on it, so it waits on no turn (it carries no chain);
            # a wait on its reply from within those turns is refused
            pending.owner = (self.sessions, name)
            chain = ()
        mail = TurnMail(turn_id, text, key, pending, forwarded, chain)
        send = actor.send
        actor.note_queued(turn_id)  # before: the actor may start it before send returns
        try:
            # no schedule point of our own when there is room: ``send`` parks once, on
            # the reply; ``submit`` checkpoints below
            send.send_nowait(mail)
        except trio.WouldBlock:
            room = waits = None
            if key is not None:
                room = trio.Event()
                waits = actor.room_waits
                if waits is None:
                    waits = actor.room_waits = {}
                waits[key] = room
            try:
                await send.send(mail)
                if key is not None and not pending.done:
                    actor.note_inflight(key, mail)  # (before its waiters look again)
            except BaseException as exc:  # not queued: closed, or the caller gave up
                actor.note_queued(turn_id, False)
                if isinstance(exc, trio.ClosedResourceError | trio.BrokenResourceError):
                    return await self._after_closed(actor)
                raise
            finally:
                if waits is not None and key is not None and room is not None:
                    del waits[key]
                    room.set()
            ack = False  # it checkpointed
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            actor.note_queued(turn_id, False)
            return await self._after_closed(actor)
        if key is not None and not pending.done:
            # Joinable only once it is in the mailbox: a request abandoned while it
            # waited for room leaves no joiner waiting forever (they wait on its room
            # event, then look again).
            actor.note_inflight(key, mail)
        if ack:
            await trio.lowlevel.checkpoint()
        return new_turn(turn_id, name, pending)

    def submit_nowait(self, name: str, text: str, key: str | None) -> Turn:
        sessions = self.sessions
        actor = sessions.activate(name)
        turn = _joined(actor, name, key, text)
        if turn is not None:
            return turn
        pending = Pending()
        turn_id = actor.new_turn_id()
        if within():  # (as submit's: see _submit_here)
            pending.owner = (sessions, name)
        mail = TurnMail(turn_id, text, key, pending)
        try:
            actor.send.send_nowait(mail)
            actor.note_queued(turn_id)
        except trio.WouldBlock:
            sessions.stats.requests_refused += 1
            raise advised(
                MailboxFullError,
                f"the mailbox of session {name!r} is full "
                f"({sessions.config.mailbox_size} requests waiting); ",
                Advice(kind=AdviceKind.WAIT_FOR_ROOM),
                session_id=name,
            ) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            error = sessions.closed_error(actor)
            raise error or advised(
                SessionStoppedError,
                f"session {name!r} is changing hands (hibernating or restarting); ",
                Advice(kind=AdviceKind.WAIT_FOR_HANDOVER),
                session_id=name,
            ) from None
        if key is not None:
            actor.note_inflight(key, mail)
        return new_turn(turn_id, name, pending)

    async def _after_closed(self, actor: Actor) -> _Again:
        error = self.sessions.closed_error(actor)
        if error is not None:
            raise error
        return _AGAIN

    # ---- other requests ----------------------------------------------------------------------

    async def call(self, name: str, request: Call | Cancel | Stop) -> Any:
        if isinstance(request, Cancel):
            return await self._cancel(name, request)
        self.refuse_wait(name, turn=False)  # (in mailbox order: behind a turn it may be part of)
        if isinstance(request, Hibernate):
            return await self._hibernate(name)
        return await self._route(
            name,
            lambda: self._serve_here(name, request),
            None if self.router is None else (lambda router: router.call(name, request)),
        )

    async def call_here(self, name: str, request: Call | Cancel | Stop | Delete) -> Any:
        """Serve a request here, never routed (a request another worker forwarded)."""
        if isinstance(request, Delete):
            return await self.delete(name, route=False)
        if isinstance(request, Cancel):
            await trio.lowlevel.checkpoint()
            actor = self.sessions.live.get(name)
            return actor is not None and actor.cancel_turn(request.turn_id)
        if isinstance(request, Hibernate):
            actor = self.sessions.live.get(name)
            if actor is not None:
                return await self._mail(actor, request)
            await trio.lowlevel.checkpoint()
            return None
        return await self._route(
            name,
            lambda: self._serve_here(name, request),
        )

    def _serve_here(self, name: str, request: Call | Stop) -> Awaitable[Any]:
        if isinstance(request, Stop):
            return self._stop_here(name)
        return self._mail_here(name, request)

    async def _mail_here(self, name: str, request: Call) -> Any:
        """A request in the mailbox here, waking the session; its result."""
        actor = self.sessions.activate(name)
        pending = Pending()
        try:
            await actor.send.send(CallMail(request, pending))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return await self._after_closed(actor)
        return await pending.wait()  # LeaseHeldError if the wake found it elsewhere

    async def _mail(self, actor: Actor, request: Call) -> Any:
        """A request in a live actor's mailbox; None if it left meanwhile."""
        pending = Pending()
        try:
            await actor.send.send(CallMail(request, pending))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            await trio.lowlevel.checkpoint()
            return None
        return await pending.wait()

    async def _cancel(self, name: str, request: Cancel) -> bool:
        await trio.lowlevel.checkpoint()
        actor = self.sessions.live.get(name)
        if (actor is None or not actor.is_ready) and self.router is not None:
            # maybe live on another worker (a session waking here has no turn yet, and
            # its wake may find it there)
            result = await self.router.call(name, request)
            if result is not NOT_ROUTED:
                return bool(result)
            actor = self.sessions.live.get(name)  # (live nowhere else: here, if woken since)
        return actor is not None and actor.cancel_turn(request.turn_id)

    async def _hibernate(self, name: str) -> None:
        actor = self.sessions.live.get(name)
        if actor is not None:
            try:
                await self._mail(actor, Hibernate())
                return
            except LeaseHeldError:  # it was waking here, and another worker runs it
                if self.router is None:
                    raise
                self.router.held_elsewhere(name)
        if self.router is not None:  # maybe live on another worker
            await self.router.call(name, Hibernate())
        await trio.lowlevel.checkpoint()

    async def _stop_here(self, name: str) -> Any:
        sessions = self.sessions
        actor = sessions.activate(name)
        try:
            await actor.ready()
        except SessionStoppedError:
            if sessions.closing:
                raise
            return None  # stopped already
        if await sessions.stop(actor):
            return None
        return _AGAIN  # it left without stopping (hibernated, restarted): again

    # ---- reads -------------------------------------------------------------------------------

    async def read(self, name: str) -> SessionState:
        """The session's state (here, at its owner, or for a stopped one, the store's)."""
        state: SessionState = await self._route(
            name,
            lambda: self.read_here(name),
            None if self.router is None else (lambda router: _or_not_routed(router.read(name))),
        )
        return state

    async def read_here(self, name: str) -> SessionState:
        session = await self.sessions.ready(name)
        state = session.copy_out()
        hub = self.sessions.hubs.get(name)
        # Past the events its hub published since (a wake's seq jump, statuses), which
        # a subscription after its seq need not see; not past a turn's deltas, which
        # the messages do not hold: a subscription after its seq replays them.
        if hub is not None and hub.seq > state.event_seq and state.open_turn is None:
            state = attrs.evolve(state, event_seq=hub.seq)
        return state

    async def outcome(self, name: str, turn_id: str) -> TurnOutcome:
        """What became of turn ``turn_id`` of the session (here, or from its owner's state)."""
        refused = self.sessions.refused.get(turn_id)
        if refused is not None and turn_id_time(turn_id, session_tag(name)) is not None:
            # failed here before it reached the session (a wake that found it live on
            # another worker, say): no state records it, and its owner never heard of it
            await trio.lowlevel.checkpoint()
            return TurnOutcome(
                session_id=name, turn_id=turn_id, status=TurnStatus.FAILED, error=refused
            )
        outcome: TurnOutcome = await self._route(
            name,
            lambda: self._outcome_here(name, turn_id),
            None
            if self.router is None
            else (lambda router: _or_not_routed(router.outcome(name, turn_id))),
        )
        return outcome

    async def outcome_here(self, name: str, turn_id: str) -> TurnOutcome:
        """What became of turn ``turn_id``, asked here, never routed (another worker
        asks the session's owner, which knows its mailbox)."""
        outcome: TurnOutcome = await self._route(name, lambda: self._outcome_here(name, turn_id))
        return outcome

    async def _outcome_here(self, name: str, turn_id: str) -> TurnOutcome:
        actor = self.sessions.activate(name)
        try:
            await actor.ready()
        except SessionStoppedError:
            if self.sessions.closing:
                raise
            return (await self.sessions.stored_session(name)).outcome(turn_id)
        return actor.outcome(turn_id)

    async def open_subscription(self, name: str, after: int | None) -> EventIterator:
        validate_name(name)
        self.sessions.check_open(name)
        if self.router is not None:  # from wherever the session runs
            return await self.router.open_subscription(name, after)
        return await self.sessions.open_subscription(name, after)

    # ---- delete ------------------------------------------------------------------------------

    async def delete(self, name: str, *, route: bool = True) -> None:
        """Remove the session everywhere: actor, subscribers, store."""
        validate_name(name)
        sessions = self.sessions
        sessions.check_open(name)  # a closing registry deletes nothing, as it spawns nothing
        sessions.deleting[name] = sessions.deleting.get(name, 0) + 1
        try:
            router = self.router
            if (
                route
                and router is not None
                and name not in sessions.live
                and await router.call(name, Delete()) is not NOT_ROUTED
            ):
                return  # deleted by the worker that ran it
            existed = await sessions.delete_here(name, deleted_error(name))
            if router is not None:
                await router.deleted(name)  # ends subscriptions on every worker
        finally:
            left = sessions.deleting.pop(name) - 1
            if left:
                sessions.deleting[name] = left
        if not existed:
            raise SessionNotFoundError(
                f"session {name!r} does not exist, so there is nothing to delete",
                session_id=name,
            )

    # ---- the router's host -----------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.sessions.worker_id

    @property
    def store(self) -> Store:
        return self.sessions.store

    @property
    def config(self) -> RegistryConfig:
        return self.sessions.config

    @property
    def closing(self) -> bool:
        return self.sessions.closing

    @property
    def grace_ends(self) -> float:
        return self.sessions.grace_ends

    @property
    def runs_turns(self) -> bool:
        return bool(self.sessions.agents)

    def agent_names(self) -> list[str]:
        return sorted(self.sessions.agents)

    def is_live(self, name: str) -> bool:
        return name in self.sessions.live

    def live_names(self) -> list[str]:
        return list(self.sessions.live)

    def subscriber_lagged(self, name: str) -> None:
        self.sessions.lagged(name)

    async def stored_status(self, name: str) -> Status:
        return (await self.sessions.stored_session(name, history=False)).status

    def event_seq_here(self, name: str) -> int | None:
        hub = self.sessions.hubs.get(name)
        # the last published: an event withheld until it is stored is published after
        return hub.published if hub is not None and name in self.sessions.live else None

    def created_here(self, name: str) -> datetime.datetime | None:
        actor = self.sessions.live.get(name)
        return actor.session.created_at if actor is not None and actor.is_ready else None

    def events_here(self, name: str, after: int) -> list[Event] | None:
        hub = self.sessions.hubs.get(name)
        if hub is None or name not in self.sessions.live or not hub.ring_covers(after):
            return None
        return hub.ring_after(after)

    def lost_here(self, name: str, after: int) -> EventsExpiredError | None:
        hub = self.sessions.hubs.get(name)
        actor = self.sessions.live.get(name)
        if hub is None or actor is None:
            return None
        if hub.lost(after):
            return hub.lost_error(after)
        erased = actor.journal.erased  # (an edit erased them; the store may not say so yet)
        return expired_error_at(name, after, erased) if after < erased else None

    async def open_subscription_here(self, name: str, after: int | None) -> EventIterator:
        return await self.sessions.open_subscription(name, after)


def _joined(actor: Actor, name: str, key: str | None, text: str) -> Turn | None:
    """The turn a request with idempotency key ``key`` and ``text`` joins: the one
    running or queued with that key (same id, same outcome), or the completed one's
    stored reply; IdempotencyKeyReusedError if that turn began with other words,
    ReplyRemovedError if its reply is no longer in the history."""
    if key is None:
        return None
    if actor.is_ready:  # first: a request queued with the key may not have been looked at
        session = actor.session
        done = session.completed.get(key)
        if done is not None:
            reused = other_words(session, name, key, done.turn_id, text)
            if reused is not None:
                raise reused
            if done.reply is None:  # an edit removed it: the turn never runs again
                raise reply_removed_error(name, key, done.turn_id)
            reply = Reply(turn_id=done.turn_id, message=done.reply)
            return new_turn(done.turn_id, name, Pending.resolved(reply), replayed=True)
        waiting = waiting_reply(session, key)
        if waiting is not None:  # (known after a wake too, unlike the mail it came by)
            reused = other_words(session, name, key, waiting.turn_id, text)
            if reused is not None:
                raise reused
            done_since = session.open_since(waiting.turn_id)
            return new_turn(
                waiting.turn_id,
                name,
                Pending.resolved(waiting),
                since=done_since,
                joined_at=_published(actor),
            )
    inflight = actor.inflight_keys.get(key)
    if inflight is not None:
        turn_id = inflight.turn_id
        # (a turn resumed after a crash, or after a review, came by a mail without
        # words: the session's history holds them)
        if inflight.text or actor.is_ready:
            reused = other_words(actor.session, name, key, turn_id, text, inflight.text)
            if reused is not None:
                raise reused
        since: int | None = None  # queued: its events are all to come
        if not actor.queued or turn_id not in actor.queued:
            since = actor.session.open_since(turn_id) if actor.is_ready else 0
        return new_turn(turn_id, name, inflight.pending, since=since, joined_at=_published(actor))
    return None


def _published(actor: Actor) -> int:
    """The seq of the last event ``actor``'s session published (0: none, or no hub)."""
    return actor.hub.published if actor.hub is not None else 0


async def _or_not_routed(awaitable: Awaitable[Any]) -> Any:
    result = await awaitable
    return NOT_ROUTED if result is None else result


def _enqueue(
    actor: Actor,
    text: str,
    given: str | None = None,
    *,
    forwarded: bool = False,
    chain: Within = (),
) -> Pending | None:
    """A turn without idempotency key in ``actor``'s mailbox at once (under ``given`` if
    the session takes it; ``forwarded`` by another worker; asked for from within the
    turns of ``chain``): its result slot; None if the mailbox is full (the caller waits for
    room) or closed (it looks again)."""
    pending = Pending()
    turn_id = actor.new_turn_id(given)
    try:
        actor.send.send_nowait(TurnMail(turn_id, text, None, pending, forwarded, chain))
    except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
        return None
    actor.note_queued(turn_id)  # (the actor runs no sooner than our caller parks)
    return pending
