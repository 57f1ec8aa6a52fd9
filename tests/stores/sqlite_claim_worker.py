"""A worker process for the cross-process claim test of SQLiteStore.

Usage: ``python sqlite_claim_worker.py PATH OWNER``. It opens the file shared
(``SQLiteStore(path, shared=True)``), prints ``ready`` once its store is open,
then answers each command read from stdin with one line:
``claim`` -> ``won FENCE`` or ``lost``; ``release`` -> ``released``; ``exit`` ends.
Each command runs in its own ``trio.run``, with one store object throughout.
"""

from __future__ import annotations

import sys

import trio

from sessionactors.stores import Lease, SQLiteStore

SESSION = "contested"


def main(path: str, owner: str) -> None:
    store = SQLiteStore(path, shared=True)
    trio.run(store.exists, SESSION)  # opens the file
    print("ready", flush=True)
    lease: Lease | None = None
    while command := sys.stdin.readline().strip():
        if command == "claim":
            lease = trio.run(store.claim, SESSION, owner, 60.0)
            print("lost" if lease is None else f"won {lease.fence}", flush=True)
        elif command == "release":
            assert lease is not None
            trio.run(store.release, SESSION, lease)
            print("released", flush=True)
        elif command == "exit":
            break
        else:
            raise SystemExit(f"unknown command {command!r}")
    trio.run(store.aclose)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
