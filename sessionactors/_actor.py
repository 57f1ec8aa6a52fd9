"""The session actor: one trio task that owns a session, reached through its mailbox.

Turns run one at a time in mailbox order. Reads (history, state) and
``cancel`` are served out of band. The actor's life is one :class:`Phase`,
changed only by the actor's own methods (the registry asks through
``request_stop``, ``close``, ``abort`` and ``kill``); supervision, which
restarts it after a crash, lives in ``_supervisor``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Final, Protocol, TypeVar

import attrs
import trio

from ._agent import Agent, run_turn
from ._codec import MAX_SEQ, metadata_size
from ._config import RegistryConfig
from ._errors import (
    Advice,
    AdviceKind,
    AgentNotFoundError,
    FencedOutError,
    IdempotencyKeyReusedError,
    LeaseHeldError,
    MessageNotFoundError,
    NothingToRetryError,
    Part,
    Private,
    ReviewNotFoundError,
    ReviewResolvedError,
    SessionActorsError,
    SessionBusyError,
    SessionCrashedError,
    SessionNotFoundError,
    SessionStoppedError,
    SnapshotCorruptError,
    SnapshotError,
    StoreError,
    TurnCancelledError,
    TurnFailedError,
    TurnNotFoundError,
    TurnTimeoutError,
    advised,
    cut_off_error,
    is_public,
    key_reused_error,
    naming_turn,
    never_began_error,
    reply_removed_error,
    shown,
    stopped_error,
)
from ._events import (
    Event,
    HistoryEdited,
    MessageAdded,
    MetadataChanged,
    ReviewResolved,
    StatusChanged,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    make_message_added,
    make_turn_finished,
    make_turn_started,
)
from ._history import rewind_end, split_for_keep_last
from ._history_input import KnownIds, check_content, check_entry, check_new_ids
from ._hub import SEQ_GAP, Hub, wake_seq
from ._journal import Journal
from ._metadata import check_info_room, check_metadata, merge_metadata, replaced_keys
from ._nesting import WITHIN, Within
from ._pending import Append, Pending
from ._reading import read_stored, stored_cleanly, stored_seq
from ._records import (
    Message,
    ReviewRequest,
    Role,
    Status,
    ToolCall,
    TurnOutcome,
    TurnStatus,
    maker,
    new_id,
    storable,
    utcnow,
)
from ._requests import (
    AddMessages,
    Call,
    Hibernate,
    ReplaceHistory,
    Reply,
    ResolveReview,
    Retry,
    Rewind,
    SetMetadata,
    SetSummary,
    Truncate,
)
from ._session import MAX_ERROR_CHARS, LiveSession
from ._telemetry import Telemetry, TurnTrace
from ._tool_calls import (
    deny_for_stop,
    kept_on_retry,
    maybe_compact,
    record_result,
    resume_tool_calls,
    run_batch,
    run_tool_calls,
)
from ._tools import describe_exception, stops
from ._turns import new_turn_id, now_us, session_tag, turn_id_time
from .stores._base import Lease, Store

__all__ = [
    "Actor",
    "CallMail",
    "Counters",
    "Host",
    "Phase",
    "TurnMail",
    "crashed_error",
    "deleted_error",
    "describe",
    "waiting_reply",
]

log = logging.getLogger("sessionactors")

#: What cancelled a turn (see ``Actor._cancelled_by``) when ``ref.cancel()`` did: the
#: only cancel that ends a turn cancelled.
CANCEL: Final = "cancel"
#: What cancelled a turn when its agent's ``turn_timeout`` passed: the turn fails.
TIMEOUT: Final = "timeout"


class Phase(enum.Enum):
    """Where an actor incarnation is in its life. Transitions (and only these):

    LOADING -> SERVING (its state is read) | LEFT (the load failed),
               or, while it loads, what SERVING may become
    SERVING -> STOPPING (``request_stop``) | CLOSING (``close``) | ABORTING | LEFT (hibernated)
    CLOSING -> STOPPING | ABORTING (``abort``: the grace ran out) | LEFT
    STOPPING -> LEFT (the stop is durable, or failed: ``stop_error``)
               | ABORTING (interrupted: see ``hibernate_interrupted``)
    ABORTING -> LEFT (hibernated at once)
    any but LEFT -> KILLED (``kill``: deleted, or its lease lost; ``kill_error``)
    KILLED -> LEFT
    """

    LOADING = "loading"
    SERVING = "serving"
    STOPPING = "stopping"
    CLOSING = "closing"
    ABORTING = "aborting"
    KILLED = "killed"
    LEFT = "left"


class TurnMail:
    """A turn in the mailbox (``forwarded``: by another worker, which sends it on to the
    session's next worker if this registry closes before it begins)."""

    __slots__ = ("forwarded", "key", "pending", "text", "turn_id", "within")

    def __init__(
        self,
        turn_id: str,
        text: str,
        key: str | None,
        pending: Pending,
        forwarded: bool = False,
        within: Within = (),
    ) -> None:
        self.turn_id = turn_id
        self.text = text
        self.key = key
        self.pending = pending
        self.forwarded = forwarded
        #: The turns its caller's code was part of (see ``_nesting``): they wait on it.
        self.within = within


class CallMail:
    """A request other than a turn, served in mailbox order."""

    __slots__ = ("pending", "request")

    def __init__(self, request: Call, pending: Pending) -> None:
        self.request = request
        self.pending = pending


Mail = TurnMail | CallMail
#: The event a turn ends with.
Outcome = TurnFinished | TurnFailed | TurnCancelled


class _Signal:
    """A marker the serving loop passes to itself, never a caller's request."""


#: The request a wake makes for itself: finish the turn its process left open.
RESUME: Final = _Signal()
#: What a turn that failed or was cancelled leaves in the history after its user
#: message when its last model step streamed no text to keep (that text, when there is
#: some, is kept instead): a marked assistant message (``interrupted``), so that the
#: next user message never follows a user message.
NO_REPLY_FAILED: Final = "(no reply: this turn failed)"
NO_REPLY_CANCELLED: Final = "(no reply: this turn was cancelled)"
#: How many turns answered by a completed key's stored reply an actor remembers.
_MAX_REMEMBERED: Final = 100
#: How many turns refused before they started (while a review waited, or by a wake
#: that could not load their session) a host remembers, for every session.
_REFUSED_KEPT: Final = 10_000
#: How many resolved reviews a host remembers, for every session (see ``Host.reviewed``).
_REVIEWED_KEPT: Final = 10_000
_make_reply: Final = maker(Reply)
_V = TypeVar("_V")
#: What the serving loop returns to leave a turn scope that was cancelled as a turn
#: ended (the turn was settled as it ended): the next turn gets a fresh scope.
RESCOPE: Final = _Signal()


@attrs.frozen
class Resolved:
    """How a review was resolved: in which session, resuming which turn, which way."""

    session_id: str
    turn_id: str
    approved: bool


class Counters:
    """The registry's running counters, kept by the actors (see ``Registry.statistics``)."""

    __slots__ = (
        "crashes",
        "failed",
        "hibernated",
        "idle_hibernations",
        "leases_lost",
        "requests_refused",
        "restarts",
        "spawned",
        "turns_cancelled",
        "turns_completed",
        "turns_failed",
        "unclean_wakes",
        "woken",
    )

    def __init__(self) -> None:
        self.spawned = self.woken = self.hibernated = self.idle_hibernations = 0
        self.crashes = self.restarts = self.failed = self.leases_lost = 0
        self.turns_completed = self.turns_failed = self.turns_cancelled = 0
        self.requests_refused = self.unclean_wakes = 0


class Host(Protocol):
    """What an actor needs from the table of live sessions that runs it."""

    store: Store
    config: RegistryConfig
    stats: Counters
    worker_id: str
    telemetry: Telemetry | None
    #: Turns refused here before they started (while a review waited, or by a wake
    #: that could not load their session: its lease held elsewhere, say), with why:
    #: their outcome, which no store records.
    refused: dict[str, str]
    #: Reviews resolved here, by id (the latest ``_REVIEWED_KEPT``): a retry of the same
    #: decision is answered as it was, the other decision refused saying what was decided.
    reviewed: dict[str, Resolved]
    #: The closing registry stopped waiting for its sessions: they end at once.
    given_up: bool

    @property
    def dead(self) -> bool:
        """Whether the test kit's ``crash`` stands for this process's death."""
        ...

    @property
    def closing(self) -> bool: ...
    def agent_for(self, session: LiveSession) -> Agent: ...
    def hub_for(self, session_id: str) -> Hub: ...
    def detach(self, actor: Actor) -> None: ...
    def replace(self, old: Actor, new: Actor) -> None: ...
    def mark_failed(
        self, actor: Actor, reason: str | Private, retry_after: float | None = None
    ) -> None:
        """Refuse the session's requests: for ``retry_after`` seconds, or for good."""
        ...

    def unwritten(self, session_id: str, error: Exception) -> None:
        """The session's acknowledged state could not be written as it left."""
        ...

    def interrupted(self) -> None:
        """Something not an Exception escaped a session: end the registry at once."""
        ...

    def unclean_woke(self, session_id: str) -> bool:
        """The session woke after an unclean stop: whether to log that at WARNING (the
        first few of many in a short time; the others are logged at DEBUG, and the host
        tells how many they were, and which, in one WARNING)."""
        ...


class Actor:
    """One incarnation of a session's actor. Live things are compared by identity."""

    __slots__ = (
        "_cancelled_by",
        "_cut",
        "_jump_due",
        "_load_scope",
        "_ready",
        "_rescope",
        "_system_cache",
        "after_crash",
        "done",
        "due",
        "fence",
        "held",
        "host",
        "hub",
        "in_turn",
        "inflight_keys",
        "journal",
        "kill_error",
        "known_ids",
        "lease",
        "load_error",
        "partial",
        "phase",
        "queued",
        "receive",
        "renewed",
        "replays",
        "restarted",
        "room_waits",
        "run_scope",
        "send",
        "session",
        "session_id",
        "stop_error",
        "tag",
        "trace",
        "turn_id",
        "turn_mail",
        "turn_scope",
        "unanswered",
    )

    def __init__(self, host: Host, session_id: str, session: LiveSession | None) -> None:
        self.host = host
        self.session_id = session_id
        self.session: LiveSession = session  # type: ignore[assignment]  # set by load
        self.phase = Phase.LOADING if session is None else Phase.SERVING
        self._ready: trio.Event | None = None if session is not None else trio.Event()
        self._load_scope: trio.CancelScope | None = None  # the wake's read, while it lasts
        #: The wake (from a clean hibernation) jumps its seq with the first status it
        #: journals (see ``load``).
        self._jump_due = False
        self.send, self.receive = trio.open_memory_channel[Mail](host.config.mailbox_size)
        self.journal = Journal(host.store, host.config, session_id, host.telemetry)
        self.hub: Hub | None = None
        self.turn_mail: TurnMail | None = None  # the turn in flight, answered when it ends
        self.turn_scope: trio.CancelScope | None = None  # made by the first turn
        self.in_turn = False  # a turn is running in turn_scope: cancel() may cut it
        self._cut: tuple[Pending, str | None] | None = None  # the turn a cut would settle
        self._rescope = False  # leave turn_scope at the next request (see _drive)
        #: What cancelled turn_scope (``cancel_turn``), set once, when it is cancelled:
        #: CANCEL (``ref.cancel()``), or why the registry's close cut the turn off ("cut":
        #: see ``abort``). The first wins: a turn that one cancel cut ends as that one says,
        #: whatever comes while it lets go, and whatever the session is doing by then.
        self._cancelled_by: str | None = None
        self.turn_id = ""
        self.partial: list[str] = []
        self.trace: TurnTrace | None = None  # the turn in flight's, with telemetry
        self.inflight_keys: dict[str, TurnMail] = {}  # idempotency key -> its turn
        # idempotency key -> set once the request with it that waits for mailbox room
        # is queued or gave up (the dispatcher's: same-key requests join it)
        self.room_waits: dict[str, trio.Event] | None = None
        # A closing turn's answer, kept until the closing snapshot says whether it was
        # stored (its turn_mail stays set meanwhile): (error, reply)
        self.held: tuple[BaseException | None, Reply] | None = None
        self.stop_error: SessionActorsError | None = None  # why a requested stop failed
        self.kill_error: SessionActorsError | None = None  # why it was killed
        self.load_error: SessionActorsError | None = None
        self.run_scope: trio.CancelScope | None = None  # set by the supervisor
        self.done: trio.Event | None = None  # made when someone waits for it to leave
        #: The lease this incarnation holds: renewed, and released as it leaves. None once
        #: released, or lost (another worker took the session over), or never claimed.
        self.lease: Lease | None = None
        #: The fencing token of the lease it claimed, put on every write it makes; kept
        #: when the lease is released or lost, so that a write made after that (a
        #: shielded one that a kill does not stop) is refused by the store, never sent
        #: without a token (which the store would not check).
        self.fence: int | None = None
        #: When (trio time) the last claim or renewal of the lease that the store
        #: confirmed was sent: the store holds the lease until lease_ttl after it, at
        #: least, and perhaps no longer (see ``Sessions.renew_leases``).
        self.renewed = 0.0
        self._system_cache: (
            tuple[tuple[str | None, str | None, str], tuple[Message, ...]] | None
        ) = None
        self.known_ids: KnownIds | None = None  # made by the first add_messages
        self.tag = session_tag(session_id)  # what its turn ids carry
        self.queued: set[str] | None = None  # ids of the turns in its mailbox
        #: A turn's outcome event while its commit runs: published once it is stored.
        self.due: Outcome | None = None
        #: The turn a write of which the store did not answer in time (see ``bounded``).
        self.unanswered = ""
        #: Set by the supervisor on an incarnation that follows a crash: the outcome the
        #: crashed one could not publish (its commit raised), and the events that say its
        #: turns are void; published once this one has read what the store kept.
        self.after_crash: tuple[Outcome | None, list[TurnFailed]] | None = None
        # turns answered by the stored reply of a completed key: id -> the completed turn's
        self.replays: dict[str, str] | None = None
        #: Set by the supervisor on an incarnation that follows one that had loaded the
        #: session in this process and crashed: what its wake finds left unstored is
        #: that crash's (logged as the crash), not an unclean stop of another process.
        self.restarted = False

    def __repr__(self) -> str:
        return f"<Actor {self.session_id!r} {self.phase.value}>"

    # ---- what others ask of it (each a documented transition) ----------------------

    def request_stop(self) -> None:
        """``ref.stop()``: take nothing new; the loop stops once the turn in flight ends."""
        if self.phase in (Phase.LOADING, Phase.SERVING, Phase.CLOSING):
            self.phase = Phase.STOPPING
        self.send.close()

    def close(self) -> None:
        """The registry is closing: take nothing new; drain the mailbox, then hibernate."""
        if self.phase in (Phase.LOADING, Phase.SERVING):
            self.phase = Phase.CLOSING
        self.send.close()

    def abort(self) -> None:
        """The shutdown grace ran out: cut the turn in flight and hibernate at once."""
        if self.phase in (Phase.LOADING, Phase.SERVING, Phase.CLOSING):
            self.phase = Phase.ABORTING
        if self._load_scope is not None and not self.acknowledged_unsaved():
            # still waking, and holding nothing answered (a restart after a crash may
            # hold answered turns only a snapshot after this read can keep): give the
            # store's read up
            self._load_scope.cancel()
        self.cancel_turn(by="cut")  # (a stopping session's turn too: it stops after it)

    def kill(self, error: SessionActorsError) -> None:
        """Stop at once, writing nothing (deleted, or its lease lost): waiters get ``error``."""
        if self.phase is not Phase.LEFT:
            self.phase = Phase.KILLED
            self.kill_error = error
            self.journal.killed = error  # (what a write it cuts is recorded as)
        # cancelled first: an actor waiting for mail gets Cancelled, not the EndOfChannel
        # of a closed mailbox, which it would take for a closing registry and hibernate
        if self.run_scope is not None:
            self.run_scope.cancel()
        self.send.close()

    def note_inflight(self, key: str, mail: TurnMail) -> None:
        """A turn with an idempotency key is in the mailbox: callers with its key join it."""
        self.inflight_keys.setdefault(key, mail)

    def cancel_turn(self, turn_id: str | None = None, *, by: str = CANCEL) -> bool:
        """Cancel the turn in flight, out of band (only if it is ``turn_id``, when given);
        whether it was cancelled. ``by``: who cancels it (see ``_cancelled_by``)."""
        if not self.in_turn or self.turn_scope is None:
            return False
        if turn_id is not None and turn_id != self.turn_id:
            return False  # (its turn ended: another one runs now)
        self.turn_scope.cancel()
        if self._cancelled_by is None:
            self._cancelled_by = by
        return True

    def new_turn_id(self, given: str | None = None) -> str:
        """A fresh id for a turn of this session (see ``_turns``).

        ``given``: the id another process issued for the turn (the worker that forwarded
        it here, so that its caller can name the turn if this one dies before answering),
        taken if this loaded session reads it ``lost``: of its form, newer than every
        record it forgot, neither recorded, under way, queued nor refused, and stamped
        no later than now here (one stamped ahead, within the clocks' leeway, would make
        the ids issued here read as forgotten once its record is dropped). The outcome
        rules then answer for it as for an id of its own.
        """
        if given is not None and self.is_ready:
            stamped = turn_id_time(given)
            try:
                if (
                    stamped is not None
                    and stamped <= now_us()
                    and self.outcome(given).status is TurnStatus.LOST
                ):
                    return given
            except TurnNotFoundError:
                pass
        return new_turn_id(self.tag)

    def note_queued(self, turn_id: str, queued: bool = True) -> None:
        """Note that turn ``turn_id`` is in the mailbox (``queued=False``: it is not, or
        no longer): ``turn_outcome`` reads such a turn as queued."""
        ids = self.queued
        if queued:
            if ids is None:
                ids = self.queued = set()
            ids.add(turn_id)
        elif ids:
            ids.discard(turn_id)

    def outcome(self, turn_id: str) -> TurnOutcome:
        """What became of ``turn_id``, with what this incarnation knows (loaded); a turn
        answered by a completed key's stored reply has that turn's outcome."""
        replays = self.replays
        if replays:
            turn_id = replays.get(turn_id, turn_id)
        return self.session.outcome(turn_id, queued=self.queued, refused=self.host.refused)

    def _refuse(self, mail: TurnMail, error: SessionActorsError) -> None:
        """Answer a turn that cannot start with ``error``; remember it (in memory).

        Its subscribers hear it too, as a ``TurnFailed`` (published, never journaled:
        the turn left nothing in the history), or ``ref.stream`` would wait forever
        for the outcome of a turn that never began.
        """
        mail.pending.set_error(error)
        self._never_began(mail.turn_id, error)
        _remember(self.host.refused, mail.turn_id, str(error), _REFUSED_KEPT)
        if mail.key is not None:  # a retry with this key runs again once it can
            self.inflight_keys.pop(mail.key, None)

    def _never_began(self, turn_id: str, error: BaseException) -> None:
        """Tell subscribers that turn ``turn_id``, which never began, failed with
        ``error``: a ``TurnFailed``, published and never journaled."""
        self.emit(
            TurnFailed(
                session_id=self.session_id,
                seq=self.next_seq(),
                turn_id=turn_id,
                error=describe(error),
                error_kind=type(error).__name__,
                error_public=is_public(error),
            )
        )

    def chain(self) -> Within:
        """The turns that its running turn's tools are part of (see ``_nesting``): its
        own, and those its caller's chain named."""
        mail = self.turn_mail
        return ((self.host, self.session_id), *(mail.within if mail is not None else ()))

    @property
    def deleted(self) -> bool:
        return self.phase is Phase.KILLED and isinstance(self.kill_error, SessionNotFoundError)

    @property
    def stopping(self) -> bool:
        return self.phase is Phase.STOPPING

    @property
    def running(self) -> bool:
        """Whether a turn of the session is under way (not waiting on a review)."""
        return self.is_ready and self.session.status is Status.RUNNING

    # ---- out-of-band reads -------------------------------------------------

    async def ready(self) -> LiveSession:
        """Wait until the state is loaded; raise what the load raised."""
        if self._ready is not None:
            await self._ready.wait()
            if self.load_error is not None:
                raise self.load_error
        else:
            await trio.lowlevel.checkpoint()
        return self.session

    @property
    def is_ready(self) -> bool:
        """Whether this incarnation has its state (read from the store, or given)."""
        return self._ready is None

    # ---- TurnContext / TurnHost ----------------------------------------------------

    def request_messages(self, agent: Agent | None = None) -> Sequence[Message]:
        session = self.session
        if agent is None:
            agent = self.host.agent_for(session)
        key = (session.system_prompt, session.summary, agent.system_prompt)
        cache = self._system_cache
        if cache is None or cache[0] != key:
            cache = self._system_cache = (key, session.system_messages(agent.system_prompt))
        return session.view(cache[1])

    def delta(self, text: str) -> None:
        (self.hub or self._hub()).delta(self.turn_id, text)

    def add_message(self, message: Message) -> None:
        self.durable(
            make_message_added(
                session_id=self.session_id,
                seq=self.next_seq(),
                turn_id=self.turn_id,
                message=message,
            )
        )

    def run_tool_calls(self, agent: Agent, calls: Sequence[ToolCall]) -> Awaitable[bool]:
        return run_tool_calls(self, agent, calls)  # its coroutine: no layer of our own

    # ---- event plumbing ----------------------------------------------------------

    def _hub(self) -> Hub:
        """The session's hub, made on the first event (an idle session needs none)."""
        hub = self.hub
        if hub is None:
            hub = self.hub = self.host.hub_for(self.session_id)
            hub.advance(self.session.event_seq)
        return hub

    def next_seq(self) -> int:
        return (self.hub or self._hub()).next_seq()

    def emit(self, event: Event) -> None:
        (self.hub or self._hub()).publish(event)

    def durable(self, event: Event, *, publish: bool = True) -> Event:
        self.session.apply(event)
        self.journal.add(event)
        if publish:
            (self.hub or self._hub()).publish(event)
        return event

    def _set_status(self, status: Status) -> None:
        """Change the status; publish it unless a turn's own events say it (running:
        ``TurnStarted``; idle: the turn's outcome)."""
        session = self.session
        if session.status is status:
            return
        session.status = status
        if status is not Status.RUNNING and status is not Status.IDLE:
            self.emit(StatusChanged(session_id=self.session_id, seq=self.next_seq(), status=status))

    def commit(self, *, compact: bool = True, append: Append | None = None) -> Awaitable[None]:
        """Make the unsaved journal events durable (per the durability policy), with
        ``append`` if given (see ``Pending.write_outcome``): the journal's write, to
        await (no coroutine of our own around it)."""
        hub = self.hub
        return self.journal.commit(
            self.session,
            self.fence,
            hub.seq if hub is not None else 0,
            compact=compact,
            append=append,
        )

    async def compact(self) -> None:
        """The snapshot that compacts the journal, if it is due (``commit`` takes it after
        its append unless told not to): best effort, a failure only defers it."""
        if self.journal.compaction_due():
            hub = self.hub
            await self.journal.compact(self.session, self.fence, hub.seq if hub is not None else 0)

    async def _write_snapshot(self, status: Status) -> None:
        await self.journal.write_snapshot(
            self.session, self.fence, max(self._hub().seq, self.session.event_seq), status
        )

    @contextlib.contextmanager
    def _bounded_write(self) -> Iterator[trio.CancelScope]:
        """Shielded (a cancel must not abandon a write half-way) and bounded by write_bound."""
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(self.host.config.write_bound) as bound,
        ):
            yield bound

    async def bounded(self, write: Awaitable[_V]) -> _V:
        """Await ``write``, store writes that a cancel must not cut half-way (the outcome
        of a turn cancelled as it ended, a call's start before the call runs), shielded
        and bounded by write_bound. If the store does not answer by then, the write is
        not acknowledged, and it may or may not have landed: it fails with a StoreError
        naming the session (the journal's fault), so the session crashes and restarts
        from its durable state, and the turn's caller hears that the store may hold what
        the write held (``unanswered``: see ``crashed_error``'s ``storing``). So does the
        caller of a write the store refused (a StoreError: it may have applied it, as a
        timeout after the server did), but for one fenced out (it wrote nothing)."""
        mail = self.turn_mail
        try:
            with self._bounded_write():
                return await write
        except StoreError as exc:
            if mail is not None and not isinstance(exc, FencedOutError):
                self.unanswered = mail.turn_id
            raise
        sid = self.session_id
        self.unanswered = "" if mail is None else mail.turn_id
        error = self.journal.fault = StoreError(
            f"session {sid!r}: the store did not answer a write in time (within "
            f"{self.host.config.write_bound:g} s): the write may or may not have landed",
            session_id=sid,
        )
        raise error

    def _status_due(self) -> bool:
        """Whether a status must be journaled before this request publishes anything."""
        return self.journal.must_journal_status(self.hub.seq if self.hub is not None else 0)

    async def _journal_status(self) -> None:
        """Journal the resting status now, whatever the durability policy; then publish it.

        A wake jumps seq past a lost incarnation's events only if the store shows
        that the session was live (a journal after its snapshot). This write shows
        it after a clean wake, and it records a jump so that the next one starts above.
        A wake's own jump (made here after a clean hibernation: see ``load``) is
        recorded by it too: its ``skipped_from`` says which seqs no event of this
        history has, for a replay from the store to tell.
        """
        session = self.session
        hub = self._hub()
        if self._jump_due:
            self._jump_due = False
            hub.jump(wake_seq(hub.seq, clean=True), clean=True)
        skipped = hub.unrecorded
        status = session.status = session.resting_status()
        event = StatusChanged(
            session_id=self.session_id,
            seq=self.next_seq(),
            status=status,
            skipped_from=0 if skipped is None else skipped + 1,
        )
        if self.journal.per_turn:
            self.durable(event, publish=False)
            await self.commit()
        else:  # the journal holds only these, and the next snapshot drops them
            session.apply(event)
            await self.journal.append_now(session, event, self.fence)
        self.journal.status_due = False
        if hub.unrecorded == skipped:
            hub.unrecorded = None
        self.emit(event)

    # ---- the lease ---------------------------------------------------------------

    async def claim(self) -> None:
        """Take the session's lease (shared stores): one live owner at a time."""
        host = self.host
        if not host.config.leases:
            return
        sent = trio.current_time()
        lease = await host.store.claim(self.session_id, host.worker_id, host.config.lease_ttl)
        if lease is None:
            raise LeaseHeldError(
                f"session {self.session_id!r} is live on another worker (another registry, "
                "in this process or another, holds the session's lease); send the request "
                "through that worker, or retry after it hibernates the session or its lease "
                "expires",
                session_id=self.session_id,
            )
        self.lease = lease
        self.fence = lease.fence
        self.renewed = sent

    async def _release_lease(self) -> None:
        """Give the lease back, if held (shielded and bounded; a failure only lets it expire).

        Its fence stays: nothing this incarnation writes afterwards is accepted."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        with self._bounded_write(), contextlib.suppress(Exception):
            await self.host.store.release(self.session_id, lease)

    # ---- the loop ---------------------------------------------------------

    async def load(self) -> None:
        """Wake: rebuild the state from the store (snapshot + journal tail)."""
        host = self.host
        sid = self.session_id
        await self.claim()
        session, stored = await read_stored(host.store, sid)
        clean = stored_cleanly(session, stored)
        durable_seq = stored_seq(session, stored)
        if durable_seq + SEQ_GAP > MAX_SEQ:  # a wake's jump must stay a storable seq
            raise SnapshotCorruptError(
                f"session {sid!r} is stored with seq {durable_seq}, too close to the "
                f"largest seq ({MAX_SEQ}) for a wake; the store is damaged: restore it "
                "from a backup or delete the session",
                session_id=sid,
            )
        if session.status is Status.STOPPED:
            stopped = advised(
                SessionStoppedError,
                f"session {sid!r} is stopped and takes no more requests; ",
                Advice(kind=AdviceKind.NEW_SESSION),
                " or delete this one with ",
                Advice(kind=AdviceKind.DELETE),
                session_id=sid,
            )
            stopped._reason = "stop"
            raise stopped
        journal = self.journal
        journal.loaded(stored, durable_seq, session)
        if journal.base is not None:  # (durability="hibernate") answered, not written
            session = LiveSession(journal.base)
        self.session = session
        hub = self.hub = host.hub_for(sid)
        for event in journal.unsaved:  # not durable yet (durability="hibernate"): replay
            session.apply(event)
        known = hub.seq
        hub.advance(max(durable_seq, session.event_seq))
        session.status = session.resting_status()
        # (a jump this hub made that no write recorded yet: see _journal_status)
        journal.status_due = clean or hub.unrecorded is not None
        self._jump_due = False
        if known <= durable_seq:
            # Every wake from the store jumps its seq (see wake_seq), so that no two
            # histories of the session share a seq: one lost with a restored store or a
            # deleted namesake and this one, which the store goes on with. The last
            # incarnation may also have published events past its last durable write
            # (it stopped uncleanly): jump above them at once, and journal that before
            # publishing anything. After a clean hibernation, the jump waits for the
            # first status journaled (a wake that only reads publishes nothing).
            if clean:
                self._jump_due = True
            else:
                hub.jump(wake_seq(durable_seq, clean=False), clean=False)
                journal.status_due = True
        host.stats.woken += 1
        if not clean and not self.restarted:
            host.stats.unclean_wakes += 1
            loud = host.unclean_woke(sid)
            _log_unclean_wake(session, durable_seq, host.config.durability, loud=loud)

    async def run(self) -> None:
        """Serve the mailbox until hibernated, stopped, or closed.

        Turns run inside ``turn_scope``, made by the first request that runs a
        turn and kept for the turns after it: a scope is made again only after a
        cancellation (``ref.cancel()``, or the registry's grace running out) cut a
        turn, which is then settled outside it.
        """
        journal = self.journal
        mail: Mail | _Signal | None = None
        WITHIN.set(None)  # (its task began in whatever code woke it: a tool's, maybe)
        if self._ready is not None:
            ready = self._ready
            loading = self._load_scope = trio.CancelScope()
            if self.phase is Phase.ABORTING:  # (restarted after the grace ran out)
                self.abort()
            try:
                with loading:
                    await self.load()
                if loading.cancelled_caught:  # (see abort) it read nothing: nothing to write
                    raise stopped_error(self.session_id, "closing")
            except SessionActorsError as exc:
                self.load_error = exc
                if self.acknowledged_unsaved():  # (restarted) answered turns it cannot keep
                    self.host.unwritten(self.session_id, exc)
                self.publish_after_crash(loaded=False)
                # not found or stopped: hold nothing, and say so only once the lease is
                # free (a caller may spawn the name elsewhere at once)
                await self._release_lease()
                ready.set()
                self._fail_queued(exc, refused=True)
                self.leave_table()
                return
            self._ready = self._load_scope = None
            if self.phase is Phase.LOADING:
                self.phase = Phase.SERVING
            self.publish_after_crash(loaded=True)
            ready.set()
            open_turn = self.session.open_turn
            if open_turn is not None and not self.session.reviews:
                # (never from a clean hibernation: a hibernated open turn waits on a review)
                journal.settle(self.session)  # what was loaded is answered
                mail = RESUME
                key = open_turn.idempotency_key
                if key is not None:  # a retry with its key joins it: its id, its events
                    self.note_inflight(key, TurnMail(open_turn.turn_id, "", key, Pending()))
        while True:
            if mail is None:
                mail = await self._serve(None, outside=True)
                if mail is None:
                    return  # left
            scope = self.turn_scope = trio.CancelScope()
            self._cancelled_by = None
            with scope:
                if await self._serve(mail, outside=False) is None:
                    return  # left
            mail = None
            self.turn_scope = None
            cut, self._cut = self._cut, None
            if cut is not None:  # the turn in flight was cancelled: settle it here
                by = self._cancelled_by or CANCEL
                await self._settle(*cut, failure=None, final=None, cancelled=by)

    async def _serve(self, mail: Mail | _Signal | None, *, outside: bool) -> Mail | _Signal | None:
        """Serve requests, ``mail`` first, until the actor leaves (None); outside the turn
        scope, return the first request that runs a turn instead of serving it."""
        host = self.host
        journal = self.journal
        idle = host.config.idle_timeout
        receive = self.receive
        while True:
            if mail is None:
                if self._rescope:  # cancelled as a turn ended: a fresh scope for the next
                    self._rescope = False
                    return RESCOPE
                journal.settle(self.session)  # every request before is answered
                if self.phase is Phase.STOPPING:
                    await self._finish_stop()
                    return None
                if self.phase is Phase.ABORTING:
                    self._fail_queued_at_close()
                    await self._hibernate_now()
                    return None
                try:
                    if idle is None:
                        mail = await receive.receive()
                    else:
                        try:  # (a request waiting is served: a deadline too close for
                            # the clock to tell from now expires before a receive)
                            mail = receive.receive_nowait()
                        except trio.WouldBlock:
                            with trio.move_on_after(idle):
                                mail = await receive.receive()
                        if mail is None:
                            host.stats.idle_hibernations += 1
                            if await self._hibernate_idle():
                                return None
                            continue
                except trio.EndOfChannel:
                    # the registry is closing (or the session stopping): queue drained
                    if self.stopping:
                        continue
                    await self._hibernate_now()
                    return None
            if mail is RESUME:
                if outside:
                    return mail
                if self._status_due():
                    await self._journal_status()
                await self.resume_interrupted()
                mail = None
                continue
            assert not isinstance(mail, _Signal)
            if outside and (
                mail.__class__ is TurnMail or isinstance(mail.request, ResolveReview | Retry)  # type: ignore[union-attr]
            ):
                return mail  # served inside the turn scope
            if self._status_due() and (
                mail.__class__ is TurnMail or not isinstance(mail.request, Hibernate)  # type: ignore[union-attr]
            ):
                try:
                    await self._journal_status()
                except BaseException as exc:
                    # the actor crashes over it (and restarts): its caller hears so, and
                    # the subscribers that the turn is void. Fenced out, it stops here
                    # without restarting: its caller gets the FencedOutError (send again),
                    # and the subscribers heard nothing of the turn (its TurnStarted comes
                    # after this write), as for a turn whose own write is fenced out
                    error: SessionActorsError
                    crash = isinstance(exc, Exception) and not isinstance(exc, FencedOutError)
                    if crash:
                        error = crashed_error(self.session_id, exc)
                        error.__cause__ = exc
                    else:
                        error = self.cut_short(exc)
                    mail.pending.set_error(error)
                    if crash and isinstance(mail, TurnMail):
                        lost = self.lost_event(mail.turn_id, exc)
                        if lost is not None:
                            self.emit(lost)
                    raise
            if isinstance(mail, TurnMail):
                drive = self._turn(mail)
                if drive is not None:
                    await drive
                del drive  # an idle actor keeps no spent coroutine alive
            elif await self._call(mail):
                return None
            mail = None  # nor a finished request (its result included)

    def _turn(self, mail: TurnMail) -> Coroutine[Any, Any, None] | None:
        """Start a turn: its driver to await, or None if it was answered at once.

        Not a coroutine itself: a turn in flight keeps one frame less alive.
        """
        if self.queued:
            self.queued.discard(mail.turn_id)
        session = self.session
        sid = self.session_id
        key = mail.key
        if key is not None:
            # (queued before its session could look the key up: submit_nowait to a
            # session still waking) a completed key, or one whose turn waits on a review
            done = session.completed.get(key)
            waiting = waiting_reply(session, key) if done is None else None
            of_key = done.turn_id if done is not None else waiting.turn_id if waiting else None
            reused = None if of_key is None else other_words(session, sid, key, of_key, mail.text)
            if reused is not None:  # the key was taken for other words
                self._refuse(mail, reused)
                return None
            if done is not None and done.reply is None:  # an edit removed its reply
                self.inflight_keys.pop(key, None)
                self._refuse(mail, reply_removed_error(sid, key, done.turn_id))
                return None
            if done is not None:  # it is the completed turn: its id, reply, outcome
                self.inflight_keys.pop(key, None)
                self.replays = _remember(self.replays, mail.turn_id, done.turn_id)
                mail.pending.set_result(Reply(turn_id=done.turn_id, message=done.reply))
                return None
            if waiting is not None:  # its turn waits on a review: as the turn answered
                if self.inflight_keys.get(key) is mail:
                    del self.inflight_keys[key]
                self.replays = _remember(self.replays, mail.turn_id, waiting.turn_id)
                mail.pending.set_result(waiting)
                return None
        if session.reviews:
            review = next(iter(session.reviews.values()))
            self._refuse(mail, _busy_error(sid, review, mail.turn_id))
            return None
        try:
            agent = self.host.agent_for(session)
        except LookupError as exc:  # (a deployment's fault: logged where it is)
            log.error("turn %s of session %r refused: %s", mail.turn_id, sid, exc)
            error = advised(AgentNotFoundError, str(exc), session_id=sid, turn_id=mail.turn_id)
            error.__cause__ = exc
            self._refuse(mail, error)
            return None
        turn_id = self.turn_id = mail.turn_id
        self.turn_mail = mail
        session.status = Status.RUNNING  # (published as the TurnStarted)
        self.durable(  # the user's message joins the history with it
            make_turn_started(
                session_id=sid,
                seq=self.next_seq(),
                turn_id=turn_id,
                text=mail.text,
                idempotency_key=key,
                message_id=new_id("msg"),
                created_at=utcnow(),
            )
        )
        before = self._compact_before if agent.compaction is not None else None
        return self._drive(agent, mail.pending, key, before=before, queued=True)

    async def _compact_before(self, agent: Agent) -> bool:
        await maybe_compact(self, agent)
        return True

    async def _drive(
        self,
        agent: Agent,
        pending: Pending,
        key: str | None,
        before: Callable[[Agent], Awaitable[bool]] | None = None,
        queued: bool = False,
    ) -> None:
        """Run (or resume) the turn loop and settle its outcome.

        ``before`` runs first, inside the turn scope; if it returns False the turn
        pauses (a review) without asking the model. A cancellation leaves the turn
        scope with ``_cut`` set, for ``run`` to settle outside it. ``queued``: a new
        turn from the mailbox, whose wait since its id was issued its trace hears.
        """
        failure: BaseException | None = None
        final: Message | None = None
        self.partial.clear()
        self._cut = (pending, key)
        self.in_turn = True
        scope = None  # the agent's time limit: the turn scope's deadline while it runs
        if agent.turn_timeout is not None:
            scope = self.turn_scope
            if scope is not None:
                scope.deadline = trio.current_time() + agent.turn_timeout
        telemetry = self.host.telemetry
        if telemetry is not None:
            trace = self.trace = telemetry.turn(
                session_id=self.session_id,
                turn_id=self.turn_id,
                agent=self.session.agent,
                queued=self.receive.statistics().current_buffer_used,
            )
            if queued and trace is not None:
                stamped = turn_id_time(self.turn_id)  # (issued as it was accepted)
                if stamped is not None:
                    trace.waited(max(0, now_us() - stamped) / 1_000_000)
        try:
            if self.trace is None:
                if before is None or await before(agent):
                    final = await run_turn(agent, self)
            else:
                with self.trace.activate():
                    if before is None or await before(agent):
                        final = await run_turn(agent, self)
        except BaseException as exc:  # the agent's or model's: this turn's only
            if exc is self.journal.fault or stops(exc):  # (our write failed: restart)
                raise
            failure = exc
        finally:
            self.in_turn = False
            if scope is not None:
                # no deadline from here on (no checkpoint came between: a limit that
                # passed as the turn ended cuts nothing), unless it already cut the turn
                scope.deadline = math.inf
                if scope.cancel_called and self._cancelled_by is None:
                    self._cancelled_by = TIMEOUT
        self._cut = None
        if self._cancelled_by is not None:  # (turn_scope.cancel_called, without the clock)
            # cancelled as the turn ended: settle it as it ended, and have the loop
            # leave the cancelled scope before anything else
            self._rescope = True
            await self.bounded(  # (its writes only: the next commit compacts, if due)
                self._settle(pending, key, failure=failure, final=final, compact=False)
            )
            return
        await self._settle(pending, key, failure=failure, final=final)

    async def _settle(
        self,
        pending: Pending,
        key: str | None,
        *,
        failure: BaseException | None,
        final: Message | None,
        cancelled: str | None = None,
        compact: bool = True,
    ) -> None:
        """Record the turn's outcome durably, publish it, and answer its caller;
        ``cancelled``: what cancelled the turn, if something did (see ``_cancelled_by``;
        "interrupted": something not an Exception escaped it); ``compact``: whether its
        commit may take the compaction snapshot after it.

        Only ``ref.cancel()`` (CANCEL) ends a turn cancelled here (a stop ends a turn
        waiting on a review so too: ``_end_waiting_turn``). A turn that the registry's
        close cut off did not end by anyone's cancel: it fails, with a
        ``SessionStoppedError`` that tells every client to send the message again
        (``cut_off_error``), and its caller gets the ``SessionStoppedError`` of
        ``stopped_error``.
        """
        sid = self.session_id
        turn_id = self.turn_id
        stats = self.host.stats
        outcome: Outcome
        error: BaseException | None = None
        cut = None  # why the registry's close cut it off, if it did
        if cancelled == TIMEOUT:
            cancelled = None
            failure = self._timeout_error()
        elif cancelled is not None and cancelled != CANCEL:
            cut, cancelled = cancelled, None
            failure = cut_off_error(sid, cut)
        if cancelled:
            text = storable("".join(self.partial)) or NO_REPLY_CANCELLED
            self.add_message(Message.create(Role.ASSISTANT, text, interrupted=True))
            outcome = TurnCancelled(session_id=sid, seq=self.next_seq(), turn_id=turn_id)
            if self.phase is Phase.STOPPING:
                error = stopped_error(sid, "stop", turn_id)
            else:
                error = TurnCancelledError(
                    f"turn {turn_id} of session {sid!r} was cancelled; what it streamed is "
                    "kept in the history, marked interrupted",
                    session_id=sid,
                    turn_id=turn_id,
                )
        elif failure is not None:
            # as a cancel does: what the failing model step streamed stays (its
            # subscribers drew it), its tool calls do not (a half call cannot run)
            streamed = storable("".join(self.partial))
            text = streamed or NO_REPLY_FAILED
            self.add_message(Message.create(Role.ASSISTANT, text, interrupted=True))
            said = describe(failure)
            reason = cause_part(failure, said)
            outcome = TurnFailed(
                session_id=sid,
                seq=self.next_seq(),
                turn_id=turn_id,
                error=said,
                error_kind=type(failure).__name__,
                error_public=isinstance(reason, str),
            )
            if cut is not None:  # (a stopping session stops after it: its caller hears so)
                error = stopped_error(sid, "stop" if self.stopping else cut, turn_id)
            else:
                kept = FAILED_KEPT if streamed else ""
                error = advised(
                    TurnFailedError,
                    f"turn {turn_id} of session {sid!r} failed: ",
                    reason,
                    f"{kept}{FAILED_TAIL}",
                    session_id=sid,
                    turn_id=turn_id,
                )
                error.__cause__ = failure
            # once, here (a cut too): front ends tell their clients the kind of what is
            # not public, and send them here for the rest
            if isinstance(failure, SessionActorsError):  # (its message says it all)
                log.warning("turn %s of session %r failed: %s", turn_id, sid, said)
            else:
                log.error("turn %s of session %r failed", turn_id, sid, exc_info=failure)
        elif final is None:
            # paused for a review: the outcome comes when the review is resolved
            self._set_status(Status.WAITING)
            await self.commit(compact=compact)
            pending.set_result(
                Reply(turn_id=turn_id, message=None, reviews=tuple(self.session.reviews.values()))
            )
            self.turn_mail = None
            self.end_trace("waiting", None)
            return
        else:
            outcome = make_turn_finished(
                session_id=sid,
                seq=self.next_seq(),
                turn_id=turn_id,
                message=final,
                idempotency_key=key,
            )
        self.durable(outcome, publish=False)
        # the info written with the outcome says the status the session rests in (a
        # listing elsewhere reads it); idle is what the outcome says, any other is told
        status = self.session.resting_status()
        announce = status is not Status.IDLE and status is not self.session.status
        self.session.status = status
        stored = True
        self.due = outcome  # (a crash now leaves it to the next incarnation: see run)
        # the reply is made after the commit unless the commit sends it (see
        # ``Pending.write_outcome``): a thousand turns waiting for a group commit hold
        # a thousand objects less, each one more for the collector to visit
        reply: Reply | None = None
        if self.phase is Phase.ABORTING:  # closing: the hibernation snapshot compacts
            with self._bounded_write() as bound:
                await self.commit(compact=False)
            stored = not bound.cancelled_caught
        elif self.journal.per_turn:
            write = pending.write_outcome
            if write is not None and error is None:
                reply = _make_reply(turn_id=turn_id, message=final, reviews=())
                await self.commit(compact=compact, append=write(reply))
            else:
                await self.commit(compact=compact)
        if reply is None:
            reply = _make_reply(turn_id=turn_id, message=final, reviews=())
        self.due = None
        # counted once its commit returned (a commit that fails crashes the session: not
        # counted; closing, a commit cut short leaves the turn to the closing snapshot)
        if cancelled:
            stats.turns_cancelled += 1
        elif failure is not None:
            stats.turns_failed += 1
        else:
            stats.turns_completed += 1
        self.emit(outcome)
        if key is not None:
            self.inflight_keys.pop(key, None)
        if announce:
            self.emit(StatusChanged(session_id=sid, seq=self.next_seq(), status=status))
        if self.trace is not None:
            outcome_name = "cancelled" if cancelled else "finished" if failure is None else "failed"
            self.end_trace(outcome_name, failure)
        if not stored:  # answered by the closing snapshot: the turn is in it, or lost
            if self.turn_mail is not None:
                self.held = (error, reply)
            return
        self.turn_mail = None
        if error is not None:
            pending.set_error(error)
        else:
            pending.set_result(reply)

    def _timeout_error(self) -> TurnTimeoutError:
        """The cause of a turn that ran past its agent's ``turn_timeout``."""
        try:
            limit = f"={self.host.agent_for(self.session).turn_timeout:g} s"
        except LookupError:  # (the agent was found when the turn began)
            limit = ""
        return TurnTimeoutError(
            f"turn {self.turn_id} of session {self.session_id!r} ran past its agent's "
            f"turn_timeout{limit} and was cut off; raise Agent.turn_timeout if this "
            "agent's turns take longer",
            session_id=self.session_id,
        )

    def end_trace(self, outcome: str, error: BaseException | None) -> None:
        """Tell the turn's telemetry how it ended (see ``TurnTrace.end``)."""
        trace = self.trace
        if trace is not None:
            self.trace = None
            trace.end(outcome, error)

    def _answer_held(self, *, stored: bool) -> None:
        """Answer a closing turn that waited for the closing snapshot."""
        held, mail = self.held, self.turn_mail
        if held is None or mail is None:
            return
        self.held = self.turn_mail = None
        error, reply = held
        if not stored:
            mail.pending.set_error(stopped_error(self.session_id, "unsaved", mail.turn_id))
        elif error is not None:
            mail.pending.set_error(error)
        else:
            mail.pending.set_result(reply)

    async def _call(self, mail: CallMail) -> bool:
        """Serve a request other than a turn; whether the actor left (hibernated)."""
        request = mail.request
        pending = mail.pending
        try:
            if isinstance(request, Hibernate):
                left = await self._hibernate_if_idle()
                pending.set_result(left)
                return left
            if isinstance(request, ResolveReview):
                await self._resolve_review(request, pending)
                return False
            if isinstance(request, Retry):
                await self._retry(pending)
                return False
            result: Any
            if isinstance(request, SetMetadata):
                # (the call a review waits on acts for the metadata its turn was made with)
                self._refuse_while_reviewing("change its metadata")
                try:
                    merged = self._merged_metadata(request)
                except (TypeError, ValueError) as exc:  # refused before any change
                    pending.set_error(exc)
                    return False
                replaced = replaced_keys(self.session.metadata, request.changes)
                result = await self._set_metadata(merged, replaced)
            elif isinstance(request, AddMessages | ReplaceHistory):
                replace = isinstance(request, ReplaceHistory)
                try:  # here, where the history is: a message it holds is written back as it is
                    check_content(
                        self.session_id,
                        request.messages,
                        "replace_history" if replace else "add_messages",
                        self.session.messages if replace else (),
                    )
                except ValueError as exc:  # refused before any change
                    pending.set_error(exc)
                    return False
                await self._put_messages(request)
                result = None
            else:
                result = await self._edit(request)
        except SessionActorsError as exc:
            if (
                isinstance(request, Hibernate) and not isinstance(exc, SnapshotError)
            ) or exc is self.journal.fault:
                # fenced out, or a write failed: what the request changed in memory is
                # not stored, and no later commit may store it: answer, then restart
                # from the durable state (as a turn whose write fails does)
                pending.set_error(exc)
                raise
            pending.set_error(exc)
            return False
        except BaseException as exc:  # crashed or killed: its waiter must not wait forever
            if self._cut is None:  # (a review's turn that was cut is settled by run)
                pending.set_error(self.cut_short(exc))
            raise
        pending.set_result(result)
        return False

    def cut_short(self, exc: BaseException) -> SessionActorsError:
        """The error for the waiter of a request that ``exc`` interrupted."""
        sid = self.session_id
        if isinstance(exc, SessionActorsError):
            return exc
        if isinstance(exc, Exception):
            return crashed_error(sid, exc)
        if self.kill_error is not None:  # cancelled: the lease was lost, or deleted
            return self.kill_error
        return stopped_error(sid, "closing")

    # ---- reviews and history edits ---------------------------------------------------

    async def _resolve_review(self, request: ResolveReview, pending: Pending) -> None:
        """Approve (run the tool) or deny (tell the model), then let the turn go on."""
        session = self.session
        sid = self.session_id
        review = session.reviews.get(request.review_id)
        if review is None:
            resolved = self.host.reviewed.get(request.review_id)
            if resolved is not None and resolved.session_id == sid:
                pending.set_result(self._resolved_again(request, resolved))
                return
            known = ", ".join(session.reviews) or "none"
            raise advised(
                ReviewNotFoundError,
                f"session {sid!r} has no pending review {shown(request.review_id)} (pending: "
                f"{known}); ",
                Advice(kind=AdviceKind.LIST_REVIEWS),
                session_id=sid,
            )
        try:
            agent = self.host.agent_for(session)
        except LookupError as exc:
            log.error("review of session %r refused, it stays pending: %s", sid, exc)
            raise advised(
                AgentNotFoundError,
                f"{exc}; the review stays pending until the agent is back",
                session_id=sid,
                turn_id=review.turn_id,
            ) from exc
        self.turn_id = review.turn_id
        approve, note = request.approve, request.note
        self.durable(
            ReviewResolved(
                session_id=sid,
                seq=self.next_seq(),
                turn_id=review.turn_id,
                review_id=request.review_id,
                approved=approve,
                note=note,
            )
        )
        _remember(
            self.host.reviewed,
            request.review_id,
            Resolved(sid, review.turn_id, approve),
            _REVIEWED_KEPT,
        )
        self._set_status(Status.RUNNING)
        call = review.tool_call

        async def before(agent: Agent) -> bool:
            if approve:
                await run_batch(self, agent, [call])
            else:
                text = "a reviewer denied this call; it did not run"
                record_result(self, call, f"{text}: {note}" if note else text, True)
            return await resume_tool_calls(self, agent, interrupted=False)

        key = session.open_turn.idempotency_key if session.open_turn is not None else None
        # the turn in flight is this review's: a crash fails its caller (the supervisor
        # fails turn_mail) instead of leaving ref.review() waiting forever
        self.turn_mail = TurnMail(review.turn_id, "", key, pending)
        if key is not None:  # a retry with its key joins the turn as it goes on
            self.inflight_keys[key] = self.turn_mail
        await self._drive(agent, pending, key, before=before)

    def _resolved_again(self, request: ResolveReview, resolved: Resolved) -> Reply:
        """The answer to a review resolved already (``resolved``): the same decision gets
        its turn's reply (what the first resolution answered, if the turn finished or
        waits on a further review); the other one, or a turn that did not finish, raises
        ReviewResolvedError saying what was decided."""
        session = self.session
        sid = self.session_id
        turn_id = resolved.turn_id
        decided = "approved" if resolved.approved else "denied"
        review_id = request.review_id
        said = f"session {sid!r} review {review_id!r} was already {decided} (turn {turn_id})"
        if request.approve != resolved.approved:
            raise advised(
                ReviewResolvedError,
                f"{said}, so it cannot be {'approved' if request.approve else 'denied'} now; ",
                Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=turn_id),
                session_id=sid,
                turn_id=turn_id,
            )
        try:
            outcome = session.outcome(turn_id)
        except TurnNotFoundError:
            outcome = None
        if outcome is not None and outcome.status is TurnStatus.FINISHED:
            return Reply(turn_id=turn_id, message=outcome.message)
        if outcome is not None and outcome.status is TurnStatus.WAITING:
            return Reply(turn_id=turn_id, message=None, reviews=tuple(session.reviews.values()))
        became = "is no longer known" if outcome is None else f"is {outcome.status.value}"
        if outcome is not None and outcome.error:
            became += f" ({outcome.error})"
        raise advised(
            ReviewResolvedError,
            f"{said}, and that turn {became}; ",
            Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=turn_id),
            session_id=sid,
            turn_id=turn_id,
        )

    async def _retry(self, pending: Pending) -> None:
        """Run the last turn again if it failed or was cancelled: what it left after its
        user message goes, and a new turn answers that message (no second copy)."""
        session = self.session
        sid = self.session_id
        self._refuse_while_reviewing("retry")
        last = session.last_turn()
        index = session.find(last.message_id) if last is not None and last.message_id else -1
        if (
            last is None
            or last.status not in (TurnStatus.FAILED, TurnStatus.CANCELLED)
            or index < 0
            or any(m.role is Role.USER for m in session.messages[index + 1 :])
        ):
            what = (
                "no turn yet"
                if last is None
                else f"its last turn {last.turn_id} {last.status.value}"
                if last.status not in (TurnStatus.FAILED, TurnStatus.CANCELLED)
                else f"the user message of its last turn {last.turn_id} is no longer last "
                "in the history"
            )
            raise NothingToRetryError(
                f"session {sid!r} has nothing to retry ({what}); retry() runs a failed or "
                "cancelled last turn again: send a new message instead",
                session_id=sid,
            )
        try:
            agent = self.host.agent_for(session)
        except LookupError as exc:
            raise advised(
                TurnFailedError,
                f"{exc}; retry once the agent is back",
                session_id=sid,
                turn_id=last.turn_id,
            ) from exc
        user = session.messages[index]
        # what the turn left: up to its outcome's interrupted reply (a message added
        # since, a person's note, say, stays: it joined after the turn, not with it)
        after = session.messages[index + 1 :]
        end = len(after)
        for i in range(len(after) - 1, -1, -1):
            if after[i].interrupted and after[i].role is Role.ASSISTANT:
                end = i + 1
                break
        kept = kept_on_retry(agent, after[:end])
        removed = tuple(m.id for m in after[:end] if m.id not in kept)
        if removed:
            self.durable(
                HistoryEdited(session_id=sid, seq=self.next_seq(), reason="retry", removed=removed)
            )
        turn_id = self.turn_id = self.new_turn_id()
        self.turn_mail = TurnMail(turn_id, user.content, None, pending)
        self._set_status(Status.RUNNING)
        self.durable(
            TurnStarted(
                session_id=sid,
                seq=self.next_seq(),
                turn_id=turn_id,
                text=user.content,
                message_id=user.id,
                created_at=user.created_at,
                retry_of=last.turn_id,
            )
        )
        before = self._compact_before if agent.compaction is not None else None
        await self._drive(agent, pending, None, before=before)

    def _refuse_while_reviewing(self, what: str) -> None:
        if self.session.reviews:
            review = next(iter(self.session.reviews.values()))
            raise advised(
                SessionBusyError,
                f"session {self.session_id!r} cannot {what} while review {review.id!r} is "
                "pending; ",
                Advice(kind=AdviceKind.RESOLVE_REVIEW, review_id=review.id),
                " first",
                session_id=self.session_id,
            )

    async def _edit(self, request: Truncate | Rewind | SetSummary) -> int:
        """A history edit, in mailbox order; returns how many messages were removed."""
        session = self.session
        sid = self.session_id
        removed: tuple[str, ...] = ()
        summary: str | None = None
        if isinstance(request, Truncate):
            self._refuse_while_reviewing("truncate")
            cut = split_for_keep_last(session.messages, request.keep_last)
            removed = tuple(m.id for m in session.messages[:cut])
            reason = "truncate"
        elif isinstance(request, Rewind):
            self._refuse_while_reviewing("rewind")
            index = session.find(request.message_id)
            if index < 0:
                raise MessageNotFoundError(
                    f"session {sid!r} has no message {shown(request.message_id)}; take ids from "
                    "ref.history()",
                    session_id=sid,
                )
            end = rewind_end(session.messages, index)
            removed = tuple(m.id for m in session.messages[end:])
            reason = "rewind"
        else:
            summary = request.text
            reason = "set_summary"
        self.durable(
            HistoryEdited(
                session_id=sid, seq=self.next_seq(), reason=reason, removed=removed, summary=summary
            )
        )
        await self.commit()
        return len(removed)

    def _merged_metadata(self, request: SetMetadata) -> dict[str, Any]:
        """The metadata with the changes merged in, checked whole (the merge may outgrow
        a limit that each change keeps): ``TypeError`` / ``ValueError`` if refused."""
        sid = self.session_id
        current = self.session.metadata
        try:
            merged = check_metadata(
                sid,
                merge_metadata(current, request.changes),
                stored=metadata_size(current),  # (metadata stored before the limit may shrink)
            )
            check_info_room(attrs.evolve(self.session.info(), metadata=merged))
        except (TypeError, ValueError) as exc:
            detail = str(exc).removeprefix(f"metadata for session {sid!r} cannot be stored: ")
            raise type(exc)(
                f"metadata for session {sid!r} cannot take these changes: merged with the "
                f"metadata it has, it cannot be stored ({detail}); make room by removing keys "
                "(set them to None)"
            ) from exc
        return merged

    async def _set_metadata(
        self, merged: dict[str, Any], replaced: tuple[str, ...]
    ) -> dict[str, Any]:
        """Journal the merged metadata, in mailbox order; returns the metadata now. A
        change that ``replaced`` values is a checkpoint (see ``erases``): the commit
        writes the snapshot in place of the journal append."""
        sid = self.session_id
        self.durable(
            MetadataChanged(session_id=sid, seq=self.next_seq(), metadata=merged, replaced=replaced)
        )
        await self.commit()
        return dict(merged)

    async def _put_messages(self, request: AddMessages | ReplaceHistory) -> None:
        """Append messages to the history, or replace it whole, without a turn (in
        mailbox order); the messages were checked as a block by the caller's ref, and
        their content against the history (``check_content``)."""
        session = self.session
        sid = self.session_id
        replace = isinstance(request, ReplaceHistory)
        what = "replace_history" if replace else "add_messages"
        self._refuse_while_reviewing(what)
        if session.open_turn is not None:  # a crash left it mid-tool; its agent is not here
            raise SessionBusyError(
                f"session {sid!r} cannot {what} while turn {session.open_turn.turn_id!r} is "
                "unfinished (a tool call waits for its result); open the registry with the "
                "session's agent, so that the turn finishes when the session wakes",
                session_id=sid,
            )
        messages = request.messages
        if not replace:
            known = self.known_ids
            if known is None:
                known = self.known_ids = KnownIds()
            check_new_ids(sid, known.of(session.messages), messages, what)
        seq = self._hub().seq
        events: list[Event] = []
        if replace and session.messages:
            removed = tuple(m.id for m in session.messages)
            events.append(
                HistoryEdited(
                    session_id=sid, seq=seq + 1, reason="replace_history", removed=removed
                )
            )
        for message in messages:
            events.append(MessageAdded(session_id=sid, seq=seq + len(events) + 1, message=message))
        if not events:
            await trio.lowlevel.checkpoint()
            return
        check_entry(sid, events, what)  # the entry as it will be journaled: refused whole
        for event in events:
            self.next_seq()  # (the seq the event already carries)
            self.durable(event)
        self._set_status(session.resting_status())
        await self.commit()

    async def resume_interrupted(self) -> None:
        """Finish a turn whose process died mid-tool (found open on wake).

        Without the session's agent here (a registry opened to read and manage the
        store), the turn stays open, to be finished by the next registry that has
        the agent and wakes the session.
        """
        open_turn = self.session.open_turn
        assert open_turn is not None
        key = open_turn.idempotency_key
        joined = self.inflight_keys.get(key) if key is not None else None
        pending = joined.pending if joined is not None else Pending()
        try:
            agent = self.host.agent_for(self.session)
        except LookupError as exc:
            log.error("turn %s stays open until its agent is back: %s", open_turn.turn_id, exc)
            error = advised(
                AgentNotFoundError,
                f"{exc}; the turn stays open until a registry with its agent wakes the session",
                session_id=self.session_id,
                turn_id=open_turn.turn_id,
            )
            error.__cause__ = exc
            pending.set_error(error)  # (callers that joined it by its key)
            if key is not None:
                self.inflight_keys.pop(key, None)
            await trio.lowlevel.checkpoint()
            return
        self.turn_id = open_turn.turn_id
        self._set_status(Status.RUNNING)

        async def before(agent: Agent) -> bool:
            return await resume_tool_calls(self, agent, interrupted=True)

        await self._drive(agent, pending, key, before=before)

    # ---- endings ---------------------------------------------------------------

    def lost_event(self, turn_id: str, cause: BaseException) -> TurnFailed | None:
        """The event that tells subscribers that turn ``turn_id`` is void: the session
        crashed, and its durable state holds nothing of it (published, never journaled);
        None if nobody ever subscribed. Its seq is taken now: publish it in order."""
        if self.hub is None:
            return None
        return TurnFailed(
            session_id=self.session_id,
            seq=self.next_seq(),
            turn_id=turn_id,
            error=f"{LOST_PREFIX}{describe(cause)})",
            lost=True,
            error_kind=type(cause).__name__,
            error_public=is_public(cause),
        )

    def _fail_queued(
        self,
        error: BaseException,
        *,
        crash: BaseException | None = None,
        lost: list[TurnFailed] | None = None,
        refused: bool = False,
        told: BaseException | None = None,
        closing: bool = False,
    ) -> None:
        """Fail every request in the mailbox with ``error``; tell the subscribers of
        each turn among them that it failed with ``told``, if given (the session ends
        with its hub open: they would otherwise wait for outcomes that never come),
        but, ``closing``, of the turns other workers forwarded, which they send on."""
        while True:
            try:
                mail = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            mail.pending.set_error(error)
            if isinstance(mail, TurnMail):
                self.note_queued(mail.turn_id, False)
                if refused:
                    _remember(self.host.refused, mail.turn_id, str(error), _REFUSED_KEPT)
                if told is not None and not (closing and mail.forwarded):
                    self._never_began(mail.turn_id, told)
                if crash is not None and lost is not None:
                    event = self.lost_event(mail.turn_id, crash)
                    if event is not None:
                        lost.append(event)
        for inflight in self.inflight_keys.values():
            inflight.pending.set_error(error)
        self.inflight_keys.clear()

    def _fail_queued_at_close(self) -> None:
        sid = self.session_id
        self._fail_queued(stopped_error(sid, "closing"), told=never_began_error(sid), closing=True)

    def fail_waiters(
        self, error: SessionActorsError, *, crash: BaseException | None = None
    ) -> list[TurnFailed]:
        """Close the mailbox and fail everyone waiting on this incarnation with ``error``.

        After a ``crash``, returns the events that tell subscribers that the turns it
        takes with it are void, for the supervisor to publish once it is known which
        of them the store kept (see ``publish_after_crash``).
        """
        lost: list[TurnFailed] = []
        self.send.close()
        self.end_trace("crashed", crash or error)
        if self._ready is not None:  # ended while waking: release its waiters
            self.load_error = error
            self._ready.set()
        if self.turn_mail is not None:
            self.turn_mail.pending.set_error(naming_turn(error, self.turn_mail.turn_id))
            if crash is not None:
                event = self.lost_event(self.turn_id, crash)
                if event is not None:
                    lost.append(event)
            self.turn_mail = None
        self._fail_queued(error, crash=crash, lost=lost)
        self.receive.close()
        return lost

    def publish_after_crash(self, *, loaded: bool) -> None:
        """Publish what the crashed incarnation before this one left unsaid, now that
        this one has read the store (``loaded``) or failed to: the outcome whose commit
        raised if the store kept it after all (with its own seq: nothing was published
        after it), then that the other turns it took with it are void."""
        after = self.after_crash
        if after is None:
            return
        self.after_crash = None
        due, lost = after
        kept: set[str] = set()
        if loaded:
            session = self.session
            if due is not None and due.turn_id in session.turns:  # its record
                kept.add(due.turn_id)
                self.emit(due)
            open_turn = session.open_turn
            if open_turn is not None:
                # durable after all (its start was journaled): it resumes, or waits on
                # its review, and its own outcome follows; a turn has one outcome
                kept.add(open_turn.turn_id)
        for event in lost:
            if event.turn_id not in kept:
                self.emit(event)

    def leave_table(self) -> None:
        """This incarnation is gone: out of the table of live sessions."""
        self.phase = Phase.LEFT
        self.host.detach(self)

    async def _hibernate_idle(self) -> bool:
        """The idle timeout's hibernation; whether the actor left. Nobody asked for it, so
        a store that refuses the snapshot fails no request: the session stays live (what
        it holds is journaled, or kept for the next snapshot) and tries again when idle
        next, instead of crashing with the requests that came meanwhile."""
        if self.journal.unwritable:
            return False  # too large to snapshot, and nothing has made it smaller since
        try:
            return await self._hibernate_if_idle()
        except SnapshotError:  # nothing written: it stays live, as it was (the journal
            return False  # logged why, and that it stays live, as it found it)
        except StoreError as exc:
            if isinstance(exc, FencedOutError):
                raise  # another worker owns it: nothing of ours to keep
            log.warning(
                "session %r stays live: its idle hibernation failed: %s", self.session_id, exc
            )
            # the snapshot may have been stored, saying hibernated: a status is
            # journaled before anything more is published, as when a request came
            self.session.status = self.session.resting_status()
            self.journal.status_due = True
            return False

    async def _hibernate_if_idle(self) -> bool:
        """Snapshot; leave if nothing arrived meanwhile (else stay live, lease kept)."""
        if self.session.reviews and self.turn_mail is not None:
            return False
        await self._snapshot_for_hibernation()
        if self.receive.statistics().current_buffer_used:
            self.journal.status_due = True  # staying live to serve them
            return False
        self._leave(Status.HIBERNATED)
        await self._release_lease()  # after leaving: a request now wakes a new actor
        return True

    async def _hibernate_now(self) -> None:
        """Hibernate at once (registry closing), shielded and bounded.

        A store that refuses the snapshot is asked again until the bound. If state
        that was acknowledged is in no other write (``durability="hibernate"``), a
        final failure is reported to the registry, which raises it on exit.
        """
        error: Exception | None = None
        with self._bounded_write() as writing:
            delay = 0.01
            while True:
                try:
                    await self._snapshot_for_hibernation()
                    error = None
                    break
                except FencedOutError:
                    raise  # another worker owns it: nothing of ours to write
                except (StoreError, ValueError, TypeError) as exc:
                    error = exc
                    if not isinstance(exc, StoreError) or not self.acknowledged_unsaved():
                        break  # a retry cannot help, or the journal holds it all
                    await trio.sleep(delay)
                    delay = min(2 * delay, 1.0)
        stored = error is None and not writing.cancelled_caught
        self._answer_held(stored=stored)
        self._fail_queued_at_close()
        if error is not None and not self.acknowledged_unsaved():
            log.warning(
                "session %r closed without its hibernation snapshot (its journal holds "
                "what it acknowledged; the next wake replays it): %s",
                self.session_id,
                error,
            )
        if not stored and self.acknowledged_unsaved():
            # (with a journal, what is not stored was never acknowledged: its caller
            # heard so)
            self.host.unwritten(
                self.session_id,
                error
                or StoreError(
                    f"the store did not answer within {self.host.config.write_bound:g} s",
                    session_id=self.session_id,
                ),
            )
        self._leave(Status.HIBERNATED)
        if not writing.cancelled_caught:  # else the store is stuck: the lease expires
            await self._release_lease()

    async def hibernate_interrupted(self) -> None:
        """Something not an Exception (KeyboardInterrupt, say) escaped this incarnation and
        ends the registry: hibernate at once, as the registry's hurried shutdown does the
        other sessions, so that nothing it answered is lost (with ``durability="hibernate"``
        this snapshot is the only write of its answered turns). The turn it cut short is
        settled as a turn cut when the shutdown grace ends is: kept, marked interrupted,
        its caller told. Its state is whole: events are folded as they happen, and a turn
        loop that an exception leaves answers its tool calls first, as a cancelled one.

        Nothing is written by an incarnation that was killed (deleted, or its lease lost),
        that left already, or that never loaded (a restart that held answered turns
        reports them unwritten).
        """
        sid = self.session_id
        if self.phase is Phase.KILLED or self.phase is Phase.LEFT:
            return
        if self._ready is not None:
            if self.acknowledged_unsaved():
                self.host.unwritten(
                    sid,
                    SessionStoppedError(
                        f"session {sid!r} was interrupted while it woke after a crash",
                        session_id=sid,
                    ),
                )
            return
        if self.phase is Phase.STOPPING:  # the stop did not happen: it hibernates instead
            self.stop_error = stopped_error(sid, "closing")
            self.phase = Phase.ABORTING
        self.close()  # take nothing new
        self.abort()
        cut, self._cut = self._cut, None
        if cut is not None:  # the turn in flight, as the interruption left it
            await self._settle(*cut, failure=None, final=None, cancelled="interrupted")
        if self.host.given_up:  # meanwhile (a crash writes nothing more)
            return
        await self._hibernate_now()
        mail = self.turn_mail
        if mail is not None:  # interrupted as it settled: its outcome may not be stored
            self.turn_mail = self.held = None
            error = stopped_error(sid, "unsaved", mail.turn_id)
            mail.pending.set_error(error)
            self.end_trace("crashed", error)

    def acknowledged_unsaved(self) -> bool:
        """Whether acknowledged state is in no write yet (only without a journal)."""
        return self.journal.holds_unwritten()

    async def _snapshot_for_hibernation(self) -> None:
        """Write the hibernated state; its status event is published once it is stored.

        A wake's jump that no write recorded yet (an incarnation that only read since it
        woke after an unclean stop) is journaled first: a snapshot keeps no event, and
        the journal is where a replay learns which seqs the jump skipped."""
        hub = self.hub
        if hub is not None and hub.unrecorded is not None and self.journal.per_turn:
            await self._journal_status()
        session = self.session
        event = None
        if session.status is not Status.HIBERNATED:
            session.status = Status.HIBERNATED
            event = StatusChanged(
                session_id=self.session_id, seq=self.next_seq(), status=Status.HIBERNATED
            )
        try:
            await self._write_snapshot(Status.HIBERNATED)
        except SnapshotError:  # nothing written (the state cannot be): it stays as it was
            session.status = session.resting_status()
            raise
        if event is not None:
            self.emit(event)

    def _leave(self, status: Status) -> None:
        self.session.status = status
        self.send.close()
        self.receive.close()
        self.leave_table()
        self.host.stats.hibernated += status is Status.HIBERNATED

    async def _finish_stop(self) -> None:
        """Stop: one write makes it so, the journal's (or, without one, the snapshot's).

        With a journal, a snapshot follows (bounded; a failure only leaves the journal
        tail for reads to replay), before the actor leaves the table: a delete of the
        name waits for it, so it cannot land on a session spawned afresh under the name.
        """
        sid = self.session_id
        if self._hub().unrecorded is not None:  # (see _snapshot_for_hibernation)
            await self._journal_status()
        self._end_waiting_turn()
        event = StatusChanged(session_id=sid, seq=self.next_seq(), status=Status.STOPPED)
        self.durable(event, publish=False)
        journal = self.journal.per_turn
        with self._bounded_write() as writing:
            if journal:
                await self.commit(compact=False)
            else:
                await self._write_snapshot(Status.STOPPED)
        if writing.cancelled_caught:
            raise StoreError(
                f"session {sid!r} may not be stopped: the store did not answer within "
                f"{self.host.config.write_bound:g} s; call stop() again once it does",
                session_id=sid,
            )
        self._answer_held(stored=True)
        self.emit(event)  # (its seq before those of the queued turns' outcomes)
        stopped = stopped_error(sid, "stop")
        self._fail_queued(stopped, told=stopped)
        if journal:  # compaction only: the stop is stored already
            with self._bounded_write(), contextlib.suppress(Exception):
                await self._write_snapshot(Status.STOPPED)
        self._leave(Status.STOPPED)
        self._hub().close()

    def _end_waiting_turn(self) -> None:
        """A stop ends the turn that waits on a review, as cancelled: a stopped session
        takes no review, so it would wait (and be listed as waiting) forever, its
        history holding a call without a result."""
        session = self.session
        open_turn = session.open_turn
        if open_turn is None or not session.reviews:
            return
        self.turn_id = open_turn.turn_id
        deny_for_stop(self)
        self.add_message(Message.create(Role.ASSISTANT, NO_REPLY_CANCELLED, interrupted=True))
        self.durable(
            TurnCancelled(session_id=self.session_id, seq=self.next_seq(), turn_id=self.turn_id)
        )
        self.host.stats.turns_cancelled += 1
        telemetry = self.host.telemetry
        if telemetry is not None:  # (its span ended "waiting"): traced as a continuation
            trace = telemetry.turn(
                session_id=self.session_id, turn_id=self.turn_id, agent=session.agent, queued=0
            )
            if trace is not None:
                trace.end("cancelled", None)
        if open_turn.idempotency_key is not None:
            self.inflight_keys.pop(open_turn.idempotency_key, None)


