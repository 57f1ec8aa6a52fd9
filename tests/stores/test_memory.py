"""MemoryStore keeps the store contract, and check_store catches stores that break it."""

from __future__ import annotations

import time

import pytest
import trio

from sessionactors import FencedOutError
from sessionactors.stores import JournalEntry, Lease, MemoryStore, StoredSession
from sessionactors.stores._memory import _Lease
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


class _IgnoresFence(MemoryStore):
    async def append(
        self, session_id: str, entries: object, info: bytes, *, fence: int | None = None
    ) -> None:
        await super().append(session_id, entries, info)  # type: ignore[arg-type]


class _RacyClaim(MemoryStore):
    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        held = self._leases.get(session_id)
        free = held is None or held.owner in (None, owner) or held.until < time.time()
        await trio.sleep(0)  # other claims slip in between the check and the write
        if not free:
            return None
        held = self._leases.setdefault(session_id, _Lease(owner=None, fence=0, until=0.0))
        held.owner, held.fence, held.until = owner, held.fence + 1, time.time() + ttl
        return Lease(owner=owner, fence=held.fence)


class _FullJournalOnLoad(MemoryStore):
    async def load(self, session_id: str) -> StoredSession | None:
        stored = await super().load(session_id)
        if stored is None:
            return None
        _, entries = await self.read_journal(session_id, 0)
        return StoredSession(
            snapshot=stored.snapshot, snapshot_seq=stored.snapshot_seq, entries=tuple(entries)
        )


class _ForgetsFencesOnDelete(MemoryStore):
    async def delete(self, session_id: str) -> bool:
        self._leases.pop(session_id, None)
        return await super().delete(session_id)


class _NoTrim(MemoryStore):
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
        await super().write_snapshot(session_id, snapshot, seq, info, trim_upto=0, fence=fence)


class _AcceptsOldSeqs(MemoryStore):
    async def append(
        self, session_id: str, entries: object, info: bytes, *, fence: int | None = None
    ) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_seq = -1
        await super().append(session_id, entries, info, fence=fence)  # type: ignore[arg-type]


class _ExpiredLeaseStillWrites(MemoryStore):
    def _check_fence(self, session_id: str, fence: int | None) -> None:
        lease = self._leases.get(session_id)
        if fence is not None and (lease is None or lease.owner is None or lease.fence != fence):
            raise FencedOutError("stale", session_id=session_id)


@pytest.mark.parametrize(
    ("broken", "failed_check"),
    [
        (_IgnoresFence, "expected it to raise FencedOutError"),
        (_RacyClaim, "exactly one winner"),
        (_FullJournalOnLoad, "only the journal entries after it"),
        (_ForgetsFencesOnDelete, "delete removes"),
        (_NoTrim, "trim_upto drops"),
        (_AcceptsOldSeqs, "not above every stored one"),
        (_ExpiredLeaseStillWrites, "expired lease"),
    ],
)
async def test_check_store_catches_a_broken_store(
    broken: type[MemoryStore], failed_check: str
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
        snapshot=b"snap", snapshot_seq=0, entries=(JournalEntry(1, b"entry"),)
    )


async def test_memory_store_rejects_a_bad_ttl() -> None:
    """claim and renew refuse a ttl that is not a positive number of seconds."""
    store = MemoryStore()
    with pytest.raises(ValueError, match="ttl"):
        await store.claim("s", "worker", 0)
    with pytest.raises(ValueError, match="ttl"):
        await store.renew("s", Lease(owner="worker", fence=1), float("nan"))
