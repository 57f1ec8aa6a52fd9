"""subscribe(after=N) with N beyond the session's last event (a stale or forged
Last-Event-ID, the id of a deleted session of that name, a store restored from an older
backup) raises EventsExpiredError as it is entered, instead of a subscription that says
nothing until the session's seq passes N."""

from __future__ import annotations

import itertools
import shutil
import zlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from durability_checks import die_mid_turn
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel

ECHO = {"a": sa.Agent(model=EchoModel())}


async def refused(ref: sa.SessionRef, after: int) -> sa.EventsExpiredError:
    """The EventsExpiredError that ``ref.subscribe(after=after)`` raises as it is entered
    (a subscription that opens and then waits fails the test: TooSlowError)."""
    entered: list[bool] = []

    async def subscribe() -> None:
        async with ref.subscribe(after=after) as events:
            entered.append(True)
            await anext(events)

    with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as caught:
        await subscribe()
    assert not entered, "the subscription opened, and raised only when read"
    return caught.value


def assert_told(error: sa.EventsExpiredError, name: str, after: int, last: int) -> None:
    """The error names the session, the seq asked for and its last one, and says what to do."""
    assert error.session_id == name
    assert error.oldest_seq == last + 1
    message = str(error)
    assert repr(name) in message, message
    assert f"after seq {after}" in message, message
    assert f"seq {last}" in message, message
    assert "ref.state()" in message, message
    assert "after=state.event_seq" in message, message


async def follow_on(ref: sa.SessionRef, after: int) -> None:
    """A subscription after ``after`` gets the next turn's events."""
    async with ref.subscribe(after=after) as events:
        turn = await ref.submit("and on")
        with trio.fail_after(5):
            async for event in events:
                assert event.seq > after
                if isinstance(event, sa.TurnFinished) and event.turn_id == turn.id:
                    return


async def test_after_a_seq_a_live_session_never_reached_raises_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A live session refuses a subscription after a seq it has not reached, saying its
    last seq, leaves no subscriber behind, and serves one after its last seq."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("live")
        await ref.send("one two")
        last = (await ref.state()).event_seq
        for after in (last + 1, last + 3, 10**30):
            assert_told(await refused(ref, after), "live", after, last)
        assert registry.live() == ["live"]
        assert registry.statistics().subscribers == 0
        await follow_on(ref, last)


async def test_after_a_seq_too_long_to_print_is_told_by_its_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A seq of more digits than Python writes out (``sys.get_int_max_str_digits()``)
    is refused as any other seq beyond the session's last, or below 0, naming the
    session and the seq's size, live and hibernated."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("huge")
        await ref.send("one two")
        last = (await ref.state()).event_seq
        for asleep in (False, True):
            if asleep:
                await ref.hibernate()
                last = (await sa.read_session(registry.store, "huge")).event_seq
            error = await refused(ref, 10**5000)
            assert (error.session_id, error.oldest_seq) == ("huge", last + 1)
            assert "session 'huge' has no event after seq (an integer of 16610 bits)" in str(error)
            with pytest.raises(ValueError, match=r"after for session 'huge' must be a seq"):
                ref.subscribe(after=-(10**5000))


async def test_after_a_seq_beyond_a_hibernated_session_raises_without_waking_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hibernated session (here, and in a new registry over its store) is read as
    stored: a subscription after a seq beyond its last is refused, and it stays asleep."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("asleep")
        await ref.send("one two")
        await ref.hibernate()
        last = (await sa.read_session(store, "asleep")).event_seq
        assert_told(await refused(ref, last + 1), "asleep", last + 1, last)
        assert registry.live() == []
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("asleep")
        assert_told(await refused(ref, last + 5), "asleep", last + 5, last)
        assert registry.live() == []
        assert registry.statistics().subscribers == 0
        await follow_on(ref, last)


