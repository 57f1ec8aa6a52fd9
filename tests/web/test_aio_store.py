"""A store written on an asyncio client, wrapped by sessionactors.aio.asyncio_store: its calls
run as asyncio tasks of the registry's loop, it passes check_store from asyncio, a trio
cancellation reaches its awaits, and a plain trio registry refuses it with advice."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import pytest
import trio

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.stores import (
    MAX_SEQ,
    JournalEntry,
    JournalPageStore,
    Lease,
    LeaseBatchStore,
    PagedStore,
    Store,
    StoredSession,
)
from sessionactors.testing import EchoModel, check_store


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` under asyncio.run, bounded in time."""

    async def bounded() -> Any:
        async with asyncio.timeout(30):
            return await main()

    return asyncio.run(bounded())


class AsyncioDictStore:
    """Sessions in dicts behind asyncio awaits, as a store on asyncpg or redis.asyncio is.

    ``hold(name)`` stops the next calls of method ``name`` in an asyncio await until
    ``let_go()``; ``entered`` is set once one waits there, and ``cancelled`` counts the
    calls that asyncio cancelled while they waited.
    """

    def __init__(self, *, fencing: bool = True) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.fencing = fencing
        self.calls: list[str] = []  # the methods called, each from an asyncio task
        self.held: str | None = None
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.cancelled = 0
        self.finished: list[str] = []  # held calls that ran to their end

    def hold(self, name: str) -> None:
        self.held, self.entered, self.gate = name, asyncio.Event(), asyncio.Event()

    def let_go(self) -> None:
        self.held = None
        self.gate.set()

    async def _io(self, name: str) -> None:
        assert asyncio.current_task() is not None, f"{name} ran outside an asyncio task"
        self.calls.append(name)
        await asyncio.sleep(0)
        if self.held == name:
            self.entered.set()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            self.finished.append(name)

    def _get(self, session_id: str) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        if session is None:
            raise sa.SessionNotFoundError(f"{session_id!r} is not stored", session_id=session_id)
        return session

    def _check_fence(self, session_id: str, fence: int | None) -> None:
        lease = self.leases.get(session_id)
        if fence is not None and self.fencing:
            if lease is None or (lease["fence"], lease["owner"] is None) != (fence, False):
                raise sa.FencedOutError(f"{session_id!r}: stale token", session_id=session_id)
            if lease["until"] < time.time():
                raise sa.FencedOutError(f"{session_id!r}: lease expired", session_id=session_id)

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._io("create")
        if session_id in self.sessions:
            raise sa.SessionExistsError(f"{session_id!r} is stored", session_id=session_id)
        self.sessions[session_id] = {
            "snapshot": bytes(snapshot),
            "snapshot_seq": 0,
            "journal": [],
            "last_seq": 0,
            "trimmed_upto": 0,
            "info": bytes(info),
        }

    async def load(self, session_id: str) -> StoredSession | None:
        await self._io("load")
        s = self.sessions.get(session_id)
        if s is None:
            return None
        tail = tuple(e for e in s["journal"] if e.seq > s["snapshot_seq"])
        return StoredSession(snapshot=s["snapshot"], snapshot_seq=s["snapshot_seq"], entries=tail)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._io("append")
        s = self._get(session_id)
        self._check_fence(session_id, fence)
        last = s["last_seq"]
        for entry in entries:
            if not last < entry.seq <= MAX_SEQ:
                raise sa.StoreError(f"{session_id!r}: bad seq", session_id=session_id)
            last = entry.seq
        s["journal"].extend(JournalEntry(e.seq, bytes(e.data)) for e in entries)
        s.update(last_seq=last, info=bytes(info))

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
        await self._io("write_snapshot")
        s = self._get(session_id)
        self._check_fence(session_id, fence)
        if trim_upto > seq or seq < s["snapshot_seq"] or seq > MAX_SEQ:
            raise sa.StoreError(f"{session_id!r}: bad snapshot seq", session_id=session_id)
        s.update(snapshot=bytes(snapshot), snapshot_seq=seq, info=bytes(info))
        s["last_seq"] = max(s["last_seq"], seq)
        if trim_upto > s["trimmed_upto"]:
            s["trimmed_upto"] = trim_upto
            s["journal"] = [e for e in s["journal"] if e.seq > trim_upto]

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await self._io("read_journal")
        s = self._get(session_id)
        return s["trimmed_upto"], [e for e in s["journal"] if e.seq > after]

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await self._io("list_sessions")
        return [(name, s["info"]) for name, s in self.sessions.items()]

    async def exists(self, session_id: str) -> bool:
        await self._io("exists")
        return session_id in self.sessions

    async def delete(self, session_id: str) -> bool:
        await self._io("delete")
        lease = self.leases.get(session_id)
        if lease is not None:
            lease.update(owner=None, until=0.0)
        return self.sessions.pop(session_id, None) is not None

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await self._io("claim")
        now = time.time()
        lease = self.leases.setdefault(session_id, {"owner": None, "fence": 0, "until": 0.0})
        if lease["owner"] not in (None, owner) and lease["until"] >= now:
            return None
        lease.update(owner=owner, fence=lease["fence"] + 1, until=now + ttl)
        return Lease(owner=owner, fence=lease["fence"])

    def _holds(self, session_id: str, lease: Lease) -> dict[str, Any] | None:
        held = self.leases.get(session_id)
        if held is None or (held["owner"], held["fence"]) != (lease.owner, lease.fence):
            return None
        return held

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await self._io("renew")
        held = self._holds(session_id, lease)
        if held is None or held["until"] < time.time():
            return False
        held["until"] = time.time() + ttl
        return True

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._io("release")
        held = self._holds(session_id, lease)
        if held is not None:
            held.update(owner=None, until=0.0)

    async def aclose(self) -> None:
        await self._io("aclose")


