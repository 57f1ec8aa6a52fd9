"""The live, mutable state of one session and the fold of journal events over it.

Pure (no trio). The actor that owns a session changes its state only by
``apply``-ing durable events, the same function that rebuilds the state from a
snapshot plus the journal on wake: what is replayed is what was lived.
"""

from __future__ import annotations

import copy
import datetime
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, overload

import attrs

from ._errors import Advice, AdviceKind, TurnNotFoundError, advised, shown
from ._events import (
    Event,
    HistoryEdited,
    MessageAdded,
    MetadataChanged,
    ReviewRequested,
    ReviewResolved,
    StatusChanged,
    ToolCallStarted,
    ToolResult,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)
from ._listing import activity_micros
from ._records import (
    CompletedTurn,
    Message,
    OpenTurn,
    ReviewRequest,
    Role,
    SessionInfo,
    SessionState,
    Status,
    TurnOutcome,
    TurnRecord,
    TurnStatus,
    Usage,
    make_info,
    make_state,
    make_turn_record,
    utcnow,
)
from ._turns import (
    CLOCK_SKEW_US,
    MAX_TURN_ID_CHARS,
    MAX_TURN_RECORDS,
    session_tag,
    turn_id_time,
)

__all__ = ["MAX_COMPLETED_KEYS", "HistoryView", "LiveSession", "new_state", "state_info"]

#: How many idempotency keys a session remembers (the most recent ones).
MAX_COMPLETED_KEYS = 1000
#: A turn's recorded error is cut to this many characters.
MAX_ERROR_CHARS = 2000

#: How the error of a failed turn ends once an edit took out its user message or one
#: before it: its kind is kept, its words are not (they may quote the prompt).
ERASED = ": (what it said went with messages taken out of the history)"


class HistoryView(Sequence[Message]):
    """A read-only view of the first ``length`` messages of a list, after a prefix.

    Building a model request must not copy a long history; the actor never
    mutates a list in place except by appending, and edits replace the list,
    so a view stays valid (and unchanged) after the turn.
    """

    __slots__ = ("_items", "_length", "_prefix")

    def __init__(self, prefix: tuple[Message, ...], items: list[Message], length: int) -> None:
        self._prefix = prefix
        self._items = items
        self._length = length

    def __len__(self) -> int:
        return len(self._prefix) + self._length

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Message]: ...
    def __getitem__(self, index: int | slice) -> Message | Sequence[Message]:
        length = self._length
        if index.__class__ is int and -length <= index < 0:  # (int: a bool is not)
            return self._items[length + index]  # the common read: the latest messages
        if isinstance(index, slice):
            return list(self)[index]
        p = len(self._prefix)
        n = p + self._length
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("history index out of range")
        return self._prefix[index] if index < p else self._items[index - p]

    def __iter__(self) -> Iterator[Message]:
        yield from self._prefix
        items = self._items
        for i in range(self._length):
            yield items[i]

    def __repr__(self) -> str:
        return f"<HistoryView of {len(self)} messages>"


def new_state(
    session_id: str,
    *,
    agent: str | None,
    metadata: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
) -> SessionState:
    """The state of a session spawned now: no history yet."""
    now = utcnow()
    return make_state(
        session_id=session_id,
        agent=agent,
        status=Status.NEW,
        metadata=dict(metadata or {}),
        created_at=now,
        updated_at=now,
        system_prompt=system_prompt,
    )


def state_info(state: SessionState) -> SessionInfo:
    """The info of a session stored as ``state``: ``LiveSession(state).info()`` for a
    state that ``LiveSession.to_state`` made (no two reviews of one id)."""
    return make_info(
        session_id=state.session_id,
        agent=state.agent,
        status=state.status,
        message_count=len(state.messages),
        updated_at=state.updated_at,
        metadata=state.metadata,
        pending_reviews=len(state.reviews),
        usage=state.usage,
    )


