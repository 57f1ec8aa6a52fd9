"""8. Memory the registry holds for 100,000 hibernated sessions.

In a fresh interpreter per measurement: open a registry, let one session live a
turn and hibernate (a warm-up: what the first use of the library allocates once,
such as the codec's generated code and msgpack's buffer, is not held *for* the
100,000), settle, read RSS (the empty registry); spawn 100,000 sessions (RSS
while all are live); hibernate every one with ``ref.hibernate()``; settle
(``gc.collect()`` + ``malloc_trim``) and read RSS again. The delta against the
empty registry is what stays behind. The notes also give the delta counted from
before the warm-up. The plain-trio baseline gets the same warm-up (one task).

Two stores: a discard store (keeps nothing: the delta is the registry's own
memory, the number with the target) and MemoryStore (keeps every snapshot in
the same process, so its delta is the registry plus the stored sessions).
``sys.getallocatedblocks()`` is reported too: it counts live Python
allocations, which is not blurred by free memory that the allocator keeps.

The baseline is the same life for plain trio tasks (100,000 tasks, each
blocked on its memory channel, then all ended): what RSS keeps after a burst
of that size even when nothing is retained (trio's task sets and the
allocator's free pages). Its harness lets go of its own table of channels, so
that the baseline counts trio, not the harness.

What stays after the registry's wave, as measured (``tests/test_registry_memory.py``
checks the registry's part): the registry itself keeps no allocation made during
the wave (its tables shrink in place, and the nurseries of its sessions end
with the wave). What remains is trio's and CPython's: trio's ``Runner.tasks`` set
stays at its peak size (4 MiB after 100,000 tasks; ``tasks_set`` below), and
pymalloc keeps each 1 MiB arena that still holds one live object, such as the
locals of trio's run loop and the current task's counters, allocated into the
wave's last freed memory.
"""

from __future__ import annotations

import argparse
import array
import sys
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
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
    settled_rss,
)
from sessionactors.stores import JournalEntry, Lease, StoredSession

SCRIPT = HERE / "bench_hibernated.py"


