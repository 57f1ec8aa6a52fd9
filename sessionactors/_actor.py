"""The session actor: one trio task that owns a session, reached through its mailbox.

Turns run one at a time in mailbox order. Reads (history, state) and
``cancel`` are served out of band. The task also supervises itself: a crash
(an exception that is not the agent's) fails the waiters with
SessionCrashedError and restarts the actor from its durable state, within a
restart intensity.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ._agent import Agent, run_turn
from ._codec import (
    SnapshotWriter,
    dump_events,
    dump_info,
    dump_snapshot,
    load_events,
    load_snapshot,
)
from ._errors import (
    FencedOutError,
    SessionActorsError,
    SessionBusyError,
    SessionCrashedError,
    SessionNotFoundError,
    SessionStoppedError,
    SnapshotCorruptError,
    StoreError,
    TurnCancelledError,
    TurnFailedError,
)
from ._events import (
    Delta,
    Event,
    MessageAdded,
    StatusChanged,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)
from ._hub import Hub
from ._records import Message, ReviewRequest, Role, Status, ToolCall
from ._session import LiveSession
from ._tooling import (
    maybe_compact,
    resolve_review,
    resume_tool_calls,
    run_call,
    run_tool_calls,
)
from .stores._base import JournalEntry, Lease, Store, StoredSession

if TYPE_CHECKING:
    from ._registry import Counters, RegistryConfig

__all__ = ["SEQ_GAP", "Actor", "Host", "LeaseHeldError", "Pending", "session_task"]

#: How far seq jumps when a session wakes from a state that was not hibernated
#: cleanly (the process died): above any seq the lost incarnation can have used.
SEQ_GAP = 1 << 20


class LeaseHeldError(SessionBusyError):
    """Another worker holds the session's lease: the session is live there."""


