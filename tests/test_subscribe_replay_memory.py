"""A replay from the store is read in pages as the reader takes it: what a subscription
holds is bounded in bytes, however long the session's journal is."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import coredis
import pytest
import trio
import trio.testing

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.stores import RedisStore, load_events
from sessionactors.testing import ScriptedModel

TURNS = 40
#: Each turn's user message; the journal holds TURNS of them (10 MB).
TEXT = "x" * 250_000
#: What a subscription that has delivered one event may hold: a few pages of the journal.
BOUND = 4_000_000


@asynccontextmanager
async def open_registries(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[sa.Store, sa.Registry, sa.Registry]]:
    """The store, the registry the session runs on and the one a subscriber reads it
    through (another worker's, for "workers")."""
    agents = {"a": sa.Agent(model=ScriptedModel(["ok"] * TURNS))}
    if kind in ("memory", "sqlite"):
        store: sa.Store = (
            sa.MemoryStore() if kind == "memory" else sa.SQLiteStore(tmp_path / "s.db")
        )
        async with sa.open_registry(store=store, agents=agents) as registry:
            yield store, registry, registry
        return
    url: str = request.getfixturevalue("redis_url")
    prefix = f"sa-test:{uuid.uuid4().hex}"
    try:
        async with AsyncExitStack() as stack:
            store = RedisStore(url, prefix=prefix)
            stack.push_async_callback(store.aclose)
            if kind == "redis":
                registry = await stack.enter_async_context(
                    sa.open_registry(store=store, agents=agents)
                )
                yield store, registry, registry
                return
            owner, reader = [
                await stack.enter_async_context(
                    sa.open_registry(
                        store=RedisStore(url, prefix=prefix), agents=agents, worker_id=worker
                    )
                )
                for worker in ("a", "b")
            ]
            yield store, owner, reader
    finally:
        with trio.fail_after(30):
            async with coredis.Redis.from_url(url) as client:
                keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
                if keys:
                    await client.unlink(keys)


async def held_since(base: int) -> int:
    """The bytes allocated since ``base`` and still held, once the store's threads let go
    of what they read: a thread that ran a store call (the session's stored state, read
    to learn its status) holds its result until the thread returns from the call, which
    a loaded machine may not schedule before the subscription's first event. What a
    subscription holds stays while its reader takes nothing: the measure waits (at most
    a second) for it to fall below the bound, and fails with what it last saw."""
    held = tracemalloc.get_traced_memory()[0] - base
    for _ in range(100):
        if held < BOUND:
            break
        await trio.sleep(0.01)
        held = tracemalloc.get_traced_memory()[0] - base
    return held


@pytest.mark.parametrize(
    "kind",
    [
        "memory",
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("workers", marks=pytest.mark.redis),
    ],
)
@pytest.mark.parametrize("hibernate", [True, False], ids=["hibernated", "live"])
async def test_a_replay_from_the_store_holds_a_bounded_number_of_bytes(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str, hibernate: bool
) -> None:
    """A subscription replaying a 10 MB journal with after=0 holds no more than a few
    pages of it at a time, and still delivers every journaled event in seq order (from
    each store, and through another worker than the session's)."""
    async with open_registries(kind, tmp_path, request) as (store, owner, reader):
        ref = await owner.spawn("long")
        with trio.fail_after(120):
            for _ in range(TURNS):
                await ref.send(TEXT)
            if hibernate:
                await ref.hibernate()
                if kind in ("redis", "workers"):
                    # a subscription there wakes a session that runs nowhere (to learn
                    # where its events stand): woken first, it holds its state before
                    # the measure, and its new hub none of the events journaled
                    await ref.state()
        _, entries = await store.read_journal("long", 0)
        journaled = [e.seq for entry in entries for e in load_events(entry.data)]
        del entries
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            with trio.fail_after(120):
                async with reader.ref("long").subscribe(after=0) as events:
                    first = await anext(events)
                    held = await held_since(base)
                    got = [first.seq]
                    async for event in events:
                        if event.seq > journaled[-1]:
                            break  # pragma: no cover (a live session publishes nothing more)
                        got.append(event.seq)
                        if event.seq == journaled[-1]:
                            break
        finally:
            tracemalloc.stop()
    assert held < BOUND, f"a subscription held {held} bytes after its first event"
    assert set(journaled) <= set(got)
    assert got == sorted(got)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_an_asyncio_replay_holds_a_bounded_number_of_bytes(tmp_path: Path, kind: str) -> None:
    """Through sessionactors.aio, a subscription replaying a 10 MB journal whose reader
    takes one event and then nothing for a while holds no more than a few pages of it
    (the events passed to asyncio ahead of the reader are bounded in bytes), and still
    delivers every journaled event in seq order."""

    async def main() -> tuple[int, list[int], list[int]]:
        store: sa.Store = (
            sa.MemoryStore() if kind == "memory" else sa.SQLiteStore(tmp_path / "s.db")
        )
        agents = {"a": sa.Agent(model=ScriptedModel(["ok"] * TURNS))}
        async with asyncio.timeout(60), aio.open_registry(store=store, agents=agents) as reg:
            ref = await reg.spawn("long")
            for _ in range(TURNS):
                await ref.send(TEXT)
            last = (await ref.state()).event_seq
            await ref.hibernate()
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                async with ref.subscribe(after=0) as events:
                    got = [(await anext(events)).seq]
                    for _ in range(200):  # (not an assertion: the reader takes nothing)
                        await asyncio.sleep(0)
                    await asyncio.sleep(0.5)
                    held = tracemalloc.get_traced_memory()[0] - base
                    async for event in events:
                        got.append(event.seq)
                        if event.seq >= last:
                            break
            finally:
                tracemalloc.stop()
            return held, got, last

    held, got, last = asyncio.run(main())
    assert held < BOUND, f"an asyncio subscription held {held} bytes after its first event"
    assert got == sorted(got)
    assert got[-1] == last


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_subscription_to_a_hibernated_session_does_not_decode_its_history(
    tmp_path: Path, kind: str
) -> None:
    """Opening a subscription to a hibernated session reads where its events stand and
    its status from the store without decoding its history: what it allocates at its
    peak is below twice the stored snapshot's bytes (its messages decoded would be many
    times that), for a 20,000-message session as for a short one."""
    store: sa.Store = sa.MemoryStore() if kind == "memory" else sa.SQLiteStore(tmp_path / "s.db")
    agents = {"a": sa.Agent(model=ScriptedModel(["ok"] * 4))}
    async with sa.open_registry(store=store, agents=agents) as registry:
        for name, count in (("short", 2), ("long", 20_000)):
            ref = await registry.spawn(name)
            await ref.add_messages(
                [sa.Message.create(sa.Role.USER, f"message {i} of many") for i in range(count)]
            )
            await ref.send("and one more")
            await ref.hibernate()
        for name in ("short", "long"):
            stored = await store.load(name)
            assert stored is not None
            assert not stored.entries
            size = len(stored.snapshot)
            del stored
            gc.collect()
            tracemalloc.start()
            try:
                with trio.fail_after(60):
                    async with registry.ref(name).subscribe() as events:
                        peak = tracemalloc.get_traced_memory()[1]
                        tracemalloc.stop()
                        assert name not in registry.live()  # (not woken)
                        await registry.ref(name).send("and again")  # followed once it wakes
                        async for event in events:
                            if isinstance(event, sa.TurnFinished):
                                assert event.message.content == "ok"
                                break
            finally:
                tracemalloc.stop()
            assert peak < 2 * size + 200_000, (name, peak, size)
