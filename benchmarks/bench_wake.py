"""4. Waking a hibernated 50-message session, per store.

Sessions of 50 messages are built with the instant model (25 turns each) and
hibernated. A wake is ``await registry.ref(name).history()`` on a hibernated
session: the store's load, the snapshot's decode, the actor's start, the
reply. The baseline is the least a wake needs on that store: the same
``store.load`` plus ``sa.load_snapshot`` of what it returned. Each round wakes
every session once (wall clock, mean per wake), then hibernates them again
(not timed); the median of the rounds is reported.

Subscribing to a hibernated session reads where its events stand and its status
from the store, without waking it: a subscription opened (and closed) on a
10,000-message session against the same on a 50-message one, per store, wall
clock, mean of 20 per round; the median of the rounds' ratios.

RedisStore runs when ``SESSIONACTORS_REDIS_URL`` is set or a ``redis-server``
binary can be started on a free port on 127.0.0.1 (stopped afterwards).
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import trio

import sessionactors as sa
from _common import (
    InstantModel,
    Row,
    agents,
    log,
    median,
    now,
    paired,
    redis_url,
    spread,
    temp_dir,
)


async def build(store: Any, names: list[str], turns: int) -> None:
    """Sessions with ``2 * turns`` messages, hibernated (durability='hibernate' builds fast)."""
    async with sa.open_registry(
        agents=agents(InstantModel()), store=store, durability="hibernate"
    ) as registry:
        for name in names:
            ref = await registry.spawn(name)
            for _ in range(turns):
                await ref.send("Where is my order? It was due yesterday.")
            await ref.hibernate()


async def measure(store: Any, names: list[str], count: int) -> tuple[list[float], list[float]]:
    wakes: list[float] = []
    raws: list[float] = []
    async with sa.open_registry(agents=agents(InstantModel()), store=store) as registry:
        for _ in range(count):
            wake = raw = 0.0
            for name in names:
                start = now()
                history = await registry.ref(name).history()
                wake += now() - start
                assert len(history) == 50, len(history)
                await registry.ref(name).hibernate()
                start = now()
                stored = await store.load(name)
                state = sa.load_snapshot(stored.snapshot, session_id=name)
                raw += now() - start
                assert len(state.messages) == 50
                assert not stored.entries
            wakes.append(wake / len(names))
            raws.append(raw / len(names))
    return wakes, raws


async def run_store(kind: str, store: Any, sessions: int, count: int) -> Row:
    names = [f"wake-{i:04d}" for i in range(sessions)]
    await build(store, names, 25)
    wakes, raws = await measure(store, names, count)
    log(f"  {kind}: wake {median(wakes) * 1e6:.0f} us, load+decode {median(raws) * 1e6:.0f} us")
    return Row(
        benchmark="4 wake a 50-message session",
        name=f"wake (ref.history() of a hibernated session), {kind}",
        measured=median(wakes) * 1e6,
        unit="us",
        baseline=median(raws) * 1e6,
        baseline_name=f"{kind}.load + sa.load_snapshot",
        baseline_unit="us",
        paired_ratio=paired(wakes, raws),
        notes=f"{sessions} sessions x {count} rounds; {spread(wakes)}",
    )


async def subscribe_round(store: Any, names: tuple[str, str], times: int) -> tuple[float, float]:
    """(long, short): seconds per subscription opened and closed on each session."""
    spent = []
    async with sa.open_registry(agents=agents(InstantModel()), store=store) as registry:
        for name in names:
            start = now()
            for _ in range(times):
                async with registry.ref(name).subscribe():
                    pass
            spent.append((now() - start) / times)
        assert registry.live() == []
    return spent[0], spent[1]


async def run_subscribe(kind: str, store: Any, count: int) -> Row:
    names = ("subscribe-long", "subscribe-short")
    await build(store, [names[0]], 5000)
    await build(store, [names[1]], 25)
    longs: list[float] = []
    shorts: list[float] = []
    for _ in range(count):
        long, short = await subscribe_round(store, names, 20)
        longs.append(long)
        shorts.append(short)
    log(f"  {kind}: subscribe {median(longs) * 1e6:.0f} us, short {median(shorts) * 1e6:.0f} us")
    return Row(
        benchmark="4 wake a 50-message session",
        name=f"subscribe to a hibernated 10,000-message session (not woken), {kind}",
        measured=median(longs) * 1e6,
        unit="us",
        baseline=median(shorts) * 1e6,
        baseline_name="the same on a 50-message session",
        baseline_unit="us",
        paired_ratio=paired(longs, shorts),
        notes=f"20 subscriptions x {count} rounds; {spread(longs)}",
    )


def main(args: argparse.Namespace) -> list[Row]:
    sessions = 30 if args.quick else 100
    count = 3 if args.quick else 5
    rows = [trio.run(run_store, "MemoryStore", sa.MemoryStore(), sessions, count)]
    with temp_dir() as tmp:
        store = sa.SQLiteStore(tmp / "wake.db")
        rows.append(trio.run(run_store, "SQLiteStore", store, sessions, count))
    rows.append(trio.run(run_subscribe, "MemoryStore", sa.MemoryStore(), count))
    with temp_dir() as tmp:
        store = sa.SQLiteStore(tmp / "subscribe.db")
        rows.append(trio.run(run_subscribe, "SQLiteStore", store, count))
    with redis_url() as url:
        if url is None:
            log("  RedisStore: skipped (no SESSIONACTORS_REDIS_URL, no redis-server binary)")
        else:
            from sessionactors.stores import RedisStore

            store = RedisStore(url, prefix=f"bench-{uuid.uuid4().hex[:8]}")
            rows.append(trio.run(run_store, "RedisStore", store, sessions, count))
    return rows


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
