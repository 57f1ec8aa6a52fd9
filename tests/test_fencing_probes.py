"""Probes of fencing after a lease is lost: a worker that learns that another worker
took a session over (or that its lease lapsed) writes nothing more that the store
would accept over the new owner's writes, deletes nothing under a live owner, and
leaves no subscription waiting (two registries share one SQLite file, as two
processes would; one test runs on Redis)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import coredis
import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import JournalEntry, Lease, RedisStore
from sessionactors.testing import EchoModel, FaultyStore

AGENTS = {"echo": sa.Agent(model=EchoModel())}
TTL = 0.3  # worker A's leases: they lapse quickly while its renewals are stalled


class StallingWorker(sa.SQLiteStore):
    """Worker A's store: with ``stalled``, its renewals never reach the file but report
    the lease held (a worker frozen past its leases); it records the fence of every
    write it makes once ``recording``."""

    stalled = False
    recording = False

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fences: list[tuple[str, int | None]] = []

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        if self.stalled:
            await trio.lowlevel.checkpoint()
            return True
        return await super().renew(session_id, lease, ttl)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        if self.recording:
            self.fences.append(("append", fence))
        await super().append(session_id, entries, info, fence=fence)

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
        if self.recording:
            self.fences.append(("write_snapshot", fence))
        await super().write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )


@contextlib.asynccontextmanager
async def worker(store: Any, worker_id: str, **options: Any) -> AsyncIterator[sa.Registry]:
    async with sa.open_registry(
        store=store, agents=AGENTS, leases=True, worker_id=worker_id, **options
    ) as registry:
        yield registry


async def wait_until_lost(a: sa.Registry, store: StallingWorker) -> None:
    """Let A's renewals through again: its next one finds the lease gone."""
    store.stalled = False
    while a.statistics().leases_lost == 0:
        await trio.sleep(0.01)


async def take_over_afresh(b: sa.Registry) -> None:
    """Worker B deletes the session A ran (its lease lapsed), spawns the name afresh,
    has one turn acknowledged, and hibernates it."""
    await b.delete("s")
    ref = await b.spawn("s")
    assert (await ref.send("fresh from b")).text == "fresh from b"
    await ref.hibernate()


async def test_an_idle_session_whose_lease_is_lost_writes_nothing_over_its_new_owner(
    tmp_path: Path,
) -> None:
    """A worker that finds the lease of its idle session lost stops the session without a write the store accepts: the session that the new owner deleted, spawned afresh and answered a turn in keeps that turn, and the old conversation does not come back."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    with trio.fail_after(30):
        async with worker(store_a, "a", lease_ttl=TTL) as a:
            ref = await a.spawn("s")
            await ref.send("one from a")
            await ref.send("two from a")  # (its seq goes past what B's session reaches)
            store_a.stalled = True
            await trio.sleep(2 * TTL)  # A's lease lapses; A has not noticed
            async with worker(sa.SQLiteStore(path), "b") as b:
                await take_over_afresh(b)
                store_a.recording = True
                await wait_until_lost(a, store_a)
                while a.live():
                    await trio.sleep(0.01)
                history = [m.content for m in await b.ref("s").history()]
    assert history == ["fresh from b", "fresh from b"]
    assert [fence for _, fence in store_a.fences if fence is None] == []


async def test_a_stop_whose_lease_is_lost_while_it_writes_snapshots_nothing_over_the_new_owner(
    tmp_path: Path,
) -> None:
    """A stop whose journal write is answered only after its worker learnt that the lease was lost writes no compaction snapshot the store accepts: the new owner's session, deleted, spawned afresh and answered meanwhile, keeps its turn."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    faulty = FaultyStore(store_a)
    errors: list[BaseException] = []

    async def stop(ref: sa.SessionRef) -> None:
        try:
            await ref.stop()
        except sa.SessionActorsError as exc:
            errors.append(exc)

    with trio.fail_after(30):
        async with worker(faulty, "a", lease_ttl=TTL) as a:
            ref = await a.spawn("s")
            await ref.send("one from a")
            await ref.send("two from a")
            gate = faulty.hold("append", session_id="s", after=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop, ref)
                while not gate.waiting:  # the stop is stored; its answer is late
                    await trio.sleep(0.01)
                store_a.stalled = True
                await trio.sleep(2 * TTL)
                async with worker(sa.SQLiteStore(path), "b") as b:
                    await take_over_afresh(b)
                    store_a.recording = True
                    await wait_until_lost(a, store_a)
                    gate.open()
                    while a.live():
                        await trio.sleep(0.01)
                    history = [m.content for m in await b.ref("s").history()]
                    status = (await b.ref("s").state()).status
    assert history == ["fresh from b", "fresh from b"]
    assert status is not sa.Status.STOPPED
    assert [fence for _, fence in store_a.fences if fence is None] == []
    assert [type(e) for e in errors] == [sa.FencedOutError]