class AsyncioPagedStore(AsyncioDictStore):
    """The same, reading its journal a page at a time (a ``JournalPageStore``)."""

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        await self._io("read_journal_page")
        s = self._get(session_id)
        page: list[JournalEntry] = []
        size = 0
        for entry in s["journal"]:
            if entry.seq > after and len(page) < limit and size < max_bytes:
                page.append(entry)
                size += len(entry.data)
        return s["trimmed_upto"], page


def echo_agents() -> dict[str, sa.Agent]:
    return {"echo": sa.Agent(model=EchoModel())}


def test_an_asyncio_store_keeps_a_session_through_a_turn_hibernation_wake_and_delete() -> None:
    """Wrapped, a store that awaits asyncio serves an aio registry: every call runs in an
    asyncio task, and a session is written, hibernated, woken and deleted there."""

    async def main() -> None:
        store = AsyncioDictStore()
        wrapped = aio.asyncio_store(store)
        async with aio.open_registry(store=wrapped, agents=echo_agents()) as registry:
            ref = await registry.spawn("web-1")
            assert (await ref.send("hello from asyncpg")).text == "hello from asyncpg"
            await ref.hibernate()
            assert registry.live() == []
            assert "web-1" in store.sessions

            ref = registry.ref("web-1")  # wakes from the store
            assert [m.content for m in await ref.history()][-1] == "hello from asyncpg"
            assert (await ref.send("and again")).text == "and again"
            assert [info.session_id for info in await registry.sessions()] == ["web-1"]
            await registry.spawn("web-2")
        assert {"create", "load", "append", "write_snapshot"} <= set(store.calls)
        assert store.calls[-1] == "aclose"

        # The registry's close hibernated both; a new registry wakes them and deletes one.
        async with aio.open_registry(store=wrapped, agents=echo_agents()) as registry:
            history = await registry.ref("web-1").history()
            assert [m.content for m in history] == ["hello from asyncpg"] * 2 + ["and again"] * 2
            await registry.delete("web-1")
            assert [info.session_id for info in await registry.sessions()] == ["web-2"]
            with pytest.raises(sa.SessionNotFoundError):
                await registry.ref("web-1").history()
        assert sorted(store.sessions) == ["web-2"]

    run(main)


