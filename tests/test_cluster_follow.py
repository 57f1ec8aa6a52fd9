"""A subscription follows its session from worker to worker: the same seqs, no gap, no lag."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping

import coredis
import pytest
import trio

import sessionactors as sa
from redis_workers import TTL, open_worker
from sessionactors.stores import Lease, RedisStore
from sessionactors.testing import EchoModel
from stream_checks import check_stream

pytestmark = pytest.mark.redis

AGENTS = {"echo": sa.Agent(model=EchoModel(delay=0.005))}  # turns in flight all along


class StallingStore(RedisStore):
    """With ``stalled``, renews no lease but reports every one held, as a worker frozen
    past its leases would."""

    stalled = False

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        if self.stalled:
            await trio.lowlevel.checkpoint()
            return set()
        return await super().renew_many(leases, ttl)


class Follower:
    """Reads one subscription (``after=0``) until it ends; keeps the error that ended it."""

    def __init__(self) -> None:
        self.events: list[sa.Event] = []
        self.error: BaseException | None = None
        self.ended = False
        self._changed = trio.Event()

    async def run(
        self, registry: sa.Registry, name: str, task_status: trio.TaskStatus[None]
    ) -> None:
        try:
            async with registry.ref(name).subscribe(after=0) as stream:
                task_status.started()
                async for event in stream:
                    self.events.append(event)
                    self._signal()
        except sa.SessionActorsError as exc:
            self.error = exc
        self.ended = True
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def finished(self) -> set[str]:
        return {e.turn_id for e in self.events if isinstance(e, sa.TurnFinished)}

    async def wait_for(self, turn_ids: set[str]) -> None:
        """Until every turn of ``turn_ids`` finished in the stream, or the stream ended."""
        while not self.ended and not turn_ids <= self.finished():
            await self._changed.wait()


def stream_problems(follower: Follower, acked: dict[str, str]) -> list[str]:
    """Problems: the stream ended, seqs that do not strictly rise, or an acknowledged
    turn not seen whole and once."""
    problems = [] if follower.error is None else [f"the stream ended: {follower.error!r}"]
    if follower.ended and follower.error is None:
        problems.append("the stream ended")
    return problems + check_stream(follower.events, acked)


async def test_subscriptions_follow_their_sessions_to_a_worker_that_joins(
    any_redis_url: str,
) -> None:
    """With balancing, subscribers on the owner of busy sessions see every event once and in order, the turns run on a worker that joined and took their shards included, and none lags (on one server, a Redis Cluster and through Sentinel)."""
    redis_url = any_redis_url
    prefix = f"sa-test:{uuid.uuid4().hex}"
    names = [f"follow-{i}" for i in range(8)]
    acked: dict[str, dict[str, str]] = {name: {} for name in names}
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "a", agents=AGENTS, balance=True) as a,
            trio.open_nursery() as readers,
        ):
            followers = {name: Follower() for name in names}
            for name in names:
                await a.spawn(name)
                await readers.start(followers[name].run, a, name)

            stop = trio.Event()
            stopped = {name: trio.Event() for name in names}

            async def converse(name: str) -> None:
                for i in itertools.count():
                    if stop.is_set():
                        stopped[name].set()
                        return
                    text = f"{name} turn {i}"
                    reply = await a.ref(name).send(text, idempotency_key=text)
                    assert reply.text == text
                    acked[name][reply.turn_id] = text

            def each_acked(count: int | dict[str, int]) -> bool:
                return all(
                    len(acked[n]) >= (count if isinstance(count, int) else count[n]) for n in names
                )

            async with trio.open_nursery() as senders:
                for name in names:
                    senders.start_soon(converse, name)
                while not each_acked(3):
                    await trio.sleep(0.01)
                async with open_worker(redis_url, prefix, "b", agents=AGENTS, balance=True) as b:
                    with trio.move_on_after(10 * TTL):  # b takes its share
                        while len(b.live()) < 2 or set(a.live()) & set(b.live()):
                            await trio.sleep(0.01)
                    moved = set(b.live())
                    assert moved
                    assert not moved & set(a.live())
                    after_move = {n: len(acked[n]) + 3 for n in names}
                    while not each_acked(after_move):  # on b for the sessions that moved
                        await trio.sleep(0.01)
                    stop.set()
                    for name in names:  # (a turn in flight is acknowledged too)
                        await stopped[name].wait()
                    await check_followers(followers, acked)
                    assert set(b.live()) >= moved  # (the turns after the move ran there)
            readers.cancel_scope.cancel()


async def check_followers(followers: dict[str, Follower], acked: dict[str, dict[str, str]]) -> None:
    problems = []
    for name, follower in followers.items():
        with trio.move_on_after(5 * TTL):
            await follower.wait_for(set(acked[name]))
        problems += [f"{name}: {p}" for p in stream_problems(follower, acked[name])]
    assert problems == []


@pytest.mark.soak  # (slow: run by make soak)
async def test_a_subscription_follows_a_hibernated_session_to_where_it_wakes(
    redis_url: str,
) -> None:
    """A subscriber on the worker where a session hibernated sees every event once and in order as it wakes on its own worker again, then on another; the subscription alone wakes it nowhere."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    acked: dict[str, str] = {}
    with trio.fail_after(30):
        async with (  # without balancing a session wakes on the worker asked
            open_worker(redis_url, prefix, "a", agents=AGENTS) as a,
            open_worker(redis_url, prefix, "b", agents=AGENTS) as b,
            coredis.Redis.from_url(redis_url) as admin,
            trio.open_nursery() as readers,
        ):

            async def send(registry: sa.Registry, text: str) -> None:
                reply = await registry.ref("s").send(text)
                acked[reply.turn_id] = text

            await a.spawn("s")
            await send(a, "one on a")
            follower = Follower()
            await readers.start(follower.run, a, "s")
            for asker in (a, b):
                await a.ref("s").hibernate()  # wherever it runs
                await trio.sleep(TTL)
                assert (a.live(), b.live()) == ([], [])  # the subscription woke it nowhere
                await send(asker, f"wakes it on {asker.worker_id}")
                await send(a, f"reaches it on {asker.worker_id}")
                await send(b, f"reaches it on {asker.worker_id} from b")
                assert (a.live(), b.live()) == (["s"], []) if asker is a else ([], ["s"])
                await follower.wait_for(set(acked))
                if asker is a:  # back on its own worker: it reads the session's hub there
                    await trio.sleep(4 * TTL)  # (the watch mark expires)
                    published = await stream_length(admin, prefix)
                    await send(a, "on a without redis")
                    await follower.wait_for(set(acked))
                    assert await stream_length(admin, prefix) == published
            assert stream_problems(follower, acked) == []
            readers.cancel_scope.cancel()