class LiveSession:
    """Mutable state of one session, owned by one actor task."""

    __slots__ = (
        "_open",
        "agent",
        "completed",
        "created_at",
        "detached",
        "event_seq",
        "journal_mark_events",
        "journal_mark_seq",
        "messages",
        "metadata",
        "open_seq",
        "reviews",
        "session_id",
        "status",
        "summary",
        "system_prompt",
        "turn_count",
        "turns",
        "turns_forgotten",
        "updated_at",
        "usage",
    )

    def __init__(self, state: SessionState) -> None:
        self.session_id = state.session_id
        self.agent = state.agent
        self.status = state.status
        self.messages: list[Message] = list(state.messages)
        self.metadata: Mapping[str, Any] = state.metadata
        self.event_seq = state.event_seq
        self.created_at = state.created_at
        self.updated_at = state.updated_at
        self.system_prompt = state.system_prompt
        self.summary = state.summary
        self.completed: dict[str, CompletedTurn] = {c.key: c for c in state.completed}
        #: The completed keys whose reply an edit removed, by their reply's id: a
        #: message of that id that joins the history again is their reply again.
        self.detached: dict[str, str] = {}
        if self.completed:
            self._attach_replies()
        self.reviews: dict[str, ReviewRequest] = {r.id: r for r in state.reviews}
        self.turn_count = state.turn_count
        # The open turn: as the TurnStarted that opened it until someone asks for an
        # OpenTurn (most turns end without anyone asking; see ``open_turn``).
        self._open: OpenTurn | TurnStarted | None = state.open_turn
        #: The seq of the TurnStarted of the open turn, if folded since the state was
        #: loaded (0: not known, it opened before the snapshot); see ``open_since``.
        self.open_seq = 0
        self.turns: dict[str, TurnRecord] = {t.turn_id: t for t in state.turns}
        self.turns_forgotten = state.turns_forgotten
        self.usage: Usage = state.usage
        self.journal_mark_seq = state.journal_mark_seq
        self.journal_mark_events = state.journal_mark_events

    def to_state(self) -> SessionState:
        """A frozen copy of the state, for snapshots (``ref.state()`` hands out
        :meth:`copy_out`, whose metadata is a copy too)."""
        return SessionState(
            session_id=self.session_id,
            agent=self.agent,
            status=self.status,
            messages=tuple(self.messages),
            metadata=self.metadata,
            event_seq=self.event_seq,
            created_at=self.created_at,
            updated_at=self.updated_at,
            system_prompt=self.system_prompt,
            summary=self.summary,
            completed=tuple(self.completed.values()),
            reviews=tuple(self.reviews.values()),
            turn_count=self.turn_count,
            open_turn=self.open_turn,
            turns=tuple(self.turns.values()),
            turns_forgotten=self.turns_forgotten,
            usage=self.usage,
            journal_mark_seq=self.journal_mark_seq,
            journal_mark_events=self.journal_mark_events,
        )

    def copy_out(self) -> SessionState:
        """The state to hand out: changing its metadata, or a message's, changes nothing
        here (most messages share the read-only empty metadata and are not copied)."""
        state = self.to_state()
        changes: dict[str, Any] = {}
        if state.metadata:
            changes["metadata"] = copy.deepcopy(state.metadata)
        if any(m.metadata for m in state.messages):
            changes["messages"] = tuple(
                attrs.evolve(m, metadata=copy.deepcopy(m.metadata)) if m.metadata else m
                for m in state.messages
            )
        return attrs.evolve(state, **changes) if changes else state

    @property
    def message_count(self) -> int:
        """As in :meth:`info` (the codec reads the info's fields from a live session)."""
        return len(self.messages)

    @property
    def pending_reviews(self) -> int:
        """As in :meth:`info`."""
        return len(self.reviews)

    def resting_status(self) -> Status:
        """The status between requests: waiting on a review, new (never used), or idle."""
        if self.reviews:
            return Status.WAITING
        if self.turn_count == 0 and not self.messages:
            return Status.NEW
        return Status.IDLE

    def info(self, status: Status | None = None) -> SessionInfo:
        status = status or self.status
        if status is Status.HIBERNATED and self._open is not None and not self.reviews:
            # a turn left open, hibernated with it (imported from another store, where
            # a process died under it): running, for listings, till a request resumes it
            status = Status.RUNNING
        return SessionInfo(
            session_id=self.session_id,
            agent=self.agent,
            status=status,
            message_count=len(self.messages),
            updated_at=self.updated_at,
            metadata=self.metadata,
            pending_reviews=len(self.reviews),
            usage=self.usage,
        )

    def view(self, prefix: tuple[Message, ...]) -> HistoryView:
        """The history as the model sees it, after ``prefix`` (system prompt, summary)."""
        return HistoryView(prefix, self.messages, len(self.messages))

    def find(self, message_id: str) -> int:
        """The index of a message in the history, or -1."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].id == message_id:
                return i
        return -1

    def turn_text(self, turn_id: str) -> str | None:
        """The words of the user's message that turn ``turn_id`` (open, or among the
        recorded turns) answers, or None if the session no longer knows them: the
        turn's record was dropped, or an edit removed its message."""
        open_ = self._open
        if open_ is not None and open_.turn_id == turn_id:
            message_id = open_.message_id
        else:
            record = self.turns.get(turn_id)
            message_id = record.message_id if record is not None else ""
        if not message_id:
            return None
        index = self.find(message_id)
        return self.messages[index].content if index >= 0 else None

    @property
    def open_turn(self) -> OpenTurn | None:
        """The turn that began durably and has no outcome yet, or None."""
        open_ = self._open
        if isinstance(open_, TurnStarted):
            open_ = self._open = OpenTurn(
                turn_id=open_.turn_id,
                idempotency_key=open_.idempotency_key,
                message_id=open_.message_id,
            )
        return open_

    @open_turn.setter
    def open_turn(self, value: OpenTurn | None) -> None:
        self._open = value

    def open_since(self, turn_id: str) -> int:
        """The seq after which the events of turn ``turn_id``, open, begin: just before
        its TurnStarted if known, else 0 (all of the session's events hold them)."""
        open_ = self._open
        if open_ is None or open_.turn_id != turn_id or not self.open_seq:
            return 0
        return self.open_seq - 1

    def apply(self, event: Event, *, now: datetime.datetime | None = None) -> None:
        """Fold one durable event into the state (events of other kinds only bump seq)."""
        if event.seq > self.event_seq:
            self.event_seq = event.seq
        if isinstance(event, TurnStarted):
            self._open = event  # an OpenTurn when asked for (see ``open_turn``)
            self.open_seq = event.seq
            if event.retry_of is None:  # (a retry's user message is in the history)
                message = event.message
                if message is not None:  # (0.1: a MessageAdded follows)
                    self.messages.append(message)
                    self.updated_at = message.created_at
        elif isinstance(event, TurnFinished):
            reply = event.message
            self._record(event.turn_id, TurnStatus.FINISHED, reply_id=reply.id)
            self._open = None
            self.turn_count += 1
            messages = self.messages
            if not messages or messages[-1].id != reply.id:
                messages.append(reply)
                if reply.usage is not None:
                    self.usage += reply.usage
            else:  # (0.1: a MessageAdded brought it already; the key keeps that one)
                reply = messages[-1]
            self.updated_at = reply.created_at
            key = event.idempotency_key
            if key is not None:  # (the history's message itself: never a copy)
                completed = self.completed
                completed[key] = CompletedTurn(key=key, turn_id=event.turn_id, reply=reply)
                if len(completed) > MAX_COMPLETED_KEYS:
                    dropped = completed.pop(next(iter(completed)))
                    if dropped.reply is None:
                        self.detached.pop(dropped.reply_id, None)
        elif isinstance(event, MessageAdded):
            added = event.message
            self.messages.append(added)
            if self.detached and added.id in self.detached:
                self._reattach(added)
            self.updated_at = added.created_at
            # a turn's own model call counts; a message put in without a turn
            # (add_messages, replace_history) was counted where it was made, if at all
            if added.usage is not None and event.turn_id is not None:
                self.usage += added.usage
        elif isinstance(event, ToolResult):
            message = event.message
            if message is not None:  # (0.1 journaled a MessageAdded with it instead)
                self.messages.append(message)
                self.updated_at = message.created_at
        elif isinstance(event, ToolCallStarted):
            open_turn = self.open_turn
            if open_turn is not None:
                self._open = attrs.evolve(
                    open_turn,
                    started_calls=(*open_turn.started_calls, event.tool_call.id),
                )
        elif isinstance(event, TurnFailed | TurnCancelled):
            if isinstance(event, TurnCancelled):
                self._record(event.turn_id, TurnStatus.CANCELLED)
            elif not event.lost:  # (a lost turn's outcome is never journaled)
                self._record(event.turn_id, TurnStatus.FAILED, error=event.error)
            self._open = None
            self.turn_count += 1
            self.updated_at = now or utcnow()
        elif isinstance(event, StatusChanged):
            self.status = event.status
            self.updated_at = now or utcnow()
        elif isinstance(event, ReviewRequested):
            self.reviews[event.review.id] = event.review
        elif isinstance(event, ReviewResolved):
            self.reviews.pop(event.review_id, None)
        elif isinstance(event, HistoryEdited):
            if event.removed:
                gone = set(event.removed)
                messages = self.messages
                self._forget_errors(gone)
                self.messages = [m for m in messages if m.id not in gone]
                if self.completed:
                    self._detach(gone)
            if event.summary is not None:
                self.summary = event.summary or None
            if event.usage is not None:  # (a compaction's summarizer)
                self.usage += event.usage
            self.updated_at = now or utcnow()
        elif isinstance(event, MetadataChanged):
            # its own: the event is published
            self.metadata = copy.deepcopy(event.metadata)
            self.updated_at = now or utcnow()

    def _attach_replies(self) -> None:
        """Give each completed key the history's message of its reply's id (the very
        object: a snapshot of schema version 2 holds a copy), or None if the history
        no longer holds it (an edit removed it)."""
        held = {m.id: m for m in self.messages}
        completed = self.completed
        for key, turn in completed.items():
            reply_id = turn.reply_id
            found = held.get(reply_id) if reply_id else None
            if found is not turn.reply:
                completed[key] = CompletedTurn(
                    key=key, turn_id=turn.turn_id, reply=found, reply_id=reply_id
                )
            if found is None and reply_id:
                self.detached[reply_id] = key

    def _detach(self, gone: set[str]) -> None:
        """Let go of the replies of completed keys that an edit removed (the keys stay)."""
        completed = self.completed
        for key, turn in completed.items():
            reply = turn.reply
            if reply is not None and reply.id in gone:
                completed[key] = CompletedTurn(
                    key=key, turn_id=turn.turn_id, reply=None, reply_id=reply.id
                )
                self.detached[reply.id] = key

    def _forget_errors(self, gone: set[str]) -> None:
        """Keep only the kind of the errors of the failed turns whose requests may have
        held a message that an edit removes (``gone``, still in the history): a
        provider's error may quote the prompt. Those are the turns of the first removed
        message and after it, and those whose message the history no longer holds."""
        turns = self.turns
        if not any(record.error is not None for record in turns.values()):
            return
        before: set[str] = set()  # the messages before the first removed one
        for message in self.messages:
            if message.id in gone:
                break
            before.add(message.id)
        for turn_id, record in turns.items():
            error = record.error
            if error is None or record.message_id in before or error.endswith(ERASED):
                continue
            kind = error.partition(":")[0]
            turns[turn_id] = attrs.evolve(record, error=f"{kind}{ERASED}")

    def _reattach(self, message: Message) -> None:
        """``message`` joined the history under the id of a removed reply (replace_history
        gave it back): it is that key's reply again."""
        key = self.detached.pop(message.id)
        turn = self.completed.get(key)
        if turn is not None and turn.reply is None and turn.reply_id == message.id:
            self.completed[key] = CompletedTurn(key=key, turn_id=turn.turn_id, reply=message)

    def _record(
        self,
        turn_id: str,
        status: TurnStatus,
        *,
        reply_id: str | None = None,
        error: str | None = None,
    ) -> None:
        """Keep how the turn ended (the last MAX_TURN_RECORDS turns)."""
        open_ = self._open  # (an OpenTurn or the TurnStarted: both carry message_id)
        message_id = open_.message_id if open_ is not None else ""
        if error is not None and len(error) > MAX_ERROR_CHARS:
            error = error[:MAX_ERROR_CHARS] + "..."
        turns = self.turns
        turns.pop(turn_id, None)  # (a re-recorded turn moves to the end)
        turns[turn_id] = make_turn_record(
            turn_id=turn_id, status=status, message_id=message_id, reply_id=reply_id, error=error
        )
        if len(turns) > MAX_TURN_RECORDS:
            gone = turns.pop(next(iter(turns)))
            issued = turn_id_time(gone.turn_id)
            if issued is not None and issued > self.turns_forgotten:
                self.turns_forgotten = issued

    def last_turn(self) -> TurnRecord | None:
        """How the most recent turn ended (None before the first)."""
        return next(reversed(self.turns.values()), None)

    def outcome(
        self,
        turn_id: str,
        *,
        queued: Collection[str] | None = None,
        refused: Mapping[str, str] | None = None,
    ) -> TurnOutcome:
        """What became of ``turn_id`` (the rules are in ``_turns``).

        ``queued``: the ids of the turns in the live actor's mailbox (None when the
        session is not live here); ``refused``: the turns it refused before they
        started, with the error. (Another worker asks the session's owner, which
        knows its mailbox.)
        """
        sid = self.session_id
        record = self.turns.get(turn_id)
        if record is not None:
            message = None
            if record.reply_id is not None:
                index = self.find(record.reply_id)
                message = self.messages[index] if index >= 0 else None
            return TurnOutcome(
                session_id=sid,
                turn_id=turn_id,
                status=record.status,
                message=message,
                error=record.error,
            )
        open_ = self._open
        if open_ is not None and open_.turn_id == turn_id:  # (issued under an earlier
            # name, for a session imported under another: its id carries the old tag)
            status = TurnStatus.WAITING if self.reviews else TurnStatus.RUNNING
            return TurnOutcome(session_id=sid, turn_id=turn_id, status=status)
        issued = turn_id_time(turn_id, session_tag(sid))
        created = activity_micros(self.created_at)
        if (
            issued is None
            or len(turn_id) > MAX_TURN_ID_CHARS
            or not created - CLOCK_SKEW_US <= issued <= time.time_ns() // 1000 + CLOCK_SKEW_US
        ):
            raise advised(
                TurnNotFoundError,
                f"session {sid!r} never issued a turn id {shown(turn_id)}; ",
                Advice(kind=AdviceKind.TURN_IDS),
                session_id=sid,
            )
        status = TurnStatus.LOST
        error = None
        if refused is not None and turn_id in refused:
            status, error = TurnStatus.FAILED, refused[turn_id]
        elif queued and turn_id in queued:
            # (before the forgotten records: an id issued by a worker whose clock is
            # behind may be stamped before records dropped while it waits)
            status = TurnStatus.QUEUED
        elif issued <= self.turns_forgotten:
            raise TurnNotFoundError(
                f"session {sid!r} no longer knows what became of turn {shown(turn_id)}: it "
                f"keeps the outcomes of its last {MAX_TURN_RECORDS} turns, and that id is "
                "older than theirs",
                session_id=sid,
            )
        return TurnOutcome(session_id=sid, turn_id=turn_id, status=status, error=error)

    def system_messages(self, system_prompt: str) -> tuple[Message, ...]:
        """What goes before the history in a model request: prompt, then summary."""
        out: list[Message] = []
        prompt = self.system_prompt if self.system_prompt is not None else system_prompt
        if prompt:
            out.append(_system_message("sys_prompt", prompt, self.created_at))
        if self.summary:
            out.append(
                _system_message(
                    "sys_summary",
                    f"Summary of the earlier conversation:\n{self.summary}",
                    self.created_at,
                )
            )
        return tuple(out)


def _system_message(id_: str, content: str, at: datetime.datetime) -> Message:
    return Message(id=id_, role=Role.SYSTEM, content=content, created_at=at)