def test_an_asyncio_store_passes_check_store_from_asyncio() -> None:
    """sessionactors.aio.check_store runs the conformance suite on a wrapped asyncio store,
    made by a function or an asyncio coroutine (and reopened over its data by either),
    and catches one that ignores fences."""
    inner: dict[int, AsyncioDictStore] = {}  # a wrapper's id: the store it wraps

    def fresh() -> Store:
        store = AsyncioDictStore()
        wrapped = aio.asyncio_store(store)
        inner[id(wrapped)] = store
        return wrapped

    async def reopen(wrapped: Store) -> Store:
        await asyncio.sleep(0)  # (an asyncpg.create_pool, say)
        first, again = inner[id(wrapped)], AsyncioDictStore()
        again.sessions, again.leases = first.sessions, first.leases
        return aio.asyncio_store(again)

    async def make() -> Store:
        await asyncio.sleep(0)
        return aio.asyncio_store(AsyncioPagedStore())

    async def main() -> None:
        await aio.check_store(fresh, reopen=reopen)
        await aio.check_store(make)
        with pytest.raises(AssertionError, match="FencedOutError"):
            await aio.check_store(lambda: aio.asyncio_store(AsyncioDictStore(fencing=False)))

    run(main)


def test_the_wrapper_has_the_optional_methods_of_its_store_only() -> None:
    """A wrapped store is a JournalPageStore (or PagedStore, LeaseBatchStore) only if the
    store it wraps is one; wrapping twice wraps once, and a trio store is refused."""
    plain = aio.asyncio_store(AsyncioDictStore())
    paged = aio.asyncio_store(AsyncioPagedStore())
    assert isinstance(plain, Store)
    assert not isinstance(plain, JournalPageStore | PagedStore | LeaseBatchStore)
    assert isinstance(paged, JournalPageStore)
    assert not isinstance(paged, PagedStore | LeaseBatchStore)
    assert aio.asyncio_store(paged) is paged
    assert "AsyncioPagedStore" in repr(paged)
    with pytest.raises(TypeError, match="trio code"):
        aio.asyncio_store(sa.MemoryStore())
    with pytest.raises(TypeError, match="lacks"):
        aio.asyncio_store(object())


class TrioCodeStore:
    """A store of an app's own written for trio (its methods await trio), over a
    MemoryStore."""

    def __init__(self) -> None:
        self.inner = sa.MemoryStore()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            await trio.sleep(0)
            return await method(*args, **kwargs)

        return call


@pytest.mark.parametrize("trio_call", ["checkpoint", "to_thread"])
def test_a_trio_store_wrapped_for_asyncio_fails_saying_to_pass_it_unwrapped(
    trio_call: str,
) -> None:
    """A store written for trio that an app wraps with asyncio_store fails at its first
    call with StoreConfigurationError naming the session and saying to pass it to
    open_registry unwrapped (not asyncio's or trio's RuntimeError about foreign yields);
    so does its aclose as the registry closes."""
    store = TrioCodeStore()
    if trio_call == "to_thread":

        async def create(*args: Any) -> None:
            await trio.to_thread.run_sync(lambda: None)

        store.create = create  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(sa.StoreConfigurationError) as caught:
            async with aio.open_registry(
                store=aio.asyncio_store(store), agents=echo_agents()
            ) as registry:
                await registry.spawn("web-1")
        told = str(caught.value)  # (the close's, whose aclose failed alike, or the spawn's)
        assert "written for trio" in told, told
        assert "unwrapped" in told, told
        chain: list[str] = []
        error: BaseException | None = caught.value
        while error is not None:
            chain.append(str(error))
            error = error.__context__
        assert any("session 'web-1'" in said for said in chain), chain

    run(main)


