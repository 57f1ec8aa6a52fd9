"""The hand-over survey: how long a worker that joins takes to get its share of busy shards.

Worker ``a`` runs ``--sessions`` live sessions (they never idle out, so their shards
stay with it; with ``--turn``, each runs turns of that many seconds all along, sent
on ``a``) on one RedisStore; worker ``b`` joins. With balancing, ``a`` hands
over the shards that now prefer ``b``, a few at a time; the survey reports when
``a`` let go of its first and its last one (the number of sessions live on ``a``
stayed the same for three balancing rounds after that), and how many it handed over.

Usage::

    .venv/bin/python benchmarks/survey_handover.py [--sessions 512] [--ttl 30] [--turn 0]

Needs a redis-server (``SESSIONACTORS_REDIS_URL``, or a ``redis-server`` binary on
the path). Prints one line of figures; writes nothing.
"""

from __future__ import annotations

import argparse
import uuid
from contextlib import AbstractAsyncContextManager

import trio

import sessionactors as sa
from _common import redis_url
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel


async def spread(url: str, sessions: int, ttl: float, turn: float) -> tuple[int, float, float, int]:
    """(sessions live on a before b joined, seconds until a handed over its first and its
    last, handed over); with ``turn``, every session runs turns of that many seconds
    all along, sent on a."""
    prefix = f"sa-survey:{uuid.uuid4().hex}"
    agents = {"echo": sa.Agent(model=EchoModel(delay=turn / 2))}  # two words a turn

    def open_worker(worker_id: str) -> AbstractAsyncContextManager[sa.Registry]:
        store = RedisStore(url, prefix=prefix)
        return sa.open_registry(store=store, agents=agents, lease_ttl=ttl, worker_id=worker_id)

    async def converse(registry: sa.Registry, name: str) -> None:
        while True:
            await registry.ref(name).send("busy turn")

    async with open_worker("a") as a, trio.open_nursery() as conversations:
        limit = trio.CapacityLimiter(32)

        async def wake(name: str) -> None:
            async with limit:
                await (await a.spawn(name)).send("hello")

        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(wake, f"pace-{i}")
        if turn:
            for i in range(sessions):
                conversations.start_soon(converse, a, f"pace-{i}")
        before = len(a.live())
        async with open_worker("b"):
            joined = trio.current_time()
            first_change = last_change = joined
            count = before
            while trio.current_time() - last_change < 3 * ttl / 3 + 1:
                await trio.sleep(0.05)
                if len(a.live()) != count:
                    if count == before:
                        first_change = trio.current_time()
                    count, last_change = len(a.live()), trio.current_time()
            result = before, first_change - joined, last_change - joined, before - count
        conversations.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=512)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--turn", type=float, default=0.0, help="seconds a turn takes")
    args = parser.parse_args()
    with redis_url() as url:
        if url is None:
            raise SystemExit("no redis-server: set SESSIONACTORS_REDIS_URL or install one")
        before, first, last, moved = trio.run(spread, url, args.sessions, args.ttl, args.turn)
    busy = f", turns of {args.turn:g}s all along" if args.turn else ""
    print(
        f"lease_ttl={args.ttl:g}s{busy}: {moved} of {before} live sessions handed over, the first "
        f"{first:.1f}s and the last {last:.1f}s after the worker joined"
    )


if __name__ == "__main__":
    main()
