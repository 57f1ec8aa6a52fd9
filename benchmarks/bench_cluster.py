"""9. Many workers on one RedisStore: a send across workers, and turns per second.

Needs a redis-server (``SESSIONACTORS_REDIS_URL``, or a ``redis-server`` binary
started on a free port on 127.0.0.1 and stopped afterwards); skipped otherwise.
The workers are separate processes (``python -m sessionactors._demo_cluster
worker``), each a registry on the same RedisStore, echo model, default
durability (every reply waits for its turn's journal append in Redis).

- send latency: this process is a worker too. ``await ref.send(text)`` one after
  another to a session it runs itself, against one that another worker process
  runs (the request goes to the owner's inbox and the reply comes back through
  this worker's inbox). Mean per send over ``K`` sends, median of the rounds
  (the two alternate within each round).
- throughput: ``S`` sessions, ``T`` turns each, all sessions at once, run by one
  worker process, against the same load split over three worker processes
  (each sends to the sessions it owns, as a load balancer with session affinity
  does), and against three workers where every request enters through a worker
  that does not own its session (a load balancer without affinity). Wall clock
  from the first command to the last answer, median of the rounds. These place
  the sessions themselves (``RedisStore(balance=False)``). A fourth load runs on
  three workers that share the shards fairly (``balance=True``, the default): the
  sessions, created hibernated, are woken through any worker, which places each
  on its shard's preferred worker; then each worker sends to the sessions it runs.

- a durable turn with no subscriber elsewhere: ``await ref.send(text)`` of a
  300-word turn (the echo model streams 300 deltas) to a session this worker runs,
  on a registry over ``RedisStore`` (the multi-worker layer running, no worker
  subscribed elsewhere), against the same on a registry over the same store
  without the multi-worker layer (the journal write alone: the same appends and
  leases, no router). Mean per send over ``K`` sends, median of the rounds.
- lease renewal: ``N`` sessions claimed by one worker on ``RedisStore`` (their
  shards' leases), then one renewal round (``renew_many``: one pipeline of shard
  renewals), against the budget of a round at ``lease_ttl=3`` (a third of it).
  Median of the rounds.

The machine has few cores: three workers and redis-server share them, so the
ratio says how much a second and third process add here, not what more
machines would.
"""

from __future__ import annotations

import argparse
import uuid

import trio

import sessionactors as sa
from _common import Row, log, median, now, paired, redis_url, spread
from sessionactors._demo_cluster import WorkerProcess
from sessionactors.stores import Lease, RedisStore, Store
from sessionactors.testing import EchoModel

TTL = 10.0
BALANCE_TTL = 3.0  # the balanced workers list each other within a third of it
RENEW_TTL = 3.0
TEXT = "Where is my order A1042?"


async def latency(url: str, sends: int, rounds: int) -> tuple[list[float], list[float]]:
    """Per round: mean seconds per send to a local session and to a remote one."""
    prefix = f"bench-cluster-{uuid.uuid4().hex[:8]}"
    local_times: list[float] = []
    remote_times: list[float] = []
    store = RedisStore(url, prefix=prefix, balance=False)  # "local" stays local
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with trio.open_nursery() as nursery:
        worker = await WorkerProcess.start(
            nursery, url, prefix, "remote-worker", TTL, balance=False
        )
        try:
            async with sa.open_registry(store=store, agents=agents, lease_ttl=TTL) as registry:
                local = await registry.spawn("local")
                assert "error" not in await worker.call("spawn", names=["remote"])
                remote = registry.ref("remote")
                for ref in (local, remote):  # warm up: connections, scripts, owner hints
                    for _ in range(50):
                        assert (await ref.send(TEXT)).text == TEXT
                assert registry.live() == ["local"]
                for r in range(rounds):
                    order = [(local, local_times), (remote, remote_times)]
                    for ref, times in order if r % 2 == 0 else order[::-1]:
                        start = now()
                        for _ in range(sends):
                            await ref.send(TEXT)
                        times.append((now() - start) / sends)
                    log(
                        f"  round {r + 1}/{rounds}: local {local_times[-1] * 1e6:.0f} us, "
                        f"remote {remote_times[-1] * 1e6:.0f} us"
                    )
        finally:
            await worker.quit()
            nursery.cancel_scope.cancel()
    return local_times, remote_times


LONG_TEXT = " ".join(f"w{i}" for i in range(300))


