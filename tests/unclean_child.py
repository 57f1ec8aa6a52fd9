"""A process for the kill -9 test of tests/test_unclean_wake.py: it runs a turn that
streams and then holds, and waits to be killed.

Usage: unclean_child.py PATH
On the SQLite file PATH it spawns session "s" and answers one turn of it ("one"), spawns
session "t" and hibernates it after a turn, then submits a second turn of "s" (with an
idempotency key) whose model streams a word and holds; once that word has streamed it
prints ``STREAMING <turn id>`` and waits for the end of its input (the kill comes first).
"""

from __future__ import annotations

import sys

import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


async def main(path: str) -> None:
    held = ScriptedModel(
        ["one", "t one", Scripted(text="two two", wait=trio.Event(), wait_after=1)]
    )
    async with sa.open_registry(
        store=sa.SQLiteStore(path), agents={"a": sa.Agent(model=held)}
    ) as registry:
        ref = await registry.spawn("s")
        await ref.send("one")
        other = await registry.spawn("t")
        await other.send("t one")
        await other.hibernate()
        async with ref.subscribe() as events:
            turn = await ref.submit("private words of the user", idempotency_key="key-two")
            async for event in events:
                if isinstance(event, sa.Delta):
                    break
        print(f"STREAMING {turn.id}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
