"""6. Durable turns per second: 1,000 concurrent sessions on SQLite.

1,000 sessions, each sending ``T`` turns one after another, all sessions at
once (the instant model; every turn adds 2 messages). Wall clock from the
first send to the last reply, in a fresh SQLite file (in a temporary
directory) per run.

- ``durability="turn"`` (the default: each reply waits until its turn is
  committed; SQLiteStore groups the appends of many sessions in one commit),
- against ``durability="hibernate"`` on the same store (the turns are only
  written at hibernation, not measured here): what durability costs;
- against the OpenAI Agents SDK: ``agents.SQLiteSession(session_id, db_path)``
  per session, one file, and ``await session.add_items([user, assistant])``
  per turn (the same 2 messages), 1,000 sessions at once under asyncio.

Without durability, the peer is pykka: 1,000 ``ThreadingActor``s (a thread each),
asked ``T`` times, all 1,000 asks of a round in flight at once (``ask(block=False)``
and then every answer), against ``durability="hibernate"`` turns.

Two more rows bound the SDK ratio from above, for reading it: the same durable
turns on ``MemoryStore`` (no I/O and no thread: what the runtime and the codec
cost), and the turns with ``durability="hibernate"`` (no durability at all),
each against the SDK in the same rounds.

Every timed window starts with ``gc.collect()``: the collector's debt from the
setup (1,000 sessions spawned and woken, 1,000 SDK sessions opened, 1,000 actors
started) is paid before the clock starts, not by whichever window its next full
collection happens to land in (measured here: one landed in 8 of 12 windows of
durable and hibernate turns, taking 28-84 ms of a 140-370 ms window, and 130-220 ms
once the SDK's modules were in the heap, as they are from round 2 on; with the
collection first, none did). Collections the timed work itself causes still count,
and each window is long enough (``T`` = 20 turns a session, 20,000 turns) to hold
its share of them: with 5 turns a session, a window held one full collection or
none depending on how many young collections its turns made (a full collection
every 121 young ones; with the SDK's modules in the heap one takes about 130 ms,
against 350 ms for the whole window), so the short windows of the lighter variants
left their full collections out, and a change that kept two objects less alive
per turn read as 78 -> 57 us a durable turn, because it moved the window's only
full collection out of it (65.9 -> 57.5 us measured over 25 turns a session).
The notes say how long the collector ran, per turn, in each variant.

Both SQLite stores run SQLite's default ``synchronous=FULL`` in WAL mode. Five
rounds alternate the five variants, and the median of the per-round ratios is
reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from functools import partial
from pathlib import Path

import trio

import sessionactors as sa
from _common import (
    InstantModel,
    Row,
    agents,
    collector_time,
    log,
    median,
    now,
    paired,
    spread,
    temp_dir,
)

USER_TEXT = "Where is my order A1042? It was due yesterday."


async def ours(
    path: Path, sessions: int, turns: int, durability: str, *, memory: bool = False
) -> tuple[float, float]:
    """Turns per second (on ``MemoryStore`` if ``memory``, else SQLite at ``path``), and
    the collector's seconds a turn."""
    store: sa.Store = sa.MemoryStore() if memory else sa.SQLiteStore(path)
    async with sa.open_registry(
        agents=agents(InstantModel()), store=store, durability=durability
    ) as registry:
        refs: list[sa.SessionRef] = []

        async def spawn(i: int) -> None:
            ref = await registry.spawn(f"tp-{i:05d}")
            await ref.state()  # wake it: the turns are timed, not the wake (benchmark 4)
            refs.append(ref)

        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(spawn, i)

        async def talk(ref: sa.SessionRef) -> None:
            for _ in range(turns):
                await ref.send(USER_TEXT)

        gc.collect()  # the setup's garbage is not the turns' (see above)
        with collector_time() as collector:
            start = now()
            async with trio.open_nursery() as nursery:
                for ref in refs:
                    nursery.start_soon(talk, ref)
            elapsed = now() - start
    return sessions * turns / elapsed, collector.seconds / (sessions * turns)


def sdk(path: Path, sessions: int, turns: int) -> tuple[float, float]:
    """Turns per second of ``agents.SQLiteSession.add_items`` (2 items a turn), and the
    collector's seconds a turn."""
    from agents import SQLiteSession

    async def run() -> tuple[float, float]:
        stores = [SQLiteSession(f"tp-{i:05d}", path) for i in range(sessions)]
        try:

            async def talk(session: SQLiteSession) -> None:
                for _ in range(turns):
                    await session.add_items(
                        [
                            {"role": "user", "content": USER_TEXT},
                            {"role": "assistant", "content": "ok"},
                        ]
                    )

            gc.collect()
            with collector_time() as collector:
                start = now()
                await asyncio.gather(*(talk(s) for s in stores))
                elapsed = now() - start
            assert len(await stores[0].get_items()) == 2 * turns
        finally:
            for s in stores:
                s.close()
        return sessions * turns / elapsed, collector.seconds / (sessions * turns)

    return asyncio.run(run())


