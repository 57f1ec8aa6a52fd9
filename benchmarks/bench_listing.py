"""12. Paging a listing of 100,000 sessions: a page costs what it costs at 1,000.

Two stores of each kind (MemoryStore, SQLiteStore) are filled directly through
the store API, one with 1,000 sessions and one with 100,000, each with a real
info (``dump_info``) whose ``updated_at`` is spread over a day at random, and
metadata ``tier`` gold or free at random. A registry without agents is opened
on each; a page is ``await registry.sessions(limit=50, ...)``: the first page,
the page after the session in the middle of the listing, and the first page of
``metadata={"tier": "gold"}``. Each round times ``calls`` pages of each kind on
both sizes (mean per page); the ratio is 100,000 over 1,000, paired per round,
median of the rounds. Target: <= 1.5x (issue 15).
"""

from __future__ import annotations

import argparse
import datetime
import random
from typing import Any

import trio

import sessionactors as sa
from _common import Row, log, median, now, paired, rounds, spread, temp_dir
from sessionactors.stores import dump_info

SMALL = 1_000
LARGE = 100_000
PAGE = 50
_START = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


async def populate(store: Any, count: int) -> list[str]:
    """``count`` sessions, created through the store; their names in listing order."""
    rng = random.Random(count)
    infos = []
    for i in range(count):
        name = f"customer-{i:06d}"
        info = sa.SessionInfo(
            session_id=name,
            agent="support",
            status=sa.Status.HIBERNATED,
            message_count=rng.randrange(2, 60),
            updated_at=_START + datetime.timedelta(microseconds=rng.randrange(86_400_000_000)),
            metadata={"tier": rng.choice(("gold", "free"))},
        )
        infos.append((info.updated_at, name, dump_info(info)))
    for start in range(0, count, 1000):  # concurrent creates share SQLite commits
        async with trio.open_nursery() as nursery:
            for _, name, blob in infos[start : start + 1000]:
                nursery.start_soon(store.create, name, b"snapshot", blob)
    return [name for _, name, _ in sorted(infos, reverse=True)]


async def time_pages(registry: sa.Registry, calls: int, **options: Any) -> float:
    start = now()
    for _ in range(calls):
        page = await registry.sessions(limit=PAGE, **options)
        assert len(page) == PAGE, len(page)
    return (now() - start) / calls


async def run_store(kind: str, make: Any, count: int, calls: int) -> list[Row]:
    stores = {size: make(size, True) for size in (SMALL, LARGE)}
    order = {}
    for size, store in stores.items():
        start = now()
        order[size] = await populate(store, size)
        await store.aclose()
        log(f"  {kind}: {size:,} sessions stored in {now() - start:.1f} s")
    stores = {size: make(size, False) for size in (SMALL, LARGE)}
    kinds = {
        "the first page": lambda size: {},
        "the page after the middle session": lambda size: {"after": order[size][size // 2]},
        "the first page of metadata={'tier': 'gold'}": lambda size: {"metadata": {"tier": "gold"}},
    }
    times: dict[tuple[str, int], list[float]] = {(k, s): [] for k in kinds for s in stores}
    async with (
        sa.open_registry(store=stores[SMALL]) as small,
        sa.open_registry(store=stores[LARGE]) as large,
    ):
        registries = {SMALL: small, LARGE: large}
        for options in kinds.values():  # warm up (SQLite's page cache, the thread)
            for size, registry in registries.items():
                await time_pages(registry, 3, **options(size))
        for _ in range(count):
            for what, options in kinds.items():
                for size, registry in registries.items():
                    times[what, size].append(await time_pages(registry, calls, **options(size)))
    rows = []
    for what in kinds:
        big, little = times[what, LARGE], times[what, SMALL]
        log(
            f"  {kind}, {what}: {median(big) * 1e6:.0f} us at {LARGE:,}, "
            f"{median(little) * 1e6:.0f} us at {SMALL:,}"
        )
        rows.append(
            Row(
                benchmark="12 paging 100,000 sessions",
                name=f"registry.sessions(limit={PAGE}), {what}, {kind}, {LARGE:,} sessions",
                measured=median(big) * 1e6,
                unit="us",
                baseline=median(little) * 1e6,
                baseline_name=f"the same at {SMALL:,} sessions",
                baseline_unit="us",
                target_on="ratio",
                target_op="<=",
                target_value=1.5,
                paired_ratio=paired(big, little),
                notes=f"{count} rounds x {calls} pages; {spread(big)}",
            )
        )
    return rows


def main(args: argparse.Namespace) -> list[Row]:
    count = rounds(args.quick, 7)
    calls = 20 if args.quick else 100
    memory = {size: sa.MemoryStore() for size in (SMALL, LARGE)}
    rows = trio.run(run_store, "MemoryStore", lambda size, _: memory[size], count, calls)
    with temp_dir() as tmp:

        def sqlite(size: int, filling: bool) -> sa.SQLiteStore:
            path = tmp / f"listing-{size}.db"
            return sa.SQLiteStore(path, synchronous="OFF" if filling else "FULL")

        rows += trio.run(run_store, "SQLiteStore", sqlite, count, calls)
    return rows


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
