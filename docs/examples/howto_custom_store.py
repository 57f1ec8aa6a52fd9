"""How-to: write your own store and check it with check_store.

``DictStore`` keeps sessions in plain dicts. A store for a real database has the same
shape: each method is one atomic operation of the database.
"""

import time
from collections.abc import Sequence

import trio

import sessionactors as sa
from sessionactors.stores import MAX_SEQ, JournalEntry, Lease, Store, StoredSession
from sessionactors.testing import EchoModel, check_store


class DictStore:
    """Sessions in dicts: a snapshot, a journal and an info blob each, plus leases."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict] = {}
        # Leases outlive sessions: fencing tokens must keep growing after a delete.
        self.leases: dict[str, dict] = {}

    # -- sessions ------------------------------------------------------------------

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
        await trio.lowlevel.checkpoint()
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
        await trio.lowlevel.checkpoint()
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
        await trio.lowlevel.checkpoint()
        s = self._get(session_id)
        self._check_fence(session_id, fence)
        last = s["last_seq"]
        for entry in entries:  # check everything before writing anything
            if not last < entry.seq <= MAX_SEQ:
                raise sa.StoreError(
                    f"session {session_id!r}: seq {entry.seq} is not above {last}"
                    " (or is above MAX_SEQ)",
                    session_id=session_id,
                )
            last = entry.seq
        s["journal"].extend(JournalEntry(e.seq, bytes(e.data)) for e in entries)
        s["last_seq"] = last
        s["info"] = bytes(info)

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
        await trio.lowlevel.checkpoint()
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
        await trio.lowlevel.checkpoint()
        s = self._get(session_id)
        return s["trimmed_upto"], [e for e in s["journal"] if e.seq > after]

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return [(name, s["info"]) for name, s in self.sessions.items()]

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return session_id in self.sessions

    async def delete(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        lease = self.leases.get(session_id)
        if lease is not None:
            lease.update(owner=None, until=0.0)
        return self.sessions.pop(session_id, None) is not None

    # -- leases --------------------------------------------------------------------

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await trio.lowlevel.checkpoint()
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
        await trio.lowlevel.checkpoint()
        held = self._holds(session_id, lease)
        if held is None or held["until"] < time.time():
            return False
        held["until"] = time.time() + ttl
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()
        held = self._holds(session_id, lease)
        if held is not None:
            held.update(owner=None, until=0.0)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def main() -> None:
    print("implements the protocol:", isinstance(DictStore(), Store))

    # The conformance suite: every property of the Store contract, each on a fresh store.
    # It runs on real time (lease expiry) and takes about a second.
    with trio.fail_after(30):
        await check_store(DictStore)
    print("check_store: passed")

    # It catches mistakes: a store that ignores fencing tokens fails, naming the property.
    class NoFencing(DictStore):
        def _check_fence(self, session_id: str, fence: int | None) -> None:
            pass

    try:
        with trio.fail_after(30):
            await check_store(NoFencing)
    except AssertionError as exc:
        print("a broken store fails:", str(exc).split(":")[1].strip())

    # A store that passes runs sessions like the built-in ones.
    agent = sa.Agent(model=EchoModel())
    store = DictStore()
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat")
        print("reply:", (await ref.send("stored in dicts")).text)
    print("stored sessions:", [name for name, _ in await store.list_sessions()])


if __name__ == "__main__":
    trio.run(main)
