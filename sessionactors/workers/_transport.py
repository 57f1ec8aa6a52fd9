"""The seam a store offers the multi-worker layer: talking between workers.

A store that connects workers (``RedisStore``) implements :class:`Transport`; the
layer (``Cluster``) uses nothing else of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .._errors import StoreConfigurationError

__all__ = ["StreamItem", "Transport", "fatal"]

#: One entry of a session's event stream: (seq, kind, payload). Kinds: "event"
#: (payload: the codec's bytes), "lost" (payload: the first lost seq, ASCII; the
#: entry's seq is the last lost one) and "gone" (the session was deleted). The
#: multi-worker layer stamps the payloads of "event" and "lost" (see ``_wire``);
#: RedisStore keeps the stamp in a field of its own (``split_stamp``), so that
#: workers of an earlier version, during a rolling upgrade, read the rest as before.
StreamItem = tuple[int, str, bytes]


class Transport(Protocol):
    """What a store offers for talking between workers (see the module docstring).

    Its calls raise ``StoreError``, and ``StoreConfigurationError`` for what no retry
    fixes, which ends the worker (see :func:`fatal`). A session's own stored data that
    is damaged (its event stream's key holds another type of value) is that session's
    error, never the store's: ``SnapshotError`` whose ``session_id`` names it. A call
    about several sessions' streams (``read``, ``publish``, ``watch``) that fails so
    raises it for one of them, and the layer ends that session's mirror with it, stops
    publishing its events and calls again without it.

    A transport may also offer ``append_and_send(session_id, entries, info, fence,
    worker, incarnation, message) -> bool``: the store's journal append that, once
    written, also sends ``message`` as :meth:`send` does, in the same round trip
    (whether it was sent and heard). The owner of a forwarded turn then answers with
    its outcome's write (RedisStore's does, on one server and through Sentinel).
    """

    async def heartbeat(
        self, worker: str, incarnation: str, ttl: float, keep_from: str | None
    ) -> str | None:
        """Say ``worker`` (this ``incarnation``) is alive for ``ttl`` seconds; drop
        inbox entries before id ``keep_from``. Returns the incarnation it replaced, read
        and replaced at once (None: none, or the transport cannot tell): a worker's
        first announcement that replaced another live incarnation refuses to run
        under the same worker id."""
        ...

    async def leave(self, worker: str, incarnation: str) -> None:
        """Say the worker is gone (if this incarnation is the live one)."""
        ...

    async def lease_owner(self, session_id: str) -> str | None:
        """The worker holding the session's lease, or None."""
        ...

    async def lease_owners(self, session_ids: Sequence[str]) -> list[str | None]:
        """The worker holding each session's lease (None: nobody), in one round trip."""
        ...

    async def members(self, worker: str, ttl: float | None) -> list[str]:
        """Count ``worker`` among the live workers for ``ttl`` seconds (None: no longer);
        the live workers."""
        ...

    async def options(self, worker: str, said: str | None, ttl: float) -> dict[str, str]:
        """Say what ``worker`` runs with (``said``, for 3 * ttl; None: no longer); what
        every worker said last, by worker (the workers of an earlier version say
        nothing)."""
        ...

    def shard(self, session_id: str) -> int:
        """The shard of a session: the sessions whose leases are held together."""
        ...

    async def watch(self, names: Sequence[str], ttl: float) -> set[str]:
        """Say a worker other than the owner subscribes to the sessions (for 3 * ttl);
        end the event stream of any of them no longer stored (see ``end_events``).
        Returns those of them that were not watched until now (a watch that lapsed, or
        a new one): a claim of one of them meanwhile found it unwatched (see
        ``take_watched``), so its owner publishes none of its events."""
        ...

    async def watched(self, names: Sequence[str]) -> set[str]:
        """Those of the sessions some worker still watches."""
        ...

    def take_watched(self, session_id: str) -> bool:
        """Whether this worker's claim of the session found it watched (once per claim)."""
        ...

    async def incarnation(self, worker: str) -> str | None:
        """The live incarnation of ``worker``, or None."""
        ...

    async def send(self, worker: str, incarnation: str, message: bytes) -> bool:
        """Hand ``message`` to that incarnation of ``worker`` if it listens (at most
        once: it may still be lost on the way); whether it listened."""
        ...

    async def listen(
        self,
        worker: str,
        incarnation: str,
        deliver: Callable[[bytes], None],
        subscribed: Callable[[], None],
    ) -> None:
        """Call ``deliver`` with every message sent to this incarnation of ``worker``,
        once ``subscribed`` was called, until the connection fails (``StoreError``)."""
        ...

    async def post(self, worker: str, message: bytes, ttl: float) -> str | None:
        """Append to the worker's inbox (it wakes the worker's reader) if it is alive;
        its incarnation, or None."""
        ...

    async def read(
        self,
        worker: str,
        inbox_after: str,
        streams: Mapping[str, int],
        block: float | None,
    ) -> tuple[list[tuple[str, bytes]], dict[str, list[StreamItem]]]:
        """Inbox messages after id ``inbox_after`` and events of the ``streams``
        (session -> seq) after their seqs, waiting up to ``block`` seconds."""
        ...

    async def publish(self, batches: Mapping[str, Sequence[StreamItem]], keep: int) -> None:
        """Append to the sessions' event streams (entries not above a stream's last
        are dropped), each kept to about ``keep`` entries."""
        ...

    async def last_event_seq(self, session_id: str) -> int:
        """The seq of the newest entry of the session's event stream (0 if none)."""
        ...

    async def first_event_seq(self, session_id: str) -> int:
        """The seq of the oldest entry of the session's event stream (0 if none)."""
        ...

    async def events_after(
        self, session_id: str, after: int
    ) -> tuple[int | None, list[StreamItem]]:
        """``(seq of the stream's oldest entry or None, entries after ``after``)``."""
        ...

    async def reset_events(self, session_id: str) -> None:
        """Remove the session's event stream (a new session of that name)."""
        ...

    async def end_events(self, session_id: str) -> None:
        """Mark the session's event stream as ended (the session was deleted), unless a
        session of that name is stored again; once."""
        ...


def fatal(exc: BaseException) -> None:
    """Raise ``exc`` again if no retry can fix it (the store's configuration): it ends
    the worker. One session's damaged data is not the store's configuration: the store
    raises that session's ``SnapshotError`` for it, which this leaves to the caller."""
    if isinstance(exc, StoreConfigurationError):
        raise exc
