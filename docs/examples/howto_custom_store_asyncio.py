"""How-to: a store written on an asyncio client, used from sessionactors.aio.

``AsyncioDictStore`` keeps sessions in dicts behind asyncio awaits, where a store on
asyncpg, redis.asyncio or motor awaits its client. Wrapped by
``sessionactors.aio.asyncio_store``, its calls run as asyncio tasks of the app's loop.
"""

import asyncio
import time
from collections.abc import Sequence

import sessionactors as sa
import sessionactors.aio
from sessionactors.stores import MAX_SEQ, JournalEntry, Lease, StoredSession
from sessionactors.testing import EchoModel


class AsyncioDictStore:
    """Sessions in dicts: a snapshot, a journal and an info blob each, plus leases."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict] = {}
        self.leases: dict[str, dict] = {}  # (outlive sessions: tokens keep growing)

    async def _io(self) -> None:
        await asyncio.sleep(0)  # asyncpg: await conn.execute(...), in one transaction

    def _get(self, session_id: str) -> dict:
        session = self.sessions.get(session_id)
        if session is None:
            raise sa.SessionNotFoundError(
                f"session {session_id!r} is not stored", session_id=session_id
            )
        return session

    def _check_fence(self, session_id: str, fence: int | None) -> None:
        if fence is None:  # unfenced writes always go ahead
            return
        lease = self.leases.get(session_id)
        if (
            lease is None
            or lease["fence"] != fence
            or lease["owner"] is None
            or lease["until"] < time.time()
        ):
            raise sa.FencedOutError(
                f"session {session_id!r}: fencing token {fence} is stale", session_id=session_id
            )

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._io()
        if session_id in self.sessions:
            raise sa.SessionExistsError(
                f"session {session_id!r} is already stored", session_id=session_id
            )
        self.sessions[session_id] = {
            "snapshot": bytes(snapshot),
            "snapshot_seq": 0,
            "journal": [],
            "last_seq": 0,
            "trimmed_upto": 0,
            "info": bytes(info),
        }

    async def load(self, session_id: str) -> StoredSession | None:
        await self._io()
        s = self.sessions.get(session_id)
        if s is None:
            return None
        tail = tuple(e for e in s["journal"] if e.seq > s["snapshot_seq"])
        return StoredSession(
            snapshot=s["snapshot"], snapshot_seq=s["snapshot_seq"], entries=tail, info=s["info"]
        )

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._io()
        s = self._get(session_id)
        self._check_fence(session_id, fence)
        last = s["last_seq"]
        for entry in entries:  # check everything before writing anything
            if not last < entry.seq <= MAX_SEQ:
                raise sa.StoreError(
                    f"session {session_id!r}: seq {entry.seq} is not above {last}",
                    session_id=session_id,
                )
            last = entry.seq
        s["journal"].extend(JournalEntry(e.seq, bytes(e.data)) for e in entries)
        s.update(last_seq=last, info=bytes(info))

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
        await self._io()
        s = self._get(session_id)
        self._check_fence(session_id, fence)
        if trim_upto > seq or seq < s["snapshot_seq"] or seq > MAX_SEQ:
            raise sa.StoreError(
                f"session {session_id!r}: bad snapshot seq {seq} / trim {trim_upto}",
                session_id=session_id,
            )
        s.update(snapshot=bytes(snapshot), snapshot_seq=seq, info=bytes(info))
        s["last_seq"] = max(s["last_seq"], seq)
        if trim_upto > s["trimmed_upto"]:
            s["trimmed_upto"] = trim_upto
            s["journal"] = [e for e in s["journal"] if e.seq > trim_upto]

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await self._io()
        s = self._get(session_id)
        return s["trimmed_upto"], [e for e in s["journal"] if e.seq > after]

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await self._io()
        return [(name, s["info"]) for name, s in self.sessions.items()]

    async def exists(self, session_id: str) -> bool:
        await self._io()
        return session_id in self.sessions

    async def delete(self, session_id: str) -> bool:
        await self._io()
        if session_id in self.leases:
            self.leases[session_id].update(owner=None, until=0.0)
        return self.sessions.pop(session_id, None) is not None

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await self._io()
        now = time.time()
        lease = self.leases.setdefault(session_id, {"owner": None, "fence": 0, "until": 0.0})
        if lease["owner"] not in (None, owner) and lease["until"] >= now:
            return None  # held by another owner and not expired
        lease.update(owner=owner, fence=lease["fence"] + 1, until=now + ttl)
        return Lease(owner=owner, fence=lease["fence"])

    def _holds(self, session_id: str, lease: Lease) -> dict | None:
        held = self.leases.get(session_id)
        if held is None or (held["owner"], held["fence"]) != (lease.owner, lease.fence):
            return None
        return held

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await self._io()
        held = self._holds(session_id, lease)
        if held is None or held["until"] < time.time():
            return False
        held["until"] = time.time() + ttl
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._io()
        held = self._holds(session_id, lease)
        if held is not None:
            held.update(owner=None, until=0.0)

    async def aclose(self) -> None:
        await self._io()  # asyncpg: await pool.close()


async def main() -> None:
    # The conformance suite, from asyncio: sessionactors.aio.check_store runs
    # sessionactors.testing.check_store in the trio run that sessionactors.aio keeps
    # on this loop, with the store's calls as asyncio tasks.
    async with asyncio.timeout(30):
        await sessionactors.aio.check_store(
            lambda: sessionactors.aio.asyncio_store(AsyncioDictStore())
        )
    print("check_store: passed")

    # The app's registry: the wrapped store runs on the app's loop, with its clients.
    store = AsyncioDictStore()
    wrapped = sessionactors.aio.asyncio_store(store)
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sessionactors.aio.open_registry(store=wrapped, agents=agents) as registry:
        ref = await registry.spawn("chat")
        print("reply:", (await ref.send("stored through asyncio")).text)
        await ref.hibernate()
        print("woken with:", len(await registry.ref("chat").history()), "messages")
        await registry.spawn("scratch")
        await registry.delete("scratch")
    print("stored sessions:", list(store.sessions))


if __name__ == "__main__":
    asyncio.run(main())
