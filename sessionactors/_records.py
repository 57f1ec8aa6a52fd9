"""The durable records: messages, tool calls, reviews and the session state.

Pure values (attrs, frozen); no trio here. These classes are what the codec
writes to snapshots and journals, so their fields follow the format rules:
new fields get defaults, field types never change.
"""

import datetime
import enum
import itertools
import os
import secrets
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import attrs

__all__ = [
    "MAX_COUNT",
    "SCHEMA_VERSION",
    "CompletedTurn",
    "Message",
    "OpenTurn",
    "ReviewRequest",
    "Role",
    "SessionInfo",
    "SessionState",
    "Status",
    "ToolCall",
    "TurnOutcome",
    "TurnRecord",
    "TurnStatus",
    "Usage",
    "check_unicode",
    "make_message",
    "make_tool_call",
    "make_turn_record",
    "maker",
    "new_id",
    "storable",
    "utcnow",
]

_T = TypeVar("_T")


def maker(cls: type[_T]) -> Callable[..., _T]:
    """A constructor of the frozen, slotted attrs class ``cls`` for the turn's hot path:
    the same fields, defaults and result as ``cls(...)``, in under a third of the time.

    attrs' ``__init__`` of a frozen class sets each field through
    ``object.__setattr__`` (a lookup of the field by name, past the frozen
    ``__setattr__``, in a call of its own). This one makes the instance as a
    subclass of ``cls`` that adds nothing but the plain ``__setattr__`` and
    ``__delattr__`` (so the interpreter stores each slot in place, as for any
    mutable slotted class), then sets its ``__class__`` to ``cls``: what it
    returns is a ``cls``, exactly, and the subclass is never seen. (Calling each
    slot's setter instead saved only a fifth.) Its arguments are keywords, as for
    the records' own constructors. A turn makes about ten records, which was a
    fifth of its cost. A default made by a factory is made, as ``__init__`` makes
    it, when its argument is left out. Only for classes whose ``__init__`` does
    nothing more: no validators, converters, factories that take self or init hooks.
    """
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__attrs_post_init__") or hasattr(cls, "__attrs_pre_init__"):
        raise TypeError(f"{cls.__name__} has an init hook; build it with its constructor")
    # (both: ``__setattr__`` and ``__delattr__`` share the one type slot that decides
    # whether an attribute store is the plain one; and an ``__init__`` that takes
    # nothing, so that calling the class makes an empty instance)
    building = type(
        f"{cls.__name__}Building",
        (cls,),
        {
            "__slots__": (),
            "__init__": object.__init__,
            "__setattr__": object.__setattr__,
            "__delattr__": object.__delattr__,
            "__module__": cls.__module__,
        },
    )
    setters: dict[str, Any] = {"_cls_": cls, "_building_": building, "_NOTHING_": attrs.NOTHING}
    params: list[str] = []
    body: list[str] = []
    for i, field in enumerate(fields):
        if field.validator is not None or field.converter is not None or not field.init:
            raise TypeError(f"{cls.__name__}.{field.name} does more than store its argument")
        name = field.alias or field.name  # the keyword of the class's own __init__
        if (
            not name.isidentifier()
            or name.endswith("_")
            or not field.name.isidentifier()
            or field.name.startswith("__")
        ):
            raise TypeError(f"{cls.__name__}.{field.name}: no maker for this field name")
        if field.default is attrs.NOTHING:
            params.append(name)
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            if field.default.takes_self:
                raise TypeError(f"{cls.__name__}.{field.name}'s default takes self")
            setters[f"_f{i}_"] = field.default.factory
            params.append(f"{name}=_NOTHING_")
            body.append(f"    if {name} is _NOTHING_: {name} = _f{i}_()")
        else:
            setters[f"_d{i}_"] = field.default
            params.append(f"{name}=_d{i}_")
        body.append(f"    self_.{field.name} = {name}")
    source = (
        f"def make(*, {', '.join(params)}):\n    self_ = _building_()\n"
        + "\n".join(body)
        + "\n    self_.__class__ = _cls_\n    return self_\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<sessionactors maker {cls.__name__}>", "exec"), setters, namespace)
    make: Callable[..., _T] = namespace["make"]
    make.__qualname__ = make.__name__ = f"make_{cls.__name__}"
    return make


#: The snapshot format version this code writes (a snapshot that needs nothing the
#: version adds is written at the version before it: see ``_codec``).
SCHEMA_VERSION = 3


_now = datetime.datetime.now
_UTC = datetime.UTC