class JournalOnly:
    """A RedisStore without its multi-worker router: every Store call, no open_router."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        if name == "open_router":
            raise AttributeError(name)
        return getattr(self._store, name)


async def turn_cost(url: str, sends: int, rounds: int) -> tuple[list[float], list[float]]:
    """Per round: mean seconds per 300-delta durable turn with the multi-worker layer
    (no remote subscriber) and without it (the journal write alone)."""
    agents = {"echo": sa.Agent(model=EchoModel())}
    routed_times: list[float] = []
    alone_times: list[float] = []
    routed_store = RedisStore(url, prefix=f"bench-cluster-{uuid.uuid4().hex[:8]}")
    alone_store: Store = JournalOnly(  # type: ignore[assignment]
        RedisStore(url, prefix=f"bench-cluster-{uuid.uuid4().hex[:8]}")
    )
    async with (
        sa.open_registry(store=routed_store, agents=agents, lease_ttl=TTL) as routed,
        sa.open_registry(store=alone_store, agents=agents, lease_ttl=TTL) as alone,
    ):
        refs = [await routed.spawn("turns"), await alone.spawn("turns")]
        for ref in refs:  # warm up
            for _ in range(20):
                assert (await ref.send(LONG_TEXT)).text == LONG_TEXT
        for r in range(rounds):
            order = list(zip(refs, (routed_times, alone_times), strict=True))
            for ref, times in order if r % 2 == 0 else order[::-1]:
                start = now()
                for _ in range(sends):
                    await ref.send(LONG_TEXT)
                times.append((now() - start) / sends)
            log(
                f"  round {r + 1}/{rounds}: routed {routed_times[-1] * 1e6:.0f} us, "
                f"journal alone {alone_times[-1] * 1e6:.0f} us"
            )
    return routed_times, alone_times


async def converse(procs: list[WorkerProcess], shares: list[list[str]], turns: int) -> float:
    """Every worker sends ``turns`` turns to each session of its share, all at once; the
    seconds that took."""
    begin = now()
    async with trio.open_nursery() as talking:
        for proc, share in zip(procs, shares, strict=True):

            async def talk(proc: WorkerProcess = proc, share: list[str] = share) -> None:
                answer = await proc.call("converse", names=share, turns=turns)
                assert "error" not in answer, answer

            talking.start_soon(talk)
    return now() - begin


async def throughput(url: str, workers: int, sessions: int, turns: int, across: bool) -> float:
    """Turns per second of ``workers`` processes running ``sessions`` x ``turns``."""
    prefix = f"bench-cluster-{uuid.uuid4().hex[:8]}"
    names = [f"tp-{i:05d}" for i in range(sessions)]
    async with trio.open_nursery() as nursery:
        procs: list[WorkerProcess] = []
        try:

            async def start(i: int) -> None:
                procs.append(
                    await WorkerProcess.start(nursery, url, prefix, f"w{i}", TTL, balance=False)
                )

            async with trio.open_nursery() as starting:
                for i in range(workers):
                    starting.start_soon(start, i)
            shares = [names[i::workers] for i in range(workers)]
            for proc, share in zip(procs, shares, strict=True):  # each owns its share
                assert "error" not in await proc.call("spawn", names=share)
            if across:  # every worker talks to sessions another one owns
                shares = shares[1:] + shares[:1]
            elapsed = await converse(procs, shares, turns)
        finally:
            for proc in procs:
                await proc.quit()
            nursery.cancel_scope.cancel()
    return sessions * turns / elapsed


async def balanced_throughput(
    url: str, workers: int, sessions: int, turns: int
) -> tuple[float, list[int]]:
    """Turns per second of ``workers`` balanced processes, each sending to the sessions
    placed on it; and how many each ran."""
    prefix = f"bench-cluster-{uuid.uuid4().hex[:8]}"
    names = [f"tp-{i:05d}" for i in range(sessions)]
    agents = {"echo": sa.Agent(model=EchoModel())}
    store = RedisStore(url, prefix=prefix, balance=False)
    async with sa.open_registry(store=store, agents=agents, lease_ttl=BALANCE_TTL) as creating:
        for name in names:
            await creating.spawn(name)  # hibernated as the registry closes
    async with trio.open_nursery() as nursery:
        procs: list[WorkerProcess] = []
        try:

            async def start(i: int) -> None:
                procs.append(await WorkerProcess.start(nursery, url, prefix, f"w{i}", BALANCE_TTL))

            async with trio.open_nursery() as starting:
                for i in range(workers):
                    starting.start_soon(start, i)
            await trio.sleep(BALANCE_TTL)  # each has listed the others (every third of it)
            for i, proc in enumerate(procs):  # woken through any worker: placed by shard
                assert "error" not in await proc.call("spawn", names=names[i::workers])
            owned = [list((await proc.call("live"))["live"]) for proc in procs]
            assert sorted(n for share in owned for n in share) == names, "not placed once each"
            elapsed = await converse(procs, owned, turns)
        finally:
            for proc in procs:
                await proc.quit()
            nursery.cancel_scope.cancel()
    return sessions * turns / elapsed, [len(share) for share in owned]


async def renewal(url: str, sessions: int, rounds: int) -> list[float]:
    """Seconds per renewal round of one worker holding ``sessions`` leases."""
    store = RedisStore(url, prefix=f"bench-cluster-{uuid.uuid4().hex[:8]}")
    leases: dict[str, Lease] = {}
    limit = trio.CapacityLimiter(64)

    async def claim(name: str) -> None:
        async with limit:
            lease = await store.claim(name, "w0", RENEW_TTL)
            assert lease is not None
            leases[name] = lease

    try:
        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(claim, f"lease-{i:06d}")
        times = []
        for _ in range(rounds):
            start = now()
            assert not await store.renew_many(leases, RENEW_TTL)
            times.append(now() - start)
        return times
    finally:
        await store.aclose()


def main(args: argparse.Namespace) -> list[Row]:
    sends = 100 if args.quick else 300
    rounds = 3 if args.quick else 5
    sessions = 150 if args.quick else 600
    turns = 3 if args.quick else 5
    tp_rounds = 2 if args.quick else 3
    with redis_url() as url:
        if url is None:
            log("  skipped: no SESSIONACTORS_REDIS_URL and no redis-server binary")
            return []
        local, remote = trio.run(latency, url, sends, rounds)
        routed, alone = trio.run(turn_cost, url, sends // 3, rounds)
        leased = 5_000 if args.quick else 20_000
        renewals = trio.run(renewal, url, leased, rounds)
        results: dict[str, list[float]] = {"one": [], "three": [], "across": [], "balanced": []}
        shares: list[int] = []
        for r in range(tp_rounds):
            results["one"].append(trio.run(throughput, url, 1, sessions, turns, False))
            results["three"].append(trio.run(throughput, url, 3, sessions, turns, False))
            results["across"].append(trio.run(throughput, url, 3, sessions, turns, True))
            rate, shares = trio.run(balanced_throughput, url, 3, sessions, turns)
            results["balanced"].append(rate)
            log(
                f"  round {r + 1}/{tp_rounds}: "
                + ", ".join(f"{k} {v[-1]:.0f} turns/s" for k, v in results.items())
            )
    group = "9 many workers on one RedisStore"
    load = f"{sessions} sessions x {turns} turns, all at once"
    return [
        Row(
            benchmark=group,
            name="ref.send to a session another worker runs (vs one this worker runs)",
            measured=median(remote) * 1e6,
            unit="us",
            baseline=median(local) * 1e6,
            baseline_name="ref.send to a session live in this worker",
            baseline_unit="us",
            paired_ratio=paired(remote, local),
            target_on="ratio",
            target_op="<=",
            target_value=1.5,
            notes=f"{sends} sequential sends x {rounds} rounds, echo model; {spread(remote)}",
        ),
        Row(
            benchmark=group,
            name="a durable 300-delta turn, no subscriber elsewhere (vs the journal write alone)",
            measured=median(routed) * 1e6,
            unit="us",
            baseline=median(alone) * 1e6,
            baseline_name="the same turn on RedisStore without the multi-worker layer",
            baseline_unit="us",
            paired_ratio=paired(routed, alone),
            target_on="ratio",
            target_op="<=",
            target_value=1.3,
            notes=f"{sends // 3} sequential sends x {rounds} rounds, echo model; {spread(routed)}",
        ),
        Row(
            benchmark=group,
            name=f"one lease renewal round of a worker with {leased} sessions (vs lease_ttl/3)",
            measured=median(renewals) * 1e3,
            unit="ms",
            baseline=RENEW_TTL / 3 * 1e3,
            baseline_name="the time between renewals at lease_ttl=3",
            baseline_unit="ms",
            paired_ratio=median(renewals) / (RENEW_TTL / 3),
            notes=f"RedisStore.renew_many, one pipeline of shard renewals; {spread(renewals)}",
        ),
        Row(
            benchmark=group,
            name="durable turns per second, 3 worker processes (vs 1)",
            measured=median(results["three"]),
            unit="turns/s",
            baseline=median(results["one"]),
            baseline_name="1 worker process, same load",
            baseline_unit="turns/s",
            paired_ratio=paired(results["three"], results["one"]),
            notes=f"{load}; each worker sends to the sessions it owns; {spread(results['three'])}",
        ),
        Row(
            benchmark=group,
            name="durable turns per second, 3 workers, every request via a non-owner (vs 1)",
            measured=median(results["across"]),
            unit="turns/s",
            baseline=median(results["one"]),
            baseline_name="1 worker process, same load",
            baseline_unit="turns/s",
            paired_ratio=paired(results["across"], results["one"]),
            notes=f"{load}; every turn forwarded to its owner; {spread(results['across'])}",
        ),
        Row(
            benchmark=group,
            name="durable turns per second, 3 workers sharing the shards fairly (vs 1)",
            measured=median(results["balanced"]),
            unit="turns/s",
            baseline=median(results["one"]),
            baseline_name="1 worker process, same load",
            baseline_unit="turns/s",
            paired_ratio=paired(results["balanced"], results["one"]),
            notes=f"{load}; sessions placed by their shards' preferred workers (balance=True), "
            f"each worker sends to those it runs; sessions per worker {shares}; "
            f"{spread(results['balanced'])}",
        ),
    ]


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__.splitlines()[0])