async def test_a_closing_snapshot_retried_after_the_lease_is_lost_is_fenced(
    tmp_path: Path,
) -> None:
    """A registry (durability="hibernate") that closes while the store refuses its hibernation snapshot, and that learns while it retries that the session's lease was lost, makes no write without the lease's fence: the new owner's session, deleted, spawned afresh and answered meanwhile, keeps its turn, and the loss counts once."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    faulty = FaultyStore(store_a)
    closing = trio.Event()

    async def lose_then_heal(a: sa.Registry) -> None:
        await closing.wait()
        await wait_until_lost(a, store_a)  # while A retries its closing snapshot
        faulty.fail("write_snapshot", session_id="s", times=0)

    with trio.fail_after(30):
        async with worker(sa.SQLiteStore(path), "b") as b, trio.open_nursery() as nursery:
            async with worker(faulty, "a", lease_ttl=TTL, durability="hibernate") as a:
                nursery.start_soon(lose_then_heal, a)
                ref = await a.spawn("s")
                await ref.send("one from a")
                await ref.send("two from a")
                faulty.fail("write_snapshot", session_id="s", times=None)
                store_a.stalled = True
                await trio.sleep(2 * TTL)
                await take_over_afresh(b)
                store_a.recording = True
                closing.set()  # leaving the block: the closing snapshot is refused
            history = [m.content for m in await b.ref("s").history()]
    assert history == ["fresh from b", "fresh from b"]
    assert [fence for _, fence in store_a.fences if fence is None] == []
    assert a.statistics().leases_lost == 1  # the refused retry is not a second loss


async def test_an_idle_session_whose_lease_is_lost_stops_without_a_write(tmp_path: Path) -> None:
    """An idle session whose worker learns that its lease was lost stops there without trying a write (no hibernation snapshot for the store to refuse), and counts as one lease lost, not as a hibernation."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    with trio.fail_after(30):
        async with worker(store_a, "a", lease_ttl=TTL) as a:
            await (await a.spawn("s")).send("one from a")
            store_a.stalled = True
            await trio.sleep(2 * TTL)
            async with worker(sa.SQLiteStore(path), "b") as b:
                assert (await b.ref("s").send("two from b")).text == "two from b"
                hibernated = a.statistics().hibernated
                store_a.recording = True
                await wait_until_lost(a, store_a)
                while a.live():
                    await trio.sleep(0.01)
                assert store_a.fences == []
                assert a.statistics().leases_lost == 1
                assert a.statistics().hibernated == hibernated
                history = [m.content for m in await b.ref("s").history()]
    assert history[::2] == ["one from a", "two from b"]


async def test_deleting_an_idle_live_session_writes_no_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """registry.delete() of a live, idle session stops its actor without a hibernation snapshot: with a store whose snapshots hang, the delete still ends at once, and nothing counts it as hibernated."""
    store = FaultyStore()
    with trio.fail_after(5):
        async with sa.open_registry(store=store, agents=AGENTS) as registry:
            await (await registry.spawn("s")).send("hello")
            gate = store.hold("write_snapshot", session_id="s")
            await registry.delete("s")
            assert gate.held == 0
            assert registry.statistics().hibernated == 0
            assert await registry.sessions() == []
            gate.open()


class StallingRedis(RedisStore):
    """Worker A's RedisStore: with ``stalled``, it renews no lease but reports every one
    held; it records the fence of every snapshot it writes."""

    stalled = False

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix=prefix, balance=False)
        self.fences: list[int | None] = []

    async def renew_many(self, leases: Any, ttl: float) -> set[str]:
        if self.stalled:
            await trio.lowlevel.checkpoint()
            return set()
        lost: set[str] = await super().renew_many(leases, ttl)
        return lost

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
        self.fences.append(fence)
        await super().write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )


@pytest.mark.redis
async def test_on_redis_an_idle_session_whose_lease_is_lost_writes_nothing_over_its_new_owner(
    redis_url: str,
) -> None:
    """On RedisStore as on SQLite, a worker that finds the lease of its idle session lost writes nothing over the new owner, which deleted the session, spawned it afresh and had a turn answered."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store_a = StallingRedis(redis_url, prefix)
    ttl = 1.0
    with trio.fail_after(30):
        async with worker(store_a, "a", lease_ttl=ttl) as a:
            ref = await a.spawn("s")
            await ref.send("one from a")
            await ref.send("two from a")
            store_a.stalled = True
            await trio.sleep(2 * ttl)  # A's lease lapses; A has not noticed
            store_b = RedisStore(redis_url, prefix=prefix, balance=False)
            async with worker(store_b, "b", lease_ttl=ttl) as b:
                await take_over_afresh(b)
                store_a.fences.clear()
                store_a.stalled = False
                while a.statistics().leases_lost == 0 or a.live():
                    await trio.sleep(0.01)
                history = [m.content for m in await b.ref("s").history()]
    assert history == ["fresh from b", "fresh from b"]
    assert None not in store_a.fences


async def test_a_delete_from_another_process_refuses_a_session_live_there(tmp_path: Path) -> None:
    """registry.delete() of a session that another process runs (it holds the session's lease on the shared SQLite file) raises LeaseHeldError naming the session, as the CLI's delete does, and changes nothing: the owner's next turn is answered; once the owner hibernates it, the delete goes through (and one of a name never stored leaves no lease behind)."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        async with (
            worker(sa.SQLiteStore(path, shared=True), "a") as a,
            worker(sa.SQLiteStore(path, shared=True), "b") as b,
        ):
            ref = await a.spawn("s")
            await ref.send("one")
            with pytest.raises(sa.LeaseHeldError, match="'s'"):
                await b.delete("s")
            assert (await ref.send("two")).text == "two"
            await ref.hibernate()
            await b.delete("s")
            assert await a.sessions() == []
            with pytest.raises(sa.SessionNotFoundError):
                await ref.send("three")
            with pytest.raises(sa.SessionNotFoundError):  # (its lease goes too)
                await b.delete("never")
            assert (await (await a.spawn("never")).send("here")).text == "here"