def utcnow() -> datetime.datetime:
    """The current time, timezone-aware, in UTC."""
    return _now(_UTC)


_ID_PREFIX = secrets.token_hex(8)  # this process; ids stay unique across processes
_ID_COUNTER = itertools.count(1)


def _reseed_ids() -> None:
    """A forked worker must not repeat its parent's ids."""
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = secrets.token_hex(8)
    _ID_COUNTER = itertools.count(1)


os.register_at_fork(after_in_child=_reseed_ids)


#: The Unicode categories of control characters: controls, format marks (such as
#: right-to-left), line and paragraph separators.
_CONTROLS: Final = frozenset({"Cc", "Cf", "Zl", "Zp"})


def is_control(ch: str) -> bool:
    """Whether the character ``ch`` is a control character (not the zero-width joiner,
    a format mark that emoji are made with)."""
    return ch != "\u200d" and unicodedata.category(ch) in _CONTROLS


def control_character(text: str) -> str | None:
    """The first control character of ``text`` (see ``is_control``), if any: the names
    and ids that reach logs, JSON and keys hold none."""
    if text.isprintable():  # (then it holds none of them: a C loop)
        return None
    return next((ch for ch in text if is_control(ch)), None)


def check_printable(text: str, subject: str) -> None:
    """ValueError, saying so of ``subject``, if ``text`` holds a control character."""
    ch = control_character(text)
    if ch is not None:
        raise ValueError(
            f"{subject} contains the control character {ch!r}; use printable characters only"
        )


def check_unicode(text: str, subject: str) -> None:
    """ValueError, saying so of ``subject``, if ``text`` holds a lone surrogate (no
    store can hold it)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{subject} is not valid Unicode: it holds a lone surrogate "
                f"({text[exc.start]!r} at index {exc.start}), which cannot be stored; "
                "decode the input with errors='replace' first"
            ) from None


def storable(text: str) -> str:
    """``text`` as it can be stored: valid Unicode.

    Text from a model or a tool may hold lone surrogates (what ``json.loads`` makes
    of ``"\\ud800"``, or ``os.fsdecode`` of a file name that is not UTF-8), which no
    store can encode. A surrogate pair split across two pieces is joined again, and
    every lone surrogate becomes U+FFFD, the replacement character.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def new_id(prefix: str) -> str:
    """A fresh identifier such as ``msg_3f2a9c...0001a``, unique across processes.

    A random part per process and a counter: cheaper than a UUID on every turn.
    """
    return f"{prefix}_{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def id_issuer(identifier: str) -> tuple[str, int] | None:
    """The process that made ``identifier`` with :func:`new_id`, and its place among
    that process's ids (an id made later has a larger one); None if it is not of
    that form."""
    tail = identifier.rsplit("_", 1)[-1]
    if len(tail) < 24:  # 16 for the process, 8 or more for the counter
        return None
    try:
        return tail[:16], int(tail[16:], 16)
    except ValueError:
        return None


class Role(enum.Enum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


def _role_named(role: object) -> Role:
    """The role that ``role`` names (``"user"``), or ValueError saying which there are."""
    try:
        return Role(role)
    except ValueError:
        names = ", ".join(repr(r.value) for r in Role)
        raise ValueError(
            f"a message's role is one of {names} (or sa.Role), not {role!r:.60}"
        ) from None


class Status(enum.Enum):
    """Where a session is in its life.

    A session that is not live is listed (and read) by what it waits for:
    ``waiting`` while a review is pending, ``running`` while a turn that its process
    left open (it died mid-turn) waits to be resumed, otherwise the status it was
    stored with (``hibernated``, ``stopped``; ``idle`` if its process died between
    turns).
    """

    NEW = "new"  #: spawned, no turn yet
    IDLE = "idle"  #: live, waiting for a request
    #: a turn is in flight, or was left open by a process that died mid-turn (the
    #: session's next request or subscription wakes it, and the turn resumes)
    RUNNING = "running"
    WAITING = "waiting"  #: a turn waits on a human review, live or hibernated
    HIBERNATED = "hibernated"  #: not live, waiting for nothing; its state is in the store
    STOPPED = "stopped"  #: finished; takes no more requests
    FAILED = "failed"  #: crashed past its restart intensity


class _NoMetadata(dict[str, Any]):
    """The empty metadata that records made without any share: read-only, so that
    sharing it is safe (and a message without metadata costs no dict of its own)."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("metadata is read-only; make a new record with the metadata it needs")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> Any:  # copies are plain empty dicts
        return (dict, ())


#: The shared empty metadata (a read-only dict).
NO_METADATA: Final = _NoMetadata()


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call of a tool that the model asked for; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str = "{}"


#: The largest count (and seq) a record holds and a store keeps (the codec's MAX_SEQ):
#: a sum of usages stops there.
MAX_COUNT: Final = 2**53 - 1


@attrs.frozen(kw_only=True)
class Usage:
    """Tokens counted by a model: ``input_tokens`` read (the prompt) and
    ``output_tokens`` written (the completion).

    On an assistant message, what the model reported for that answer; on a
    session's state and listing, the sum over the session's life (it keeps
    counting when the history is truncated or compacted). Add two with ``+``: a
    sum stops at 2**53 - 1, the largest count a store keeps.
    """

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Input and output tokens together."""
        return self.input_tokens + self.output_tokens

    def __add__(self, other: "Usage") -> "Usage":
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            input_tokens=min(self.input_tokens + other.input_tokens, MAX_COUNT),
            output_tokens=min(self.output_tokens + other.output_tokens, MAX_COUNT),
        )


