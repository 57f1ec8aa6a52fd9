"""The exception hierarchy: every error is a :class:`SessionActorsError`.

Each error also subclasses the builtin a user would naturally catch, and its
message names the session, says what happened and what to do about it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeGuard, TypeVar

import attrs

__all__ = [
    "AgentNotFoundError",
    "EventsExpiredError",
    "FencedOutError",
    "IdempotencyKeyReusedError",
    "InvalidHistoryError",
    "InvalidSessionNameError",
    "LeaseHeldError",
    "MailboxFullError",
    "MaxStepsError",
    "MessageNotFoundError",
    "ModelError",
    "NothingToRetryError",
    "ReplyRemovedError",
    "ReviewNotFoundError",
    "ReviewResolvedError",
    "SessionActorsError",
    "SessionBusyError",
    "SessionCrashedError",
    "SessionExistsError",
    "SessionNotFoundError",
    "SessionStoppedError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotVersionError",
    "StoreConfigurationError",
    "StoreError",
    "StoreNotDurableError",
    "StoreNotReplicatedError",
    "SubscriberLaggedError",
    "TurnCancelledError",
    "TurnFailedError",
    "TurnNotFoundError",
    "TurnTimeoutError",
    "WorkerUnreachableError",
]


class AdviceKind(enum.Enum):
    """What an error's message advises doing, of a closed set (see :class:`Advice`)."""

    CREATE = "create"  #: create the session (``registry.spawn(name)``)
    AFTER_PARAM = "after_param"  #: the listing's ``after=`` parameter (a name, not advice)
    WAIT_FOR_ROOM = "wait_for_room"  #: wait for room in the mailbox, or retry later
    WAIT_FOR_HANDOVER = "wait_for_handover"  #: send again once the session changed hands
    NEW_SESSION = "new_session"  #: go on in a session of another name
    SPAWN_AFRESH = "spawn_afresh"  #: create the session again
    DELETE = "delete"  #: delete the session (``registry.delete(name)``)
    LIST_REVIEWS = "list_reviews"  #: list the session's pending reviews
    RESOLVE_REVIEW = "resolve_review"  #: approve or deny review ``review_id``
    RELOAD_STATE = "reload_state"  #: reload the state, resume after its ``event_seq``
    RELOAD = "reload"  #: reload the state
    RESUME_AFTER = "resume_after"  #: subscribe again after event ``seq``
    LOST_TURNS = "lost_turns"  #: what became of each lost turn (its outcome says)
    LOST_OUTCOME = "lost_outcome"  #: the lost turn's outcome says so
    TURN_IDS = "turn_ids"  #: where turn ids come from
    TURN_OUTCOME = "turn_outcome"  #: look up what became of turn ``turn_id``
    OR_TURN_OUTCOME = "or_turn_outcome"  #: or look up the turn's outcome (``turn_id``'s)
    FOLLOW_TURN = "follow_turn"  #: follow the turn by the session's events
    IDEMPOTENCY_KEY = "idempotency_key"  #: the idempotency key a turn is sent with
    TALK_TO_IT = "talk_to_it"  #: talk to the existing session, naming no agent
    REOPEN = "reopen"  #: send it again once a registry is open
    OPEN_REGISTRY = "open_registry"  #: open a registry to continue
    AIO_BLOCK = "aio_block"  #: use the object inside its asyncio registry's block
    AIO_AGAIN = "aio_again"  #: make the call again inside an open asyncio registry
    AIO_LIFESPAN = "aio_lifespan"  #: (in an app: while the lifespan that opened it runs)


@attrs.frozen(kw_only=True)
class Advice:
    """What an error's message advises doing, as a record, so that a frontend tells it
    its own way: ``str(error)`` tells a Python caller (``create it with
    registry.spawn('s')``), the HTTP gateway tells a client the route to use (``POST
    /sessions/s/messages``). ``kind`` says what it is; ``review_id``, ``turn_id`` and
    ``seq`` are the values it names, where it names one. The session is the error's
    ``session_id``. An error's ``_told`` holds its message as text and records, in
    order (``advised`` makes such an error). Internal: the kinds follow the messages.
    """

    kind: AdviceKind
    review_id: str = ""
    turn_id: str = ""
    seq: int = 0


