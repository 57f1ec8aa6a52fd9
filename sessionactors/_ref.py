"""The caller's side: SessionRef (a cheap handle), Turn and Reply."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._actor import Actor, CallRequest, LeaseHeldError, Pending, TurnRequest
from ._errors import MailboxFullError, SessionCrashedError, SessionStoppedError
from ._events import Event, TurnCancelled, TurnFailed, TurnFinished
from ._records import Message, ReviewRequest, SessionState, new_id

if TYPE_CHECKING:
    from ._cluster import Cluster
    from ._registry import Registry

__all__ = ["Reply", "SessionRef", "Turn"]


@attrs.frozen(kw_only=True)
class Reply:
    """The answer to one turn.

    ``message`` is the final assistant message (``None`` while the turn waits
    on ``reviews``).
    """

    turn_id: str
    message: Message | None
    reviews: tuple[ReviewRequest, ...] = ()

    @property
    def text(self) -> str:
        """The reply's text ("" while waiting on a review)."""
        return self.message.content if self.message is not None else ""


def _reply(outcome: tuple[str, Message | None, tuple[ReviewRequest, ...]]) -> Reply:
    turn_id, message, reviews = outcome
    return Reply(turn_id=turn_id, message=message, reviews=reviews)


@attrs.define(eq=False)
class Turn:
    """A submitted turn; ``await turn.reply()`` waits for its outcome."""

    id: str
    session_id: str
    _pending: Pending = attrs.field(alias="pending", repr=False)
    #: True when an idempotency key had already completed: the stored reply, no new turn
    replayed: bool = False

    async def reply(self) -> Reply:
        """Wait for the turn's reply.

        Raises TurnFailedError, TurnCancelledError, SessionCrashedError or
        SessionStoppedError for the turn's other outcomes. Cancelling the
        wait abandons it; the turn runs on.
        """
        return _reply(await self._pending.wait())

    @property
    def done(self) -> bool:
        """Whether the outcome is known."""
        return self._pending.done