#: No tokens counted (the default of a session's usage).
NO_USAGE: Final = Usage()


@attrs.frozen(kw_only=True)
class Message:
    """One message of a conversation.

    A ``Role.TOOL`` message answers the call whose id is ``tool_call_id``;
    ``is_error`` marks a tool result that reports a failure. ``interrupted``
    marks an assistant message whose turn was cancelled or failed part-way (what
    its last model step streamed), or the "(no reply: ...)" message that such a
    turn leaves after its user message when that step streamed no text (so that
    roles keep alternating). The turn's outcome tells which ended it
    (``SessionState.turns``, ``ref.turn_outcome``).

    ``usage`` is what the model reported for an assistant message (None when it
    reported nothing, and on other messages).

    ``metadata`` is read-only, like the message: messages made without any
    share one empty mapping (a ``dict`` that refuses changes), so a long
    history holds no empty dict per message. Give a message metadata with
    ``attrs.evolve(message, metadata={...})``: plain data, as a session's
    metadata is (floats finite).
    """

    id: str
    role: Role
    content: str
    created_at: datetime.datetime
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    interrupted: bool = False
    is_error: bool = False
    metadata: Mapping[str, Any] = NO_METADATA
    usage: Usage | None = None

    @classmethod
    def create(
        cls,
        role: Role | str,
        content: str,
        *,
        tool_calls: tuple[ToolCall, ...] = (),
        tool_call_id: str | None = None,
        interrupted: bool = False,
        is_error: bool = False,
        usage: Usage | None = None,
    ) -> "Message":
        """A new message with a fresh id, stamped now; ``role`` a :class:`Role` or its
        name (``"user"``), anything else ``ValueError``."""
        return make_message(
            id=new_id("msg"),
            role=role if role.__class__ is Role else _role_named(role),
            content=content,
            created_at=utcnow(),
            tool_calls=tool_calls,
            tool_call_id=tool_call_id,
            interrupted=interrupted,
            is_error=is_error,
            usage=usage,
        )


@attrs.frozen(kw_only=True)
class ReviewRequest:
    """A tool call that waits for a person's approval before it runs."""

    id: str
    session_id: str
    tool_call: ToolCall
    created_at: datetime.datetime
    turn_id: str = ""


def _reply_id(turn: "CompletedTurn") -> str:
    return turn.reply.id if turn.reply is not None else ""


@attrs.frozen(kw_only=True)
class CompletedTurn:
    """What an idempotency key already produced: the turn and its reply.

    ``reply`` is the turn's final reply, the very message the history holds, and
    ``reply_id`` its id (by default). Once an edit of the history removes that
    message (truncate, rewind, replace_history, a compaction), ``reply`` is
    ``None``: the key is kept, so that a retry with it never runs the turn again,
    but its reply is not (the retry raises :class:`ReplyRemovedError`); a message of
    that id that joins the history again (replace_history giving it back) is its
    reply again. A snapshot writes the reply once, in the history, and the key by
    ``reply_id``; it refuses a ``reply_id`` that is not the reply's, and a key
    without reply whose ``reply_id`` the history holds. (``reply`` used to be never
    ``None``: snapshots of schema version 2 and earlier hold each key's reply whole,
    whatever became of the history, and load as they were written; a session woken
    from one lets go of the replies its history no longer holds.)
    """

    key: str
    turn_id: str
    reply: Message | None
    reply_id: str = attrs.field(default=attrs.Factory(_reply_id, takes_self=True))