@attrs.frozen(kw_only=True)
class Private:
    """A part of an error's message that is the server's own account of a failure: an
    exception's words (``text``, "Kind: message", as ``describe`` puts them) that may
    name files, hosts, keys or what a model's provider answered. ``str(error)`` repeats
    it whole, for the Python caller and the server's log; a frontend that serves others
    (the HTTP gateway) tells its ``kind`` instead. ``cause_part`` (in ``_actor``) makes
    one of an exception that is not the library's to tell (see ``is_public``). Internal."""

    kind: str
    text: str


#: A part of an error's message (see ``SessionActorsError._told``).
Part = str | Advice | Private


_AIO_BLOCK = "sessionactors.aio.open_registry(...)` block"

#: Each advice as ``str(error)`` tells it to a Python caller: fields ``{name}`` (the
#: repr of the error's session, or ``name``), ``{review}``, ``{turn}`` (reprs), ``{seq}``.
_PYTHON_ADVICE: dict[AdviceKind, str] = {
    AdviceKind.CREATE: "create it with registry.spawn({name})",
    AdviceKind.AFTER_PARAM: "after=",
    AdviceKind.WAIT_FOR_ROOM: "use await ref.submit(...) to wait for room, or retry later",
    AdviceKind.WAIT_FOR_HANDOVER: "use await ref.submit(...), which waits for it",
    AdviceKind.NEW_SESSION: "spawn a new session",
    AdviceKind.SPAWN_AFRESH: "spawn it afresh",
    AdviceKind.DELETE: "registry.delete({name})",
    AdviceKind.LIST_REVIEWS: "list them with ref.pending_reviews()",
    AdviceKind.RESOLVE_REVIEW: "resolve it with ref.review({review}, approve=...)",
    AdviceKind.RELOAD_STATE: (
        "reload the state with ref.state() and subscribe with after=state.event_seq"
    ),
    AdviceKind.RELOAD: "reload with ref.state()",
    AdviceKind.RESUME_AFTER: "subscribe again with after={seq}",
    AdviceKind.LOST_TURNS: " (ref.turn_outcome(turn_id) says so of each)",
    AdviceKind.LOST_OUTCOME: "ref.turn_outcome reads lost: ",
    AdviceKind.TURN_IDS: "take turn ids from reply.turn_id or turn.id of this session",
    AdviceKind.TURN_OUTCOME: "ask ref.turn_outcome({turn})",
    AdviceKind.OR_TURN_OUTCOME: "(or ref.turn_outcome)",
    AdviceKind.FOLLOW_TURN: "follow it with ref.subscribe() and ref.turn_outcome()",
    AdviceKind.IDEMPOTENCY_KEY: "idempotency_key=...",
    AdviceKind.TALK_TO_IT: "talk to it with registry.ref({name}) (or get_or_spawn without agent=)",
    AdviceKind.REOPEN: "send it again once a registry is open",
    AdviceKind.OPEN_REGISTRY: "open a registry to continue",
    AdviceKind.AIO_BLOCK: "use it inside the `async with " + _AIO_BLOCK,
    AdviceKind.AIO_AGAIN: "make the call again inside an open `async with " + _AIO_BLOCK,
    AdviceKind.AIO_LIFESPAN: " (in an app: while the lifespan that opened it runs)",
}


def python_advice(advice: Advice, session_id: str | None) -> str:
    """``advice`` as ``str(error)`` tells it, for an error about ``session_id``."""
    if advice.kind is AdviceKind.OR_TURN_OUTCOME and advice.turn_id:
        return f"(or ref.turn_outcome({advice.turn_id!r}))"
    return _PYTHON_ADVICE[advice.kind].format(
        name="name" if session_id is None else repr(session_id),
        review=repr(advice.review_id),
        turn=repr(advice.turn_id),
        seq=advice.seq,
    )