async def stream_length(admin: coredis.Redis[bytes], prefix: str) -> int:
    """How many events went to the sessions' event streams under ``prefix``."""
    keys = [key async for key in admin.scan_iter(match=f"{prefix}:*:ev", count=1000)]
    return sum([await admin.xlen(key) for key in keys])


async def test_a_subscription_read_late_follows_its_session_with_every_delta(
    redis_url: str,
) -> None:
    """A subscriber that reads only after its session hibernated and ran a turn on another worker still sees every event of that turn once and in order, deltas included."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    acked: dict[str, str] = {}
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", agents=AGENTS) as a,
            open_worker(redis_url, prefix, "b", agents=AGENTS) as b,
        ):
            await a.spawn("s")
            reply = await a.ref("s").send("one on a")
            acked[reply.turn_id] = reply.text
            follower = Follower()
            async with a.ref("s").subscribe(after=0) as stream:
                await a.ref("s").hibernate()
                for text in ("two on b", "three on b"):  # it wakes on b
                    reply = await b.ref("s").send(text)
                    acked[reply.turn_id] = text
                assert (a.live(), b.live()) == ([], ["s"])
                async for event in stream:  # read from here on
                    follower.events.append(event)
                    if isinstance(event, sa.TurnFinished) and event.turn_id == reply.turn_id:
                        break
            assert stream_problems(follower, acked) == []


async def test_subscriptions_follow_their_sessions_when_their_worker_loses_the_shard(
    redis_url: str,
) -> None:
    """Subscribers on a worker that lost its sessions' shard see every event once and in order as the sessions run on the worker that took them over (before or after the loss was noticed), and none lags."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    names = ["s1", "s2"]
    acked: dict[str, dict[str, str]] = {name: {} for name in names}
    store = StallingStore(redis_url, prefix=prefix, balance=False)
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=store, agents=AGENTS, lease_ttl=TTL, worker_id="a") as a,
            open_worker(redis_url, prefix, "b", agents=AGENTS) as b,
            trio.open_nursery() as readers,
        ):

            async def send(registry: sa.Registry, name: str, text: str) -> None:
                reply = await registry.ref(name).send(text)
                acked[name][reply.turn_id] = text

            followers = {name: Follower() for name in names}
            for name in names:
                await a.spawn(name)
                await send(a, name, "one on a")
                await readers.start(followers[name].run, a, name)
            store.stalled = True
            await trio.sleep(2 * TTL)  # a's leases expire
            await send(b, "s1", "two on b")  # b takes s1 over before a notices
            assert b.live() == ["s1"]
            store.stalled = False
            while a.live():  # a notices and stops both
                await trio.sleep(0.05)
            await send(b, "s2", "two on b")  # b wakes s2 after a noticed
            for name in names:
                await send(a, name, "three via a")
            await check_followers(followers, acked)
            assert a.statistics().leases_lost == 2
            readers.cancel_scope.cancel()


async def test_a_subscriber_that_fell_behind_lags_even_if_its_session_left(
    redis_url: str,
) -> None:
    """A subscriber on the owner that fell behind by more than its buffer ends as lagged after its last buffered event, also when its session left the worker since: only a loss ends a stream as lagged."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", agents=AGENTS, subscriber_buffer=4) as a,
            open_worker(redis_url, prefix, "b", agents=AGENTS) as b,
        ):
            await a.spawn("s")
            seen: list[sa.Event] = []
            async with a.ref("s").subscribe() as stream:
                await a.ref("s").send("more words than the buffer holds")  # never read
                await a.ref("s").hibernate()
                await b.ref("s").send("it wakes on b")
                error: BaseException | None = None
                try:
                    async for event in stream:
                        seen.append(event)
                except sa.SubscriberLaggedError as exc:
                    error = exc
            assert len(seen) == 4
            assert isinstance(error, sa.SubscriberLaggedError)
            assert error.last_seq == seen[-1].seq
