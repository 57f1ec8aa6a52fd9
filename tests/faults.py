"""Fault injection shared by the tests: stores that fail or stall on demand."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from sessionactors import StoreError
from sessionactors.stores import JournalEntry, Lease, MemoryStore


class FaultyStore(MemoryStore):
    """A MemoryStore whose ``append`` fails for chosen sessions: a store fault crashes the actor.

    ``faults[name]`` is how many of that session's next appends fail (-1: all).
    """

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, int] = {}
        self.injected = 0

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        left = self.faults.get(session_id, 0)
        if left:
            self.faults[session_id] = left - 1 if left > 0 else left
            self.injected += 1
            await trio.lowlevel.checkpoint()
            raise OSError(f"injected store fault for {session_id!r}")
        await super().append(session_id, entries, info, fence=fence)


class GatedStore(MemoryStore):
    """A MemoryStore whose writes can be held or made to fail, per operation.

    ``gates[op]``: the next calls of ``op`` ("append", "write_snapshot",
    "delete" or "release") wait for that event (one never set: a stalled store).
    ``failures[op]``: how many of the next calls of ``op`` raise StoreError.
    ``refusals[op]``: an exception the next call of ``op`` raises instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, trio.Event] = {}
        self.failures: dict[str, int] = {}
        self.refusals: dict[str, Exception] = {}

    async def _enter(self, op: str, session_id: str) -> None:
        gate = self.gates.get(op)
        if gate is not None:
            await gate.wait()
        refusal = self.refusals.pop(op, None)
        if refusal is not None:
            await trio.lowlevel.checkpoint()
            raise refusal
        if self.failures.get(op):
            self.failures[op] -= 1
            await trio.lowlevel.checkpoint()
            raise StoreError(f"injected {op} fault for {session_id!r}", session_id=session_id)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._enter("append", session_id)
        await super().append(session_id, entries, info, fence=fence)

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
        await self._enter("write_snapshot", session_id)
        await super().write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )

    async def delete(self, session_id: str) -> bool:
        await self._enter("delete", session_id)
        return await super().delete(session_id)

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._enter("release", session_id)
        await super().release(session_id, lease)