#: How a failed turn's ``TurnFailedError`` message ends, after its reason (``describe``
#: of the exception): the first part only when the turn streamed text.
FAILED_KEPT: Final = "; what it streamed is kept, marked interrupted"
FAILED_TAIL: Final = "; the session is fine, send the next message when the cause is fixed"


#: How the reason of a ``TurnFailed`` of a turn lost to a crash begins (``lost_event``).
def _log_unclean_wake(
    session: LiveSession, durable_seq: int, durability: str, *, loud: bool
) -> None:
    """Say that ``session`` woke after an unclean stop: the process that ran it last
    stopped without storing it, and whatever it had not stored is gone. Which turns
    those were, no store knows (nothing of a turn is stored before its outcome), so the
    line names the session and what the store holds last, never a turn's words. At
    WARNING if ``loud``, else at DEBUG (the host counts it in a line of its own: see
    ``Host.unclean_woke``)."""
    last = session.last_turn()
    stored = f"the last turn stored is {last.turn_id!r} ({last.status.value}), and " if last else ""
    answered = (
        " (with durability='hibernate', the turns it answered since its last snapshot too)"
        if durability != "turn"
        else ""
    )
    open_turn = session.open_turn
    resumes = ""
    if open_turn is not None:
        then = "waits on its review" if session.reviews else "resumes"
        resumes = f"; turn {open_turn.turn_id!r}, stored before its tool calls, {then}"
    log.log(
        logging.WARNING if loud else logging.DEBUG,
        "session %r woke after an unclean stop (the process that ran it was killed or "
        "crashed, or lost its lease, before storing it): the turns it had accepted there "
        "that the store holds nothing of, if any (the one under way, those queued), are "
        "lost%s: their callers got no reply, and ref.turn_outcome(turn_id) reads lost for "
        "them (send them again); %sthe events after seq %d, the last stored, are gone%s",
        session.session_id,
        answered,
        stored,
        durable_seq,
        resumes,
    )


