"""7. Durable turn cost at 10,000 messages of history vs 10 (SQLite).

The histories are built honestly, through the library: a registry with
``durability="hibernate"`` sends 5,000 turns to one session and 5 to another
(instant model), then hibernates both, which writes their snapshots. The
file is then copied afresh for every round, and a registry with the default
``durability="turn"`` wakes both sessions (not timed) and sends them turns
alternately, one each, timing every ``ref.send`` on the wall clock. A durable
turn appends its journal entries in a commit; every ``snapshot_every`` (1,000)
entries the whole state is snapshotted again, so the mean over the turns
includes those snapshots (a few per round). The median of the rounds' means
is reported.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import trio

import sessionactors as sa
from _common import InstantModel, Row, agents, log, median, now, paired, spread, temp_dir

TEXT = "Where is my order A1042? It was due yesterday."


async def build(path: Path, long_turns: int, short_turns: int) -> None:
    async with sa.open_registry(
        agents=agents(InstantModel()), store=sa.SQLiteStore(path), durability="hibernate"
    ) as registry:
        for name, turns in (("long", long_turns), ("short", short_turns)):
            ref = await registry.spawn(name)
            for _ in range(turns):
                await ref.send(TEXT)
            await ref.hibernate()


async def measure(path: Path, turns: int) -> tuple[float, float, int, int]:
    """Mean wall seconds per durable turn (long, short); the long one's messages and bytes."""
    async with sa.open_registry(
        agents=agents(InstantModel()), store=sa.SQLiteStore(path)
    ) as registry:
        long, short = registry.ref("long"), registry.ref("short")
        length = len(await long.history())
        size = len(sa.dump_snapshot(await long.state()))
        assert len(await short.history()) == 10
        for _ in range(5):  # warm up: the first commits open the file's pages
            await long.send(TEXT)
            await short.send(TEXT)
        long_time = short_time = 0.0
        for _ in range(turns):
            start = now()
            await long.send(TEXT)
            middle = now()
            await short.send(TEXT)
            short_time += now() - middle
            long_time += middle - start
    return long_time / turns, short_time / turns, length, size


def main(args: argparse.Namespace) -> list[Row]:
    turns = 300 if args.quick else 1000
    count = 3 if args.quick else 5
    size = 0
    longs: list[float] = []
    shorts: list[float] = []
    with temp_dir() as tmp:
        base = tmp / "base.db"
        start = now()
        trio.run(build, base, 5000, 5)
        log(f"  built the histories in {now() - start:.1f} s")
        for r in range(count):
            path = tmp / f"round-{r}.db"
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{base}{suffix}").exists():
                    shutil.copyfile(f"{base}{suffix}", f"{path}{suffix}")
            long, short, length, size = trio.run(measure, path, turns)
            assert length == 10_000, length
            longs.append(long)
            shorts.append(short)
            log(
                f"  round {r + 1}/{count}: 10,000 messages {long * 1e6:.0f} us, "
                f"10 messages {short * 1e6:.0f} us"
            )
    return [
        Row(
            benchmark="7 durable turn vs history length, SQLite",
            name="durable turn at 10,000 messages",
            measured=median(longs) * 1e6,
            unit="us",
            baseline=median(shorts) * 1e6,
            baseline_name="the same turn at 10 messages",
            baseline_unit="us",
            target_on="ratio",
            target_op="<=",
            target_value=1.2,
            paired_ratio=paired(longs, shorts),
            notes=f"mean of {turns} turns each, alternating, incl. the snapshots "
            f"(10,000 messages: {size / 2**20:.1f} MB); {spread(longs)}",
        )
    ]


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
