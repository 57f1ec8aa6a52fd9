"""MemoryStore keeps the store contract, and check_store catches stores that break it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import attrs
import pytest
import trio

from forwarding_store import Forwarding
from sessionactors import FencedOutError, StoreError
from sessionactors.stores import MAX_SEQ, JournalEntry, Lease, MemoryStore, StoredSession
from sessionactors.testing import check_store


async def test_memory_store_passes_check_store() -> None:
    """MemoryStore passes the store conformance suite."""
    with trio.fail_after(20):
        await check_store(MemoryStore)


async def test_check_store_accepts_an_async_factory() -> None:
    """check_store awaits a factory that returns an awaitable store."""

    async def make() -> MemoryStore:
        await trio.lowlevel.checkpoint()
        return MemoryStore()

    with trio.fail_after(20):
        await check_store(make)


# Negative controls: each store below breaks one property, and check_store must say which.
# They are built on MemoryStore through its public methods only.


class _Wrapped(Forwarding):
    """A store that hands every call to a MemoryStore."""

    inner: MemoryStore

    def __init__(self) -> None:
        super().__init__(MemoryStore())


@attrs.define
class _Held:
    owner: str | None
    fence: int
    until: float


class _OwnLeases(_Wrapped):
    """Keeps the leases itself, and checks fencing tokens before writing through."""

    def __init__(self) -> None:
        super().__init__()
        self.leases: dict[str, _Held] = {}

    def stale(self, session_id: str, fence: int | None) -> bool:
        held = self.leases.get(session_id)
        return fence is not None and (
            held is None or held.owner is None or held.fence != fence or held.until < time.time()
        )

    async def checked(self, session_id: str, fence: int | None) -> None:
        await self.inner.read_journal(session_id, 0)  # SessionNotFoundError first
        if self.stale(session_id, fence):
            raise FencedOutError("stale fencing token", session_id=session_id)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self.checked(session_id, fence)
        await self.inner.append(session_id, entries, info)

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
        await self.checked(session_id, fence)
        await self.inner.write_snapshot(session_id, snapshot, seq, info, trim_upto=trim_upto)

    async def delete(self, session_id: str) -> bool:
        held = self.leases.get(session_id)
        if held is not None:
            held.owner, held.until = None, 0.0
        return await self.inner.delete(session_id)

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await trio.lowlevel.checkpoint()
        held = self.leases.setdefault(session_id, _Held(owner=None, fence=0, until=0.0))
        if held.owner not in (None, owner) and held.until >= time.time():
            return None
        held.owner, held.fence, held.until = owner, held.fence + 1, time.time() + ttl
        return Lease(owner=owner, fence=held.fence)

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await trio.lowlevel.checkpoint()
        held = self.leases.get(session_id)
        if held is None or (held.owner, held.fence) != (lease.owner, lease.fence):
            return False
        if held.until < time.time():
            return False
        held.until = time.time() + ttl
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()
        held = self.leases.get(session_id)
        if held is not None and (held.owner, held.fence) == (lease.owner, lease.fence):
            held.owner, held.until = None, 0.0


class _IgnoresFence(_Wrapped):
    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self.inner.append(session_id, entries, info)


class _RacyClaim(_OwnLeases):
    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        held = self.leases.setdefault(session_id, _Held(owner=None, fence=0, until=0.0))
        free = held.owner in (None, owner) or held.until < time.time()
        await trio.sleep(0)  # other claims slip in between the check and the write
        if not free:
            return None
        held.owner, held.fence, held.until = owner, held.fence + 1, time.time() + ttl
        return Lease(owner=owner, fence=held.fence)


class _FullJournalOnLoad(_Wrapped):
    async def load(self, session_id: str) -> StoredSession | None:
        stored = await self.inner.load(session_id)
        if stored is None:
            return None
        _, entries = await self.inner.read_journal(session_id, 0)
        return StoredSession(
            snapshot=stored.snapshot, snapshot_seq=stored.snapshot_seq, entries=tuple(entries)
        )


class _InfoOfCreate(_Wrapped):
    """Gives the info that the session was created with, not its last write's."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[str, bytes] = {}

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self.inner.create(session_id, snapshot, info)
        self.created[session_id] = info

    async def load(self, session_id: str) -> StoredSession | None:
        stored = await self.inner.load(session_id)
        if stored is None:
            return None
        return attrs.evolve(stored, info=self.created.get(session_id))


class _ForgetsFencesOnDelete(_OwnLeases):
    async def delete(self, session_id: str) -> bool:
        self.leases.pop(session_id, None)
        return await self.inner.delete(session_id)


class _NoTrim(_Wrapped):
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
        await self.inner.write_snapshot(session_id, snapshot, seq, info, trim_upto=0, fence=fence)


class _AcceptsOldSeqs(_Wrapped):
    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        with contextlib.suppress(StoreError):  # says it wrote what it refused
            await self.inner.append(session_id, entries, info, fence=fence)