LOST_PREFIX: Final = "the session crashed and restarted without this turn ("


def describe(exc: BaseException) -> str:
    """``exc`` in words, as an event can carry and a store hold: whatever an agent's
    exception says (a lone surrogate, megabytes of a response body, a ``__str__``
    that raises) fails its turn, never the session that journals it."""
    text = storable(describe_exception(exc))
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def cause_part(exc: BaseException, text: str | None = None) -> str | Private:
    """``exc`` in words (``text``, else ``describe(exc)``) as a part of an error's
    message that repeats it: the text if the library may tell it (``is_public``), else
    a ``Private`` part, which a frontend that serves others tells by its kind."""
    if text is None:
        text = describe(exc)
    return text if is_public(exc) else Private(kind=type(exc).__name__, text=text)


def other_words(
    session: LiveSession, sid: str, key: str, turn_id: str, text: str, words: str = ""
) -> IdempotencyKeyReusedError | None:
    """The error of a request with ``key`` and ``text`` if turn ``turn_id`` of that key
    began with other words (``words``, or else as the session's history holds them),
    else None; None too where the session no longer knows them (its record dropped,
    or an edit removed its message): such a key is checked on the key alone."""
    if not words:
        words = session.turn_text(turn_id) or ""
    if not words or words == text:
        return None
    return key_reused_error(sid, key, turn_id)