class SessionActorsError(Exception):
    """Base class of every error raised by sessionactors.

    ``session_id`` names the session the error is about (``None`` when it is
    about no single session).
    """

    #: (Internal) the message as text, advice records and the server's own accounts
    #: (``Private``), for a frontend that tells them its own way (the HTTP gateway: see
    #: ``told``); empty if it has none.
    _told: tuple[Part, ...] = ()

    def __init__(self, message: str, *, session_id: str | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id


_E = TypeVar("_E", bound=SessionActorsError)


def advised(cls: type[_E], *told: Part, session_id: str | None = None, **fields: object) -> _E:
    """An error of ``cls`` whose message is ``told``: text, advice records that ``str()``
    tells as a Python caller follows them (``python_advice``), and the server's own
    accounts (``Private``), which ``str()`` repeats whole."""
    error = cls(python_told(told, session_id), session_id=session_id, **fields)
    error._told = told
    return error


def python_told(parts: tuple[Part, ...], session_id: str | None) -> str:
    """The message of ``parts`` as ``str(error)`` tells it (see ``advised``)."""
    return told_parts(parts, session_id, python_advice)


def told(
    error: BaseException,
    say: Callable[[Advice, str | None], str],
    private: Callable[[Private], str] | None = None,
) -> str:
    """``error``'s message with its advice told by ``say(advice, session_id)`` (a
    frontend's wording) and the server's own accounts in it by ``private(part)`` (whole
    if None); its ``str()`` if it has no records (see ``unmarked``)."""
    parts = error._told if isinstance(error, SessionActorsError) else ()
    if not parts:
        return str(error)
    session_id = error.session_id if isinstance(error, SessionActorsError) else None
    return told_parts(parts, session_id, say, private)


def told_parts(
    parts: tuple[Part, ...],
    session_id: str | None,
    say: Callable[[Advice, str | None], str],
    private: Callable[[Private], str] | None = None,
) -> str:
    """The message of ``parts`` with its advice told by ``say`` and its accounts by
    ``private`` (whole if None): see ``told``."""
    return "".join(
        part
        if isinstance(part, str)
        else (part.text if private is None else private(part))
        if isinstance(part, Private)
        else say(part, session_id)
        for part in parts
    )


def unmarked(error: BaseException) -> TypeGuard[TurnFailedError | SessionCrashedError]:
    """Whether ``error`` reports a failure (a ``TurnFailedError`` or a
    ``SessionCrashedError``, whose messages quote their cause) without the parts that
    mark the server's own account in it: one from a worker of an older version, which
    sends none, or whose parts did not tell its message. The library makes every such
    error with parts (``advised``), so a frontend that serves others tells one without
    them by its kind only, never by its text."""
    return isinstance(error, TurnFailedError | SessionCrashedError) and not error._told


def has_private(error: BaseException) -> bool:
    """Whether ``error``'s message repeats the server's own account of a failure."""
    parts = error._told if isinstance(error, SessionActorsError) else ()
    return any(isinstance(part, Private) for part in parts)


def advises(error: BaseException, kind: AdviceKind) -> bool:
    """Whether ``error``'s message gives advice of ``kind`` (which crosses between
    workers with it)."""
    parts = error._told if isinstance(error, SessionActorsError) else ()
    return any(isinstance(part, Advice) and part.kind is kind for part in parts)


def is_public(exc: BaseException) -> bool:
    """Whether ``exc``'s message is the library's own words, which a frontend may tell
    the people it serves: an error of a class the library defines (by the class, never
    by its name: an app's own ``StoreError`` is the app's), other than a store's (its
    message names the server's files and hosts) and a crash's (it repeats its cause),
    whose message repeats no ``Private`` account and is not ``unmarked``; and a
    ``ModelError`` raised with ``public=True``, by whichever adapter raised it (a model's
    provider answers with its address, keys and words: hidden unless the adapter says
    so)."""
    if isinstance(exc, ModelError):
        return exc.public
    cls = type(exc)
    return (
        issubclass(cls, SessionActorsError)
        and cls.__module__.partition(".")[0] == "sessionactors"
        and not issubclass(cls, StoreError | SessionCrashedError)
        and not has_private(exc)
        and not unmarked(exc)
    )


class SessionNotFoundError(SessionActorsError, LookupError):
    """The session is neither live nor stored."""


class SessionExistsError(SessionActorsError):
    """A session of that name is already live or stored."""


class InvalidSessionNameError(SessionActorsError, ValueError):
    """A session name breaks the naming rules (empty, too long, control characters)."""


class InvalidHistoryError(SessionActorsError, ValueError):
    """Messages given to ``ref.add_messages`` or ``ref.replace_history`` would not
    make a valid history: a tool call separated from its results, or a message id
    that is empty or used twice. Nothing was written."""


class _TurnError(SessionActorsError):
    """(Internal) the base of the errors about a turn, which ``turn_id`` names (empty
    when there is none): it takes ``turn_id=``. The reference shows its subclasses
    under their public bases."""

    def __init__(self, message: str, *, session_id: str | None = None, turn_id: str = "") -> None:
        super().__init__(message, session_id=session_id)
        self.turn_id = turn_id


class _KeyedTurnError(_TurnError):
    """(Internal) the base of the errors about a turn sent with an idempotency key,
    ``idempotency_key`` (empty when there is none): it takes ``idempotency_key=`` too."""

    #: (class defaults too: an error rebuilt from another worker's account has them)
    turn_id: str = ""
    idempotency_key: str = ""

    def __init__(
        self,
        message: str,
        *,
        session_id: str | None = None,
        turn_id: str = "",
        idempotency_key: str = "",
    ) -> None:
        super().__init__(message, session_id=session_id, turn_id=turn_id)
        self.idempotency_key = idempotency_key


class TurnFailedError(_TurnError):
    """The agent or its model raised during the turn; ``__cause__`` is the original.

    What the failing model step streamed is kept in the history, marked
    ``interrupted`` (the message says so), or, if it streamed no text, the message
    "(no reply: this turn failed)": see ``TurnFailed``. ``ref.retry()`` runs the
    turn again in its place.
    """


class AgentNotFoundError(TurnFailedError, LookupError):
    """The registry has no agent by the name the session runs with, so it cannot run
    the session's turns (it can still read and manage the session): open the registry
    with that agent in ``agents=``."""


class TurnCancelledError(_TurnError):
    """The turn was cancelled with ``ref.cancel()`` (or by the session stopping)."""


class SessionCrashedError(_TurnError):
    """The session's actor crashed while the request was pending, or keeps crashing.

    ``turn_id`` names the turn whose write the store was doing when the session
    crashed and that it may have kept (the store failed or did not answer in time):
    ask ``ref.turn_outcome(turn_id)`` before sending it again, since the session
    resumes or answers that turn if the write landed. With many workers, it also
    names a turn sent on to the worker running the session when that worker died
    before answering (a turn without idempotency key, by the id the worker that sent
    it on gave it, which the owner runs it under): ask the same. It is empty
    otherwise.
    """

    turn_id: str = ""


class SessionStoppedError(_TurnError):
    """The session (or the registry) is stopped and takes no more requests.

    ``turn_id`` names the turn that had started when the session stopped under it
    (cut off, or not confirmed by the store): it may be in the history. With many
    workers, it also names a turn sent on to another worker whose answer this closing
    registry no longer waited for (it may have run there, or may still). It is empty
    when the request never ran. A turn cut off while it ran ends, for its subscribers
    and in ``ref.turn_outcome``, as failed with this error's kind (a ``TurnFailed``
    whose ``error_kind`` is ``"SessionStoppedError"``), never as cancelled.
    """

    #: (Internal, set by ``stopped_error``) why the session's registry stopped the
    #: request: "cut" (its shutdown grace ran out), "unsaved" (it closed before the store
    #: confirmed the turn), "interrupted" (a BaseException closed it), "crashed" (the test
    #: kit's ``crash``), "stop" (the session is stopped: ``ref.stop()``, under way, done
    #: or read from the store), "closing"; empty if not said. It crosses between workers
    #: with the error; a worker that ran the request for another rewords "cut" and
    #: "unsaved" its way.
    _reason: str = ""


class MailboxFullError(SessionActorsError):
    """``submit_nowait`` found the session's mailbox full."""


class SubscriberLaggedError(SessionActorsError):
    """A subscriber fell behind its bounded buffer and was ended; or the events it
    followed were interrupted before they reached it (a session that runs on another
    worker, whose events the store's event stream did not carry whole), which its
    message says.

    ``last_seq`` is the seq of the last event it received: subscribe again with
    ``after=last_seq`` to resume without a gap.
    """

    def __init__(self, message: str, *, session_id: str | None = None, last_seq: int) -> None:
        super().__init__(message, session_id=session_id)
        self.last_seq = last_seq


class EventsExpiredError(SessionActorsError, LookupError):
    """The events asked for are no longer available.

    ``oldest_seq`` is the seq of the oldest event still available. To resume,
    reload the state with ``state = await ref.state()`` and subscribe with
    ``after=state.event_seq``.
    """

    def __init__(self, message: str, *, session_id: str | None = None, oldest_seq: int) -> None:
        super().__init__(message, session_id=session_id)
        self.oldest_seq = oldest_seq


class SnapshotError(SessionActorsError, ValueError):
    """Snapshot or journal bytes could not be turned back into records, or a session's
    state could not be made into a snapshot (it would pass the size limit)."""


class SnapshotVersionError(SnapshotError):
    """The bytes carry a schema version this version of sessionactors cannot read."""


class SnapshotCorruptError(SnapshotError):
    """The bytes are not a valid snapshot (truncated, garbled, wrong types, too large),
    or the store's record of the session was changed behind its back (a seq out of
    range, a Redis key of the session's that holds another type of value). The
    session's own error: other sessions go on."""


class StoreError(SessionActorsError, OSError):
    """The store failed to read or write."""


class StoreNotDurableError(StoreError):
    """The store's server is configured so that it can lose writes it acknowledged.

    Raised when a store connects, and when it connects again (to a server
    restarted, or to another master after a failover), before anything is read
    or written there; until the server is fixed, every call raises it. The
    message says what the server runs with and how to fix it; a store for
    tests or caches can opt out explicitly (``RedisStore(url,
    persistence="volatile")``).
    """


class StoreNotReplicatedError(StoreError, TimeoutError):
    """Fewer replicas than the store demands (``RedisStore(url, replicas=N)``) confirmed
    a write within their time (``replica_timeout``).

    The primary ran the write: it is not undone, later reads there see it, and it
    reaches the replicas once they catch up; but it can be lost if the primary
    fails before a replica has it. Take it as a write whose outcome is unsure: read
    the session before writing it again (a turn retried with the same
    ``idempotency_key`` runs once), and check the replicas (``INFO replication``
    on the primary). Through a registry, the turn's caller gets
    :class:`SessionCrashedError` with this error as its ``__cause__``, and the
    session restarts from what the primary holds.
    """


class LeasesUnrenewedError(StoreError):
    """(Internal: a registry handles it) A renewal of many leases at once that reached
    only part of the store (a master of a Redis Cluster down): it renewed the leases of
    every session but ``unanswered``, whose renewal failed, and ``lost``, whose leases
    it found held no more."""

    def __init__(self, message: str, *, lost: frozenset[str], unanswered: frozenset[str]) -> None:
        super().__init__(message)
        self.lost = lost
        self.unanswered = unanswered


#: What a store that lost or rolled back data looks like, as the messages that may be
#: explained by it say.
LOST_DATA_CAUSES = (
    "a server restarted without its append-only file, a FLUSHALL, a restore from an older copy"
)
LOST_DATA = f"the store lost or rolled back data ({LOST_DATA_CAUSES})"


class FencedOutError(StoreError):
    """A write carried a fencing token that the store no longer shows for the session:
    another worker took the session over, or the store lost or rolled back data (a
    server restarted without its append-only file, a restore from an older copy).

    ``lost_data`` is true when the store could prove that it lost or rolled back data
    (its lease of the session holds an older fencing token than the write's, or its
    journal ends before what the writer wrote); false for another claim taking the
    session over, and for what the store cannot tell apart (a lease that is gone: it was
    released, expired, taken over and released, or lost). The session stops on this
    worker; a request sent again wakes it from what the store holds.

    ``turn_id`` names the turn that the stop cut off, for its caller (the turn had
    started, and its outcome was not stored: ask ``ref.turn_outcome(turn_id)`` what
    became of it before sending it again); it is empty for other requests.
    """

    #: (class defaults too: an error rebuilt from another worker's account has them)
    lost_data: bool = False
    turn_id: str = ""

    def __init__(
        self,
        message: str,
        *,
        session_id: str | None = None,
        lost_data: bool = False,
        turn_id: str = "",
    ) -> None:
        super().__init__(message, session_id=session_id)
        self.lost_data = lost_data
        self.turn_id = turn_id


def naming_turn(error: SessionActorsError, turn_id: str) -> SessionActorsError:
    """``error`` as the caller of turn ``turn_id`` gets it: a ``FencedOutError`` that
    names no turn is told again naming that one (the same message, advice and cause);
    any other error as it is."""
    if not isinstance(error, FencedOutError) or error.turn_id or not turn_id:
        return error
    named = FencedOutError(
        str(error), session_id=error.session_id, lost_data=error.lost_data, turn_id=turn_id
    )
    named._told = error._told
    named.__cause__ = error.__cause__
    return named


class StoreConfigurationError(StoreError):
    """The store refused an operation that a retry cannot fix: a permission the store's
    user lacks, a command the server disabled or renamed, keys spread over the slots
    of a cluster, a password or database number in the store's URL that the server
    refuses, a key that a Redis store's sessions share (its listing order, a key
    group's index, fencing counter or shard lease) holding another type of value than
    the store keeps there (one of a session's own fails that session alone, with
    ``SnapshotCorruptError``), a SQLite file that is not a store (or is in a directory
    that does not exist), that a newer version wrote, that SQLite reads as damaged, or
    that this process may not write, a store on an asyncio client
    (``sessionactors.aio.asyncio_store``) used outside ``sessionactors.aio``. Fix the
    server's configuration, the URL, the file or the registry (its message says what).
    The registry, ``serve`` and the command line do not retry it."""


class WorkerUnreachableError(_KeyedTurnError, TimeoutError):
    """A request sent to the worker that runs the session got no word from it within
    its deadline (the shared store or that worker did not answer), or never reached
    it in that time (that worker said so whenever it was asked). A turn sent through
    a registry without agents while no worker is live is refused so too, and did not
    run.

    The request may or may not have run there: send it again (a turn sent with
    ``idempotency_key=`` runs once however often it is sent). ``turn_id`` names the
    turn (ask ``ref.turn_outcome(turn_id)`` what became of it): a turn without a key
    by the id this worker gave it as it sent it on, a keyed one once that worker had
    accepted it (a key may join a turn under way, which has its own id); and
    ``idempotency_key`` is the key the turn was sent with; each is empty otherwise.
    """


class SessionBusyError(SessionActorsError):
    """The session cannot take this request now (for example a review is pending).

    ``turn_id`` names the turn that the session refused as it came to it (a review
    pending): its ``TurnFailed`` is published, and ``ref.turn_outcome`` says it failed;
    empty for a request refused before it reached the session.
    """

    #: (a class default too: an error rebuilt from another worker's account has it)
    turn_id: str = ""

    def __init__(self, message: str, *, session_id: str | None = None, turn_id: str = "") -> None:
        super().__init__(message, session_id=session_id)
        self.turn_id = turn_id


class LeaseHeldError(SessionBusyError):
    """Another registry holds the session's lease (in another process, or in this one
    on the same store): the session is live there, not here.

    Send the request through that process (a registry on a store that connects
    workers does so itself), or retry once it hibernates the session or its
    lease expires.
    """


class MaxStepsError(SessionActorsError, RuntimeError):
    """The model kept calling tools past the agent's ``max_steps``.

    It becomes the ``__cause__`` of the turn's :class:`TurnFailedError`.
    """


class TurnTimeoutError(SessionActorsError, TimeoutError):
    """The turn ran past the agent's ``turn_timeout`` (a model that stopped answering, a
    tool that hangs) and was cut: what it streamed is kept, marked ``interrupted``.

    It becomes the ``__cause__`` of the turn's :class:`TurnFailedError`.
    """


class ModelError(SessionActorsError, RuntimeError):
    """A model adapter could not get an answer (HTTP error, malformed stream).

    It becomes the ``__cause__`` of the turn's :class:`TurnFailedError`.
    ``status_code`` is the HTTP status when there was one.

    ``public``: the message may be shown to the people a frontend serves (it names no
    address, key or provider's answer). By default it is not: the turn's ``TurnFailed``
    has ``error_public=False`` and the HTTP gateway tells its clients that the turn
    failed with a ``ModelError`` (the message goes to the server's log), while Python
    callers and subscribers read it whole either way. The message is stored too, with
    the failed turn's outcome (its ``TurnFailed`` event in the journal, and
    ``ref.turn_outcome``'s ``error``), as any exception that fails a turn is: an adapter
    whose provider's errors may quote a key raises this with words of its own.
    """

    public: bool = False

    def __init__(
        self,
        message: str,
        *,
        session_id: str | None = None,
        status_code: int | None = None,
        public: bool = False,
    ) -> None:
        super().__init__(message, session_id=session_id)
        self.status_code = status_code
        self.public = public


class ReviewNotFoundError(SessionActorsError, LookupError):
    """No pending review of the session has that id."""


class ReviewResolvedError(_TurnError, ReviewNotFoundError):
    """The review was resolved already, the other way (approved, and now denied, or the
    reverse), or its turn did not finish; ``turn_id`` names the turn that it resumed.

    The same decision again (a retry) is answered with the turn's reply instead, as
    long as the process that ran the session remembers the review (its last 10,000
    resolved reviews, across hibernation, not across a restart).
    """


class MessageNotFoundError(SessionActorsError, LookupError):
    """No message of the session has that id."""


class TurnNotFoundError(SessionActorsError, LookupError):
    """The session never issued that turn id, or no longer keeps its outcome."""


class NothingToRetryError(SessionActorsError, LookupError):
    """``ref.retry()`` found no failed or cancelled last turn to run again."""


class ReplyRemovedError(_KeyedTurnError, LookupError):
    """A request sent with an idempotency key whose turn already ran, but whose reply
    an edit of the history has since removed (truncate, rewind, replace_history, a
    compaction): the key still keeps the turn from running again, but no longer its
    reply, so the request is refused. ``turn_id`` is the turn that ran with the key,
    ``idempotency_key`` the key."""


class IdempotencyKeyReusedError(_KeyedTurnError, ValueError):
    """A request sent with an idempotency key that the session already took for
    another message: the key's turn (queued, running, waiting on a review, or
    completed) began with other words. The request is refused and runs nothing;
    a new message needs a new key. ``turn_id`` is the turn of the key,
    ``idempotency_key`` the key."""


def reply_removed_error(sid: str, key: str, turn_id: str) -> ReplyRemovedError:
    """The error of a retry with ``key``, whose turn ``turn_id`` ran but whose reply an
    edit of session ``sid``'s history removed."""
    return advised(
        ReplyRemovedError,
        f"session {sid!r} already ran the turn of idempotency key {shown(key)} (turn "
        f"{turn_id!r}), but an edit of its history (truncate, rewind, replace_history or a "
        "compaction) has since removed that turn's reply, which the key no longer keeps; "
        "the turn will not run again: to send these words as a new turn, send them with "
        "another ",
        Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
        session_id=sid,
        turn_id=turn_id,
        idempotency_key=key,
    )


def key_reused_error(sid: str, key: str, turn_id: str) -> IdempotencyKeyReusedError:
    """The error of a request with ``key``, which session ``sid`` took for another
    message, that of turn ``turn_id``."""
    return advised(
        IdempotencyKeyReusedError,
        f"session {sid!r} already took idempotency key {shown(key)} for another message "
        f"(turn {turn_id!r}); a key names one request, and only its retries may carry it: "
        "this request ran nothing. Send a new message with a new ",
        Advice(kind=AdviceKind.IDEMPOTENCY_KEY),
        session_id=sid,
        turn_id=turn_id,
        idempotency_key=key,
    )


#: How many characters of a caller's value an error message repeats (see ``shown``).
SHOWN_CHARS = 64


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error message repeats it: its repr, or for a value longer than
    ``limit`` characters (a name, key or id a client sent, of any length) the repr of
    its first ``limit`` characters, an ellipsis and its length."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def stopped_error(sid: str, reason: str, turn_id: str = "") -> SessionStoppedError:
    """The error of a request the session did not finish, for ``reason`` (see
    ``SessionStoppedError._reason``); ``turn_id``: the turn that had started (it may be
    in the history)."""
    reopen = Advice(kind=AdviceKind.REOPEN)
    told: tuple[Part, ...]
    if reason == "stop":
        told = (
            f"session {sid!r} was stopped; ",
            Advice(kind=AdviceKind.NEW_SESSION),
            " to continue the conversation",
        )
    elif reason == "unsaved":
        told = (
            f"the registry closed before the store confirmed the turn of session {sid!r} "
            "(it did not answer in time), so the turn may be lost: ",
            reopen,
            " (with an idempotency key, a retry cannot run it twice)",
        )
    elif reason == "crashed" and turn_id:
        told = (
            f"the registry that ran session {sid!r} crashed under the turn (the test kit's "
            "sessionactors.testing.crash, which stands for the death of its process): the "
            "store holds what was written before, and the turn may or may not be in it; ",
            Advice(kind=AdviceKind.TURN_OUTCOME, turn_id=turn_id),
            " once a registry is open",
        )
    elif reason == "crashed":
        told = (
            f"the registry that ran session {sid!r} crashed before it ran this request (the "
            "test kit's sessionactors.testing.crash, which stands for the death of its "
            "process): ",
            reopen,
        )
    elif reason == "interrupted":
        told = (
            f"the turn of session {sid!r} was cut off when something not an Exception "
            "(a KeyboardInterrupt, say) escaped it and closed the registry; what it "
            "streamed is kept, marked interrupted: ",
            reopen,
        )
    elif reason == "cut":
        told = (
            f"the turn of session {sid!r} was cut off when the registry closed after its "
            "shutdown grace; what it streamed is kept, marked interrupted: ",
            reopen,
        )
    else:
        told = (
            f"session {sid!r} did not run this request: the registry was closing; ",
            reopen,
        )
    error = advised(SessionStoppedError, *told, session_id=sid, turn_id=turn_id)
    error._reason = reason
    return error


def unanswered_error(sid: str | None) -> SessionStoppedError:
    """The error of a caller whose own call of the store (``sid``'s, or a listing's) had
    no answer when its registry closed and gave up on the store."""
    what = "the listing of sessions" if sid is None else f"this request of session {sid!r}"
    error = advised(
        SessionStoppedError,
        f"the registry closed and the store did not answer {what} by then (a write "
        "it made may or may not have landed): ",
        Advice(kind=AdviceKind.REOPEN),
        session_id=sid,
    )
    error._reason = "closing"
    return error


def stopped_for_good(error: SessionStoppedError) -> bool:
    """Whether ``error`` says that its session is stopped (``ref.stop()``: it takes no
    more requests, ever), rather than a registry or a worker under the request: its
    reason, "stop". A worker of an earlier version sends no reason: its advice to go on
    in a session of another name says it, if that crossed with it."""
    if error._reason:
        return error._reason == "stop"
    return advises(error, AdviceKind.NEW_SESSION)


def cut_off_error(sid: str, reason: str) -> SessionStoppedError:
    """The failure a turn's ``TurnFailed`` carries when its registry's close cut it off
    while it ran (``reason``: "cut", its shutdown grace ran out; "interrupted", something
    not an Exception escaped a session and ended it), in words that every client
    follows, a browser that only reads the session's events included: the worker that
    ran it stopped, send the message again. (Its caller's ``stopped_error`` advises as
    the caller's frontend does.)"""
    if reason == "interrupted":
        why = "something not an Exception (a KeyboardInterrupt, say) stopped the worker running it"
    else:
        why = "the worker running it stopped (its registry closed, its shutdown grace over)"
    return SessionStoppedError(
        f"the turn of session {sid!r} was cut off when {why}; what it streamed is kept, "
        "marked interrupted: send the message again",
        session_id=sid,
    )


def never_began_error(sid: str) -> SessionStoppedError:
    """The failure a queued turn's ``TurnFailed`` carries when its registry closed before
    the turn began, in words that every client follows (see ``cut_off_error``)."""
    return SessionStoppedError(
        f"the turn of session {sid!r} never began: the worker holding it stopped first "
        "(its registry closed); nothing of it is kept: send the message again",
        session_id=sid,
    )


# Tracebacks and reprs name the public path (``sessionactors.SessionNotFoundError``).
for _name in __all__:
    globals()[_name].__module__ = "sessionactors"
del _name