async def test_after_a_seq_beyond_a_stopped_session_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stopped session refuses a subscription after a seq beyond its last too, rather
    than one that ends with nothing said."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("done")
        await ref.send("bye")
        await ref.stop()
        last = (await ref.state()).event_seq
        assert_told(await refused(ref, last + 1), "done", last + 1, last)
        async with ref.subscribe(after=last) as events:
            assert [event async for event in events] == []


async def test_the_last_event_id_of_a_deleted_namesake_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a session is deleted and one of the same name is created, a subscription
    after a seq that only the deleted one reached is refused, live and hibernated: the
    new one's first seq is above the deleted one's last (its first write jumps, see
    test_resume_other_history.py)."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("n")
        for text in ("one two three", "four five six"):
            await ref.send(text)
        old = (await ref.state()).event_seq
        await registry.delete("n")
        ref = await registry.spawn("n")
        await ref.send("a new conversation")
        first = (await ref.history())[0]
        assert first.content == "a new conversation"
        error = await refused(ref, old)
        assert error.session_id == "n"
        assert old < error.oldest_seq <= (await ref.state()).event_seq
        await ref.hibernate()
        assert (await refused(ref, old)).oldest_seq == error.oldest_seq
        assert registry.live() == []
        await follow_on(ref, (await sa.read_session(registry.store, "n")).event_seq)


async def test_the_last_event_id_before_a_store_was_restored_from_a_backup_raises(
    tmp_path: Path,
) -> None:
    """A SQLite file restored from a copy taken before the client's last event: the
    subscription after that event is refused, and one after the restored state goes on."""
    path, backup = tmp_path / "sessions.db", tmp_path / "backup.db"
    with trio.fail_after(30):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            ref = await registry.spawn("b")
            await ref.send("before the backup")
        shutil.copyfile(path, backup)
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            await registry.ref("b").send("after the backup")
            seen = (await registry.ref("b").state()).event_seq
        shutil.copyfile(backup, path)
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            ref = registry.ref("b")
            last = (await sa.read_session(registry.store, "b")).event_seq
            assert last < seen
            assert_told(await refused(ref, seen), "b", seen, last)
            await follow_on(ref, last)


async def test_after_a_seq_beyond_where_a_dead_process_could_reach_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a process died mid-turn, a subscription after a seq no incarnation can have
    reached is told it is beyond the session at once, before the session wakes; one after
    a seq inside the lost turn is told the events are lost, by the session woken to name
    the seq its events go on from."""
    store = sa.MemoryStore()
    death = await die_mid_turn(store)
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        error = await refused(ref, 10**30)
        assert error.session_id == "s"
        assert "no event after seq" in str(error)
        assert registry.live() == []
        lost = await refused(ref, death.last)
        assert lost.oldest_seq > death.last
        assert "lost" in str(lost)
        state = await ref.state()  # past the jump
        assert death.last < lost.oldest_seq <= state.event_seq + 1
        error = await refused(ref, 10**30)
        assert_told(error, "s", 10**30, (await ref.state()).event_seq)


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_the_oldest_seq_a_lost_turn_names_is_one_to_resume_after(
    autojump_clock: trio.testing.MockClock, durability: str
) -> None:
    """After a process died mid-turn, a subscription after a seq of the lost turn is told
    the oldest seq available, and one after the seq before it follows on from there: it is
    not refused again (as beyond the session), and it gets the session's next turn."""
    store = sa.MemoryStore()
    death = await die_mid_turn(store, durability=durability)
    async with sa.open_registry(store=store, agents=ECHO, durability=durability) as registry:
        ref = registry.ref("s")
        lost = await refused(ref, death.last)
        assert "lost" in str(lost)
        assert lost.oldest_seq > death.last
        await follow_on(ref, lost.oldest_seq - 1)


