"""The test kit's stores: FaultyStore stalls and fails on demand, FlawedStore breaks the contract."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import JournalEntry, JournalPageStore, MemoryStore, Store, dump_events
from sessionactors.testing import (
    EchoModel,
    FaultyStore,
    FlawedStore,
    Gate,
    Scripted,
    ScriptedModel,
    check_store,
    crash,
    journal_events,
)

ECHO = {"echo": sa.Agent(model=EchoModel())}
SNAPSHOT = b"\x81\xaeschema_version\x01"  # a store keeps bytes; it never decodes them


def entry(seq: int) -> JournalEntry:
    return JournalEntry(seq, bytes([seq]))


# ---- FaultyStore -------------------------------------------------------------------


async def test_a_faulty_store_without_faults_keeps_the_store_contract() -> None:
    """FaultyStore passes check_store over a MemoryStore when no fault is planned."""
    with trio.fail_after(60):
        await check_store(lambda: FaultyStore(MemoryStore()))


async def test_a_faulty_store_is_a_store(autojump_clock: trio.abc.Clock) -> None:
    """FaultyStore implements the Store protocol and a registry runs on it."""
    store = FaultyStore()
    assert isinstance(store, Store)
    assert isinstance(store.store, MemoryStore)
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        with trio.fail_after(10):
            assert (await (await registry.spawn("s")).send("hi")).text == "hi"
    assert store.calls["append"] >= 1
    assert store.injected == 0


async def test_a_failure_fires_as_many_times_as_planned() -> None:
    """fail() raises StoreError for the next ``times`` calls, then the calls go through."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    store.fail("append", times=2)
    assert store.failures_left("append") == 2
    for _ in range(2):
        with pytest.raises(sa.StoreError, match="injected append fault for session 's'"):
            await store.append("s", [entry(1)], b"")
    assert store.failures_left("append") == 0
    await store.append("s", [entry(1)], b"")
    assert store.injected == 2
    assert store.calls["append"] == 3
    _, entries = await store.read_journal("s", 0)
    assert entries == [entry(1)]


async def test_a_failure_after_the_call_keeps_what_the_store_did() -> None:
    """fail(after=True) lets the call reach the wrapped store, then raises: the write is
    kept, its acknowledgement lost."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    store.fail("append", after=True)
    assert store.failures_left("append", after=True) == 1
    assert store.failures_left("append") == 0
    with pytest.raises(sa.StoreError, match="after the store did it"):
        await store.append("s", [entry(1)], b"")
    await store.append("s", [entry(2)], b"")
    _, entries = await store.read_journal("s", 0)
    assert entries == [entry(1), entry(2)]
    assert store.injected == 1


async def test_a_failure_can_be_for_one_session_and_raise_a_given_error() -> None:
    """A failure for one session leaves the others alone, and raises the error it was given."""
    store = FaultyStore()
    for name in ("a", "b"):
        await store.create(name, SNAPSHOT, b"")
    store.fail("append", session_id="a", times=None, error=OSError("disk on fire"))
    assert store.failures_left("append", session_id="a") is None
    await store.append("b", [entry(1)], b"")
    for seq in (1, 2):
        with pytest.raises(OSError, match="disk on fire"):
            await store.append("a", [entry(seq)], b"")
    store.fail("append", session_id="a", times=0)  # cleared
    await store.append("a", [entry(1)], b"")
    assert store.injected == 2


async def test_a_failure_for_a_session_comes_before_one_for_any() -> None:
    """With failures planned for a session and for any session, that session's fires first."""
    store = FaultyStore()
    await store.create("a", SNAPSHOT, b"")
    store.fail("exists", error=KeyError("any"))
    store.fail("exists", session_id="a", error=LookupError("a"))
    with pytest.raises(LookupError, match="a"):
        await store.exists("a")
    with pytest.raises(KeyError, match="any"):
        await store.exists("a")
    assert await store.exists("a")


