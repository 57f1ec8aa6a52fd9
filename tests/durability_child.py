"""A worker for the kill -9 tests: sends turns and prints an ACK after each reply.

Usage: durability_child.py PATH MODE SESSIONS
MODE is "durable" (the real SQLiteStore), "ack-before-commit" (a broken store
variant that answers appends before writing them: the negative control) or
"hibernate-loop" (hibernates and wakes sessions in a loop).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

import sessionactors as sa
from sessionactors.stores import JournalEntry, SQLiteStore
from sessionactors.testing import EchoModel


class AckBeforeCommitStore(SQLiteStore):
    """Broken on purpose: append returns at once and writes later."""

    nursery: trio.Nursery | None = None

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        assert self.nursery is not None
        parent_append = super().append

        async def later() -> None:
            await trio.sleep(0.05)
            await parent_append(session_id, entries, info, fence=fence)

        self.nursery.start_soon(later)
        await trio.lowlevel.checkpoint()


async def main(path: str, mode: str, sessions: int) -> None:
    store = AckBeforeCommitStore(path) if mode == "ack-before-commit" else SQLiteStore(path)
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with trio.open_nursery() as nursery:
        if isinstance(store, AckBeforeCommitStore):
            store.nursery = nursery
        async with sa.open_registry(store=store, agents=agents) as registry:
            refs = [await registry.get_or_spawn(f"s{i}") for i in range(sessions)]
            print("READY", flush=True)

            async def drive(i: int, ref: sa.SessionRef) -> None:
                k = sum(1 for m in await ref.history() if m.role is sa.Role.USER)
                while True:
                    await ref.send(f"s{i}-{k}")
                    print(f"ACK s{i} {k}", flush=True)
                    k += 1
                    if mode == "hibernate-loop":
                        await ref.hibernate()

            async with trio.open_nursery() as inner:
                for i, ref in enumerate(refs):
                    inner.start_soon(drive, i, ref)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