@attrs.define(eq=False, repr=False)
class SessionRef:
    """A handle to a session by name; holding one keeps nothing alive.

    A request through it wakes the session if it is hibernated; it raises
    SessionNotFoundError if the name is neither live nor stored.
    """

    _registry: Registry = attrs.field(alias="registry")
    session_id: str
    #: Serve requests in this process only, never forwarding them to another worker
    #: (a worker serving a request that another one forwarded to it).
    _local: bool = attrs.field(default=False, kw_only=True, alias="local")

    def __repr__(self) -> str:
        return f"<SessionRef {self.session_id!r}>"

    def _cluster(self) -> Cluster | None:
        return None if self._local else self._registry._cluster

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SessionRef):
            return NotImplemented
        return self._registry is other._registry and self.session_id == other.session_id

    def __hash__(self) -> int:
        return hash((id(self._registry), self.session_id))

    # ---- turns -------------------------------------------------------------------

    async def send(self, text: str, *, idempotency_key: str | None = None) -> Reply:
        """Run one turn and wait for its reply (after it is durable)."""
        _check_text(self.session_id, text)
        turn = await self._submit(text, idempotency_key, ack=False)
        return _reply(await turn._pending.wait())  # Turn.reply(), one coroutine less

    async def submit(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Put a turn in the mailbox, waiting for room; don't wait for the reply."""
        _check_text(self.session_id, text)
        return await self._submit(text, idempotency_key, ack=True)

    async def _submit(self, text: str, idempotency_key: str | None, *, ack: bool) -> Turn:
        # ``ack``: a turn forwarded to another worker returns once accepted there
        # (else once answered: ``send`` needs only the reply, a round trip less).
        cluster = self._cluster()
        for _ in range(100):
            if cluster is not None and cluster.owned_elsewhere(self.session_id):
                forwarded = await cluster.submit(self.session_id, text, idempotency_key, ack=ack)
                if forwarded is not None:
                    return forwarded
            actor = self._registry._activate(self.session_id)
            if not actor.is_ready:
                try:
                    await actor.ready()
                except LeaseHeldError:
                    if cluster is None:
                        raise
                    cluster.held_elsewhere(self.session_id)  # live on another worker
                    continue
            turn = self._dedupe(actor, idempotency_key)
            if turn is not None:
                await trio.lowlevel.checkpoint()
                return turn
            turn, request = self._new_turn(text, idempotency_key)
            try:
                await actor.send.send(request)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                await self._registry._after_closed_mailbox(actor)
                continue
            if idempotency_key is not None and not request.pending.done:
                # Joinable only once it is in the mailbox: a request abandoned while it
                # waited for room must leave no joiner waiting forever. A same-key request
                # queued meanwhile is answered from the first one's reply by the actor.
                actor.inflight_keys.setdefault(idempotency_key, request)
            return turn
        raise SessionStoppedError(  # pragma: no cover - a session flapping without end
            f"session {self.session_id!r} kept closing its mailbox; try again",
            session_id=self.session_id,
        )

    def submit_nowait(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Like ``submit``, but raise MailboxFullError instead of waiting for room.

        It does no I/O, so it reaches only sessions that are live in this process
        or can be woken here: a session live on another worker fails the turn with
        SessionBusyError (``submit`` forwards it).
        """
        _check_text(self.session_id, text)
        actor = self._registry._activate(self.session_id)
        turn = self._dedupe(actor, idempotency_key)
        if turn is not None:
            return turn
        turn, request = self._new_turn(text, idempotency_key)
        try:
            actor.send.send_nowait(request)
        except trio.WouldBlock:
            raise MailboxFullError(
                f"the mailbox of session {self.session_id!r} is full "
                f"({self._registry.config.mailbox_size} requests waiting); "
                "use await ref.submit(...) to wait for room, or retry later",
                session_id=self.session_id,
            ) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._registry._closed_error(actor) from None
        if idempotency_key is not None:
            actor.inflight_keys[idempotency_key] = request
        return turn

    def _new_turn(self, text: str, key: str | None) -> tuple[Turn, TurnRequest]:
        pending = Pending()
        turn_id = new_id("turn")
        return (
            Turn(id=turn_id, session_id=self.session_id, pending=pending),
            TurnRequest(turn_id, text, key, pending),
        )

    def _dedupe(self, actor: Actor, key: str | None) -> Turn | None:
        if key is None:
            return None
        inflight = actor.inflight_keys.get(key)
        if inflight is None and actor.is_ready:
            done = actor.session.completed.get(key)
            if done is not None:
                pending = Pending.resolved((done.turn_id, done.reply, ()))
                return Turn(
                    id=done.turn_id, session_id=self.session_id, pending=pending, replayed=True
                )
        if inflight is None:
            return None
        # the turn already running or queued for this key: same id, same outcome
        return Turn(id=inflight.turn_id, session_id=self.session_id, pending=inflight.pending)

    # ---- reads and control -------------------------------------------------------

    async def history(self) -> list[Message]:
        """The messages so far (a copy), without waiting behind queued turns."""
        session = await self._registry._ready(self.session_id)
        return list(session.messages)

    async def state(self) -> SessionState:
        """The session's whole state, without waiting behind queued turns.

        A stopped session's state is read from the store.
        """
        session = await self._registry._ready(self.session_id)
        state = session.to_state()
        hub = self._registry._hubs.get(self.session_id)
        if hub is not None and hub.seq > state.event_seq:
            state = attrs.evolve(state, event_seq=hub.seq)
        return state

    async def cancel(self) -> bool:
        """Cancel the turn in flight, out of band; whether there was one."""
        await trio.lowlevel.checkpoint()
        actor = self._registry._live.get(self.session_id)
        cluster = self._cluster()
        if actor is None and cluster is not None:  # maybe live on another worker
            return bool((await cluster.call(self.session_id, "cancel", {}))[1])
        return actor is not None and actor.cancel_turn()

    async def hibernate(self) -> None:
        """Snapshot the session to the store and end its task, after the queued requests.

        If requests arrive meanwhile, the snapshot is written and the session
        stays live to serve them. A session that is not live is left alone.
        """
        actor = self._registry._live.get(self.session_id)
        if actor is None:
            cluster = self._cluster()
            if cluster is not None:  # maybe live on another worker
                await cluster.call(self.session_id, "hibernate", {})
            await trio.lowlevel.checkpoint()
            return
        await self._call(actor, "hibernate", {})

    async def stop(self) -> None:
        """Finish the session: the turn in flight completes, queued requests fail
        with SessionStoppedError, and later requests raise SessionStoppedError.

        Stopping a stopped session does nothing. If the store refuses the stop,
        this raises (a ``StoreError``, say) and the session is not stopped: it
        restarts from its durable state. If the store does not answer in time,
        the error says the session may not be stopped. Either way, calling
        ``stop()`` again is safe.
        """
        cluster = self._cluster()
        for _ in range(100):
            actor = self._registry._activate(self.session_id)
            try:
                await actor.ready()
            except SessionStoppedError:
                if self._registry._closing:
                    raise
                return
            except LeaseHeldError:
                if cluster is None:
                    raise
                if (await cluster.call(self.session_id, "stop", {}))[0]:
                    return
                continue  # free again: stop it here
            if await self._registry._stop(actor):
                return
        raise SessionCrashedError(  # pragma: no cover - a session that never holds still
            f"session {self.session_id!r} kept leaving before it could stop; call stop() again",
            session_id=self.session_id,
        )

    async def _call(self, actor: Actor, kind: str, args: dict[str, object]) -> object:
        pending = Pending()
        try:
            await actor.send.send(CallRequest(kind, args, pending))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            await trio.lowlevel.checkpoint()
            return None
        return await pending.wait()

    async def _request(self, kind: str, args: dict[str, object]) -> Any:
        """A non-turn request in mailbox order, waking the session if needed."""
        cluster = self._cluster()
        for _ in range(100):
            if cluster is not None and cluster.owned_elsewhere(self.session_id):
                sent, result = await cluster.call(self.session_id, kind, args)
                if sent:
                    return result
            actor = self._registry._activate(self.session_id)
            pending = Pending()
            try:
                await actor.send.send(CallRequest(kind, args, pending))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                await self._registry._after_closed_mailbox(actor)
                continue
            try:
                return await pending.wait()
            except LeaseHeldError:  # the wake found the session live on another worker
                if cluster is None:
                    raise
                cluster.held_elsewhere(self.session_id)
        raise SessionStoppedError(  # pragma: no cover
            f"session {self.session_id!r} kept closing its mailbox; try again",
            session_id=self.session_id,
        )

    # ---- reviews and history edits ---------------------------------------------

    async def review(self, review_id: str, approve: bool, note: str | None = None) -> Reply:
        """Approve (the tool runs) or deny (the model is told, with ``note``) a pending
        review; the turn then goes on, and this returns its reply (which may list
        further reviews)."""
        result = await self._request(
            "review", {"review_id": review_id, "approve": approve, "note": note}
        )
        turn_id, message, reviews = result
        return Reply(turn_id=turn_id, message=message, reviews=reviews)

    async def pending_reviews(self) -> list[ReviewRequest]:
        """The reviews this session waits on (at most one at a time)."""
        session = await self._registry._ready(self.session_id)
        return list(session.reviews.values())

    async def truncate(self, keep_last: int) -> int:
        """Drop all but the last ``keep_last`` messages (more if a tool call and its
        results would be split); returns how many were removed."""
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, not {keep_last}")
        removed: int = await self._request("truncate", {"keep_last": keep_last})
        return removed

    async def rewind(self, message_id: str) -> int:
        """Drop every message after ``message_id`` (keeping a tool call's results);
        returns how many were removed."""
        removed: int = await self._request("rewind", {"message_id": message_id})
        return removed

    async def set_summary(self, text: str) -> None:
        """Set the summary the model sees after the system prompt ("" clears it)."""
        await self._request("set_summary", {"text": text})

    # ---- events --------------------------------------------------------------------

    def subscribe(self, after: int | None = None) -> _Subscription:
        """Events of this session: live from now on, or replayed from ``after``.

        An async context manager yielding an async iterator. ``after=seq``
        first replays every still-available event with a larger seq
        (EventsExpiredError if some are gone), then continues live with no
        gap and no duplicate. Subscribing does not wake the session.
        """
        return _Subscription(self._registry, self.session_id, after)

    @asynccontextmanager
    async def stream(
        self, text: str, *, idempotency_key: str | None = None
    ) -> AsyncIterator[AsyncIterator[Event]]:
        """Submit a turn and iterate over that turn's events only, ending with its outcome."""
        async with self.subscribe() as events:
            turn = await self.submit(text, idempotency_key=idempotency_key)

            async def only_this_turn() -> AsyncGenerator[Event, None]:
                if turn.replayed:  # no new turn ran: nothing to stream
                    return
                async for event in events:
                    if getattr(event, "turn_id", None) != turn.id:
                        continue
                    yield event
                    if isinstance(event, TurnFinished | TurnFailed | TurnCancelled):
                        return

            gen = only_this_turn()
            try:
                yield gen
            finally:
                await gen.aclose()


class _Subscription:
    """``async with ref.subscribe(after) as events: async for event in events``."""

    def __init__(self, registry: Registry, session_id: str, after: int | None) -> None:
        self._registry = registry
        self._session_id = session_id
        self._after = after
        self._iterator: object = None

    async def __aenter__(self) -> AsyncIterator[Event]:
        iterator = await self._registry._open_subscription(self._session_id, self._after)
        self._iterator = iterator
        return iterator

    async def __aexit__(self, *exc: object) -> None:
        from ._subscription import EventIterator

        assert isinstance(self._iterator, EventIterator)
        self._iterator.close()


#: The longest message a turn accepts, in characters (journal entries stay loadable).
MAX_TEXT_CHARS = 8 * 1024 * 1024


def _check_text(session_id: str, text: object) -> None:
    if not isinstance(text, str):
        raise TypeError(
            f"a message to session {session_id!r} must be str, not {type(text).__name__}"
        )
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(
            f"a message of {len(text):,} characters to session {session_id!r} is over the "
            f"limit of {MAX_TEXT_CHARS:,}; send large documents in parts or by reference"
        )
