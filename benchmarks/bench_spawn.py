"""2. Spawning 100,000 idle sessions on a MemoryStore: RSS per session and time per spawn.

Each variant runs in a fresh interpreter. The baseline is the least an idle
trio actor can be: a task blocked on its own bounded memory channel (the
mailbox), started with ``nursery.start_soon``. RSS is read from
``/proc/self/statm`` after ``gc.collect()`` (and ``malloc_trim``), before and
after the spawns. The time per spawn is this process's CPU time (the wall
clock is in the notes) from the first spawn until every new task is blocked.
Every round runs each variant once; the median of the rounds is reported.

The ``gc`` variants tune the collector for the burst: ``gc.freeze()`` moves
everything alive before the spawns out of the collector's sight, and
``gc.set_threshold(50_000, 20, 100)`` makes young collections rarer.
The MemoryStore keeps each session's snapshot and info in the same process,
so the sessionactors numbers include them.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import trio
import trio.testing

import sessionactors as sa
from _common import (
    HERE,
    InstantModel,
    Row,
    agents,
    child,
    child_exit,
    cpu,
    log,
    median,
    now,
    settled_rss,
)

SCRIPT = HERE / "bench_spawn.py"
GC_THRESHOLD = (50_000, 20, 100)


async def _spawn_raw(n: int, tune: bool) -> None:
    mailboxes: dict[str, trio.MemorySendChannel[object]] = {}

    async def idle(receive: trio.MemoryReceiveChannel[object]) -> None:
        async for _ in receive:
            pass

    async with trio.open_nursery() as nursery:
        await trio.testing.wait_all_tasks_blocked()
        before = settled_rss()
        if tune:
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
        start, start_cpu = now(), cpu()
        for i in range(n):
            send, receive = trio.open_memory_channel[object](64)
            mailboxes[f"s{i:06d}"] = send
            nursery.start_soon(idle, receive)
        await trio.testing.wait_all_tasks_blocked()
        elapsed, elapsed_cpu = now() - start, cpu() - start_cpu
        after = settled_rss()
        child_exit({"wall": elapsed, "cpu": elapsed_cpu, "rss": after - before, "n": n})


async def _spawn_sa(n: int, tune: bool, woken: bool = False) -> None:
    async with sa.open_registry(agents=agents(InstantModel()), store=sa.MemoryStore()) as registry:
        await trio.testing.wait_all_tasks_blocked()
        before = settled_rss()
        if tune:
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
        start, start_cpu = now(), cpu()
        for i in range(n):
            await registry.spawn(f"s{i:06d}")
        await trio.testing.wait_all_tasks_blocked()
        elapsed, elapsed_cpu = now() - start, cpu() - start_cpu
        assert registry.statistics().spawned == n
        if woken:  # each woken by one read: a live actor idle on its mailbox
            for i in range(n):
                await registry.ref(f"s{i:06d}").state()
            await trio.testing.wait_all_tasks_blocked()
            assert registry.statistics().live == n
        after = settled_rss()
        # leave at once: shutting down would hibernate every session
        child_exit({"wall": elapsed, "cpu": elapsed_cpu, "rss": after - before, "n": n})


def run_child(variant: str, n: int) -> None:
    kind, _, tune = variant.partition("+")
    if kind == "raw":
        trio.run(_spawn_raw, n, tune == "gc")  # reports with child_exit from inside the run
    else:
        trio.run(_spawn_sa, n, tune == "gc", kind == "woken")


def main(args: argparse.Namespace) -> list[Row]:
    if args.child:
        run_child(args.child, args.n)
    n = 20_000 if args.quick else 100_000
    variants = ["raw", "sa", "sa+gc", "raw+gc", "woken"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    count = 1 if args.quick else 2
    for r in range(count):
        for v in variants:
            runs[v].append(child(SCRIPT, v, n=n))
            got = runs[v][-1]
            log(
                f"  round {r + 1}/{count} {v}: {got['cpu'] / n * 1e6:.1f} us/spawn (cpu), "
                f"{got['rss'] / n / 1024:.2f} KB/session"
            )

    def per(v: str, key: str) -> float:
        """The median over the rounds, per session."""
        return median([run[key] for run in runs[v]]) / n

    group = f"2 spawn {n:,} idle sessions"
    size = f"{n:,} sessions, {count} rounds; CPU time"
    rows = []
    for v, label in (("sa", "no gc tuning"), ("sa+gc", "gc.freeze + set_threshold")):
        raw = "raw" if v == "sa" else "raw+gc"
        rows.append(
            Row(
                benchmark=group,
                name=f"RSS per idle session, MemoryStore ({label})",
                measured=per(v, "rss") / 1024,
                unit="KB",
                baseline=per(raw, "rss") / 1024,
                baseline_name="trio task blocked on its memory channel",
                baseline_unit="KB",
                target_on="ratio",
                target_op="<=",
                target_value=1.0,
                notes=f"{size}; a spawned session is stored, and its actor starts with its "
                "first request",
            )
        )
        rows.append(
            Row(
                benchmark=group,
                name=f"time per spawn, MemoryStore ({label})",
                measured=per(v, "cpu") * 1e6,
                unit="us",
                baseline=per(raw, "cpu") * 1e6,
                baseline_name="nursery.start_soon + memory channel",
                baseline_unit="us",
                target_on="ratio",
                target_op="<=",
                target_value=1.2,
                notes=f"{size}; wall clock {per(v, 'wall') * 1e6:.0f} us "
                f"(baseline {per(raw, 'wall') * 1e6:.0f} us)",
            )
        )
    rows.append(
        Row(
            benchmark=group,
            name="RSS per session woken by one read and idle (live actor), MemoryStore",
            measured=per("woken", "rss") / 1024,
            unit="KB",
            baseline=per("raw", "rss") / 1024,
            baseline_name="trio task blocked on its memory channel",
            baseline_unit="KB",
            notes=f"{size}; the state loaded, a task blocked on its mailbox",
        )
    )
    return rows


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