def waiting_reply(session: LiveSession, key: str) -> Reply | None:
    """The reply of the open turn with idempotency key ``key`` while it waits on a
    review (what its caller was answered), or None."""
    open_turn = session.open_turn
    if open_turn is None or open_turn.idempotency_key != key or not session.reviews:
        return None
    return Reply(turn_id=open_turn.turn_id, message=None, reviews=tuple(session.reviews.values()))


def _busy_error(sid: str, review: ReviewRequest, turn_id: str) -> SessionBusyError:
    return advised(
        SessionBusyError,
        f"session {sid!r} is waiting on review {review.id!r} of tool {review.tool_call.name!r}; ",
        Advice(kind=AdviceKind.RESOLVE_REVIEW, review_id=review.id),
        " before sending a new message",
        session_id=sid,
        turn_id=turn_id,
    )


def crashed_error(
    sid: str,
    exc: BaseException,
    *,
    failed: bool = False,
    retry_after: float | None = None,
    storing: str = "",
    step: bool = False,
) -> SessionCrashedError:
    """``storing``: the turn whose outcome (with ``step``: a step before its outcome, a
    call's start or a review request) the store was writing, and may have kept;
    ``retry_after``: with ``failed``, the seconds until the session may start again."""
    cause = cause_part(exc)
    if failed:
        return failed_error(sid, cause, retry_after)
    told: tuple[Part, ...]
    if storing:
        what = "a step" if step else "the outcome"
        held = "that step (and then resumes the turn)" if step else "that outcome"
        told = (
            f"session {sid!r} crashed while the store wrote {what} of turn {storing} (",
            cause,
            f"); it was restarted from its last durable state, which may hold {held}: ",
            Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=storing),
            " before sending it again (with an idempotency key, a retry cannot run it twice)",
        )
    else:
        told = (
            f"session {sid!r} crashed while handling this request (",
            cause,
            "); it was restarted from its last durable state, so retry the request",
        )
    return advised(SessionCrashedError, *told, session_id=sid, turn_id=storing)


def failed_error(sid: str, reason: str | Private, retry_after: float | None) -> SessionCrashedError:
    """The error of a request to a session marked failed (by ``reason``: its cause, as
    ``cause_part`` puts it); ``retry_after``: the seconds until it may start again
    (None: not before the process restarts)."""
    if retry_after is None:
        then = "fix the cause, then restart the process or delete the session"
    else:
        then = f"its store failed, so it is tried again on a request in {retry_after:.1f} s"
    return advised(
        SessionCrashedError,
        f"session {sid!r} crashed too often and is marked failed (",
        reason,
        f"); {then}",
        session_id=sid,
    )


def _remember(
    table: dict[str, _V] | None, key: str, value: _V, most: int = _MAX_REMEMBERED
) -> dict[str, _V]:
    """``table`` (made if None) with ``key``: ``value``, holding the latest ``most``
    entries."""
    if table is None:
        table = {}
    table[key] = value
    if len(table) > most:
        del table[next(iter(table))]
    return table


def deleted_error(sid: str) -> SessionNotFoundError:
    return SessionNotFoundError(
        f"session {sid!r} was deleted while this request was pending", session_id=sid
    )
