"""A store of a test's own that hands every call of the Store protocol to another store
(and has nothing more: no ``list_page``), to subclass with one method changed."""

from __future__ import annotations

from collections.abc import Sequence

from sessionactors.stores import JournalEntry, Lease, Store, StoredSession


class Forwarding:
    """Every call of the Store protocol, handed to ``inner``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self.inner.create(session_id, snapshot, info)

    async def load(self, session_id: str) -> StoredSession | None:
        return await self.inner.load(session_id)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self.inner.append(session_id, entries, info, fence=fence)

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
        await self.inner.write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        return await self.inner.read_journal(session_id, after)

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        return await self.inner.list_sessions()

    async def exists(self, session_id: str) -> bool:
        return await self.inner.exists(session_id)

    async def delete(self, session_id: str) -> bool:
        return await self.inner.delete(session_id)

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        return await self.inner.claim(session_id, owner, ttl)

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        return await self.inner.renew(session_id, lease, ttl)

    async def release(self, session_id: str, lease: Lease) -> None:
        await self.inner.release(session_id, lease)

    async def aclose(self) -> None:
        await self.inner.aclose()
