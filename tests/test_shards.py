"""Leases by shard on RedisStore: one renewal per worker, and a lost shard stops its turns."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager

import coredis
import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import Lease, RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis


class HangingModel:
    """Streams one word, then waits until cancelled; says when it started and when it was cancelled."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = trio.Event()

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("thinking")
        self.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled.set()
            raise
        yield sa.TextChunk("never")  # pragma: no cover


class CountingStore(RedisStore):
    """Counts renewal rounds; with ``blind``, reports every lease held without asking redis
    (broken on purpose: a negative control)."""

    blind: bool = False
    rounds: int = 0
    renewed: trio.Event | None = None

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        try:
            if self.blind:
                await trio.lowlevel.checkpoint()
                return set()
            return await super().renew_many(leases, ttl)
        finally:
            self.rounds += 1
            if self.renewed is not None:
                self.renewed.set()


async def keep_many_leases(url: str, sessions: int, ttl: float, lifetimes: int) -> None:
    """``sessions`` live sessions on one worker keep their leases for ``lifetimes`` lease
    lifetimes: none is lost, and another worker can claim none of them."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store = CountingStore(url, prefix=prefix)
    names = [f"s{i}" for i in range(sessions)]
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=store, agents=agents, lease_ttl=ttl) as registry:
        limit = trio.CapacityLimiter(64)

        async def spawn(name: str) -> None:
            async with limit:
                await (await registry.spawn(name)).history()  # live from now on

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(spawn, name)
        start = store.rounds
        await trio.sleep(lifetimes * ttl)
        assert store.rounds - start >= lifetimes  # one call a round, whatever the count
        assert registry.statistics().leases_lost == 0
        assert len(registry.live()) == sessions
        other = RedisStore(url, prefix=prefix)
        try:
            for name in names[:: max(1, sessions // 200)]:
                assert await other.claim(name, "another-worker", ttl) is None
        finally:
            await other.aclose()


async def test_a_worker_keeps_the_leases_of_many_live_sessions(redis_url: str) -> None:
    """500 live sessions on one worker keep their leases for several lease lifetimes (of
    2 s: the tests run in two processes, and a 1 s lease was seen lapsing on a loaded
    machine)."""
    with trio.fail_after(120):
        await keep_many_leases(redis_url, 500, ttl=2.0, lifetimes=3)


@pytest.mark.soak
async def test_a_worker_keeps_the_leases_of_20000_live_sessions(redis_url: str) -> None:
    """20,000 live sessions on one worker keep their leases for several lifetimes at lease_ttl=3."""
    with trio.fail_after(900):
        await keep_many_leases(redis_url, 20_000, ttl=3.0, lifetimes=4)


async def lose_a_shard(
    start_server: Callable[..., AbstractContextManager[str]], *, blind: bool
) -> tuple[bool, BaseException | None]:
    """A turn waits in its model call while redis loses the shard's lease (FLUSHALL):
    (whether the model call was cancelled, the turn's error)."""
    model = HangingModel()
    with start_server() as url:
        store = CountingStore(url)
        store.blind = blind
        agents = {"hang": sa.Agent(model=model)}
        async with (
            sa.open_registry(
                store=store, agents=agents, lease_ttl=1.0, shutdown_grace=0.1
            ) as registry,
            coredis.Redis.from_url(url) as admin,
        ):
            ref = await registry.spawn("s")
            turn = await ref.submit("think")
            await model.started.wait()
            await admin.flushall()
            for _ in range(3):  # renewal rounds after the loss
                store.renewed = trio.Event()
                await store.renewed.wait()
            await trio.testing.wait_all_tasks_blocked()
            error: BaseException | None = None
            if model.cancelled.is_set():
                with pytest.raises(sa.SessionActorsError) as raised:
                    await turn.reply()
                error = raised.value
            return model.cancelled.is_set(), error


async def test_a_worker_that_loses_a_shard_stops_its_turns(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """When a worker's shard lease is lost, the next renewal stops the shard's sessions at once: the turn's model call is cancelled and its caller gets FencedOutError."""
    with trio.fail_after(30):
        cancelled, error = await lose_a_shard(private_redis_server, blind=False)
    assert cancelled
    assert isinstance(error, sa.FencedOutError)


async def test_a_renewal_that_does_not_ask_the_store_is_caught(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """The same check reports a model call still running when renewals ignore the store (negative control)."""
    with trio.fail_after(30):
        cancelled, _ = await lose_a_shard(private_redis_server, blind=True)
    assert not cancelled