@pytest.mark.redis
async def test_a_worker_that_does_not_run_the_session_asks_its_owner(
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """On a worker that does not run the session, a subscription after a seq its owner
    published but did not store (a turn's deltas) follows on, and one after a seq beyond
    the owner's last is refused at once: first asked, with a mirror open there already,
    and once the session hibernated."""
    release = trio.Event()
    model = ScriptedModel(["one", Scripted(text="two two two", wait=release, wait_after=2)])
    with trio.fail_after(30):
        async with two_redis_workers({"a": sa.Agent(model=model)}) as (a, b):
            owner = await a.spawn("s")
            await owner.send("one")
            async with owner.subscribe() as live:
                turn = await owner.submit("two")
                deltas = 0
                async for event in live:
                    deltas += isinstance(event, sa.Delta)
                    if deltas == 2:
                        seen = event.seq
                        break
            assert (a.live(), b.live()) == (["s"], [])
            assert (await sa.read_session(b.store, "s")).event_seq < seen  # not stored
            ref = b.ref("s")
            assert_told(await refused(ref, seen + 1000), "s", seen + 1000, seen)
            async with ref.subscribe(after=seen) as events:  # the owner is ahead
                assert_told(await refused(ref, seen + 1000), "s", seen + 1000, seen)
                release.set()
                async for event in events:
                    assert event.seq > seen
                    if isinstance(event, sa.TurnFinished):
                        assert event.turn_id == turn.id
                        break
            await owner.hibernate()
            after = (await sa.read_session(b.store, "s")).event_seq + 1000
            error = await refused(ref, after)
            assert_told(error, "s", after, (await ref.state()).event_seq)


async def test_a_session_live_in_another_process_is_not_taken_for_a_dead_one(
    tmp_path: Path,
) -> None:
    """Two processes on one SQLite file with leases: while one streams a turn, a
    subscription in the other after a delta it published (above the store's seq) opens,
    rather than being told the turn was lost with a process that stopped."""
    path = tmp_path / "shared.db"
    release = trio.Event()
    model = ScriptedModel(["one", Scripted(text="two two two", wait=release, wait_after=2)])
    agents = {"a": sa.Agent(model=model)}
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=sa.SQLiteStore(path), agents=agents, leases=True) as here,
            sa.open_registry(store=sa.SQLiteStore(path), agents=agents, leases=True) as there,
        ):
            owner = await there.spawn("s")
            await owner.send("one")
            async with owner.subscribe() as live:
                turn = await owner.submit("two")
                deltas = 0
                async for event in live:
                    deltas += isinstance(event, sa.Delta)
                    if deltas == 2:
                        seen = event.seq
                        break
            assert (await sa.read_session(here.store, "s")).event_seq < seen  # not stored
            async with here.ref("s").subscribe(after=seen):
                pass
            assert here.live() == []
            release.set()
            await turn.reply()