async def test_a_held_call_waits_for_its_gate() -> None:
    """hold() keeps calls of that operation waiting until gate.open(), then lets them through."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    gate = store.hold("append")
    done: list[int] = []

    async def append(seq: int) -> None:
        await store.append("s", [entry(seq)], b"")
        done.append(seq)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(append, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert (gate.waiting, gate.held, done) == (1, 1, [])
        assert (await store.read_journal("s", 0))[1] == []  # not written yet
        gate.open()
    assert done == [1]
    assert (gate.waiting, gate.is_open) == (0, True)
    await store.append("s", [entry(2)], b"")  # an open gate holds nothing more
    assert [e.seq for e in (await store.read_journal("s", 0))[1]] == [1, 2]


async def test_a_gate_opens_from_another_trio_run() -> None:
    """gate.open() from another thread's trio run lets the held call go on (an asyncio
    test of a registry that sessionactors.aio runs in a trio thread of its own)."""
    store = FaultyStore()
    gate = store.hold("exists")
    answered = threading.Event()

    def other_run() -> None:
        async def main() -> None:
            await store.exists("s")
            answered.set()

        trio.run(main)

    thread = threading.Thread(target=other_run, daemon=True)  # (left if it hangs)
    thread.start()
    with trio.fail_after(10):
        while gate.waiting == 0:
            await trio.sleep(0.01)
        gate.open()
        while thread.is_alive():
            await trio.sleep(0.01)
    assert answered.is_set()


async def test_a_gate_made_alone_holds_a_scripted_answer_until_opened() -> None:
    """Gate() holds a ScriptedModel answer at Scripted(wait=gate) until gate.open()."""
    gate = Gate()
    model = ScriptedModel([Scripted(text="a b c", wait=gate, wait_after=1)])
    async with sa.open_registry(agents={"m": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            turn = await ref.submit("hi")
            await trio.testing.wait_all_tasks_blocked()
            assert (gate.waiting, gate.held, turn.done) == (1, 1, False)
            gate.open()
            assert (await turn.reply()).text == "a b c"
    assert (gate.waiting, gate.is_open) == (0, True)
    assert repr(gate) == "<Gate open>"


async def test_a_gate_opened_before_anyone_waits_holds_nobody() -> None:
    """An open gate lets a waiter through at once, and counts it as held by none."""
    gate = Gate()
    gate.open()
    with trio.fail_after(10):
        await gate.wait()
    assert (gate.waiting, gate.held) == (0, 0)


async def test_a_waiter_of_a_crashed_registry_hears_of_the_crash() -> None:
    """A caller waiting on a turn when crash(registry) stops it is told the registry was
    crashed, not that the store did not answer."""
    gate = Gate()
    model = ScriptedModel([Scripted(text="partial reply", wait=gate, wait_after=1)])
    with trio.fail_after(10):
        with trio.CancelScope() as process:
            async with sa.open_registry(agents={"m": sa.Agent(model=model)}) as registry:
                ref = await registry.spawn("s")
                turn = await ref.submit("hi")
                await trio.testing.wait_all_tasks_blocked()
                crash(registry)
                process.cancel()
        with pytest.raises(sa.SessionStoppedError) as stopped:
            await turn.reply()
    message = str(stopped.value)
    assert "crashed" in message, message
    assert "sessionactors.testing.crash" in message, message
    assert "did not answer" not in message, message
    assert stopped.value.turn_id == turn.id


def test_crash_names_the_registries_it_takes() -> None:
    """crash() of something else names both public registry classes, no private module."""
    with pytest.raises(TypeError) as refused:
        crash(object())  # type: ignore[arg-type]
    message = str(refused.value)
    assert "sessionactors.Registry" in message
    assert "sessionactors.aio.Registry" in message
    assert "._" not in message, message


async def test_a_page_of_the_journal_is_a_read_of_it() -> None:
    """read_journal_page meets the failures and gates of read_journal and counts as one."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    await store.append("s", [entry(1), entry(2)], b"")
    store.fail("read_journal", session_id="s")
    with pytest.raises(sa.StoreError, match="injected read_journal fault for session 's'"):
        await store.read_journal_page("s", 0, limit=1, max_bytes=10)
    gate = store.hold("read_journal", after=True)
    got: list[tuple[int, list[JournalEntry]]] = []

    async def read() -> None:
        got.append(await store.read_journal_page("s", 0, limit=1, max_bytes=10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert (gate.waiting, got) == (1, [])
        gate.open()
    assert got == [(0, [entry(1)])]
    assert (store.calls["read_journal"], store.injected) == (2, 1)


class WholeJournalStore:
    """A store that reads its journal whole only (it has no read_journal_page)."""

    def __init__(self) -> None:
        self.store = MemoryStore()

    def __getattr__(self, name: str) -> Any:
        if name == "read_journal_page":
            raise AttributeError(name)
        return getattr(self.store, name)


@pytest.mark.parametrize("wrap", [FaultyStore, lambda store: FlawedStore("lose_appends", store)])
async def test_the_wrappers_read_pages_of_a_store_that_reads_its_journal_whole(
    wrap: Callable[[Store], Store],
) -> None:
    """FaultyStore and FlawedStore read pages of a store without read_journal_page, cut
    from its read_journal."""
    store = wrap(WholeJournalStore())  # type: ignore[arg-type]
    assert isinstance(store, JournalPageStore)
    inner = store.store  # type: ignore[attr-defined]
    await store.create("s", SNAPSHOT, b"")
    await inner.append("s", [JournalEntry(seq, b"ab") for seq in (1, 2, 3)], b"")
    assert await store.read_journal_page("s", 0, limit=2, max_bytes=10) == (
        0,
        [JournalEntry(1, b"ab"), JournalEntry(2, b"ab")],
    )
    assert await store.read_journal_page("s", 1, limit=5, max_bytes=3) == (
        0,
        [JournalEntry(2, b"ab"), JournalEntry(3, b"ab")],
    )


async def test_a_faulty_store_over_a_store_without_pages_keeps_the_store_contract() -> None:
    """FaultyStore over a store that reads its journal whole passes check_store."""
    with trio.fail_after(60):
        await check_store(lambda: FaultyStore(WholeJournalStore()))  # type: ignore[arg-type]


async def test_a_gate_after_the_call_holds_its_acknowledgement() -> None:
    """hold(after=True) lets the call reach the store and holds only its return."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    gate = store.hold("append", after=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.append, "s", [entry(1)], b"")
        await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 1
        assert (await store.read_journal("s", 0))[1] == [entry(1)]  # written already
        gate.open()


async def test_a_gate_for_one_session_holds_only_its_calls() -> None:
    """A gate with a session_id holds that session's calls and no other's."""
    store = FaultyStore()
    gate = store.hold("create", session_id="slow")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.create, "slow", SNAPSHOT, b"")
        await store.create("fast", SNAPSHOT, b"")
        await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 1
        assert not await store.exists("slow")
        gate.open()
    assert await store.exists("slow")


async def test_a_held_call_fails_if_a_failure_is_planned_when_it_goes_on() -> None:
    """A call waits at its gate first, then meets the failures planned by then."""
    store = FaultyStore()
    await store.create("s", SNAPSHOT, b"")
    gate = store.hold("append")
    errors: list[BaseException] = []

    async def append() -> None:
        try:
            await store.append("s", [entry(1)], b"")
        except sa.StoreError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(append)
        await trio.testing.wait_all_tasks_blocked()
        store.fail("append")
        gate.open()
    assert len(errors) == 1
    assert (await store.read_journal("s", 0))[1] == []


def test_unknown_operations_are_refused() -> None:
    """hold() and fail() name the store operations when given another name."""
    store = FaultyStore()
    with pytest.raises(ValueError, match="'apend' is not a store operation; use one of create"):
        store.hold("apend")
    with pytest.raises(ValueError, match="not a store operation"):
        store.fail("snapshot")
    with pytest.raises(ValueError, match="at least 0"):
        store.fail("append", times=-1)


async def test_a_store_fault_in_a_turn_crashes_only_that_session(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An append that fails for one session crashes its actor (the waiter gets
    SessionCrashedError caused by the fault); it restarts and the other session is untouched."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        victim, other = await registry.spawn("victim"), await registry.spawn("other")
        store.fail("append", session_id="victim")
        with trio.fail_after(10):
            with pytest.raises(sa.SessionCrashedError) as crash:
                await victim.send("lost")
            assert (await other.send("fine")).text == "fine"
            assert (await victim.send("again")).text == "again"
    assert isinstance(crash.value.__cause__, sa.StoreError)
    assert store.injected == 1


# ---- FlawedStore -------------------------------------------------------------------


def test_flaws_are_checked() -> None:
    """FlawedStore refuses a flaw it does not have, naming those it has."""
    with pytest.raises(ValueError, match="'lose_everything' is not a flaw FlawedStore has"):
        FlawedStore("lose_everything")


@pytest.mark.parametrize("flaw", FlawedStore.FLAWS)
async def test_the_store_conformance_suite_catches_a_flawed_store(flaw: str) -> None:
    """check_store fails for a store with any of FlawedStore's flaws."""
    with trio.fail_after(60), pytest.raises(AssertionError, match="store check failed"):
        await check_store(lambda: FlawedStore(flaw, MemoryStore()))


async def test_check_store_with_reopen_catches_writes_acknowledged_before_they_last() -> None:
    """Given ``reopen``, check_store reads what each write acknowledged through a second
    store over the same data: a store that acknowledges an append before it is written
    (lost with its process) fails that property, and an honest one passes."""
    with trio.fail_after(60):
        with pytest.raises(AssertionError, match="store check failed: what each write") as caught:
            await check_store(
                lambda: FlawedStore("ack_appends_early", MemoryStore()),
                reopen=lambda first: FlawedStore("ack_appends_early", first.store),
            )
        assert "through another store" in str(caught.value)
        # (two FaultyStores over one MemoryStore: a store whose data outlives the object)
        await check_store(
            lambda: FaultyStore(MemoryStore()), reopen=lambda first: FaultyStore(first.store)
        )


class _ClosesBadly(MemoryStore):
    async def aclose(self) -> None:
        await super().aclose()
        raise sa.StoreError("the connection pool would not close")


async def test_check_store_names_the_property_whose_store_failed_to_close() -> None:
    """A store whose aclose raises fails check_store with an AssertionError naming the
    property it was checked for, not with the store's own error."""
    with trio.fail_after(60), pytest.raises(AssertionError) as caught:
        await check_store(_ClosesBadly)
    message = str(caught.value)
    assert message.startswith("store check failed: a new store is empty"), message
    assert "aclose raised StoreError: the connection pool would not close" in message


class _Hangs(MemoryStore):
    """A store whose listing never answers; it counts its closes."""

    closed = 0

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        type(self).closed += 1
        await super().aclose()


async def test_check_store_cancelled_still_closes_the_store_it_checks() -> None:
    """check_store cancelled (the fail_after its docs advise, around a store that hangs)
    closes the store it was checking before the cancellation goes on."""
    with trio.move_on_after(0.5) as scope:
        await check_store(_Hangs)
    assert scope.cancelled_caught
    assert _Hangs.closed >= 1


async def test_appends_acknowledged_early_are_lost_with_the_process() -> None:
    """With ack_appends_early an append lands only when the same wrapper is called again,
    so a process that dies first (its wrapper dropped) loses it."""
    disk = MemoryStore()
    first = FlawedStore("ack_appends_early", disk)
    await first.create("s", SNAPSHOT, b"")
    await first.append("s", [entry(1)], b"")
    await first.append("s", [entry(2)], b"")  # writes 1, keeps 2 back
    assert (await first.read_journal("s", 0))[1] == [entry(1), entry(2)]  # writes 2
    await first.append("s", [entry(3)], b"")
    second = FlawedStore("ack_appends_early", disk)  # the next process
    assert (await second.read_journal("s", 0))[1] == [entry(1), entry(2)]


async def test_journal_events_decodes_what_the_store_holds(autojump_clock: trio.abc.Clock) -> None:
    """journal_events returns the journaled events of a session above ``after``, decoded."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            reply = await ref.send("hello")
    events = await journal_events(store, "s")
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    finished = [e for e in events if isinstance(e, sa.TurnFinished)]
    assert [e.turn_id for e in finished] == [reply.turn_id]
    started = [e.message for e in events if isinstance(e, sa.TurnStarted)]
    assert [m.content for m in started if m is not None] == ["hello"]
    assert [e.message.content for e in finished] == ["hello"]
    after = finished[0].seq - 1
    assert await journal_events(store, "s", after=after) == [e for e in events if e.seq > after]
    with pytest.raises(sa.SessionNotFoundError):
        await journal_events(store, "nobody")
    await store.create("raw", SNAPSHOT, b"")
    await store.append("raw", [JournalEntry(1, dump_events(finished))], b"")
    assert await journal_events(store, "raw") == finished
