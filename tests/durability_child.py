"""A worker for the kill -9 tests: sends turns and prints an ACK after each reply.

Usage: durability_child.py PATH MODE SESSIONS
It imports what it needs, then waits for a line on stdin before it opens the store
(the harness starts the next round's child while this round's runs).
MODE is "durable" (the real SQLiteStore), "ack-before-commit" (the store wrapped in
the test kit's FlawedStore("ack_appends_early"), which answers appends before
writing them: the negative control) or
"hibernate-loop" (hibernates and wakes sessions in a loop).
"""

from __future__ import annotations

import sys

import trio

import sessionactors as sa
from sessionactors.stores import SQLiteStore, Store
from sessionactors.testing import EchoModel, FlawedStore


async def main(path: str, mode: str, sessions: int) -> None:
    store: Store = SQLiteStore(path)
    if mode == "ack-before-commit":  # each append is written only at the next store call
        store = FlawedStore("ack_appends_early", store)
    agents = {"echo": sa.Agent(model=EchoModel())}
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
    if sys.stdin.readline():  # (end of input: the harness did not need this child)
        trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
