"""How-to: choose a durability policy, and bound the journal."""

import os
import tempfile

import trio

import sessionactors as sa
from sessionactors.stores import SQLiteStore, load_events
from sessionactors.testing import EchoModel


async def journal_after_one_reply(path: str, durability: str) -> None:
    """Send one message; list the events journaled in the file right after the reply."""
    agent = sa.Agent(model=EchoModel())
    store = SQLiteStore(path)
    async with sa.open_registry(store=store, agents={"echo": agent}, durability=durability) as reg:
        await reg.spawn("chat")
        await reg.ref("chat").send("hello")
        # Look at the file through a second store object, as another process would.
        observer = SQLiteStore(path)
        _, entries = await observer.read_journal("chat", 0)
        await observer.aclose()
        on_disk = [type(e).__name__ for entry in entries for e in load_events(entry.data)]
    # A clean exit hibernates every session: with either policy, nothing is lost.
    async with sa.open_registry(store=SQLiteStore(path), agents={"echo": agent}) as reg:
        kept = len(await reg.ref("chat").history())
    print(f"durability={durability!r}: journaled at reply time: {on_disk}")
    print(f"    {kept} messages after a clean restart")


async def snapshots_and_trimming(path: str) -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(
        store=SQLiteStore(path),
        agents={"echo": agent},
        snapshot_every=8,  # at least 8 journaled events between snapshots (default 1000)
        journal_keep_events=8,  # keep 8 journaled events for replay (default 100_000)
    ) as registry:
        ref = await registry.spawn("long")
        for i in range(30):
            await ref.send(f"message {i}")
        observer = SQLiteStore(path)
        stored = await observer.load("long")
        assert stored is not None
        print(f"snapshot at seq {stored.snapshot_seq}, journal tail {len(stored.entries)} entries")
        await observer.aclose()
        # Events older than the newest journal_keep_events are gone from the journal:
        await ref.hibernate()
        try:
            async with ref.subscribe(after=0):
                pass
        except sa.EventsExpiredError as exc:
            print("replay from 0 expired; oldest available seq:", exc.oldest_seq)


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        for durability in ("turn", "hibernate"):
            path = os.path.join(directory, f"{durability}.db")
            await journal_after_one_reply(path, durability)
        await snapshots_and_trimming(os.path.join(directory, "long.db"))


if __name__ == "__main__":
    trio.run(main)
