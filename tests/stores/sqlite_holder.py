"""A process that holds an SQLiteStore open, for the tests of sharing one file.

Usage: ``python sqlite_holder.py PATH MODE`` with MODE ``exclusive``, ``shared`` or
``readonly``. It opens the store and prints ``ready``, or ``refused`` and the
error if the store refuses to open; then answers each command read from stdin
with one line: ``create NAME`` -> ``created`` (a session with one journal entry),
``list`` -> the stored names, comma-separated; ``exit`` (or the end of stdin)
closes the store and ends.
"""

import sys

import trio

from sessionactors import StoreError
from sessionactors.stores import JournalEntry, SQLiteStore


async def create(store: SQLiteStore, name: str) -> None:
    await store.create(name, b"snapshot", b"info")
    await store.append(name, [JournalEntry(1, b"entry")], b"info")


async def names(store: SQLiteStore) -> str:
    return ",".join(name for name, _ in await store.list_sessions())


def main(path: str, mode: str) -> None:
    store = SQLiteStore(path, shared=mode == "shared", readonly=mode == "readonly")
    try:
        trio.run(store.list_sessions)
    except StoreError as exc:
        print(f"refused {exc}", flush=True)
        return
    print("ready", flush=True)
    while (command := sys.stdin.readline().split()) and command[0] != "exit":
        if command[0] == "create":
            trio.run(create, store, command[1])
            print("created", flush=True)
        elif command[0] == "list":
            print(trio.run(names, store), flush=True)
        else:
            raise SystemExit(f"unknown command {command!r}")
    trio.run(store.aclose)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