class _ExpiredLeaseStillWrites(_OwnLeases):
    def stale(self, session_id: str, fence: int | None) -> bool:
        held = self.leases.get(session_id)
        return fence is not None and (held is None or held.owner is None or held.fence != fence)


class _AcceptsAnySeq(_Wrapped):
    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        if any(entry.seq > MAX_SEQ for entry in entries):
            return  # says it wrote what no store may hold
        await self.inner.append(session_id, entries, info, fence=fence)


class _FailsTogether(_Wrapped):
    """Fails every append in flight together with one that fails, under the failing
    one's name, as an SQLite group commit once did."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.failure: StoreError | None = None

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        self.in_flight += 1
        try:
            try:
                await self.inner.append(session_id, entries, info, fence=fence)
            except StoreError as exc:
                self.failure = exc
                raise
            for _ in range(10):  # the others of the group finish meanwhile
                await trio.sleep(0)
            if self.failure is not None:
                raise self.failure
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.failure = None


class _PagesByName(_Wrapped):
    """Lists a page at a time, but by name instead of by activity."""

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        listed = sorted(await self.inner.list_sessions(), reverse=True)
        names = [name for name, _ in listed]
        start = names.index(after) + 1 if after is not None else 0
        return listed[start : start + limit]


class _IdleUpToTheTime(_Wrapped):
    """Lists the sessions idle since a time, but those active at that very time too."""

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        return await self.inner.list_page(after=after, limit=limit)

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        return await self.inner.list_idle_page(
            active_before=active_before + 1, after=after, limit=limit
        )


class _ForgetsOnClose(_Wrapped):
    async def aclose(self) -> None:
        self.inner = MemoryStore()  # reopens as an empty store


async def test_a_store_keeping_its_own_leases_passes() -> None:
    """Positive control: the lease-keeping wrapper the broken stores build on passes."""
    with trio.fail_after(20):
        await check_store(_OwnLeases)


@pytest.mark.parametrize(
    ("broken", "failed_check"),
    [
        (_IgnoresFence, "expected it to raise FencedOutError"),
        (_RacyClaim, "exactly one winner"),
        (_FullJournalOnLoad, "only the journal entries after it"),
        (_InfoOfCreate, "the info of the last write"),
        (_ForgetsFencesOnDelete, "delete removes"),
        (_NoTrim, "trim_upto drops"),
        (_AcceptsOldSeqs, "not above every stored one"),
        (_ExpiredLeaseStillWrites, "expired lease"),
        (_AcceptsAnySeq, "a seq above it raises StoreError"),
        (_FailsTogether, "each succeed or fail alone"),
        (_ForgetsOnClose, "never reads empty"),
        (_PagesByName, "newest activity first"),
        (_IdleUpToTheTime, "active before a time"),
    ],
)
async def test_check_store_catches_a_broken_store(
    broken: type[_Wrapped], failed_check: str
) -> None:
    """check_store fails a store that breaks one property, naming that property."""
    with trio.fail_after(20), pytest.raises(AssertionError, match=failed_check) as info:
        await check_store(broken)
    assert str(info.value).startswith("store check failed: ")


async def test_check_store_reports_an_unexpected_exception() -> None:
    """An unexpected exception from the store becomes an AssertionError caused by it."""

    class Crashes(MemoryStore):
        async def list_sessions(self) -> list[tuple[str, bytes]]:
            raise RuntimeError("boom")

    with trio.fail_after(20), pytest.raises(AssertionError, match="RuntimeError: boom") as info:
        await check_store(Crashes)
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_memory_store_copies_nothing_it_does_not_own() -> None:
    """Bytes-like inputs are stored as bytes, so later changes to them do not leak in."""
    store = MemoryStore()
    snapshot = bytearray(b"snap")
    data = bytearray(b"entry")
    await store.create("s", snapshot, b"info")  # type: ignore[arg-type]
    await store.append("s", [JournalEntry(1, data)], b"info")  # type: ignore[arg-type]
    snapshot[:] = b"XXXX"
    data[:] = b"YYYYY"
    assert await store.load("s") == StoredSession(
        snapshot=b"snap", snapshot_seq=0, entries=(JournalEntry(1, b"entry"),), info=b"info"
    )


async def test_memory_store_rejects_a_bad_ttl() -> None:
    """claim and renew refuse a ttl that is not a positive number of seconds."""
    store = MemoryStore()
    with pytest.raises(ValueError, match="ttl"):
        await store.claim("s", "worker", 0)
    with pytest.raises(ValueError, match="ttl"):
        await store.renew("s", Lease(owner="worker", fence=1), float("nan"))


async def test_memory_store_refuses_seqs_that_are_not_counts() -> None:
    """A seq that is not an integer (a bool, a float) is refused with StoreError."""
    store = MemoryStore()
    await store.create("s", b"snap", b"info")
    for bad in (True, 1.5, "1"):
        with pytest.raises(StoreError, match="not an integer"):
            await store.append("s", [JournalEntry(bad, b"x")], b"info")  # type: ignore[arg-type]
    assert await store.read_journal("s", 0) == (0, [])
