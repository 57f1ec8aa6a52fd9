"""The snapshots a live session writes as its long history grows and is edited: each is the
exact dump_snapshot of the state it holds, and that state is the session's."""

from __future__ import annotations

import trio

import sessionactors as sa
from sessionactors.stores import MemoryStore, Store
from sessionactors.testing import EchoModel, FaultyStore, FlawedStore

ECHO = {"echo": sa.Agent(model=EchoModel())}
BIG = "word " * 4000  # a turn whose journal entry soon outweighs the snapshot


async def snapshot_problems(disk: Store) -> list[str]:
    """Grow a session past a hundred messages, edit it in every way, and check every snapshot
    written meanwhile. Problems found: snapshot bytes that are not the dump of what they hold,
    or a snapshot that is not the session's state as it was written."""
    store = FaultyStore(disk)
    problems: list[str] = []
    checked = 0
    async with sa.open_registry(store=store, agents=ECHO, snapshot_every=1) as registry:
        ref = await registry.spawn("s")

        async def check(what: str) -> None:
            nonlocal checked
            stored = await disk.load("s")
            assert stored is not None
            state = sa.load_snapshot(stored.snapshot)
            if sa.dump_snapshot(state) != stored.snapshot:
                problems.append(f"after {what}: the snapshot is not the dump of what it holds")
            if list(state.messages) != await ref.history():
                problems.append(f"after {what}: the snapshot holds another history")
            checked += 1

        async def until_a_snapshot(what: str) -> None:
            """Send big turns until one is followed by a snapshot (the journal outweighs it)."""
            for _ in range(40):
                before = store.calls["write_snapshot"]
                await ref.send(BIG)
                if store.calls["write_snapshot"] > before:
                    await check(what)
                    return
            problems.append(f"after {what}: no snapshot was written")

        with trio.fail_after(60):
            for i in range(70):  # a long history: over a hundred messages
                await ref.send(f"turn {i}")
            await until_a_snapshot("a long history")
            await until_a_snapshot("turns appended to it")
            history = await ref.history()
            await ref.rewind(history[-3].id)  # drops the newest turn
            await until_a_snapshot("a rewind")
            await ref.truncate(len(await ref.history()) - 4)  # drops the oldest
            await until_a_snapshot("a truncate")
            await ref.set_summary("what came before")
            await until_a_snapshot("a summary")
            await ref.hibernate()
            await until_a_snapshot("a wake (every message a new object)")
    if checked < 6:
        problems.append(f"only {checked} snapshots were checked")
    return problems


async def test_every_snapshot_written_holds_the_sessions_state(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Each snapshot a long, edited session writes is the dump_snapshot of what it holds, and
    holds the session's history."""
    assert await snapshot_problems(MemoryStore()) == []


async def test_the_snapshot_check_catches_a_stale_snapshot(autojump_clock: trio.abc.Clock) -> None:
    """The same check reports a snapshot that holds an older history than the session's
    (a store that keeps the old snapshot): the negative control."""
    problems = await snapshot_problems(FlawedStore("lose_snapshots", MemoryStore()))
    assert any("holds another history" in p for p in problems), problems
