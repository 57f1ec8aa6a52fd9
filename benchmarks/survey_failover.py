"""The failover survey: what a Sentinel failover does to a stream of turns.

A master, one or two replicas and a Sentinel start on 127.0.0.1 (durable servers, as
the tests start them); one session takes a turn every 0.1 s through
``redis+sentinel://`` with ``RedisStore(replicas=N)``; 3 s in, ``SENTINEL FAILOVER``;
the turns go on for 20 s. For each configuration the survey prints the turns
acknowledged, those acknowledged but missing from the new master afterwards, the
sends refused (typed errors) and when the last was refused.

Usage::

    .venv/bin/python benchmarks/survey_failover.py [--rounds 1]

Needs redis-server and redis-sentinel's binary (``redis-server --sentinel``) on the
path. Prints a line a configuration; writes nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

AGENTS = {"echo": sa.Agent(model=EchoModel())}
#: (replicas the servers have, replicas every write waits for)
CONFIGURATIONS = [(1, 0), (1, 1), (2, 1), (2, 2)]


def _servers() -> ModuleType:
    path = Path(__file__).parent.parent / "tests" / "redis_server.py"
    spec = importlib.util.spec_from_file_location("redis_server", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


async def failover(
    servers: ModuleType, url: str, waited: int
) -> tuple[int, int, int, float | None]:
    """(acknowledged, acknowledged and lost, refused, seconds after the failover of the
    last refusal)."""
    service, port = urlsplit(url).path.strip("/"), urlsplit(url).port
    acked: list[str] = []
    refused: list[float] = []
    store = RedisStore(url, replicas=waited, timeout=1.0)
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        ref = await registry.spawn("s")
        for i in range(30):  # 3 s of turns: the replicas in step
            await ref.send(f"before {i}")
            acked.append(f"before {i}")
            await trio.sleep(0.1)
        while b"NOGOODSLAVE" in servers._command(port, "SENTINEL", "FAILOVER", service):
            await trio.sleep(0.2)  # (until the Sentinel has looked at the replicas)
        start = trio.current_time()
        for i in itertools.count():
            if trio.current_time() - start > 20:
                break
            try:
                await ref.send(f"after {i}")
                acked.append(f"after {i}")
            except sa.SessionActorsError:
                refused.append(trio.current_time() - start)
            await trio.sleep(0.1)
    async with sa.open_registry(store=RedisStore(url), agents=AGENTS) as registry:
        try:
            stored = {m.content for m in await registry.ref("s").history()}
        except sa.SessionActorsError:
            stored = set()
    lost = sum(1 for text in acked if text not in stored)
    return len(acked), lost, len(refused), refused[-1] if refused else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    servers = _servers()
    for _ in range(args.rounds):
        for replicas, waited in CONFIGURATIONS:
            with servers.private_redis_sentinel(replicas=replicas) as url:
                acked, lost, refused, last = trio.run(failover, servers, url, waited)
            until = f"{last:.1f} s" if last is not None else "-"
            print(
                f"master + {replicas} replica(s), replicas={waited}: {acked} turns acknowledged, "
                f"{lost} of them lost; {refused} sends refused, the last {until} after the "
                "failover",
                flush=True,
            )


if __name__ == "__main__":
    main()
