"""The caller's side: SessionRef (a cheap handle over one dispatcher) and Turn.

A ref turns each call into one typed request (``_requests``) and hands it to
the registry's dispatcher, which decides where the session runs. It checks
its arguments first: nothing the store would refuse reaches a session.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, NoReturn, Protocol

import attrs
import trio

from ._codec import MAX_TEXT_CHARS
from ._errors import (
    Advice,
    AdviceKind,
    EventsExpiredError,
    FencedOutError,
    SessionActorsError,
    SessionCrashedError,
    SessionStoppedError,
    WorkerUnreachableError,
    advised,
)
from ._events import Event, TurnCancelled, TurnFailed, TurnFinished, TurnStarted
from ._final import NoPublicConstructor
from ._history_input import check_messages
from ._metadata import plain_metadata
from ._pending import Pending
from ._records import Message, ReviewRequest, SessionState, TurnOutcome, check_unicode
from ._requests import (
    AddMessages,
    Call,
    Cancel,
    Hibernate,
    ReplaceHistory,
    Reply,
    ResolveReview,
    Retry,
    Rewind,
    SetMetadata,
    SetSummary,
    Stop,
    Truncate,
)
from ._subscription import EventIterator, shown_seq
from ._turns import MAX_TURN_ID_CHARS

__all__ = [
    "MAX_TEXT_CHARS",
    "Dispatcher",
    "SessionRef",
    "Turn",
    "check_after",
    "check_message",
    "check_text",
    "check_type",
]


class Dispatcher(Protocol):
    """Where a ref's requests go: the registry's dispatcher (here or elsewhere)."""

    async def submit(self, name: str, text: str, key: str | None, *, ack: bool) -> Turn: ...
    def enqueue(self, name: str, text: str) -> Pending | None: ...
    def submit_nowait(self, name: str, text: str, key: str | None) -> Turn: ...
    async def call(self, name: str, request: Call | Cancel | Stop) -> Any: ...
    async def read(self, name: str) -> SessionState: ...
    async def outcome(self, name: str, turn_id: str) -> TurnOutcome: ...
    async def open_subscription(self, name: str, after: int | None) -> EventIterator: ...
    def runs_here(self, name: str) -> bool: ...
    def refuse_wait(self, name: str, *, turn: bool = True) -> None: ...

    #: How requests reach other workers (None: this registry is alone).
    router: Any


@attrs.define(eq=False, repr=False)
class Turn(metaclass=NoPublicConstructor):
    """A submitted turn; ``await turn.reply()`` waits for its outcome. Made by ``submit``."""

    _made_by = "ref.submit(...) returns one"

    _id: str = attrs.field(alias="id")
    session_id: str
    _pending: Pending = attrs.field(alias="pending")
    _replayed: bool = attrs.field(default=False, alias="replayed")
    #: It joined a turn already under way (its idempotency key's, running or waiting on
    #: a review): the seq after which that turn's events begin (0: not known). None for
    #: a new turn, a queued one, or a replayed one.
    _since: int | None = attrs.field(default=None, alias="since")
    #: For a joined turn: the seq of the last event its session had published when it
    #: joined (a crash's lost verdict for the turn up to there was taken back: it resumed).
    _joined_at: int = attrs.field(default=0, alias="joined_at")
    #: Whether ``replayed`` was known when the turn was made (a turn another worker
    #: accepted): a reply under another id then names the turn that ran for it there
    #: (sent on to the session's next worker), not a completed turn's stored reply.
    _known: bool = attrs.field(default=False, alias="known")

    def __repr__(self) -> str:
        return f"Turn(id={self.id!r}, session_id={self.session_id!r}, replayed={self.replayed})"

    def _replayed_as(self) -> str | None:
        """The id of the completed turn whose stored reply answered this one, if the
        session found its idempotency key completed only once it looked (``submit_nowait``
        to a session still waking)."""
        pending = self._pending
        if pending.done and pending.error is None:
            turn_id: str = pending.result.turn_id
            if turn_id != self._id:  # (a turn's own reply carries its own id)
                return turn_id
        return None

    @property
    def id(self) -> str:
        """The turn's id: the ``turn_id`` of its events, its reply and its outcome.

        For a replayed turn, the id of the turn that completed with its key. For a
        turn that another worker accepted and, closing before it began, sent on to
        the session's next worker: the id it runs under there, once that worker took it.
        """
        if self._replayed:
            return self._id
        return self._replayed_as() or self._pending.renamed or self._id

    @property
    def replayed(self) -> bool:
        """True when its idempotency key had already completed: the stored reply, no new turn.

        Known when ``submit`` returns. A ``submit_nowait`` to a session that is still
        waking cannot look its key up at once: until its reply is known (``turn.done``)
        such a turn reads not replayed, under an id of its own that ``turn_outcome``
        also answers; once the session found the key completed, ``replayed`` is True
        and ``id`` is the completed turn's.
        """
        if self._known:
            return self._replayed
        return self._replayed or self._replayed_as() is not None

    async def reply(self) -> Reply:
        """Wait for the turn's reply.

        Raises TurnFailedError, TurnCancelledError, SessionCrashedError or
        SessionStoppedError for the turn's other outcomes. Cancelling the
        wait abandons it; the turn runs on.
        """
        reply: Reply = await self._pending.wait()
        return reply

    @property
    def done(self) -> bool:
        """Whether the outcome is known."""
        return self._pending.done


def known_reply(turn: Turn) -> Reply:
    """The reply of a turn whose outcome is known (``turn.done``), or raise its error,
    without waiting: for a host that answers after its trio run has ended."""
    pending = turn._pending
    assert pending.done, "only for a done turn"
    if pending.error is not None:
        raise pending.error
    reply: Reply = pending.result
    return reply


def joined(turn: Turn) -> tuple[int | None, int]:
    """For a ``turn`` that joined its idempotency key's turn under way: the seq after
    which that turn's events begin (None if it joined none: a new turn, or one still
    queued), and the seq its session had published when it joined (see ``taken_back``)."""
    return turn._since, turn._joined_at


def taken_back(event: Event, joined_at: int) -> bool:
    """Whether ``event`` is a crash's lost verdict that the restarted session took back:
    published before a stream joined the turn (at ``joined_at``), which then resumed."""
    return event.__class__ is TurnFailed and event.lost and event.seq <= joined_at


def new_turn(
    turn_id: str,
    session_id: str,
    pending: Pending,
    *,
    replayed: bool = False,
    known: bool = False,
    since: int | None = None,
    joined_at: int = 0,
) -> Turn:
    """A Turn waiting on ``pending`` (for the dispatcher and routers). ``known``:
    whether ``replayed`` is known for good (see ``Turn._known``); ``since``: it joined
    a turn under way, whose events follow that seq, when the session had published up
    to ``joined_at`` (see ``Turn._since``)."""
    return Turn._create(
        id=turn_id,
        session_id=session_id,
        pending=pending,
        replayed=replayed,
        known=known,
        since=since,
        joined_at=joined_at,
    )


@attrs.define(eq=False, repr=False)
class SessionRef(metaclass=NoPublicConstructor):
    """A handle to a session by name; holding one keeps nothing alive.

    Made by ``registry.ref(name)`` (and ``spawn``, ``get_or_spawn``). A request
    through it wakes the session if it is hibernated; it raises
    SessionNotFoundError if the name is neither live nor stored.
    """

    _made_by = "use registry.ref(name), registry.spawn(name) or registry.get_or_spawn(name)"

    _dispatcher: Dispatcher
    session_id: str

    def __repr__(self) -> str:
        return f"<SessionRef {self.session_id!r}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SessionRef):
            return NotImplemented
        return self._dispatcher is other._dispatcher and self.session_id == other.session_id

    def __hash__(self) -> int:
        return hash((id(self._dispatcher), self.session_id))

    # ---- turns -------------------------------------------------------------------

    async def send(self, text: str, *, idempotency_key: str | None = None) -> Reply:
        """Run one turn and wait for its reply (after it is durable).

        With ``idempotency_key``, a retry joins or replays the key's turn instead of
        running another; the key sent with other words raises
        IdempotencyKeyReusedError (see the idempotency how-to).
        """
        sid = self.session_id
        check_text(sid, text)
        pending = None
        if idempotency_key is None:  # the common case: queued at once, no Turn made
            pending = self._dispatcher.enqueue(sid, text)
        if pending is None:
            _check_key(sid, idempotency_key)
            turn = await self._dispatcher.submit(sid, text, idempotency_key, ack=False)
            pending = turn._pending
        reply: Reply = await pending.wait()  # Turn.reply(), one coroutine less
        return reply

    async def submit(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Put a turn in the mailbox, waiting for room; don't wait for the reply."""
        check_text(self.session_id, text)
        _check_key(self.session_id, idempotency_key)
        return await self._dispatcher.submit(self.session_id, text, idempotency_key, ack=True)

    def submit_nowait(self, text: str, *, idempotency_key: str | None = None) -> Turn:
        """Like ``submit``, but raise MailboxFullError instead of waiting for room.

        It does no I/O, so it reaches only sessions that are live in this process
        or can be woken here: a session live on another worker fails the turn with
        SessionBusyError (``submit`` forwards it).
        """
        check_text(self.session_id, text)
        _check_key(self.session_id, idempotency_key)
        return self._dispatcher.submit_nowait(self.session_id, text, idempotency_key)

    async def retry(self) -> Reply:
        """Run the last turn again if it failed or was cancelled, and wait for its reply.

        What that turn left after its user message (the marked "no reply" message,
        an interrupted partial reply, its tool calls and results) is removed, and a
        new turn (a new turn id; its ``TurnStarted`` names the old one in
        ``retry_of``) answers the same user message: the history holds it once.
        The calls of tools that must not run twice (``idempotent=False``) stay, with
        their results, so that the new turn's model sees that they ran.
        Queued behind the requests before it, like a turn. Raises
        NothingToRetryError if the last turn did not fail and was not cancelled,
        or if a user message has joined the history after it. What it removes is
        erased as a history edit's is: the new turn's first write is the session's
        snapshot, and the events before the removal leave the journal and the replay
        buffers.
        """
        reply: Reply = await self._dispatcher.call(self.session_id, Retry())
        return reply

    # ---- reads and control -------------------------------------------------------

    async def turn_outcome(self, turn_id: str) -> TurnOutcome:
        """What became of turn ``turn_id``: queued, running, waiting (on a review),
        finished (with its reply), failed (with the error), cancelled, or lost.

        Served without waiting behind queued turns; it answers after hibernation
        and restarts too, for the session's last 256 turns. Lost means that the
        turn was accepted but will never run and left nothing in the history (the
        session crashed, stopped or closed before the turn was durable): send it
        again. A turn that its registry's close cut off while it ran (its worker
        stopped) reads failed, its error beginning "SessionStoppedError: ": what it
        streamed is kept, marked interrupted; send the message again. Cancelled means
        that ``cancel()`` cut it, or that ``stop()`` ended it while it waited on a
        review. Raises TurnNotFoundError if the session never issued
        ``turn_id`` (another session's id, or one of its form that it could not have
        issued: stamped more than 10 minutes before it was created or after now, or of
        over 200 characters), or no longer keeps its outcome.
        """
        check_type(self.session_id, "turn_id", turn_id, str)
        return await self._dispatcher.outcome(self.session_id, turn_id)

    async def history(self) -> list[Message]:
        """The messages so far (a copy), without waiting behind queued turns."""
        return list((await self._dispatcher.read(self.session_id)).messages)

    async def state(self) -> SessionState:
        """The session's whole state, without waiting behind queued turns.

        Its ``event_seq`` is the seq of the last event its messages reflect: draw the
        messages, then subscribe with ``after=state.event_seq`` to follow on. Read while
        a turn streams its reply, the messages end with the turn's user message (the
        reply so far is in no message), and ``event_seq`` is before the turn's deltas:
        the subscription replays those its session still holds (see ``subscribe``).
        A stopped session's state is read from the store.
        """
        return await self._dispatcher.read(self.session_id)

    async def cancel(self, turn_id: str | None = None) -> bool:
        """Cancel the turn in flight (with ``turn_id``, only if it is that turn), out of
        band; whether it was cancelled.

        Its waiter gets TurnCancelledError; what it streamed is kept, marked
        interrupted, once the turn has ended (its ``TurnCancelled`` event): this
        returns as soon as the turn is told to stop. Without ``turn_id`` it cancels
        whichever turn is in flight.
        With ``turn_id`` (``turn.id``, ``reply.turn_id``, or a ``TurnStarted``
        event's) it cancels only that turn, and answers False if another turn (or
        none) is in flight: a stop pressed as its turn ends does not cancel the
        turn queued behind it, which may be another caller's. A turn still queued
        is not cancelled either (False): ask again once it started. A ``turn_id``
        that names no turn of this session is just not in flight (False); one that
        is not a str raises TypeError.
        """
        if turn_id is not None:
            check_type(self.session_id, "turn_id", turn_id, str)
            if len(turn_id) > MAX_TURN_ID_CHARS or not turn_id.isascii():
                await trio.lowlevel.checkpoint()
                return False  # (no turn id looks like this)
        cancelled: bool = await self._dispatcher.call(self.session_id, Cancel(turn_id=turn_id))
        return cancelled

    async def hibernate(self) -> None:
        """Snapshot the session to the store and end its task, after the queued requests.

        If requests arrive meanwhile, the snapshot is written and the session
        stays live to serve them. A session that is not live is left alone.
        """
        await self._dispatcher.call(self.session_id, Hibernate())

    async def stop(self) -> None:
        """Finish the session: the turn in flight completes, queued requests fail
        with SessionStoppedError, and later requests raise SessionStoppedError. A
        turn that waits on a review ends cancelled (a stopped session takes no
        review); one that the registry's close cuts off while the stop waits for it
        ends failed, as any turn the close cuts off does.

        Stopping a stopped session does nothing. If the store refuses the stop,
        this raises (a ``StoreError``, say) and the session is not stopped: it
        restarts from its durable state. If the store does not answer in time,
        the error says the session may not be stopped. Either way, calling
        ``stop()`` again is safe.
        """
        await self._dispatcher.call(self.session_id, Stop())

    # ---- reviews and history edits ---------------------------------------------

    async def review(self, review_id: str, approve: bool, note: str | None = None) -> Reply:
        """Approve (the tool runs) or deny (the model is told, with ``note``) a pending
        review; the turn then goes on, and this returns its reply (which may list
        further reviews)."""
        sid = self.session_id
        check_type(sid, "review_id", review_id, str)
        check_type(sid, "approve", approve, bool)
        if note is not None:
            check_text(sid, note, "note")
        request = ResolveReview(review_id=review_id, approve=approve, note=note)
        reply: Reply = await self._dispatcher.call(sid, request)
        return reply

    async def pending_reviews(self) -> list[ReviewRequest]:
        """The reviews this session waits on (at most one at a time)."""
        return list((await self._dispatcher.read(self.session_id)).reviews)

    async def truncate(self, keep_last: int) -> int:
        """Drop all but the last ``keep_last`` messages; returns how many were removed.

        More are kept when the cut falls inside a turn: it moves back to the user
        message that began it, so the history (and the next model request, after
        the system prompt and summary) begins with a user message, as every chat
        API wants, and no tool call is parted from its results. In a history with
        no user message before the cut, it moves back only to keep a tool call
        with its results. ``keep_last=0`` drops everything.

        A checkpoint (when it removes messages): the session's snapshot is written
        with the edit, and the events before it leave the store's journal and the
        replay buffers, so the removed text is replayed by nothing
        (``subscribe(after=)`` a seq before it raises EventsExpiredError).
        """
        check_type(self.session_id, "keep_last", keep_last, int)
        if keep_last < 0:
            raise ValueError(
                f"keep_last must be >= 0, not {keep_last} (session {self.session_id!r})"
            )
        removed: int = await self._dispatcher.call(self.session_id, Truncate(keep_last=keep_last))
        return removed

    async def rewind(self, message_id: str) -> int:
        """Drop every message after ``message_id`` (keeping a tool call's results);
        returns how many were removed.

        A checkpoint (when it removes messages): the session's snapshot is written
        with the edit, and the events before it leave the store's journal and the
        replay buffers, so the removed text is replayed by nothing
        (``subscribe(after=)`` a seq before it raises EventsExpiredError).
        """
        check_type(self.session_id, "message_id", message_id, str)
        removed: int = await self._dispatcher.call(self.session_id, Rewind(message_id=message_id))
        return removed

    async def set_summary(self, text: str) -> None:
        """Set the summary the model sees after the system prompt ("" clears it).

        A checkpoint: the session's snapshot is written with it, and the events
        before it (an earlier summary among them) leave the store's journal and the
        replay buffers (``subscribe(after=)`` a seq before it raises
        EventsExpiredError)."""
        check_text(self.session_id, text, "summary")
        await self._dispatcher.call(self.session_id, SetSummary(text=text))

    async def set_metadata(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``changes`` into the session's metadata; returns the metadata as it now is.

        A merge, not a replacement: the keys given are set, a key given as ``None``
        is removed, the others stay (``set_metadata({"tier": "gold", "trial":
        None})``). The change is journaled (it survives hibernation and restarts),
        published as a ``MetadataChanged`` event carrying the whole new metadata,
        and served in mailbox order, after the turns queued before it. Refused with
        ``SessionBusyError`` while a tool call waits on its review: the call acts for
        the metadata its turn was made with (its ``ToolContext``).

        A checkpoint when it replaces a key's value by another or removes the key
        (the event's ``replaced`` names them): the session's snapshot is written
        with it (one snapshot write, where a change that only adds keys is a small
        journal append), and the events before it leave the store's journal and the
        replay buffers, so the old value is replayed by nothing (``subscribe(after=)``
        a seq before it raises EventsExpiredError). The keys stay (``replaced`` names
        them, in the event that stays): keep what is personal in values, not in keys.

        Metadata is plain data, as for ``spawn(metadata=...)`` (floats finite):
        anything else raises ``TypeError`` or ``ValueError`` naming the session, before
        anything is written.

        The metadata, as it is after the merge, is at most ``MAX_METADATA_BYTES``
        (64 KiB) encoded: labels, ids, flags. Every listing entry
        (``registry.sessions()``, the gateway's ``GET /sessions``) carries the whole
        metadata, and every turn writes it again; more raises ``ValueError`` naming
        the session, the size and the limit. Store a reference to a large value
        instead of the value. Metadata stored before the limit may be larger: a change
        that leaves it no larger is taken, so that it can shrink.
        """
        sid = self.session_id
        # (the size is checked on the merge: a change may shrink larger metadata stored before)
        request = SetMetadata(changes=plain_metadata(sid, changes))
        metadata: dict[str, Any] = await self._dispatcher.call(sid, request)
        return metadata

    async def add_messages(self, messages: Iterable[Message]) -> None:
        """Append ``messages`` to the history without calling the model.

        For messages that no turn of this session produced: a person's reply in a
        support chat (``sa.Message.create(sa.Role.ASSISTANT, "...")``), a system
        note, or a conversation imported from elsewhere, tool calls and results
        included. The next turn's model request holds them, after the messages
        already there. Any role may be added; an assistant message with tool calls
        must come with one tool message per call right after it, in the same call.

        The messages are journaled together (they survive hibernation and
        restarts), published as one ``MessageAdded`` event each (with no
        ``turn_id``), and served in mailbox order, after the turns queued before.
        Refused before anything is written: anything but ``sa.Message`` records,
        or a field of the wrong type (``TypeError``), a message longer than a turn's
        may be (its content, with an assistant message's tool call arguments, over
        1,048,576 characters, as ``send`` refuses) and what cannot be stored
        (``ValueError``), and an id that is empty, given twice or already in the
        history, or a tool call separated from its results
        (:class:`InvalidHistoryError`); ``SessionBusyError`` while a review is pending.
        """
        sid = self.session_id
        request = AddMessages(messages=check_messages(sid, messages, "add_messages"))
        await self._dispatcher.call(sid, request)

    async def replace_history(self, messages: Iterable[Message]) -> None:
        """Replace the whole history with ``messages`` (``[]`` clears it), without
        calling the model.

        The system prompt, summary, metadata and turn outcomes stay. Published as a
        ``HistoryEdited`` event (``reason="replace_history"``) that removes every
        message, then one ``MessageAdded`` per new message, all journaled together;
        served in mailbox order. The messages are checked as for
        :meth:`add_messages` (ids need only be unique among themselves), but a message
        the history holds, given back unchanged (same id and fields), is not checked
        again: ``ref.replace_history(await ref.history())`` always succeeds, for a
        session stored before a limit too (a longer tool result, metadata with a NaN).

        A checkpoint (when it removes messages), for a redacted copy: the session's
        snapshot is written with the replacement in place of a journal append, and
        the events before it leave the store's journal and the replay buffers, so
        the removed text is replayed by nothing (``subscribe(after=)`` a seq before
        it raises EventsExpiredError).
        """
        sid = self.session_id
        request = ReplaceHistory(messages=check_messages(sid, messages, "replace_history"))
        await self._dispatcher.call(sid, request)

    # ---- events --------------------------------------------------------------------

    def subscribe(self, after: int | None = None) -> _Subscription:
        """Events of this session: live from now on, or replayed from ``after``.

        An async context manager yielding an async iterator. ``after=seq``
        first replays every still-available event with a larger seq
        (EventsExpiredError if some are gone), then continues live with no
        gap and no duplicate. The replay reads the store a page at a time, as the
        reader takes it: a reader that a snapshot's trim of the journal overtakes
        gets EventsExpiredError there (reload the state with ``ref.state()``).
        Subscribing does not wake an idle session, nor decode its history (it reads
        where its events stand and its status: the same cost for a long conversation
        as for a short one); one whose process died in the middle of a turn (a turn
        open, no review pending) is woken by a registry that has its agent, so that
        the turn ends and the subscriber sees its outcome. With other workers (a
        ``RedisStore``), a subscription to a session that runs nowhere wakes it where
        a request would: its owner publishes its events.

        It ends when the session is stopped or the registry closes. When the
        session is deleted, iterating raises ``SessionNotFoundError`` after the last
        event, saying that the session was deleted (a session spawned again under its
        name is another one: subscribe to it anew). It raises
        ``SubscriberLaggedError`` if the reader fell behind (or, for a session that
        runs on another worker, its events were interrupted on their way through the
        store: its message says which), and
        the wake's error if a wake of the session fails while it is open (the
        name not stored, the store or the snapshot failing): subscribe again,
        with ``after=`` the last seq read, once the cause is fixed.

        ``after`` beyond the session's last event (a seq it never reached: a
        client's stale or forged Last-Event-ID, one of a deleted session of the
        same name, one from before its store was restored from a backup) raises
        EventsExpiredError on entering, whose ``oldest_seq`` is the seq after the
        session's last, rather than a subscription that says nothing until the
        session's seq passes ``after``; so does ``after`` inside a turn that died
        with its process (never stored; with ``leases=True``, unless another
        process holds the session's lease: it is live there). Reload the state
        with ``ref.state()``, which wakes the session (resuming a turn that died),
        and subscribe with ``after=state.event_seq``, or with
        ``after=exc.oldest_seq - 1``. A session that is not live is read from the
        store for this, without waking it (nor waiting for a wake under way, for a
        seq the store holds), but for a seq inside a turn that died with its
        process: this registry, if it has the session's agent, wakes it then, to
        name the seq its events go on from; one live on another worker is asked
        (it may be ahead of the store: deltas are not stored).
        """
        check_after(self.session_id, after)
        return _Subscription(self._dispatcher, self.session_id, after)

    def stream(self, text: str, *, idempotency_key: str | None = None) -> _InBlock:
        """Submit a turn and iterate over that turn's events only, ending with its outcome.

        The outcome is ``TurnFinished``, ``TurnFailed`` (``lost=True`` if the session
        crashed and the turn is void) or ``TurnCancelled``; if the session's events
        end first (it was deleted or stopped, its wake failed, or the registry
        closed), or the worker that ran it died or lost the session's lease
        (``FencedOutError``, as ``send`` raises), iterating raises the turn's error
        instead (for a deleted session, ``SessionNotFoundError`` saying so). With
        ``idempotency_key``, a turn sent again after its worker died is followed
        under its new turn id (a second ``TurnStarted``); a stream whose key
        joins a turn already under way (running, or waiting on a review) first yields
        that turn's events published so far that are still available (see
        ``subscribe``), from its ``TurnStarted``.

        A turn that pauses for a review is followed through it: the stream yields its
        ``ReviewRequested`` and then waits, for as long as the review does, for the
        rest of the turn (the tool's result, the next answer, the outcome), where
        ``send`` returns at once with ``reply.reviews``. A web handler that must not
        hold its response while a person decides ends it at ``ReviewRequested``, as the
        HTTP gateway's stream does, and the client follows the turn with
        ``subscribe`` once it resolved the review.

        A text or key that ``send`` refuses raises its error here, when called, before
        anything is sent (a web handler can answer it before it starts a response).
        """
        check_message(self.session_id, text, idempotency_key)
        self._dispatcher.refuse_wait(self.session_id)  # (it waits on the turn)
        return _InBlock(self._stream(text, idempotency_key), "ref.stream(text)", self.session_id)

    @asynccontextmanager
    async def _stream(
        self, text: str, idempotency_key: str | None
    ) -> AsyncIterator[AsyncIterator[Event]]:
        async with self.subscribe() as live:
            turn = await self.submit(text, idempotency_key=idempotency_key)
            events, before = live, 0
            if turn._since is not None:
                # it joined a turn under way (its key's), which published events before
                # this subscription began: follow that turn from its start instead
                before = turn._joined_at
                events = await self._open_from(turn._since)
                live.close()

            async def only_this_turn() -> AsyncGenerator[Event, None]:
                if turn.replayed:  # no new turn ran: nothing to stream
                    return
                following = named = turn.id
                # a turn that runs here publishes its outcome even if its actor crashes
                # (lost=True); one whose worker dies or loses the session may end
                # without one, or run under a new id (sent on to the session's next
                # worker when the first closed before starting it): where the turns
                # that started since began, to read a renamed one's events again once
                # ``turn.id`` names it (the next worker took it) or its reply does
                source: EventIterator = events
                starts: dict[str, int] = {}
                runs_here, name = self._dispatcher.runs_here, self.session_id
                alone = self._dispatcher.router is None  # (no other worker)
                async with AsyncExitStack() as stack:

                    async def again(read: EventIterator, start: int) -> EventIterator:
                        """The session's events again from ``start`` on (those still
                        available); ``read``, read no more, is closed (it would fill)."""
                        read.close()
                        source = await self._open_from(start - 1)
                        stack.callback(source.close)
                        return source

                    while True:
                        event: Event | None = None
                        if alone and not turn.done and runs_here(name):
                            try:  # (one worker: its turn here publishes its outcome)
                                event = await source.__anext__()
                            except StopAsyncIteration:
                                break
                        else:  # a quiet while is looked into: a worker that loses the
                            # session mid-turn publishes nothing more of it
                            with trio.move_on_after(_OUTCOME_CHECK):
                                try:
                                    event = await source.__anext__()
                                except StopAsyncIteration:
                                    break
                        turn_id = getattr(event, "turn_id", None)  # (None: a quiet while)
                        if turn_id != following:
                            renamed = turn.id
                            if renamed != named and not turn.done:
                                # sent on to the session's next worker under this id
                                following = named = renamed
                                start = starts.get(renamed)
                                if start is not None:  # its events went by: again
                                    source = await again(source, start)
                                    continue
                        if event is None:  # a quiet while: is the turn over elsewhere?
                            if turn.done:
                                ran_as = await _ran_as(turn, runs_here(name))
                                if ran_as is None:  # no outcome will come
                                    break
                                if ran_as and ran_as != following:
                                    following = ran_as
                                    start = starts.get(ran_as)
                                    if start is not None:  # its events went by: again
                                        source = await again(source, start)
                            continue
                        if (
                            turn_id != following
                            and idempotency_key is not None
                            and isinstance(event, TurnStarted)
                            and event.idempotency_key == idempotency_key
                        ):
                            # its worker died mid-turn and the key ran it again, as a new
                            # turn
                            following = event.turn_id
                        if turn_id != following or taken_back(event, before):
                            if isinstance(event, TurnStarted):
                                starts[event.turn_id] = event.seq
                                if len(starts) > _STARTS_KEPT:
                                    del starts[next(iter(starts))]
                            continue
                        yield event
                        if isinstance(event, TurnFinished | TurnFailed | TurnCancelled):
                            return
                # the events ended before the turn's outcome (the session was deleted,
                # stopped, or the registry closed), or the worker that ran it died: its
                # caller's error ends the stream
                reply = await turn.reply()
                if reply.reviews:  # (its caller was answered: it waits on a review)
                    await self._ended_waiting(following)

            gen = only_this_turn()
            try:
                yield gen
            finally:
                try:
                    await gen.aclose()
                finally:
                    events.close()

    async def _ended_waiting(self, turn_id: str) -> None:
        """The events of a stream ended while its turn ``turn_id`` waited on a review:
        raise why (the session was deleted, the registry closed)."""
        outcome = await self.turn_outcome(turn_id)
        raise advised(
            SessionStoppedError,
            f"the events of session {self.session_id!r} ended while turn {turn_id!r} "
            f"waited on a review (it reads {outcome.status.value} now); ",
            Advice(kind=AdviceKind.FOLLOW_TURN),
            session_id=self.session_id,
        )

    async def _open_from(self, after: int) -> EventIterator:
        """A subscription that replays the events after ``after`` still available."""
        while True:
            try:
                return await self._dispatcher.open_subscription(self.session_id, after)
            except EventsExpiredError as exc:  # (trimmed meanwhile: again, from there)
                after = exc.oldest_seq - 1


#: Seconds without an event after which a stream checks whether its turn ended
#: without an outcome it will ever see (its worker died: see ``_ran_as``).
_OUTCOME_CHECK = 1.0
#: How many other turns' starts a stream remembers while it waits for its own turn.
_STARTS_KEPT = 4096


async def _ran_as(turn: Turn, here: bool) -> str | None:
    """For a finished ``turn`` whose outcome event has not come after a quiet while: the
    id it ran under (its reply's), "" if its outcome event is on its way (it failed
    where it ran, or its session crashed ``here``, whose restart publishes the outcome
    it finds, or that the turn is lost, however long its read of the store takes),
    None if none will come: the worker that ran it died or lost it, or it never ran
    (the caller's error says so)."""
    try:
        reply = await turn.reply()
    except SessionCrashedError:
        return "" if here else None
    except (WorkerUnreachableError, FencedOutError):
        return None
    except SessionStoppedError as exc:
        return "" if exc.turn_id else None  # (cut off as it ran: its outcome is kept)
    except SessionActorsError:
        return ""
    return reply.turn_id


class _Subscription:
    """``async with ref.subscribe(after) as events: async for event in events``."""

    __slots__ = ("_after", "_dispatcher", "_entered", "_iterator", "_session_id")

    def __init__(self, dispatcher: Dispatcher, session_id: str, after: int | None) -> None:
        self._dispatcher = dispatcher
        self._session_id = session_id
        self._after = after
        self._entered = False  # (at once: an entry still opening counts)
        self._iterator: EventIterator | None = None

    async def __aenter__(self) -> EventIterator:
        if self._entered:
            raise entered_twice(self._session_id, "ref.subscribe()")
        self._entered = True
        self._iterator = await self._dispatcher.open_subscription(self._session_id, self._after)
        return self._iterator

    async def __aexit__(self, *exc: object) -> None:
        if self._iterator is not None:
            self._iterator.close()

    def __aiter__(self) -> NoReturn:
        raise not_in_block("ref.subscribe()")


def entered_twice(session_id: str, form: str) -> RuntimeError:
    """The error for entering one ``{form}`` (a subscription or a stream) again: its
    caller's bug, not the session's state (as trio's for a cancel scope used twice)."""
    what = "a subscription to" if form == "ref.subscribe()" else "a stream of"
    return RuntimeError(
        f"{what} session {session_id!r} is entered once; call {form} again for another"
    )


def not_in_block(form: str) -> TypeError:
    """The error for ``async for event in {form}``: the ``async with`` was forgotten."""
    return TypeError(
        f"{form} is an async context manager, not an iterator of events: write "
        f"`async with {form} as events:` and then `async for event in events:`"
    )


class _InBlock:
    """A context manager of events that says how to use it when iterated directly."""

    __slots__ = ("_entered", "_form", "_manager", "_session_id")

    def __init__(
        self,
        manager: AbstractAsyncContextManager[AsyncIterator[Event]],
        form: str,
        session_id: str,
    ):
        self._manager = manager
        self._form = form
        self._session_id = session_id
        self._entered = False

    async def __aenter__(self) -> AsyncIterator[Event]:
        if self._entered:
            raise entered_twice(self._session_id, self._form)
        self._entered = True
        return await self._manager.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._manager.__aexit__(*exc)

    def __aiter__(self) -> NoReturn:
        raise not_in_block(self._form)


def check_type(session_id: str, what: str, value: object, kind: type) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(
            f"{what} for session {session_id!r} must be {kind.__name__}, "
            f"not {type(value).__name__} ({value!r:.60})"
        )


def check_message(session_id: str, text: object, idempotency_key: object = None) -> None:
    """TypeError or ValueError if ``send``/``submit`` would refuse this text or key (for
    front ends that must refuse a request before they create its session)."""
    check_text(session_id, text)
    _check_key(session_id, idempotency_key)


def check_after(session_id: str, after: object) -> None:
    """TypeError or ValueError if ``subscribe`` would refuse this ``after``."""
    if after is not None:
        check_type(session_id, "after", after, int)
        assert isinstance(after, int)
        if after < 0:
            raise ValueError(
                f"after for session {session_id!r} must be a seq (>= 0), not {shown_seq(after)}"
            )


def check_text(session_id: str, text: object, what: str = "a message") -> None:
    """TypeError or ValueError if ``text`` (``what`` for the session: a message, a
    summary, a note, a system prompt) is no str, is longer than a message may be or
    holds what cannot be stored."""
    if not isinstance(text, str):
        raise TypeError(f"{what} to session {session_id!r} must be str, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(
            f"{what} of {len(text):,} characters to session {session_id!r} is over the "
            f"limit of {MAX_TEXT_CHARS:,}; send large documents in parts or by reference"
        )
    check_unicode(text, f"{what} to session {session_id!r}")


def _check_key(session_id: str, key: object) -> None:
    if key is None:
        return
    if not isinstance(key, str):
        raise TypeError(
            f"idempotency_key for session {session_id!r} must be str or None, "
            f"not {type(key).__name__} ({key!r:.60})"
        )
    if not key or len(key) > 1024:
        raise ValueError(
            f"idempotency_key for session {session_id!r} must be 1 to 1024 characters, "
            f"not {len(key)}"
        )
    check_text(session_id, key, "idempotency_key")
