"""Append throughput of SQLiteStore: 1,000 concurrent appenders against one at a time.

Usage: ``python tests/stores/sqlite_append_bench.py [DIRECTORY]``. Prints appends per
second for both, the ratio, and the store's statistics (appends per commit).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import trio

from sessionactors.stores import JournalEntry, SQLiteStore

APPENDERS = 1000
ROUNDS = 5
SOLO_APPENDS = 500
ENTRY = b"x" * 200


async def concurrent(path: Path) -> tuple[float, str]:
    store = SQLiteStore(path)
    names = [f"session-{i}" for i in range(APPENDERS)]
    for name in names:
        await store.create(name, b"snapshot", b"info")
    before = store.statistics()

    async def appender(name: str) -> None:
        for seq in range(1, ROUNDS + 1):
            await store.append(name, [JournalEntry(seq, ENTRY)], b"info")

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(appender, name)
    elapsed = time.perf_counter() - start
    after = store.statistics()
    await store.aclose()
    commits = after.commits - before.commits
    appends = after.appends - before.appends
    detail = f"{appends} appends in {commits} commits, largest batch {after.largest_batch}"
    return APPENDERS * ROUNDS / elapsed, detail


async def solo(path: Path) -> float:
    store = SQLiteStore(path)
    await store.create("solo", b"snapshot", b"info")
    start = time.perf_counter()
    for seq in range(1, SOLO_APPENDS + 1):
        await store.append("solo", [JournalEntry(seq, ENTRY)], b"info")
    elapsed = time.perf_counter() - start
    await store.aclose()
    return SOLO_APPENDS / elapsed


async def main(directory: Path) -> None:
    single = await solo(directory / "solo.db")
    grouped, detail = await concurrent(directory / "grouped.db")
    print(f"one appender at a time:     {single:10.0f} appends/s")
    print(f"{APPENDERS} concurrent appenders: {grouped:10.0f} appends/s ({detail})")
    print(f"ratio: {grouped / single:.1f}x")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as tmp:
        trio.run(main, Path(tmp))
