"""Fault injection shared by the tests: a store that fails on demand."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from sessionactors.stores import JournalEntry, MemoryStore


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