class DiscardStore:
    """A store that keeps nothing once used (writes vanish; a spawned session's first
    snapshot is kept until its first wake reads it): the registry alone."""

    def __init__(self) -> None:
        self._created: dict[str, bytes] = {}

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._created[session_id] = snapshot

    async def load(self, session_id: str) -> StoredSession | None:
        await trio.lowlevel.checkpoint()
        snapshot = self._created.pop(session_id, None)
        return None if snapshot is None else StoredSession(snapshot=snapshot, snapshot_seq=0)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await trio.lowlevel.checkpoint()

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        await trio.lowlevel.checkpoint()

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await trio.lowlevel.checkpoint()
        return 0, []

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return []

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return False

    async def delete(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return False

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await trio.lowlevel.checkpoint()
        return Lease(owner=owner, fence=1)

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def _tasks_set() -> int:
    """The size of trio's set of all tasks, which keeps its peak size (0 if unknown)."""
    runner = getattr(trio._core._run.GLOBAL_RUN_CONTEXT, "runner", None)
    tasks = getattr(runner, "tasks", None)
    return sys.getsizeof(tasks) if tasks is not None else 0


async def _raw_wave(
    nursery: trio.Nursery,
    n: int,
    idle: Callable[[trio.MemoryReceiveChannel[object]], Awaitable[None]],
    rss: array.array[int],
) -> None:
    """Start ``n`` tasks blocked on their channels, read RSS, end them all."""
    mailboxes: dict[str, trio.MemorySendChannel[object]] = {}
    for i in range(n):
        send, receive = trio.open_memory_channel[object](64)
        mailboxes[f"s{i:06d}"] = send
        nursery.start_soon(idle, receive)
    del send, receive  # the harness keeps no channel
    await trio.testing.wait_all_tasks_blocked()
    rss[0] = settled_rss()
    for i in range(n):
        await mailboxes.pop(f"s{i:06d}").aclose()
    mailboxes.clear()  # the harness's own table, at its peak size: not trio's
    await trio.testing.wait_all_tasks_blocked()


async def _measure_raw(n: int) -> None:
    """The baseline: the same life for plain trio tasks (start, idle, end, forget)."""

    async def idle(receive: trio.MemoryReceiveChannel[object]) -> None:
        async for _ in receive:
            pass

    async with trio.open_nursery() as nursery:
        await trio.testing.wait_all_tasks_blocked()
        cold = settled_rss()
        # warm-up, as on the registry's side: one task lives and ends first
        send, receive = trio.open_memory_channel[object](64)
        nursery.start_soon(idle, receive)
        await send.aclose()
        await trio.testing.wait_all_tasks_blocked()
        rss = array.array("q", [0])  # made before the wave, as in _measure
        empty, empty_blocks = settled_rss(), sys.getallocatedblocks()
        await _raw_wave(nursery, n, idle, rss)
        held, held_blocks = settled_rss(), sys.getallocatedblocks()
        live = rss[0]
        child_exit(
            {
                "empty": empty,
                "live": live - empty,
                "held": held - empty,
                "held_cold": held - cold,
                "blocks": held_blocks - empty_blocks,
                "hibernate_cpu": 0.0,
                "tasks_set": _tasks_set(),
                "n": n,
            }
        )


async def _wave(
    registry: sa.Registry, n: int, rss: array.array[int], times: array.array[float]
) -> None:
    """Spawn and wake ``n`` sessions, read RSS, hibernate them all (timed)."""
    for i in range(n):
        await (await registry.spawn(f"s{i:06d}")).state()  # live: its actor started
    await trio.testing.wait_all_tasks_blocked()
    rss[0] = settled_rss()
    times[0] = cpu()
    for i in range(n):
        await registry.ref(f"s{i:06d}").hibernate()
    await trio.testing.wait_all_tasks_blocked()
    times[1] = cpu()


async def _measure(n: int, store_kind: str) -> None:
    if store_kind == "raw":
        await _measure_raw(n)
    traced = store_kind == "discard-traced"
    store: Any = DiscardStore() if store_kind.startswith("discard") else sa.MemoryStore()
    async with sa.open_registry(agents=agents(InstantModel()), store=store) as registry:
        await trio.testing.wait_all_tasks_blocked()
        cold = settled_rss()
        # Warm-up: one session lives a turn and hibernates before the empty reading, so
        # that first-use costs (the codec's generated code, msgpack's buffer, caches)
        # are not counted as held for the 100,000.
        warm = await registry.spawn("warm-up")
        await warm.send("hello")
        await warm.hibernate()
        await trio.testing.wait_all_tasks_blocked()
        if traced:  # live allocations, not RSS (RSS also counts what the allocator keeps)
            tracemalloc.start()
        # Readings go into arrays made before the wave: an object the harness made
        # during it (a loop's last int, a reading) would keep a whole allocator
        # arena resident and be counted as the registry's.
        times = array.array("d", [0.0, 0.0])
        rss = array.array("q", [0, 0])
        empty, empty_blocks = settled_rss(), sys.getallocatedblocks()
        empty_traced = tracemalloc.get_traced_memory()[0] if traced else 0
        await _wave(registry, n, rss, times)
        held, held_blocks = settled_rss(), sys.getallocatedblocks()
        held_traced = tracemalloc.get_traced_memory()[0] - empty_traced if traced else 0
        live, hibernate_cpu = rss[0], times[1] - times[0]
        stats = registry.statistics()
        assert stats.live == 0, stats
        child_exit(
            {
                "empty": empty,
                "live": live - empty,
                "held": held - empty,
                "held_cold": held - cold,
                "blocks": held_blocks - empty_blocks,
                "hibernate_cpu": hibernate_cpu,
                "traced": held_traced,
                "tasks_set": _tasks_set(),
                "n": n,
            }
        )


def main(args: argparse.Namespace) -> list[Row]:
    if args.child:
        trio.run(_measure, args.n, args.child)
    n = 20_000 if args.quick else 100_000
    results: dict[str, dict[str, Any]] = {}
    for kind in ("raw", "discard", "memory", "discard-traced"):
        got = results[kind] = child(SCRIPT, kind, n=n)
        log(
            f"  {kind}: live {got['live'] / 2**20:.1f} MB, held after hibernating "
            f"{got['held'] / 2**20:.2f} MB, {got['blocks']} more blocks, "
            f"hibernate {got['hibernate_cpu'] / n * 1e6:.1f} us each (cpu); "
            f"trio's task set {got['tasks_set'] / 2**20:.1f} MB; "
            f"{got['held_cold'] / 2**20:.2f} MB from before the warm-up"
        )
    group = f"8 registry memory, {n:,} hibernated"
    rows = []
    for kind, label, target, base, base_name in (
        (
            "discard",
            "a discard store: the registry alone",
            10.0,
            "raw",
            "plain trio: RSS left after as many idle tasks ended",
        ),
        (
            "memory",
            "MemoryStore: registry + stored snapshots",
            None,
            "discard",
            "the registry alone (discard store)",
        ),
    ):
        got = results[kind]
        rows.append(
            Row(
                benchmark=group,
                name=f"RSS held after hibernating all ({label})",
                measured=got["held"] / 2**20,
                unit="MB",
                baseline=results[base]["held"] / 2**20,
                baseline_name=base_name,
                baseline_unit="MB",
                target_on="measured" if target else "",
                target_op="<=" if target else "",
                target_value=target,
                notes=(
                    f"{n:,} sessions; {got['held_cold'] / 2**20:.1f} MB (baseline "
                    f"{results[base]['held_cold'] / 2**20:.1f} MB) counting from before "
                    "the warm-up; "
                    f"{got['live'] / 2**20:.0f} MB while live; "
                    f"{got['blocks'] / n:+.3f} live allocations per session; "
                    f"hibernate {got['hibernate_cpu'] / n * 1e6:.0f} us each (cpu); "
                    f"{got['tasks_set'] / 2**20:.1f} MB of it is trio's task set at its "
                    "peak size"
                    + (
                        "; most of the rest, allocator arenas kept by a few objects of "
                        "trio's run loop (see the module docstring)"
                        if kind == "discard"
                        else ""
                    )
                ),
            )
        )
    traced = results["discard-traced"]["traced"] / 2**20
    rows.append(
        Row(
            benchmark=group,
            name="live allocations the registry holds after hibernating all (tracemalloc)",
            measured=traced,
            unit="MB",
            baseline=results["discard"]["held"] / 2**20,
            baseline_name="RSS held in the same run (allocator pages included)",
            baseline_unit="MB",
            target_on="measured",
            target_op="<=",
            target_value=10.0,
            notes=(
                f"{n:,} sessions; Python objects still allocated, as tracemalloc counts "
                f"them; {results['discard-traced']['tasks_set'] / 2**20:.1f} MB of it is "
                "trio's set of all tasks, which keeps its peak size"
            ),
        )
    )
    return rows


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