@pytest.mark.parametrize("noticed_by", ["renewal", "write"])
async def test_a_subscription_on_the_worker_that_lost_the_lease_ends_with_fenced_out_error(
    tmp_path: Path, noticed_by: str
) -> None:
    """Without a router (a shared SQLite file), a subscription on the worker that finds its session's lease lost, by a renewal or by a refused write, ends with FencedOutError instead of waiting forever for events that the new owner publishes elsewhere (a turn the refused write was for ends with no outcome)."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    seen: list[type[sa.Event]] = []
    with trio.fail_after(30):
        async with worker(store_a, "a", lease_ttl=TTL) as a:
            ref = await a.spawn("s")
            await ref.send("one from a")
            async with ref.subscribe() as events:
                store_a.stalled = True
                await trio.sleep(2 * TTL)
                async with worker(sa.SQLiteStore(path), "b") as b:
                    await b.ref("s").send("two from b")
                    if noticed_by == "renewal":
                        await wait_until_lost(a, store_a)
                    else:
                        with pytest.raises(sa.FencedOutError):
                            await ref.send("three from a")
                        store_a.stalled = False
                    with pytest.raises(sa.FencedOutError):  # noqa: PT012
                        async for event in events:
                            seen.append(type(event))
    # (the refused turn streamed before its write; it has no outcome)
    assert sa.TurnFinished not in seen
    if noticed_by == "renewal":
        assert seen == []


async def test_a_session_whose_lease_lapsed_unrenewed_is_live_in_one_process_only(
    tmp_path: Path,
) -> None:
    """A worker whose renewals fail (its store does not answer it) for longer than the lease's ttl stops the session, whose lease has lapsed in the store: once another worker has taken it over, the session is live there only, and the first worker does not answer reads from its stale copy."""
    path = tmp_path / "shared.db"
    faulty = FaultyStore(sa.SQLiteStore(path))
    with trio.fail_after(30):
        async with worker(faulty, "a", lease_ttl=TTL) as a:
            ref = await a.spawn("s")
            await ref.send("one from a")
            faulty.fail("renew", times=None)  # A cannot reach the store to renew
            await trio.sleep(3 * TTL)
            async with worker(sa.SQLiteStore(path), "b") as b:
                assert (await b.ref("s").send("two from b")).text == "two from b"
                assert b.live() == ["s"]
                assert a.live() == []
                with pytest.raises(sa.SessionBusyError):  # live in b, not here
                    await ref.history()
            faulty.fail("renew", times=0)
    assert faulty.injected > 0


@pytest.mark.redis
@pytest.mark.soak  # (slow; the store's own test checks the words: make soak runs this)
async def test_a_session_whose_lease_redis_lost_says_what_may_explain_it_at_warning(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session whose lease key redis lost (a server restarted without its append-only
    file) fails its next turn with a FencedOutError that says what can explain a lease
    that is gone (released, taken over and released, or the store lost or rolled back
    data), claims no lost data (the store cannot tell these apart), and says to send
    the request again; the registry logs it at WARNING, not ERROR."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store = RedisStore(redis_url, prefix=prefix, balance=False)
    with trio.fail_after(30):
        async with worker(store, "a", lease_ttl=30) as a:
            ref = await a.spawn("s")
            await ref.send("one")
            async with coredis.Redis.from_url(redis_url, decode_responses=True) as client:
                [key] = [k async for k in client.scan_iter(match=f"{prefix}:*:lease")]
                await client.delete([key])
            with pytest.raises(sa.FencedOutError) as caught:
                await ref.send("two")
        async with coredis.Redis.from_url(redis_url) as client:
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(keys)
    said = str(caught.value)
    assert not caught.value.lost_data
    assert "released, expired, taken over and released" in said
    assert "or the store lost or rolled back data" in said
    assert "send the request again" in said
    logged = [r for r in caplog.records if r.name == "sessionactors" and "'s'" in r.getMessage()]
    assert [r.levelname for r in logged if "no lease" in r.getMessage()] == ["WARNING"], caplog.text
    assert not [r for r in logged if r.levelname == "ERROR"], caplog.text
