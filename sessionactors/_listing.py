"""The order sessions are listed in, and what a listing filters on.

Pure (no trio). A listing runs newest activity first: by the ``updated_at`` of
the session's info (the time of its last message), sessions with the same time
by name, descending. Both keys descending is an order every store keeps with
one index: SQLite an index on ``(activity, session_id)``, Redis a sorted set
(whose members of one score are ordered by name), a list kept sorted in memory.

A store reads the activity time out of the info bytes it is given with
:func:`info_activity` (integer microseconds, so that it is exact in an SQLite
integer and a Redis score alike); unreadable info sorts as the oldest, and the
registry lists it as failed.
"""

import bisect
import datetime
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgpack

from ._errors import Advice, AdviceKind, SessionNotFoundError, advised
from ._records import SessionInfo, Status

__all__ = [
    "LISTING_BATCH",
    "activity_micros",
    "after_not_found",
    "check_active_before",
    "check_listing",
    "info_activity",
    "listing_key",
    "matches",
    "page_of",
    "told_status",
]

#: How many sessions the registry asks a store for at a time.
LISTING_BATCH: Final = 500

_UPDATED_AT: Final = "updated_at"
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
#: The last microsecond a datetime holds, counted from the epoch.
_LAST_MICROS: Final = (datetime.datetime.max.replace(tzinfo=datetime.UTC) - _EPOCH) // (
    datetime.timedelta(microseconds=1)
)


def info_activity(info: bytes) -> int:
    """The session's activity time (``updated_at``) in microseconds since the epoch,
    read from its encoded info; 0 if the info cannot be read (or says a time past any
    a datetime holds)."""
    try:
        raw = msgpack.unpackb(
            info,
            raw=False,
            timestamp=0,
            strict_map_key=True,
            max_ext_len=12,
        )
        stamp = raw[_UPDATED_AT]
    except Exception:  # damaged info: the registry lists the session as failed
        return 0
    if stamp.__class__ is not msgpack.Timestamp:
        return 0
    micros: int = stamp.seconds * 1_000_000 + stamp.nanoseconds // 1000
    return micros if 0 < micros <= _LAST_MICROS else 0


def told_status(status: Status, *, pending_reviews: int, open_turn: bool = False) -> Status:
    """The status a session that is not live here is told with, from what the store
    holds (its info, in a listing; its state, read without waking it).

    Hibernation stores ``hibernated``, and a process that died stores what it last
    wrote; a reader asks what the session waits for: a session with a pending review
    waits for a person (``waiting``), and one with a turn open and no review has a turn
    under way, or left open by a process that died mid-turn, which the next request or
    subscription resumes (``running``). A stored info says ``running`` for such a turn
    already (each write of a turn stores it); a stored state says it with its open turn.
    """
    if status is Status.STOPPED or status is Status.FAILED:
        return status
    if pending_reviews:
        return Status.WAITING
    if open_turn:
        return Status.RUNNING
    return status


def listing_key(session_id: str, info: bytes) -> tuple[int, str]:
    """The session's place in a listing: the larger the key, the earlier it comes."""
    return (info_activity(info), session_id)


def page_of(
    items: Iterable[tuple[str, bytes]],
    *,
    after: str | None,
    limit: int,
    active_before: int | None = None,
) -> list[tuple[str, bytes]]:
    """A page of ``(session_id, info)`` in listing order, from every session at once
    (for stores that offer only ``list_sessions``: it costs the whole listing); only
    the sessions whose activity time is below ``active_before``, if given."""
    keyed = sorted(((listing_key(name, info), name, info) for name, info in items), reverse=True)
    start = 0
    if after is not None:
        start = next((i + 1 for i, (_, name, _) in enumerate(keyed) if name == after), -1)
        if start < 0:
            raise after_not_found(after)
    if active_before is not None:
        start = max(start, bisect.bisect_right(keyed, -active_before, key=lambda k: -k[0][0]))
    return [(name, info) for _, name, info in keyed[start : start + limit]]


def after_not_found(after: str) -> SessionNotFoundError:
    return advised(
        SessionNotFoundError,
        f"session {after!r}, given as ",
        Advice(kind=AdviceKind.AFTER_PARAM),
        ", is not stored (it was deleted since it was listed?); list again from the start",
        session_id=after,
    )


def check_listing(
    status: object, metadata: object, limit: object, after: object
) -> tuple[Status | None, dict[str, Any] | None]:
    """Check ``registry.sessions()``'s arguments; the status as a ``Status``."""
    wanted: Status | None = None
    if status is not None:
        if isinstance(status, Status):
            wanted = status
        elif isinstance(status, str) and status in Status._value2member_map_:
            wanted = Status(status)
        else:
            values = ", ".join(s.value for s in Status)
            raise ValueError(f"status must be a Status or one of {values}; not {status!r:.60}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of key to value, not {metadata!r:.60}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a whole number >= 1 or None, not {limit!r:.60}")
    if after is not None and not isinstance(after, str):
        raise TypeError(f"after must be a session name (str) or None, not {after!r:.60}")
    return wanted, None if metadata is None else dict(metadata)


def check_active_before(active_before: object) -> int | None:
    """Check ``registry.sessions()``'s ``active_before``: an aware datetime, or None;
    the time in microseconds since the epoch (as ``info_activity`` reads them)."""
    if active_before is None:
        return None
    if not isinstance(active_before, datetime.datetime):
        raise TypeError(
            "active_before must be an aware datetime (datetime.datetime.now(datetime.UTC) "
            f"- datetime.timedelta(days=90)) or None, not {active_before!r:.60}"
        )
    if active_before.utcoffset() is None:
        raise ValueError(
            f"active_before must be an aware datetime, not the naive {active_before!r:.60}: "
            "give it a timezone (tzinfo=datetime.UTC)"
        )
    return activity_micros(active_before)


def activity_micros(at: datetime.datetime) -> int:
    """The aware datetime ``at`` in microseconds since the epoch."""
    return (at - _EPOCH) // datetime.timedelta(microseconds=1)


def matches(info: SessionInfo, status: Status | None, metadata: Mapping[str, Any] | None) -> bool:
    """Whether ``info`` has ``status`` and every key of ``metadata`` with an equal value."""
    if status is not None and info.status is not status:
        return False
    if metadata:
        have = info.metadata
        missing = object()
        return all(have.get(key, missing) == value for key, value in metadata.items())
    return True