class HangingModel:
    """An asyncio model: echoes the user's words, but streams "partial" and then waits
    for good on "hang"."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        text = request.messages[-1].content
        await asyncio.sleep(0)
        if text == "hang":
            yield sa.TextChunk("partial")
            await asyncio.Event().wait()
        yield sa.TextChunk(text)


def test_a_turn_cancelled_while_its_write_waits_in_asyncio_keeps_the_write() -> None:
    """A cancel that comes while a turn's write waits in the store's asyncio await does
    not cut it: a turn writing its reply finishes (cancel() is False), a cancelled turn
    writing its outcome ends cancelled, and a new registry wakes the session with both."""

    async def main() -> None:
        store = AsyncioDictStore()
        wrapped = aio.asyncio_store(store)
        agents = {"a": sa.Agent(model=HangingModel())}
        async with aio.open_registry(store=wrapped, agents=agents) as registry:
            ref = await registry.spawn("web-1")
            store.hold("append")
            turn = await ref.submit("written whole")
            await store.entered.wait()  # the reply's write
            assert await ref.cancel() is False  # (the turn is ending: too late to cancel)
            store.let_go()
            assert (await turn.reply()).text == "written whole"

            async with ref.subscribe() as events:
                turn = await ref.submit("hang")
                async for event in events:
                    if isinstance(event, sa.Delta):
                        break
            store.hold("append")
            cancelling = asyncio.create_task(ref.cancel())
            await store.entered.wait()  # the cancelled turn's outcome
            store.let_go()
            assert await cancelling is True
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            assert store.finished == ["append", "append"]
            assert store.cancelled == 0

        async with aio.open_registry(store=wrapped, agents=agents) as registry:
            history = await registry.ref("web-1").history()
        assert [(m.content, m.interrupted) for m in history] == [
            ("written whole", False),
            ("written whole", False),
            ("hang", False),
            ("partial", True),
        ]

    run(main)


def test_a_caller_giving_up_cancels_the_store_call_waiting_in_asyncio() -> None:
    """A caller that gives up while the store's listing waits in an asyncio await cancels
    that await (trio's cancellation reaches the store's asyncio task), and the registry
    goes on."""

    async def main() -> None:
        store = AsyncioDictStore()
        agents = echo_agents()
        async with aio.open_registry(store=aio.asyncio_store(store), agents=agents) as registry:
            await registry.spawn("web-1")
            store.hold("list_sessions")
            listing = asyncio.create_task(registry.sessions())
            await store.entered.wait()
            listing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await listing
            while store.cancelled == 0:  # (the cancellation crosses into trio and back)
                await asyncio.sleep(0)
            store.let_go()
            assert [info.session_id for info in await registry.sessions()] == ["web-1"]

    run(main)


async def test_a_trio_registry_refuses_an_asyncio_store_saying_what_to_use() -> None:
    """Under sessionactors.open_registry (plain trio, no asyncio loop), a wrapped asyncio store
    sends nothing to the store and raises StoreConfigurationError naming
    sessionactors.aio.open_registry; the trio check_store reports it as its cause."""
    store = AsyncioDictStore()
    with trio.fail_after(10):
        with pytest.raises(sa.StoreConfigurationError, match=r"sessionactors\.aio\.open_registry"):
            async with sa.open_registry(
                store=aio.asyncio_store(store), agents=echo_agents()
            ) as reg:
                await reg.spawn("web-1")
        with pytest.raises(AssertionError) as caught:
            await check_store(lambda: aio.asyncio_store(AsyncioDictStore()))
    assert isinstance(caught.value.__cause__, sa.StoreConfigurationError)
    assert "sessionactors.aio.check_store" in str(caught.value)
    assert store.calls == []
