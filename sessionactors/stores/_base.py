"""The store protocol: how sessions are kept durable.

A store deals in bytes: snapshots and journal entries are encoded by the
codec before they reach it, so a store never needs to understand a record.
Each session has

* one snapshot (its state as of ``snapshot_seq``),
* a journal of entries, each with the ``seq`` of the event it holds, strictly
  increasing; entries after the snapshot are replayed over it on load, and
  entries up to it are kept for subscribers replaying events until trimmed,
* an info blob (a short encoded description, for listings),
* a lease: an owner, an expiry and a fencing token that strictly increases
  with every successful claim.

A store may also list its sessions a page at a time (:class:`PagedStore`); one
that does not is listed through ``list_sessions``, all at once. A paged store may
also start a page at an activity time (:class:`IdlePageStore`), for listings of the
sessions idle since then; one that does not has its pages read and filtered. Likewise a store
may read its journal a page at a time (:class:`JournalPageStore`); one that does
not is replayed to a subscriber through ``read_journal``, all at once.

Writes may carry ``fence``: when it is not ``None`` the store checks, in the
same atomic step as the write, that it equals the session's current fencing
token and that the lease is unexpired, and raises :class:`FencedOutError`
otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

__all__ = [
    "IdlePageStore",
    "JournalEntry",
    "JournalPageStore",
    "Lease",
    "LeaseBatchStore",
    "PagedStore",
    "Store",
    "StoredSession",
]


@attrs.frozen
class JournalEntry:
    """One journal entry: the encoded event and its seq."""

    seq: int
    data: bytes


@attrs.frozen(kw_only=True)
class StoredSession:
    """What ``load`` returns: the latest snapshot and the entries after it, and the
    info blob that the last write stored with them, or ``None`` from a store that
    does not give it.

    The info is what listings show (``sessions list``); a session read from the store
    takes its ``updated_at`` from it, so that every reader sees the time its last
    writer did. Without it, the journal's status changes, failed and cancelled turns,
    history edits and metadata changes, which carry no time of their own, are read
    as made at the time of the read.
    """

    snapshot: bytes
    snapshot_seq: int
    entries: tuple[JournalEntry, ...] = ()
    info: bytes | None = None


@attrs.frozen(kw_only=True)
class Lease:
    """A successful claim: the fencing token to put on every write."""

    owner: str
    fence: int


@runtime_checkable
class Store(Protocol):
    """An async, durable home for sessions. Every method may raise ``StoreError``."""

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        """Store a new session with ``snapshot`` at seq 0.

        Raises ``SessionExistsError`` if the name is already stored.
        """
        ...

    async def load(self, session_id: str) -> StoredSession | None:
        """The session's snapshot and the journal entries after it, and the info
        blob of its last write (see :class:`StoredSession`), or ``None``."""
        ...

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        """Append entries (seqs strictly above every stored one) durably, atomically.

        Raises ``SessionNotFoundError`` if the session is not stored, and
        ``FencedOutError`` for a stale ``fence``.
        """
        ...

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        """Replace the snapshot with one covering every event up to ``seq``.

        Atomically drops journal entries with seq <= ``trim_upto`` (which is
        at most ``seq``). Raises like ``append``.
        """
        ...

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        """``(trimmed_upto, entries)``: the kept entries with seq > ``after``, in order.

        ``trimmed_upto`` is the highest seq ever trimmed (0 if none): entries at or
        below it are gone. Raises ``SessionNotFoundError`` if not stored.
        """
        ...

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        """``(session_id, info)`` for every stored session."""
        ...

    async def exists(self, session_id: str) -> bool:
        """Whether the session is stored."""
        ...

    async def delete(self, session_id: str) -> bool:
        """Remove the session everywhere (snapshot, journal, lease); whether it existed."""
        ...

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        """Take the session's lease for ``ttl`` seconds.

        Succeeds (with a fencing token larger than any issued before for this
        session) if the lease is free, expired, or already ``owner``'s; returns
        ``None`` if another owner holds an unexpired lease (in a store that leases
        sessions by shard, such as ``RedisStore``, a lease on the session's shard).
        A session need not be stored to be claimed.
        """
        ...

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        """Extend ``lease`` for ``ttl`` seconds; ``False`` if it is no longer held."""
        ...

    async def release(self, session_id: str, lease: Lease) -> None:
        """Give the lease up, if still held by ``lease``; otherwise do nothing."""
        ...

    async def aclose(self) -> None:
        """Release resources (connections, threads). Idempotent."""
        ...


@runtime_checkable
class PagedStore(Store, Protocol):
    """A :class:`Store` that lists its sessions a page at a time.

    ``registry.sessions()`` pages through a store that has ``list_page``; a store
    with only ``list_sessions`` still works, but every listing then reads (and
    sorts) every session's info.
    """

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        """Up to ``limit`` (>= 1) ``(session_id, info)``, newest activity first.

        The order: by the ``updated_at`` in each session's info, newest first
        (read with ``info_activity`` from the info bytes each write brings; info
        that cannot be read counts as the oldest), then by name, descending.
        ``after`` is a stored session's name: the page starts just past it.
        Raises ``SessionNotFoundError`` if ``after`` is not stored. A page costs
        about the same however many sessions are stored.
        """
        ...


@runtime_checkable
class IdlePageStore(PagedStore, Protocol):
    """A :class:`PagedStore` that starts a page at an activity time, for listings of
    the sessions idle since then (``registry.sessions(active_before=...)``).

    Through ``list_idle_page`` a page of the sessions idle since a time costs about
    what the first page of the listing does, however many sessions were active since;
    through ``list_page`` alone the registry reads every newer session's page first
    and filters them. ``MemoryStore``, ``SQLiteStore`` and ``RedisStore`` have it.
    """

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        """``list_page``'s answer less the sessions whose activity time (``info_activity``
        of their info, microseconds since the epoch) is ``active_before`` or later: up
        to ``limit`` (>= 1) of the others, in listing order, past ``after`` if given.
        Raises ``SessionNotFoundError`` if ``after`` is not stored. A page costs about
        the same however many sessions are stored, active since or not.
        """
        ...


@runtime_checkable
class LeaseBatchStore(Store, Protocol):
    """A :class:`Store` that renews many leases in one step (``RedisStore`` renews the
    shards that hold them in one round trip).

    A registry on such a store renews every live session's lease with one call per
    renewal interval instead of one call per session; a store without ``renew_many``
    is renewed session by session.
    """

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        """Extend every lease (session name -> lease) for ``ttl`` seconds; the names
        whose leases are no longer held."""
        ...


@runtime_checkable
class JournalPageStore(Store, Protocol):
    """A :class:`Store` that reads a session's journal a page at a time.

    A subscription replaying events from the store (``ref.subscribe(after=...)``,
    an event stream with Last-Event-ID) reads the next page only when its reader
    has taken the last one, so it holds a page of the journal at a time, however
    long the journal is; through ``read_journal`` alone it holds the whole journal
    after the seq it resumes from. ``MemoryStore``, ``SQLiteStore`` and ``RedisStore``
    read pages, and so do the test kit's ``FaultyStore`` and ``FlawedStore``.
    """

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        """``(trimmed_upto, entries)`` as ``read_journal`` answers, but only the first
        entries with seq > ``after``: at most ``limit`` (>= 1) of them, and none after
        the one that brings their data to ``max_bytes`` or more (so at least one, if any
        is kept). Raises ``SessionNotFoundError`` if not stored.
        """
        ...