class Pending:
    """The result slot of one request; any number of callers may wait on it.

    Its first waiter parks directly (no ``trio.Event``): a request in flight
    keeps as few objects alive as it can, which matters to the collector when
    thousands are in flight. Further waiters (callers joining a turn by its
    idempotency key) queue behind it.
    """

    __slots__ = ("_others", "_task", "done", "error", "result")

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None  # the first waiter
        self._others: dict[trio.lowlevel.Task, None] | None = None  # the rest, in order
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    @classmethod
    def resolved(cls, result: Any) -> Pending:
        p = cls()
        p.result = result
        p.done = True
        return p

    def set_result(self, result: Any) -> None:
        if not self.done:
            self.result = result
            self._finish()

    def set_error(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self._finish()

    def _finish(self) -> None:
        self.done = True
        task, others = self._task, self._others
        self._task = self._others = None
        if task is not None:
            trio.lowlevel.reschedule(task)
        if others is not None:
            for task in others:
                trio.lowlevel.reschedule(task)

    def _abort_first(self, _: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def wait(self) -> Any:
        if self.done:
            await trio.lowlevel.checkpoint()
        else:
            task = trio.lowlevel.current_task()
            if self._task is None:
                self._task = task
                await trio.lowlevel.wait_task_rescheduled(self._abort_first)
            else:
                others = self._others
                if others is None:
                    others = self._others = {}
                others[task] = None

                def abort(_: object) -> trio.lowlevel.Abort:
                    if self._others is not None:
                        del self._others[task]
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
        if self.error is not None:
            raise self.error
        return self.result


class TurnRequest:
    __slots__ = ("key", "pending", "text", "turn_id")

    def __init__(self, turn_id: str, text: str, key: str | None, pending: Pending) -> None:
        self.turn_id = turn_id
        self.text = text
        self.key = key
        self.pending = pending


class CallRequest:
    """A request other than a turn, run in mailbox order (hibernate, edits, reviews)."""

    __slots__ = ("args", "kind", "pending")

    def __init__(self, kind: str, args: dict[str, Any], pending: Pending) -> None:
        self.kind = kind
        self.args = args
        self.pending = pending


Request = TurnRequest | CallRequest


class Host(Protocol):
    """What an actor needs from its registry."""

    store: Store
    config: RegistryConfig
    stats: Counters
    owner_id: str
    _closing: bool

    def _agent_for(self, session: LiveSession) -> Agent: ...
    def _hub_for(self, session_id: str) -> Hub: ...
    def _detach(self, actor: Actor) -> None: ...
    def _replace(self, old: Actor, new: Actor) -> None: ...
    def _mark_failed(self, actor: Actor, reason: str) -> None: ...


class Actor:
    """One incarnation of a session's actor. Live things are compared by identity."""

    __slots__ = (
        "_journal_at",
        "_journal_size",
        "_ready",
        "_settled",
        "_since_snapshot",
        "_snapshot_size",
        "_snapshot_writer",
        "_system_cache",
        "abort_reason",
        "deleted",
        "done",
        "held",
        "host",
        "hub",
        "inflight_keys",
        "kill_error",
        "lease",
        "load_error",
        "partial",
        "receive",
        "run_scope",
        "send",
        "session",
        "session_id",
        "stop_error",
        "stop_requested",
        "store_fault",
        "stored_clean",
        "turn_id",
        "turn_request",
        "turn_scope",
        "unsaved",
    )

    def __init__(self, host: Host, session_id: str, session: LiveSession | None) -> None:
        self.host = host
        self.session_id = session_id
        self.session: LiveSession = session  # type: ignore[assignment]  # set by load
        self._ready: trio.Event | None = None if session is not None else trio.Event()
        self.send, self.receive = trio.open_memory_channel[Request](host.config.mailbox_size)
        self.hub: Hub | None = None
        self.turn_request: TurnRequest | None = None
        self.turn_scope: trio.CancelScope | None = None
        self.turn_id = ""
        self.partial: list[str] = []
        self.inflight_keys: dict[str, TurnRequest] = {}  # idempotency key -> its turn
        # A closing turn's answer, kept until the closing snapshot says whether it was
        # stored (its turn_request stays set meanwhile): (error, result)
        self.held: tuple[BaseException | None, Any] | None = None
        self.stop_requested = False
        self.stop_error: SessionActorsError | None = None  # why a requested stop failed
        # The store holds a clean hibernation: a wake after this process dies would not
        # jump seq, so a status is journaled before anything more is published.
        self.stored_clean = False
        self.store_fault: StoreError | None = None  # the last write of ours that failed
        self.abort_reason: str | None = None
        self.deleted = False
        self.run_scope: trio.CancelScope | None = None
        self.done: trio.Event | None = None
        self.lease: Lease | None = None
        self.kill_error: SessionActorsError | None = None
        self.load_error: SessionActorsError | None = None
        self.unsaved: list[Event] = []
        # unsaved[:_settled] were answered: a restart without a journal (the only
        # one that keeps unsaved events) keeps them
        self._settled = 0
        self._since_snapshot = 0
        self._journal_size = 0  # bytes journaled since the snapshot
        # A status is journaled (whatever the durability) before the seq reaches this:
        # a wake jumps SEQ_GAP past the highest seq the store has, so that stays ahead.
        self._journal_at = SEQ_GAP // 2
        self._snapshot_size = 0  # bytes of the latest snapshot
        self._snapshot_writer: SnapshotWriter | None = None  # made for a long history
        self._system_cache: (
            tuple[tuple[str | None, str | None, str], tuple[Message, ...]] | None
        ) = None

    def __repr__(self) -> str:
        return f"<Actor {self.session_id!r}>"

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
        return self._ready is None

    def cancel_turn(self) -> bool:
        if self.turn_scope is None:
            return False
        self.turn_scope.cancel()
        return True

    # ---- TurnContext ---------------------------------------------------------

    def request_messages(self) -> Sequence[Message]:
        session = self.session
        agent = self.host._agent_for(session)
        key = (session.system_prompt, session.summary, agent.system_prompt)
        cache = self._system_cache
        if cache is None or cache[0] != key:
            cache = self._system_cache = (key, session.system_messages(agent.system_prompt))
        return session.view(cache[1])

    def delta(self, text: str) -> None:
        self._emit(
            Delta(session_id=self.session_id, seq=self._seq(), turn_id=self.turn_id, text=text)
        )

    def add_message(self, message: Message) -> None:
        self._durable(
            MessageAdded(
                session_id=self.session_id, seq=self._seq(), turn_id=self.turn_id, message=message
            )
        )

    def run_tool_calls(self, agent: Agent, calls: Sequence[ToolCall]) -> Awaitable[bool]:
        return run_tool_calls(self, agent, calls)  # its coroutine: no layer of our own

    # ---- event plumbing ----------------------------------------------------------

    def _hub(self) -> Hub:
        """The session's hub, made on the first event (an idle session needs none)."""
        hub = self.hub
        if hub is None:
            hub = self.hub = self.host._hub_for(self.session_id)
            hub.advance(self.session.event_seq)
        return hub

    def _seq(self) -> int:
        return (self.hub or self._hub()).next_seq()

    def _emit(self, event: Event) -> None:
        (self.hub or self._hub()).publish(event)

    def _durable(self, event: Event, *, publish: bool = True) -> Event:
        self.session.apply(event)
        self.unsaved.append(event)
        if publish:
            (self.hub or self._hub()).publish(event)
        return event

    def _set_status(self, status: Status) -> None:
        if self.session.status is status:
            return
        self.session.status = status
        self._emit(StatusChanged(session_id=self.session_id, seq=self._seq(), status=status))

    async def commit(self, *, compact: bool = True) -> None:
        """Make the unsaved journal events durable (per the durability policy).

        Then, if ``compact``, snapshot once the journal outweighs the snapshot: a
        snapshot costs as much as the history is long, so this keeps a turn's cost
        independent of it. That snapshot only compacts (what it holds is journaled
        already): if the store refuses it, the journal waits for the next try.
        """
        host = self.host
        if host.config.durability != "turn" or not self.unsaved:
            return
        events = self.unsaved
        count = len(events)
        # one entry per commit: a turn's events cost one row, not one each
        entry = JournalEntry(events[-1].seq, dump_events(events))
        try:
            await host.store.append(
                self.session_id,
                [entry],
                dump_info(self.session.info()),
                fence=self.lease.fence if self.lease else None,
            )
        except StoreError as exc:
            self.store_fault = exc
            raise
        self._journal_at = entry.seq + SEQ_GAP // 2
        del events[:count]
        self._since_snapshot += count
        self._journal_size += len(entry.data)
        if (
            compact
            and self._since_snapshot >= host.config.snapshot_every
            and self._journal_size >= self._snapshot_size
        ):
            with contextlib.suppress(Exception):  # the entries are stored: only compaction
                await self._write_snapshot(self.session.status)

    @contextlib.contextmanager
    def _bounded_write(self) -> Iterator[trio.CancelScope]:
        """Shielded (a cancel must not abandon a write half-way) and bounded by write_bound."""
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(self.host.config.write_bound) as bound,
        ):
            yield bound

    async def _write_snapshot(self, status: Status) -> None:
        host = self.host
        session = self.session
        seq = max(self._hub().seq, session.event_seq)
        session.event_seq = seq
        state = attrs.evolve(session.to_state(), status=status)
        writer = self._snapshot_writer
        if writer is None and len(state.messages) >= SnapshotWriter.MIN_MESSAGES:
            writer = self._snapshot_writer = SnapshotWriter()
        snapshot = dump_snapshot(state) if writer is None else writer.dump(state)
        await host.store.write_snapshot(
            self.session_id,
            snapshot,
            seq,
            dump_info(session.info(status)),
            # without a journal ("hibernate"), replay reaches no further back than this
            # snapshot: say so (EventsExpiredError) rather than replay a silent gap
            trim_upto=seq
            if host.config.durability != "turn"
            else max(0, seq - host.config.journal_keep_seqs),
            fence=self.lease.fence if self.lease else None,
        )
        self.unsaved.clear()
        self._settled = 0
        self._journal_at = seq + SEQ_GAP // 2
        self._since_snapshot = 0
        self._journal_size = 0
        self._snapshot_size = len(snapshot)

    async def _journal_status(self) -> None:
        """Journal the resting status now, whatever the durability policy; then publish it.

        A wake jumps seq past a lost incarnation's events only if the store shows
        that the session was live (a journal after its snapshot). This write shows
        it after a clean wake, and it records a jump so that the next one starts above.
        """
        session = self.session
        status = session.status = _resting_status(session)
        event = StatusChanged(session_id=self.session_id, seq=self._seq(), status=status)
        if self.host.config.durability == "turn":
            self._durable(event, publish=False)
            await self.commit()
        else:  # the journal holds only these, and the next snapshot drops them
            session.apply(event)
            await self.host.store.append(
                self.session_id,
                [JournalEntry(event.seq, dump_events([event]))],
                dump_info(session.info()),
                fence=self.lease.fence if self.lease else None,
            )
            self._journal_at = event.seq + SEQ_GAP // 2
        self.stored_clean = False
        self._emit(event)

    # ---- the loop ---------------------------------------------------------

    async def claim(self) -> None:
        """Take the session's lease (shared stores): one live owner at a time."""
        host = self.host
        if not host.config.leases:
            return
        lease = await host.store.claim(self.session_id, host.owner_id, host.config.lease_ttl)
        if lease is None:
            raise LeaseHeldError(
                f"session {self.session_id!r} is live on another worker (it holds the "
                "session's lease); send the request through that worker, or retry after "
                "it hibernates the session or its lease expires",
                session_id=self.session_id,
            )
        self.lease = lease

    async def _release_lease(self) -> None:
        """Give the lease back, if held (shielded and bounded; a failure only lets it expire)."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        # any failure only lets the lease expire (and the actor may have left already)
        with self._bounded_write(), contextlib.suppress(Exception):
            await self.host.store.release(self.session_id, lease)

    def kill(self, error: SessionActorsError) -> None:
        """Stop at once (deleted, or the lease was lost): waiters get ``error``."""
        self.kill_error = error
        self.send.close()
        if self.run_scope is not None:
            self.run_scope.cancel()

    async def load(self) -> None:
        """Wake: rebuild the state from the store (snapshot + journal tail)."""
        host = self.host
        sid = self.session_id
        await self.claim()
        session, stored = await read_stored(host.store, sid)
        clean = not stored.entries and session.status is Status.HIBERNATED
        durable_seq = max(
            session.event_seq, stored.snapshot_seq, *(entry.seq for entry in stored.entries)
        )
        if session.status is Status.STOPPED:
            raise SessionStoppedError(
                f"session {sid!r} is stopped and takes no more requests; "
                f"spawn a new session or delete this one with registry.delete({sid!r})",
                session_id=sid,
            )
        self._since_snapshot = len(stored.entries)
        self._journal_size = sum(len(e.data) for e in stored.entries)
        self._snapshot_size = len(stored.snapshot)
        self.session = session
        hub = self.hub = host._hub_for(sid)
        if self.unsaved:  # not durable yet (durability="hibernate"): replay them too
            for event in self.unsaved:
                session.apply(event)
        known = hub.seq
        hub.advance(max(durable_seq, session.event_seq))
        session.status = _resting_status(session)
        self.stored_clean = clean
        self._journal_at = durable_seq + SEQ_GAP // 2
        if not clean and known <= durable_seq:
            # The last incarnation may have published events past its last durable
            # write; jump above them, durably, before publishing anything.
            hub.advance(durable_seq + SEQ_GAP)
            await self._journal_status()
        host.stats.woken += 1

    async def run(self) -> None:
        """Serve the mailbox until hibernated, stopped, or closed."""
        host = self.host
        if self._ready is not None:
            ready = self._ready
            try:
                await self.load()
            except SessionActorsError as exc:
                self.load_error = exc
                ready.set()
                self._fail_queued(exc)
                await self._release_lease()  # not found or stopped: hold nothing
                host._detach(self)
                return
            self._ready = None
            ready.set()
            if self.session.open_turn is not None and not self.session.reviews:
                # (never from a clean hibernation: a hibernated open turn waits on a review)
                self._settled = len(self.unsaved)
                await self.resume_interrupted()
        idle = host.config.idle_timeout
        receive = self.receive
        while True:
            self._settled = len(self.unsaved)  # every request before this one is answered
            if self.stop_requested:
                await self._finish_stop()
                return
            if self.abort_reason is not None:
                self._fail_queued(_stopped_error(self.session_id, self.abort_reason))
                await self._hibernate_now()
                return
            try:
                if idle is None:
                    request = await receive.receive()
                else:
                    request = None
                    with trio.move_on_after(idle):
                        request = await receive.receive()
                    if request is None:
                        host.stats.idle_hibernations += 1
                        if await self._hibernate_if_idle():
                            return
                        continue
            except trio.EndOfChannel:
                # the registry is closing (or the session stopping): queue drained
                if self.stop_requested:
                    continue
                await self._hibernate_now()
                return
            assert request is not None
            if (
                self.stored_clean
                # without a journal: the jump must still clear what was published
                or (self.hub is not None and self.hub.seq >= self._journal_at)
            ) and (isinstance(request, TurnRequest) or request.kind != "hibernate"):
                try:
                    await self._journal_status()
                except BaseException as exc:
                    request.pending.set_error(self._cut_short(exc))
                    raise
            if isinstance(request, TurnRequest):
                drive = self._turn(request)
                if drive is not None:
                    await drive
                del drive  # an idle actor keeps no spent coroutine alive
            elif request.kind == "hibernate":
                try:
                    left = await self._hibernate_if_idle()
                except BaseException as exc:  # fenced out, crashed, killed: answer anyway
                    request.pending.set_error(self._cut_short(exc))
                    raise
                request.pending.set_result(left)
                if left:
                    return
            else:
                await self._call(request)
            request = None  # nor a finished request (its result included)

    def _turn(self, request: TurnRequest) -> Coroutine[Any, Any, None] | None:
        """Start a turn: its driver to await, or None if it was answered at once.

        Not a coroutine itself: a turn in flight keeps one frame less alive.
        """
        session = self.session
        sid = self.session_id
        key = request.key
        if key is not None:
            done = session.completed.get(key)
            if done is not None:
                self.inflight_keys.pop(key, None)
                request.pending.set_result((done.turn_id, done.reply, ()))
                return None
        if session.reviews:
            review = next(iter(session.reviews.values()))
            request.pending.set_error(_busy_error(sid, review))
            if key is not None:
                self.inflight_keys.pop(key, None)
            return None
        try:
            agent = self.host._agent_for(session)
        except LookupError as exc:
            error = TurnFailedError(str(exc), session_id=sid, turn_id=request.turn_id)
            error.__cause__ = exc
            request.pending.set_error(error)
            if key is not None:  # a retry with this key runs again once the agent is back
                self.inflight_keys.pop(key, None)
            return None
        turn_id = self.turn_id = request.turn_id
        self.turn_request = request
        self._set_status(Status.RUNNING)
        self._durable(
            TurnStarted(
                session_id=sid,
                seq=self._seq(),
                turn_id=turn_id,
                text=request.text,
                idempotency_key=key,
            )
        )
        self.add_message(Message.create(Role.USER, request.text))
        before = self._compact_before if agent.compaction is not None else None
        return self._drive(agent, request.pending, key, before=before)

    async def _compact_before(self, agent: Agent) -> bool:
        await maybe_compact(self, agent)
        return True

    async def _drive(
        self,
        agent: Agent,
        pending: Pending,
        key: str | None,
        before: Callable[[Agent], Awaitable[bool]] | None = None,
    ) -> None:
        """Run (or resume) the turn loop and settle its outcome.

        ``before`` runs first, inside the turn's cancel scope; if it returns
        False the turn pauses (a review) without asking the model.
        """
        sid = self.session_id
        turn_id = self.turn_id
        failure: BaseException | None = None
        final: Message | None = None
        self.partial = []
        with trio.CancelScope() as scope:
            self.turn_scope = scope
            try:
                if before is None or await before(agent):
                    final = await run_turn(agent, self)
            except Exception as exc:
                if exc is self.store_fault:  # our write failed, not the agent: restart
                    raise
                failure = exc
        self.turn_scope = None
        stats = self.host.stats
        outcome: Event
        error: BaseException | None = None
        if scope.cancelled_caught:
            text = "".join(self.partial)
            if text:
                self.add_message(Message.create(Role.ASSISTANT, text, interrupted=True))
            outcome = TurnCancelled(session_id=sid, seq=self._seq(), turn_id=turn_id)
            if self.abort_reason is not None:
                error = _stopped_error(sid, "cut")
            elif self.stop_requested:
                error = _stopped_error(sid, "stop")
            else:
                error = TurnCancelledError(
                    f"turn {turn_id} of session {sid!r} was cancelled; what it streamed is "
                    "kept in the history, marked interrupted",
                    session_id=sid,
                    turn_id=turn_id,
                )
            stats.turns_cancelled += 1
        elif failure is not None:
            outcome = TurnFailed(
                session_id=sid, seq=self._seq(), turn_id=turn_id, error=_describe(failure)
            )
            error = TurnFailedError(
                f"turn {turn_id} of session {sid!r} failed: {_describe(failure)}; "
                "the session is fine, send the next message when the cause is fixed",
                session_id=sid,
                turn_id=turn_id,
            )
            error.__cause__ = failure
            stats.turns_failed += 1
        elif final is None:
            # paused for a review: the outcome comes when the review is resolved
            self._set_status(Status.WAITING)
            await self.commit()
            pending.set_result((turn_id, None, tuple(self.session.reviews.values())))
            self.turn_request = None
            return
        else:
            outcome = TurnFinished(
                session_id=sid, seq=self._seq(), turn_id=turn_id, message=final, idempotency_key=key
            )
            stats.turns_completed += 1
        self._durable(outcome, publish=False)
        stored = True
        if self.abort_reason is not None:  # closing: the hibernation snapshot compacts
            with self._bounded_write() as bound:
                await self.commit(compact=False)
            stored = not bound.cancelled_caught
        else:
            await self.commit()
        self._emit(outcome)
        if key is not None:
            self.inflight_keys.pop(key, None)
        self._set_status(_resting_status(self.session))
        if not stored:  # answered by the closing snapshot: the turn is in it, or lost
            if self.turn_request is not None:
                self.held = (error, (turn_id, final, ()))
            return
        self.turn_request = None
        if error is not None:
            pending.set_error(error)
        else:
            pending.set_result((turn_id, final, ()))

    def _answer_held(self, *, stored: bool) -> None:
        """Answer a closing turn that waited for the closing snapshot."""
        held, request = self.held, self.turn_request
        if held is None or request is None:
            return
        self.held = self.turn_request = None
        error, result = held
        if not stored:
            request.pending.set_error(_stopped_error(self.session_id, "unsaved"))
        elif error is not None:
            request.pending.set_error(error)
        else:
            request.pending.set_result(result)

    async def _call(self, request: CallRequest) -> None:
        try:
            if request.kind == "review":
                await resolve_review(self, request.pending, **request.args)
                return
            result = await run_call(self, request.kind, request.args)
        except SessionActorsError as exc:
            request.pending.set_error(exc)
            return
        except BaseException as exc:  # crashed or killed: its waiter must not wait forever
            request.pending.set_error(self._cut_short(exc))
            raise
        request.pending.set_result(result)

    def _cut_short(self, exc: BaseException) -> SessionActorsError:
        """The error for the waiter of a request that ``exc`` interrupted."""
        sid = self.session_id
        if isinstance(exc, SessionActorsError):
            return exc
        if isinstance(exc, Exception):
            return crashed_error(sid, exc)
        if self.kill_error is not None:  # cancelled: the lease was lost, or deleted
            return self.kill_error
        if self.deleted:
            return _deleted_error(sid)
        return _stopped_error(sid, "closing")

    async def resume_interrupted(self) -> None:
        """Finish a turn whose process died mid-tool (found open on wake)."""
        open_turn = self.session.open_turn
        assert open_turn is not None
        self.turn_id = open_turn.turn_id
        try:
            agent = self.host._agent_for(self.session)
        except LookupError as exc:
            outcome = TurnFailed(
                session_id=self.session_id,
                seq=self._seq(),
                turn_id=self.turn_id,
                error=_describe(exc),
            )
            self._durable(outcome)
            await self.commit()
            return
        self._set_status(Status.RUNNING)

        async def before(agent: Agent) -> bool:
            return await resume_tool_calls(self, agent, interrupted=True)

        await self._drive(agent, Pending(), open_turn.idempotency_key, before=before)

    # ---- endings ---------------------------------------------------------------

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                request = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            request.pending.set_error(error)
        for inflight in self.inflight_keys.values():
            inflight.pending.set_error(error)
        self.inflight_keys.clear()

    def close_mailbox(self) -> None:
        self.send.close()

    async def _hibernate_if_idle(self) -> bool:
        """Snapshot; leave if nothing arrived meanwhile (else stay live, lease kept)."""
        if self.session.reviews and self.turn_request is not None:
            return False
        await self._snapshot_for_hibernation()
        if self.receive.statistics().current_buffer_used:
            self.stored_clean = True  # staying live to serve them
            return False
        self._leave(Status.HIBERNATED)
        await self._release_lease()  # after leaving: a request now wakes a new actor
        return True

    async def _hibernate_now(self) -> None:
        """Hibernate at once (registry closing), shielded and bounded."""
        with self._bounded_write() as writing:
            await self._snapshot_for_hibernation()
        self._answer_held(stored=not writing.cancelled_caught)
        self._fail_queued(_stopped_error(self.session_id, "closing"))
        self._leave(Status.HIBERNATED)
        if not writing.cancelled_caught:  # else the store is stuck: the lease expires
            await self._release_lease()

    async def _snapshot_for_hibernation(self) -> None:
        """Write the hibernated state; its status event is published once it is stored."""
        session = self.session
        event = None
        if session.status is not Status.HIBERNATED:
            session.status = Status.HIBERNATED
            event = StatusChanged(
                session_id=self.session_id, seq=self._seq(), status=Status.HIBERNATED
            )
        await self._write_snapshot(Status.HIBERNATED)
        if event is not None:
            self._emit(event)

    def _leave(self, status: Status) -> None:
        self.session.status = status
        self.send.close()
        self.receive.close()
        self.host._detach(self)
        self.host.stats.hibernated += status is Status.HIBERNATED

    async def _finish_stop(self) -> None:
        """Stop: one write makes it so, the journal's (or, without one, the snapshot's).

        With a journal, a snapshot follows once the actor has left (the caller does
        not wait for it): reads of the stopped session then replay no journal tail.
        """
        sid = self.session_id
        event = StatusChanged(session_id=sid, seq=self._seq(), status=Status.STOPPED)
        self._durable(event, publish=False)
        journal = self.host.config.durability == "turn"
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
        self._fail_queued(_stopped_error(sid, "stop"))
        self._emit(event)
        self._leave(Status.STOPPED)
        self._hub().close()
        if journal:  # compaction only: the stop is stored already
            with self._bounded_write(), contextlib.suppress(Exception):
                await self._write_snapshot(Status.STOPPED)


async def read_stored(store: Store, session_id: str) -> tuple[LiveSession, StoredSession]:
    """The session as the store has it (snapshot + journal tail), without waking it."""
    stored = await store.load(session_id)
    if stored is None:
        raise SessionNotFoundError(
            f"session {session_id!r} does not exist; create it with registry.spawn({session_id!r})",
            session_id=session_id,
        )
    state = load_snapshot(stored.snapshot, session_id=session_id)
    if state.session_id != session_id:
        raise SnapshotCorruptError(
            f"the snapshot stored for session {session_id!r} belongs to "
            f"{state.session_id!r}; the store is inconsistent: restore it or delete the session",
            session_id=session_id,
        )
    session = LiveSession(state)
    for entry in stored.entries:
        for event in load_events(entry.data, session_id=session_id):
            if event.seq > stored.snapshot_seq:
                session.apply(event)
    return session, stored


def _resting_status(session: LiveSession) -> Status:
    if session.reviews:
        return Status.WAITING
    if session.turn_count == 0 and not session.messages:
        return Status.NEW
    return Status.IDLE


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _busy_error(sid: str, review: ReviewRequest) -> SessionBusyError:
    return SessionBusyError(
        f"session {sid!r} is waiting on review {review.id!r} of tool "
        f"{review.tool_call.name!r}; resolve it with ref.review({review.id!r}, approve=...) "
        "before sending a new message",
        session_id=sid,
    )


def _stopped_error(sid: str, reason: str) -> SessionStoppedError:
    if reason == "stop":
        text = f"session {sid!r} was stopped; spawn a new session to continue the conversation"
    elif reason == "unsaved":
        text = (
            f"the registry closed before the store confirmed the turn of session {sid!r} "
            "(it did not answer in time), so the turn may be lost: send it again once a "
            "registry is open (with an idempotency key, a retry cannot run it twice)"
        )
    elif reason == "cut":
        text = (
            f"the turn of session {sid!r} was cut off when the registry closed after its "
            "shutdown grace; what it streamed is kept, marked interrupted: send it again "
            "once a registry is open"
        )
    else:
        text = (
            f"session {sid!r} did not run this request: the registry was closing; "
            "send it again once a registry is open"
        )
    return SessionStoppedError(text, session_id=sid)


def crashed_error(sid: str, exc: BaseException, *, failed: bool = False) -> SessionCrashedError:
    if failed:
        return SessionCrashedError(
            f"session {sid!r} crashed too often and is marked failed ({_describe(exc)}); "
            "fix the cause, then restart the process or delete the session",
            session_id=sid,
        )
    return SessionCrashedError(
        f"session {sid!r} crashed while handling this request ({_describe(exc)}); it was "
        "restarted from its last durable state, so retry the request",
        session_id=sid,
    )


async def session_task(host: Host, actor: Actor) -> None:
    """The supervised life of one session: run, and restart after crashes."""
    config = host.config
    crashes: deque[float] | None = None  # made on the first crash
    while True:
        scope = actor.run_scope = trio.CancelScope()
        if actor.deleted:  # deleted before this task began
            scope.cancel()
        try:
            with scope:
                if crashes is not None:  # a restart lets the others run first
                    await trio.lowlevel.checkpoint()
                await actor.run()
            if scope.cancelled_caught:  # deleted, or its lease was lost
                _end(host, actor, actor.kill_error or _deleted_error(actor.session_id))
            return
        except FencedOutError as exc:
            # another worker owns the session now: stop here, no restart
            host.stats.leases_lost += 1
            actor.lease = None
            _end(host, actor, exc)
            return
        except Exception as exc:
            host.stats.crashes += 1
            if actor.deleted:  # crashed while being deleted: nothing to restart
                _end(host, actor, _deleted_error(actor.session_id))
                return
            now = trio.current_time()
            if crashes is None:
                crashes = deque()
            crashes.append(now)
            while crashes and now - crashes[0] > config.restart_window:
                crashes.popleft()
            failed = len(crashes) > config.max_restarts
            error = crashed_error(actor.session_id, exc, failed=failed)
            error.__cause__ = exc
            if actor.stop_requested:  # the stop did not happen: its caller hears why
                actor.stop_error = exc if isinstance(exc, SessionActorsError) else error
            _fail_waiters(actor, error)
            if failed:
                host._mark_failed(actor, _describe(exc))
                return
            host.stats.restarts += 1
            fresh = Actor(host, actor.session_id, None)
            fresh.hub = actor.hub
            if config.durability != "turn":  # what was answered, not the request cut short
                fresh.unsaved = actor.unsaved[: actor._settled]
            fresh.lease = actor.lease
            if host._closing:  # it takes nothing new: it only hibernates what it has
                fresh.close_mailbox()
                fresh.abort_reason = actor.abort_reason
            host._replace(actor, fresh)
            actor = fresh
        except BaseException as exc:
            if _cancelled(exc):
                # Cancelled from outside: the registry gave up waiting (a stalled store),
                # or something escaped it. Nobody is left to answer, so answer them now.
                cut = actor._cut_short(exc)  # killed, deleted, or closing
                if actor.turn_request is not None and not (actor.kill_error or actor.deleted):
                    # closing, not killed or deleted: its write may not have landed
                    actor.turn_request.pending.set_error(
                        _stopped_error(actor.session_id, "unsaved")
                    )
                _end(host, actor, cut)
            raise


def _end(host: Host, actor: Actor, error: SessionActorsError) -> None:
    """The actor is gone for good (deleted, lease lost, cancelled): fail every waiter."""
    if actor.stop_requested and not actor.deleted:  # the stop did not happen either
        actor.stop_error = error
    _fail_waiters(actor, error)
    host._detach(actor)


def _fail_waiters(actor: Actor, error: SessionActorsError) -> None:
    """Close the mailbox and fail everyone waiting on this actor with ``error``."""
    actor.send.close()
    if actor._ready is not None:  # ended while waking: release its waiters
        actor.load_error = error
        actor._ready.set()
    if actor.turn_request is not None:
        actor.turn_request.pending.set_error(error)
        actor.turn_request = None
    actor._fail_queued(error)
    actor.receive.close()


def _cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation (or a group of nothing else, from a nursery)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def _deleted_error(sid: str) -> SessionNotFoundError:
    return SessionNotFoundError(
        f"session {sid!r} was deleted while this request was pending", session_id=sid
    )
