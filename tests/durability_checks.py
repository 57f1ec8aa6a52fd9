"""Durability checks over any store, each a promise to callers that a store fault could break.

Each check runs one or more "processes" over one shared store, the disk: a
process is a registry over ``wrap(disk)``, the view of the disk one process has
(``wrap`` is a store wrapper from the test kit, or ``as_is``). A process death is
the test kit's ``crash(registry)`` and a cancel scope around its registry: nothing
after it runs, and the disk keeps what it had. A check raises AssertionError naming what broke.

The race tests run them over sound stores; test_durability_controls.py runs them
over the test kit's FlawedStore as well, where they must fail: the negative control.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import MemoryStore, Store
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, crash

ECHO = {"a": sa.Agent(model=EchoModel())}

#: One process's view of the shared disk.
Wrap = Callable[[Store], Store]
Check = Callable[[Wrap], Awaitable[None]]


def as_is(disk: Store) -> Store:
    """The disk itself: a sound store."""
    return disk


async def watch(ref: sa.SessionRef, seen: list[sa.Event], after: int | None = None) -> None:
    """Append every event of ``ref`` to ``seen`` until cancelled."""
    async with ref.subscribe(after=after) as events:
        async for event in events:
            seen.append(event)


async def stored_user_texts(store: Store, name: str, **options: object) -> list[str]:
    """The user messages of session ``name`` as a new process over ``store`` finds them."""
    async with sa.open_registry(store=store, agents=ECHO, **options) as registry:
        try:
            history = await registry.ref(name).history()
        except sa.SessionActorsError as exc:
            raise AssertionError(f"session {name!r} did not load: {exc!r}") from exc
    return [m.content for m in history if m.role is sa.Role.USER]


# ---- what was acknowledged stays -----------------------------------------------------


async def acknowledged_turns_survive_a_death(wrap: Wrap) -> None:
    """Every turn answered before a process death is there, in order, in the next process."""
    disk = MemoryStore()
    acknowledged: list[str] = []
    with trio.fail_after(3600), trio.CancelScope() as process:
        async with sa.open_registry(store=wrap(disk), agents=ECHO) as registry:
            ref = await registry.spawn("s")
            for text in ("one", "two", "three"):
                acknowledged.append((await ref.send(text)).text)
            crash(registry)
            process.cancel()
    found = await stored_user_texts(wrap(disk), "s")
    assert found == acknowledged, f"acknowledged {acknowledged}, the next process found {found}"


async def a_long_message_survives_a_death(wrap: Wrap) -> None:
    """A long message, not ASCII, answered before a process death is there whole in the
    next process (a store that cuts or re-encodes what it keeps loses it)."""
    disk = MemoryStore()
    text = "déjà vu, " * 12_000  # (108,000 characters; its journal entry, twice that)
    with trio.fail_after(3600), trio.CancelScope() as process:
        async with sa.open_registry(store=wrap(disk), agents=ECHO) as registry:
            ref = await registry.spawn("s")
            try:
                await ref.send(text)
            except sa.SessionActorsError as exc:  # (what the spawn wrote did not read back)
                raise AssertionError(f"the session failed on the store: {exc!r}") from exc
            crash(registry)
            process.cancel()
    found = await stored_user_texts(wrap(disk), "s")
    assert found == [text], (
        f"acknowledged a message of {len(text):,} characters, found {found!r:.200}"
    )


async def a_hibernated_session_wakes_whole(wrap: Wrap, durability: str = "turn") -> None:
    """A session hibernated twice wakes in a new process with every turn it answered."""
    disk = MemoryStore()
    with trio.fail_after(3600):
        async with sa.open_registry(
            store=wrap(disk), agents=ECHO, durability=durability
        ) as registry:
            ref = await registry.spawn("s")
            await ref.send("one")
            await ref.hibernate()
            await ref.send("two")  # wakes it
            await ref.hibernate()
        found = await stored_user_texts(wrap(disk), "s")
    assert found == ["one", "two"], f"hibernated with ['one', 'two'], woke with {found}"


async def compaction_keeps_every_turn(wrap: Wrap) -> None:
    """Snapshots that compact the journal after every write lose no turn."""
    disk = MemoryStore()
    with trio.fail_after(3600):
        async with sa.open_registry(store=wrap(disk), agents=ECHO, snapshot_every=1) as registry:
            ref = await registry.spawn("s")
            for text in ("one", "two", "three"):
                await ref.send(text)
        found = await stored_user_texts(wrap(disk), "s")
    assert found == ["one", "two", "three"], f"compacted three turns, found {found}"


# ---- seqs ------------------------------------------------------------------------------


async def crash_in_a_held_turn(store: Store, seen: list[sa.Event], **options: object) -> None:
    """Wake ``s`` in a new "process", start a turn that streams and holds, then die."""
    held = ScriptedModel([Scripted(text="two two two", wait=trio.Event(), wait_after=1)])
    with trio.CancelScope() as process:
        async with (
            sa.open_registry(store=store, agents={"a": sa.Agent(model=held)}, **options) as reg,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watch, reg.ref("s"), seen)
            await trio.testing.wait_all_tasks_blocked()
            await reg.ref("s").submit("two")
            await trio.testing.wait_all_tasks_blocked()  # streaming, not committed
            crash(reg)
            process.cancel()
    assert any(isinstance(e, sa.Delta) for e in seen), "the held turn streamed nothing"


async def next_turn_after(store: Store, last: int, **options: object) -> list[sa.Event]:
    """In a new "process" run one turn: the events a live subscription gets. A
    subscription resuming after ``last`` (published by the process that died, never
    stored) must hear that the events after it are gone."""
    got: list[sa.Event] = []
    expired: list[sa.EventsExpiredError] = []

    async def resume() -> None:
        try:
            await watch(reg.ref("s"), [], last)
        except sa.EventsExpiredError as exc:
            expired.append(exc)

    async with (
        sa.open_registry(store=store, agents=ECHO, **options) as reg,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(watch, reg.ref("s"), got)
        nursery.start_soon(resume)
        await trio.testing.wait_all_tasks_blocked()
        await reg.ref("s").send("three")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert expired, f"a subscription resumed after seq {last}, which no store holds, was not told"
    assert expired[0].oldest_seq > last, expired[0]
    return got


@attrs.frozen
class Death:
    """What a subscriber saw of a process that died mid-turn."""

    turn_id: str  # the turn it died in
    durable: int  # the seq of the last event the store holds (the turn before it ended)
    last: int  # the last seq the subscriber saw (a Delta of the lost turn)


async def die_mid_turn(store: Store, **options: object) -> Death:
    """A "process" answers one turn, streams part of a second one, and dies."""
    held = ScriptedModel(["one", Scripted(text="two two two", wait=trio.Event(), wait_after=2)])
    seen: list[sa.Event] = []
    with trio.CancelScope() as process:
        async with (
            sa.open_registry(
                store=store, agents={"a": sa.Agent(model=held)}, **options
            ) as registry,
            trio.open_nursery() as nursery,
        ):
            ref = await registry.spawn("s")
            durable = (await ref.send("one")).turn_id

            async def watch() -> None:
                async with ref.subscribe(after=0) as events:
                    async for event in events:
                        seen.append(event)

            nursery.start_soon(watch)
            turn = await ref.submit("two")
            while sum(isinstance(e, sa.Delta) for e in seen) < 2:  # streaming, not stored
                await trio.sleep(0.01)
            crash(registry)
            process.cancel()
    finished = [e for e in seen if isinstance(e, sa.TurnFinished) and e.turn_id == durable]
    assert isinstance(seen[-1], sa.Delta), seen
    return Death(turn_id=turn.id, durable=finished[0].seq, last=seen[-1].seq)


def assert_a_whole_new_turn(events: list[sa.Event], last: int) -> None:
    """``events`` hold a whole turn, every event numbered above ``last``."""
    kinds = [type(e) for e in events]
    assert sa.TurnStarted in kinds, kinds
    assert sa.TurnFinished in kinds, kinds
    reused = [e for e in events if e.seq <= last]
    assert not reused, f"seqs up to {last} were published already, and used again: {reused}"


async def a_death_after_a_clean_wake_reuses_no_seq(wrap: Wrap) -> None:
    """A process that dies in the first turn after a clean wake published seqs the next
    process never publishes again."""
    disk = MemoryStore()
    with trio.fail_after(3600):
        async with sa.open_registry(store=wrap(disk), agents=ECHO) as registry:
            await (await registry.spawn("s")).send("one")
        seen: list[sa.Event] = []
        await crash_in_a_held_turn(wrap(disk), seen)
        last = seen[-1].seq
        assert_a_whole_new_turn(await next_turn_after(wrap(disk), last), last)


# ---- one owner ------------------------------------------------------------------------


async def a_stale_owner_cannot_stop_the_session(wrap: Wrap) -> None:
    """A worker whose lease another worker took has its stop refused (FencedOutError), and
    the new owner carries on."""
    disk = MemoryStore()
    problems: list[str] = []
    with trio.fail_after(3600):
        async with (
            sa.open_registry(store=wrap(disk), agents=ECHO, leases=True, worker_id="A") as a,
            sa.open_registry(store=wrap(disk), agents=ECHO, leases=True, worker_id="B") as b,
        ):
            ref = await a.spawn("s")
            await ref.send("one")
            lease = await disk.claim("s", "A", 30.0)  # A's lease ends while A still runs s
            assert lease is not None
            await disk.release("s", lease)
            await b.ref("s").history()  # B takes the session over
            try:
                await ref.stop()
            except sa.FencedOutError:
                pass
            except sa.SessionActorsError as exc:
                problems.append(f"the stale owner's stop raised {exc!r}, not FencedOutError")
            else:
                problems.append("the stale owner's stop was written")
            try:
                reply = await b.ref("s").send("two")
            except sa.SessionActorsError as exc:
                problems.append(f"the new owner failed: {exc!r}")
            else:
                if reply.text != "two":
                    problems.append(f"the new owner answered {reply.text!r}")
    assert problems == []


async def a_session_leased_by_one_worker_is_busy_for_another(wrap: Wrap) -> None:
    """While one worker runs a session, another worker's request gets SessionBusyError and
    does not run it too."""
    disk = MemoryStore()
    problems: list[str] = []
    with trio.fail_after(3600):
        async with (
            sa.open_registry(store=wrap(disk), agents=ECHO, leases=True, worker_id="A") as a,
            sa.open_registry(store=wrap(disk), agents=ECHO, leases=True, worker_id="B") as b,
        ):
            await (await a.spawn("s")).send("one")
            try:
                reply = await b.ref("s").send("from b")
            except sa.SessionBusyError:
                pass
            else:
                problems.append(f"a second worker ran the session: {reply.text!r}")
            if b.live() != [] or a.live() != ["s"]:
                problems.append(f"live on A: {a.live()}, on B: {b.live()}")
    assert problems == []


#: Every check, by name.
CHECKS: dict[str, Check] = {
    "acknowledged turns survive a death": acknowledged_turns_survive_a_death,
    "a long message survives a death": a_long_message_survives_a_death,
    "a hibernated session wakes whole": a_hibernated_session_wakes_whole,
    "a hibernated session wakes whole (durability=hibernate)": (
        lambda wrap: a_hibernated_session_wakes_whole(wrap, "hibernate")
    ),
    "compaction keeps every turn": compaction_keeps_every_turn,
    "a death after a clean wake reuses no seq": a_death_after_a_clean_wake_reuses_no_seq,
    "a stale owner cannot stop the session": a_stale_owner_cannot_stop_the_session,
    "a session leased by one worker is busy for another": (
        a_session_leased_by_one_worker_is_busy_for_another
    ),
}