def pykka_turns(sessions: int, turns: int) -> tuple[float, float]:
    """Asks per second to ``sessions`` pykka ThreadingActors, all of a round at once, and
    the collector's seconds an ask."""
    import pykka

    class Echo(pykka.ThreadingActor):  # type: ignore[misc]
        def on_receive(self, message: object) -> object:
            return message

    actors = [Echo.start() for _ in range(sessions)]
    try:
        for actor in actors:  # every thread started and answering
            actor.ask("warm")
        gc.collect()
        with collector_time() as collector:
            start = now()
            for _ in range(turns):
                futures = [actor.ask(USER_TEXT, block=False) for actor in actors]
                for future in futures:
                    assert future.get() == USER_TEXT
            elapsed = now() - start
    finally:
        pykka.ActorRegistry.stop_all()
    return sessions * turns / elapsed, collector.seconds / (sessions * turns)


def main(args: argparse.Namespace) -> list[Row]:
    sessions = 1000
    turns = 4 if args.quick else 20
    count = 2 if args.quick else 5
    results: dict[str, list[float]] = {
        "turn": [],
        "hibernate": [],
        "memory": [],
        "sdk": [],
        "pykka": [],
    }
    collector: dict[str, list[float]] = {k: [] for k in results}  # seconds a turn
    with temp_dir() as tmp:
        for r in range(count):
            got = {
                "turn": trio.run(ours, tmp / f"turn-{r}.db", sessions, turns, "turn"),
                "hibernate": trio.run(ours, tmp / f"hib-{r}.db", sessions, turns, "hibernate"),
                "memory": trio.run(
                    partial(ours, memory=True), tmp / "unused", sessions, turns, "turn"
                ),
                "sdk": sdk(tmp / f"sdk-{r}.db", sessions, turns),
                "pykka": pykka_turns(sessions, turns),
            }
            for key, (rate, collected) in got.items():
                results[key].append(rate)
                collector[key].append(collected)
            log(
                f"  round {r + 1}/{count}: "
                + ", ".join(f"{k} {v[-1]:.0f} turns/s" for k, v in results.items())
            )
    per_turn = {k: [1e6 / v for v in values] for k, values in results.items()}
    group = "6 durable turns, 1,000 sessions, SQLite"
    load = f"{sessions:,} sessions x {turns} turns"

    def collected(*keys: str) -> str:
        return (
            "garbage collector "
            + ", ".join(f"{key} {median(collector[key]) * 1e6:.1f} us" for key in keys)
            + " a turn"
        )

    return [
        Row(
            benchmark=group,
            name='time per turn, durability="turn" (vs "hibernate")',
            measured=median(per_turn["turn"]),
            unit="us",
            baseline=median(per_turn["hibernate"]),
            baseline_name='durability="hibernate", same store',
            baseline_unit="us",
            target_on="ratio",
            target_op="<=",
            target_value=2.0,
            paired_ratio=paired(per_turn["turn"], per_turn["hibernate"]),
            notes=f"{load}; {median(results['turn']):.0f} vs "
            f"{median(results['hibernate']):.0f} turns/s; {spread(per_turn['turn'])}; "
            + collected("turn", "hibernate"),
        ),
        Row(
            benchmark=group,
            name='durable turns per second, durability="turn" (vs OpenAI Agents SDK)',
            measured=median(results["turn"]),
            unit="turns/s",
            baseline=median(results["sdk"]),
            baseline_name="agents.SQLiteSession.add_items, 2 items a turn",
            baseline_unit="turns/s",
            target_on="ratio",
            target_op=">=",
            target_value=8.0,
            paired_ratio=paired(results["turn"], results["sdk"]),
            notes=f"{load}; SDK {1e6 / median(results['sdk']) / 2:.0f} us per message; "
            + collected("turn", "sdk"),
        ),
        Row(
            benchmark=group,
            name='durable turns per second on MemoryStore (no I/O), durability="turn" '
            "(vs OpenAI Agents SDK)",
            measured=median(results["memory"]),
            unit="turns/s",
            baseline=median(results["sdk"]),
            baseline_name="agents.SQLiteSession.add_items, 2 items a turn",
            baseline_unit="turns/s",
            paired_ratio=paired(results["memory"], results["sdk"]),
            notes=f"{load}; context for the row above: the same turns with a store that "
            "costs nothing; " + collected("memory"),
        ),
        Row(
            benchmark=group,
            name='turns per second, durability="hibernate" (vs OpenAI Agents SDK)',
            measured=median(results["hibernate"]),
            unit="turns/s",
            baseline=median(results["sdk"]),
            baseline_name="agents.SQLiteSession.add_items, 2 items a turn",
            baseline_unit="turns/s",
            paired_ratio=paired(results["hibernate"], results["sdk"]),
            notes=f"{load}; context: the same turns with no durability at all",
        ),
        Row(
            benchmark=group,
            name="turns per second without durability, 1,000 actors (vs pykka ask)",
            measured=median(results["hibernate"]),
            unit="turns/s",
            baseline=median(results["pykka"]),
            baseline_name="pykka ThreadingActor.ask, 1,000 actors, a round's asks in flight",
            baseline_unit="turns/s",
            target_on="ratio",
            target_op=">=",
            target_value=1.5,
            paired_ratio=paired(results["hibernate"], results["pykka"]),
            notes=f"{load}; sessionactors on SQLite with durability='hibernate'; "
            + collected("hibernate", "pykka"),
        ),
    ]


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