@attrs.frozen(kw_only=True)
class OpenTurn:
    """A turn that began durably and has no outcome yet.

    It is open while it waits on a review, or if its process died while a
    tool ran; ``started_calls`` are the calls of non-idempotent tools that began
    running (a wake never runs them again; idempotent calls simply run again).
    """

    turn_id: str
    idempotency_key: str | None = None
    started_calls: tuple[str, ...] = ()
    #: the id of the user's message the turn answers ("" in states written before 0.3)
    message_id: str = ""


class TurnStatus(enum.Enum):
    """What became of a turn (see ``SessionRef.turn_outcome``)."""

    QUEUED = "queued"  #: in the mailbox, not started yet
    RUNNING = "running"  #: in flight
    WAITING = "waiting"  #: paused on a human review (``ref.review``)
    FINISHED = "finished"  #: ended with a reply
    #: the agent, its model or a tool raised; or it was refused; or its registry's close
    #: cut it off while it ran (a ``SessionStoppedError``: send the message again)
    FAILED = "failed"
    #: ``ref.cancel()`` cut it; or, waiting on a review, its session was stopped
    #: (``ref.stop()``: a stopped session takes no review)
    CANCELLED = "cancelled"
    #: accepted, but it did not run and never will: the session crashed, stopped
    #: or closed before the turn was durable; the history holds nothing of it
    LOST = "lost"


@attrs.frozen(kw_only=True)
class TurnRecord:
    """How one turn ended, as its session keeps it (durable, in ``SessionState.turns``).

    ``message_id`` is the user's message the turn answered, ``reply_id`` its
    final reply (finished turns), ``error`` what went wrong (failed turns): once an
    edit took out the user's message or one before it, the error's kind only (its
    words may quote the prompt; see "What an edit erases" in the history how-to).
    """

    turn_id: str
    status: TurnStatus
    message_id: str = ""
    reply_id: str | None = None
    error: str | None = None


@attrs.frozen(kw_only=True)
class SessionState:
    """Everything durable about one session; what a snapshot holds.

    ``usage`` sums the tokens that the models reported for the session's
    assistant messages and compactions, over its whole life.

    ``journal_mark_seq`` and ``journal_mark_events`` are the journal's retention
    bookkeeping (see ``journal_keep_events``), carried from one wake to the next:
    the seq of the oldest snapshot still counted, and how many events were journaled
    after it up to this state.
    """

    schema_version: int = SCHEMA_VERSION
    session_id: str
    agent: str | None = None
    status: Status = Status.NEW
    messages: tuple[Message, ...] = ()
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    event_seq: int = 0
    created_at: datetime.datetime
    updated_at: datetime.datetime
    system_prompt: str | None = None
    summary: str | None = None
    completed: tuple[CompletedTurn, ...] = ()
    reviews: tuple[ReviewRequest, ...] = ()
    turn_count: int = 0
    open_turn: OpenTurn | None = None
    #: How the most recent turns ended, oldest first (see ``ref.turn_outcome``).
    turns: tuple[TurnRecord, ...] = ()
    #: Turns issued before this time (microseconds since the epoch, as in their ids)
    #: and not in ``turns`` are forgotten: their records were dropped.
    turns_forgotten: int = 0
    usage: Usage = NO_USAGE
    journal_mark_seq: int = 0
    journal_mark_events: int = 0


@attrs.frozen(kw_only=True)
class SessionInfo:
    """A short description of one session, live or stored (``usage``: the tokens
    its models reported, summed, as in its state; ``metadata``: the session's
    whole metadata, which is why metadata is small: at most ``MAX_METADATA_BYTES``)."""

    session_id: str
    agent: str | None
    status: Status
    message_count: int
    updated_at: datetime.datetime
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    pending_reviews: int = 0
    usage: Usage = NO_USAGE


@attrs.frozen(kw_only=True)
class TurnOutcome:
    """What became of one turn: the answer of ``await ref.turn_outcome(turn_id)``.

    ``message`` is the final reply of a finished turn (``None`` if a history edit
    has removed it since); ``error`` says why a failed turn failed.
    """

    session_id: str
    turn_id: str
    status: TurnStatus
    message: Message | None = None
    error: str | None = None


#: Fast constructors of the records a turn makes, and a spawn (see :func:`maker`).
make_message: Final = maker(Message)
make_tool_call: Final = maker(ToolCall)
make_turn_record: Final = maker(TurnRecord)
make_state: Final = maker(SessionState)
make_info: Final = maker(SessionInfo)
