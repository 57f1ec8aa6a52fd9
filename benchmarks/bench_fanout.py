"""3. Streaming fan-out: cost per event per subscriber, and a stuck subscriber.

Cost per event per subscriber: a turn whose model streams 200 chunks back to
back, with S subscribers (S = 1, 10, 100) that each read every event of the
turn (``async for event in events``) until its ``TurnFinished``. The time
from ``ref.send`` until every subscriber has seen the ``TurnFinished``, minus
the same turn with no subscriber, divided by S and by the events of the turn
(the deltas plus the turn's few other events). The floor is the same shape in
raw trio: one task ``send_nowait``-s as many events into S buffered memory
channels, S tasks read them. CPU time; MemoryStore; every round measures
both side by side.

A stuck subscriber: the latency of ``ref.send`` (a 10-chunk turn, mean over
40 consecutive turns) with 100 subscribers of which one never reads, against
the same turns with 100 subscribers that all read. The never-reading one
stays subscribed for the whole window (its buffer of 1,000 events does not
fill). For context, the same turns with no subscriber at all.
"""

from __future__ import annotations

import argparse

import trio

import sessionactors as sa
from _common import ChunkModel, Row, agents, cpu, log, median, paired, spread

CHUNKS = 200


class _Finish:
    """Counts subscribers that saw the end of the current turn."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.events = 0
        self.all_seen = trio.Event()

    def hit(self) -> None:
        self.seen += 1
        if self.seen == self.expected:
            self.all_seen.set()

    def reset(self) -> None:
        self.seen = 0
        self.all_seen = trio.Event()


async def _reader(ref: sa.SessionRef, finish: _Finish, task_status: trio.TaskStatus[None]) -> None:
    async with ref.subscribe() as events:
        task_status.started()
        async for event in events:
            finish.events += 1
            if isinstance(event, sa.TurnFinished):
                finish.hit()


async def session_turns(subscribers: int, turns: int) -> tuple[float, float]:
    """(CPU seconds per turn until every subscriber saw it end, events per turn per reader)."""
    async with sa.open_registry(
        agents=agents(ChunkModel(CHUNKS)), store=sa.MemoryStore()
    ) as registry:
        ref = await registry.spawn("fanout")
        finish = _Finish(subscribers)
        async with trio.open_nursery() as nursery:
            for _ in range(subscribers):
                await nursery.start(_reader, ref, finish)
            for _ in range(3):  # warm up
                finish.reset()
                await ref.send("go")
                if subscribers:
                    await finish.all_seen.wait()
            finish.events = 0
            start = cpu()
            for _ in range(turns):
                finish.reset()
                await ref.send("go")
                if subscribers:
                    await finish.all_seen.wait()
            elapsed = cpu() - start
            nursery.cancel_scope.cancel()
    events = finish.events / (subscribers * turns) if subscribers else 0.0
    return elapsed / turns, events


async def raw_turns(subscribers: int, turns: int, events: int) -> float:
    """The floor: ``events`` send_nowait-s into each of S buffered channels, S readers."""
    sends = []
    finish = _Finish(subscribers)

    async def reader(receive: trio.MemoryReceiveChannel[object]) -> None:
        async for item in receive:
            if item is None:
                finish.hit()

    async with trio.open_nursery() as nursery:
        for _ in range(subscribers):
            send, receive = trio.open_memory_channel[object](1000)
            sends.append(send)
            nursery.start_soon(reader, receive)
        await trio.lowlevel.checkpoint()
        payload = [object() for _ in range(events - 1)] + [None]
        start = cpu()
        for _ in range(turns):
            finish.reset()
            for item in payload:
                for send in sends:
                    send.send_nowait(item)
            await trio.lowlevel.checkpoint()
            if subscribers:
                await finish.all_seen.wait()
        elapsed = cpu() - start
        nursery.cancel_scope.cancel()
    return elapsed / turns


async def stuck_turns(subscribers: int, stuck: int, turns: int) -> float:
    """Mean latency of ``ref.send`` over ``turns`` 10-chunk turns (CPU time)."""
    async with sa.open_registry(agents=agents(ChunkModel(10)), store=sa.MemoryStore()) as registry:
        ref = await registry.spawn("stuck")
        finish = _Finish(subscribers - stuck)
        async with trio.open_nursery() as nursery:
            for _ in range(subscribers - stuck):
                await nursery.start(_reader, ref, finish)
            for _ in range(stuck):
                await nursery.start(_never_reads, ref)
            await ref.send("warm up")
            start = cpu()
            for _ in range(turns):
                await ref.send("go")
            elapsed = cpu() - start
            assert registry.statistics().subscribers == subscribers, "a subscriber was dropped"
            nursery.cancel_scope.cancel()
    return elapsed / turns


async def _never_reads(ref: sa.SessionRef, task_status: trio.TaskStatus[None]) -> None:
    async with ref.subscribe():
        task_status.started()
        await trio.sleep_forever()


async def run(quick: bool) -> list[Row]:
    count = 3 if quick else 5
    turns_for = {1: 200, 10: 40, 100: 8} if quick else {1: 400, 10: 80, 100: 16}
    group = "3 fan-out"
    rows = []
    for subs, turns in turns_for.items():
        ours: list[float] = []
        floor: list[float] = []
        events = 0.0
        for _ in range(count):
            bare, _ = await session_turns(0, turns)
            with_subs, events = await session_turns(subs, turns)
            per = round(events)
            raw = await raw_turns(subs, turns, per)
            raw_bare = await raw_turns(0, turns, per)
            ours.append((with_subs - bare) / (subs * per))
            floor.append((raw - raw_bare) / (subs * per))
        log(
            f"  {subs} subscribers: {median(ours) * 1e6:.2f} us, floor {median(floor) * 1e6:.2f} us"
        )
        rows.append(
            Row(
                benchmark=group,
                name=f"per event per subscriber, {subs} subscriber{'s' if subs > 1 else ''}",
                measured=median(ours) * 1e6,
                unit="us",
                baseline=median(floor) * 1e6,
                baseline_name="raw trio send_nowait into buffered channels, read by tasks",
                baseline_unit="us",
                target_on="measured" if subs == 100 else "",
                target_op="<=" if subs == 100 else "",
                target_value=3.0 if subs == 100 else None,
                paired_ratio=paired(ours, floor),
                notes=f"{events:.0f} events per turn ({CHUNKS} deltas); {spread(ours)}",
            )
        )
    turns = 20 if quick else 40
    stuck: list[float] = []
    reading: list[float] = []
    none: list[float] = []
    for _ in range(count):
        stuck.append(await stuck_turns(100, 1, turns))
        reading.append(await stuck_turns(100, 0, turns))
        none.append(await stuck_turns(0, 0, turns))
    log(
        f"  stuck: {median(stuck) * 1e6:.0f} us, all reading {median(reading) * 1e6:.0f} us, "
        f"none {median(none) * 1e6:.0f} us"
    )
    rows.append(
        Row(
            benchmark=group,
            name="turn latency, 100 subscribers, 1 never reads",
            measured=median(stuck) * 1e6,
            unit="us",
            baseline=median(reading) * 1e6,
            baseline_name="the same turn, 100 subscribers all reading",
            baseline_unit="us",
            target_on="ratio",
            target_op="<=",
            target_value=1.2,
            paired_ratio=paired(stuck, reading),
            notes=f"10-chunk turns, mean of {turns}; {spread(stuck)}",
        )
    )
    rows.append(
        Row(
            benchmark=group,
            name="turn latency, 100 subscribers, 1 never reads (vs no subscriber)",
            measured=median(stuck) * 1e6,
            unit="us",
            baseline=median(none) * 1e6,
            baseline_name="the same turn with no subscriber",
            baseline_unit="us",
            paired_ratio=paired(stuck, none),
            notes="context: the readers' own work runs in the same thread",
        )
    )
    return rows


def main(args: argparse.Namespace) -> list[Row]:
    return trio.run(run, args.quick)


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