async def test_a_subscription_after_a_stored_seq_does_not_wait_for_a_wake(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the session wakes (its wake held), a subscription after a seq the store
    holds opens at once and follows on; one after a seq beyond it waits for the wake
    and is refused."""
    store = FaultyStore(sa.MemoryStore())
    async with sa.open_registry(store=store, agents=ECHO, leases=True) as registry:
        ref = await registry.spawn("w")
        await ref.send("one two")
        await ref.hibernate()
        last = (await sa.read_session(store, "w")).event_seq
        gate = store.hold("claim", session_id="w")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ref.state)
            await trio.testing.wait_all_tasks_blocked()
            assert registry.live() == ["w"]
            with trio.fail_after(5):
                async with ref.subscribe(after=last):
                    assert not gate.is_open
            nursery.start_soon(lambda: refused(ref, last + 100))
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
        assert_told(await refused(ref, last + 100), "w", last + 100, (await ref.state()).event_seq)
        await follow_on(ref, last)


@pytest.mark.redis
async def test_a_refusal_on_a_worker_wakes_no_session(
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """On workers, a subscription after a seq beyond a hibernated session's last is
    refused without waking it, on a worker that follows the session already (its
    mirror is behind the seq) and on one that does not."""
    with trio.fail_after(30):
        async with two_redis_workers(ECHO) as (a, b):
            owner = await a.spawn("s")
            await owner.send("one two")
            assert (a.live(), b.live()) == (["s"], [])
            ref = b.ref("s")
            async with ref.subscribe():  # b follows it (a mirror of a's events)
                await owner.hibernate()
                last = (await sa.read_session(b.store, "s")).event_seq
                assert_told(await refused(ref, 2**60), "s", 2**60, last)
                assert (a.live(), b.live()) == ([], [])
            assert_told(await refused(ref, 2**60), "s", 2**60, last)
            assert (a.live(), b.live()) == ([], [])
            # a keeps the session's shard (a shard mate is live there): asked there
            mate = next(n for n in (f"m{k}" for k in itertools.count()) if same_shard(n, "s"))
            await (await a.spawn(mate)).send("hello")
            assert (a.live(), b.live()) == ([mate], [])
            assert_told(await refused(ref, 2**60), "s", 2**60, last)
            assert (a.live(), b.live()) == ([mate], [])
            await follow_on(ref, last)


@pytest.mark.redis
async def test_a_seq_beyond_64_bits_is_refused_on_a_worker_as_on_its_owner(
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """On a worker that does not run the session, a subscription after a seq wider than
    the wire between workers carries (2**64 and up) is refused as on the session's owner,
    naming the seq asked for: while it is live there, and once it hibernated (asked of
    the worker that keeps its shard), waking nothing; a negative one is a ValueError."""
    with trio.fail_after(30):
        async with two_redis_workers(ECHO) as (a, b):
            owner = await a.spawn("s")
            await owner.send("one two")
            last = (await owner.state()).event_seq
            ref = b.ref("s")
            for after in (2**64, 10**30):
                assert_told(await refused(owner, after), "s", after, last)
                assert_told(await refused(ref, after), "s", after, last)
            for negative in (-(2**63) - 1, -(10**30)):
                for either in (owner, ref):
                    with pytest.raises(ValueError, match="after for session 's' must be a seq"):
                        either.subscribe(after=negative)
            mate = next(n for n in (f"m{k}" for k in itertools.count()) if same_shard(n, "s"))
            await (await a.spawn(mate)).send("hello")  # a keeps the session's shard
            await owner.hibernate()
            last = (await sa.read_session(b.store, "s")).event_seq
            for after in (2**64, 10**30):
                assert_told(await refused(ref, after), "s", after, last)
            assert (a.live(), b.live()) == ([mate], [])
            await follow_on(ref, last)


def same_shard(name: str, other: str) -> bool:
    """Whether two session names share a shard of a RedisStore (``crc32(name) % 1024``)."""
    return zlib.crc32(name.encode()) % 1024 == zlib.crc32(other.encode()) % 1024


async def test_with_leases_a_seq_never_stored_is_told_lost_by_a_wake_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With leases, a seq a process published and never stored is not refused as the
    subscription is entered: that process may be alive, holding the lease (this one
    cannot tell without claiming the lease, which could fence it out). The subscription
    opens and wakes nothing; a wake here (the process did die) ends it as lost."""
    store = sa.MemoryStore()
    death = await die_mid_turn(store)  # (without leases: it holds none)
    async with sa.open_registry(store=store, agents=ECHO, leases=True) as registry:
        ref = registry.ref("s")

        async def follow() -> None:
            async with ref.subscribe(after=death.last) as events:
                assert registry.live() == []
                await ref.state()  # (a request wakes it)
                await anext(events)

        with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as caught:
            await follow()
        lost = caught.value
        state = await ref.state()
        assert death.last < lost.oldest_seq <= state.event_seq + 1
    store = sa.MemoryStore()
    death = await die_mid_turn(store, leases=True, lease_ttl=3600)
    async with sa.open_registry(store=store, agents=ECHO, leases=True) as registry:
        async with registry.ref("s").subscribe(after=death.last):
            assert registry.live() == []
        with pytest.raises(sa.LeaseHeldError):
            await registry.ref("s").state()
