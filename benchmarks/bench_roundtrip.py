"""1. Request/reply floor: ``ref.send`` with an instant model vs a raw trio round trip.

The floor is the least a trio actor can do per request: one task puts a slot
and an Event into a bounded memory channel, another task fills the slot and
sets the Event. ``ref.send`` adds everything a session turn is (ids, events,
history, the hub, the reply record, and the journal write with
``durability="turn"``). pykka's ``ask`` to a threading actor is the peer.
The bare actor (``_bare_actor.py``) is a reference for reading the ratios: a
session actor with only the guarantees the targets were set against, timed
the same way.
No subscribers; MemoryStore; 250 sends per session (a fresh session every
250 turns keeps the history at a conversation's length).

The trio variants are single-threaded and CPU-bound: they are timed with the
process's CPU time, so other load on the machine does not count. pykka's ask
is mostly a thread hop (waiting), so it is compared on the wall clock, with
the floor's wall clock. Every round runs every variant once; the ratio is the
median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

import pykka
import trio

import sessionactors as sa
from _bare_actor import bare_actors
from _common import InstantModel, Row, agents, cpu, log, median, now, paired, run_main, spread

#: sends per session: the history stays short (500 messages at most), as in a
#: conversation; the cost of a long history is benchmark 7's subject.
PER_SESSION = 250


class _Slot:
    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: object = None


async def raw_trio(n: int) -> tuple[float, float]:
    send, receive = trio.open_memory_channel[_Slot](64)

    async def server() -> None:
        async for slot in receive:
            slot.value = "ok"
            slot.event.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        for _ in range(50):
            slot = _Slot()
            await send.send(slot)
            await slot.event.wait()
        start, start_cpu = now(), cpu()
        for _ in range(n):
            slot = _Slot()
            await send.send(slot)
            await slot.event.wait()
            assert slot.value == "ok"
        elapsed, elapsed_cpu = now() - start, cpu() - start_cpu
        await send.aclose()
    return elapsed / n, elapsed_cpu / n


async def _time_sends(
    sends: list[Callable[[str], Awaitable[Any]]], warm: Callable[[str], Awaitable[Any]]
) -> tuple[float, float]:
    """(wall, cpu) seconds per send: ``PER_SESSION`` sends to each session, after 50
    to a session of its own to warm up."""
    for _ in range(50):
        await warm("hi")
    start, start_cpu = now(), cpu()
    for send in sends:
        for _ in range(PER_SESSION):
            reply = await send("hi")
    elapsed, elapsed_cpu = now() - start, cpu() - start_cpu
    assert reply.message.content == "ok"
    count = len(sends) * PER_SESSION
    return elapsed / count, elapsed_cpu / count


async def ref_send(n: int, durability: str) -> tuple[float, float]:
    """(wall, cpu) seconds per ``ref.send``: ``PER_SESSION`` sends to each of n // PER_SESSION."""
    async with sa.open_registry(
        agents=agents(InstantModel()), store=sa.MemoryStore(), durability=durability
    ) as registry:
        refs = [await registry.spawn(f"floor-{i}") for i in range(n // PER_SESSION)]
        warm = await registry.spawn("warm-up")
        return await _time_sends([ref.send for ref in refs], warm.send)


async def bare_send(n: int, durable: bool) -> tuple[float, float]:
    """The same for the bare actor (``_bare_actor.py``)."""
    async with trio.open_nursery() as nursery:
        actors = bare_actors(nursery, n // PER_SESSION + 1, durable=durable)
        timed = await _time_sends([actor.send for actor in actors[1:]], actors[0].send)
        nursery.cancel_scope.cancel()
    return timed


class _Echo(pykka.ThreadingActor):
    def on_receive(self, message: object) -> object:
        return message


def pykka_ask(n: int) -> tuple[float, float]:
    actor = _Echo.start()
    try:
        for _ in range(50):
            actor.ask("hi")
        start, start_cpu = now(), cpu()
        for _ in range(n):
            actor.ask("hi")
        return (now() - start) / n, (cpu() - start_cpu) / n
    finally:
        actor.stop()


def main(args: argparse.Namespace) -> list[Row]:
    n = 1000 if args.quick else 4000
    count = 3 if args.quick else 7
    keys = ("raw", "hibernate", "turn", "bare", "bare-durable", "pykka")
    wall: dict[str, list[float]] = {k: [] for k in keys}
    used: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(count):
        # interleaved: each round measures every variant once
        got = {
            "raw": trio.run(raw_trio, n),
            "hibernate": trio.run(ref_send, n, "hibernate"),
            "turn": trio.run(ref_send, n, "turn"),
            "bare": trio.run(bare_send, n, False),
            "bare-durable": trio.run(bare_send, n, True),
            "pykka": pykka_ask(n),
        }
        for k, (w, c) in got.items():
            wall[k].append(w)
            used[k].append(c)
        log(
            f"  round {r + 1}/{count} (cpu, wall): "
            + ", ".join(f"{k} {c * 1e6:.1f}/{w * 1e6:.1f} us" for k, (w, c) in got.items())
        )
    group = "1 request/reply floor"
    floor = "raw trio request/reply (memory channel + Event)"

    def vs(
        key: str,
        base: str,
        name: str,
        base_name: str,
        times: dict[str, list[float]],
        target: float | None,
        note: str,
    ) -> Row:
        return Row(
            benchmark=group,
            name=name,
            measured=median(times[key]) * 1e6,
            unit="us",
            baseline=median(times[base]) * 1e6,
            baseline_name=base_name,
            baseline_unit="us",
            target_on="ratio" if target else "",
            target_op="<=" if target else "",
            target_value=target,
            paired_ratio=paired(times[key], times[base]),
            notes=f"{note}; {spread(times[key])}",
        )

    cpu_note = f"CPU time, {n} sends, {PER_SESSION} per session"
    bare_note = (
        f"{cpu_note}; the targets' guarantees and nothing more (what it leaves out: "
        "benchmarks/_bare_actor.py)"
    )
    return [
        vs(
            "hibernate",
            "raw",
            'ref.send, durability="hibernate", MemoryStore',
            floor,
            used,
            2.0,
            cpu_note,
        ),
        vs("turn", "raw", 'ref.send, durability="turn", MemoryStore', floor, used, 2.5, cpu_note),
        vs("bare", "raw", "the bare actor (reference)", floor, used, None, bare_note),
        vs(
            "bare-durable",
            "raw",
            "the bare actor, durable (reference)",
            floor,
            used,
            None,
            bare_note,
        ),
        vs(
            "hibernate",
            "bare",
            'ref.send, durability="hibernate", vs the bare actor',
            "the bare actor",
            used,
            None,
            cpu_note,
        ),
        vs(
            "turn",
            "bare-durable",
            'ref.send, durability="turn", vs the bare actor, durable',
            "the bare actor, durable",
            used,
            None,
            cpu_note,
        ),
        vs(
            "pykka",
            "raw",
            "pykka ask (ThreadingActor), the peer (wall clock)",
            floor + ", wall",
            wall,
            None,
            "wall clock: a thread hop is mostly waiting",
        ),
        vs(
            "turn",
            "pykka",
            'ref.send, durability="turn" (wall clock) vs pykka ask',
            "pykka ask",
            wall,
            None,
            "wall clock",
        ),
    ]


if __name__ == "__main__":
    run_main(main, __doc__ or "")
