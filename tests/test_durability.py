"""Hibernation and wake keep a session exactly; hostile names are stored safely."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors.testing import ScriptedModel
from strategies import MSGPACK_INT_MAX, MSGPACK_INT_MIN

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
HISTORIES = st.lists(st.tuples(TEXT, TEXT), min_size=0, max_size=8)


def comparable(state: sa.SessionState) -> tuple[object, ...]:
    """Everything durable about a session, minus what a wake is meant to change."""
    return (
        state.session_id,
        state.agent,
        state.messages,
        dict(state.metadata),
        state.system_prompt,
        state.summary,
        state.completed,
        state.reviews,
        state.turn_count,
        state.open_turn,
        state.created_at,
    )


async def hibernate_and_wake(
    turns: list[tuple[str, str]], metadata: dict[str, object], summary: str | None, store: sa.Store
) -> tuple[sa.SessionState, sa.SessionState]:
    model = ScriptedModel([reply for _, reply in turns])
    agents = {"a": sa.Agent(model=model)}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s", metadata=metadata, system_prompt="be kind")
        for i, (text, _) in enumerate(turns):
            await ref.send(text, idempotency_key=f"k{i}")
        if summary is not None:
            await ref.set_summary(summary)
        before = await ref.state()
        await ref.hibernate()
        assert registry.live() == []
    async with sa.open_registry(store=store, agents=agents) as registry:
        after = await registry.ref("s").state()
    return before, after


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=HISTORIES,
    metadata=st.dictionaries(
        st.text(max_size=8),
        st.integers(MSGPACK_INT_MIN, MSGPACK_INT_MAX) | TEXT | st.none(),
        max_size=4,
    ),
    summary=st.none() | TEXT,
)
def test_hibernate_and_wake_keep_the_state_exactly(
    turns: list[tuple[str, str]], metadata: dict[str, object], summary: str | None
) -> None:
    """A session hibernated and woken in a new registry has exactly the state it had."""
    before, after = trio.run(
        hibernate_and_wake,
        turns,
        metadata,
        summary,
        sa.MemoryStore(),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert comparable(after) == comparable(before)
    assert after.event_seq >= before.event_seq


HOSTILE_NAMES = [
    "../../etc/passwd",
    "/absolute/path",
    "C:\\windows\\system32",
    "x'; DROP TABLE sessions; --",
    'quote " and backslash \\',
    "*?[]{}",
    "%s %d %(name)s",
    "é" * 128,  # 256 UTF-8 bytes
]


async def test_hostile_names_are_stored_safely_on_sqlite(tmp_path: Path) -> None:
    """Path-like and SQL-like names round-trip through SQLite, and nothing is written beside the database."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    path = store_dir / "sessions.db"
    agents = {"a": sa.Agent(model=ScriptedModel(["ok"], repeat=True))}
    with trio.fail_after(30):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            for name in HOSTILE_NAMES:
                await (await registry.spawn(name)).send(f"hello {name}")
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
            assert sorted(i.session_id for i in await registry.sessions()) == sorted(HOSTILE_NAMES)
            for name in HOSTILE_NAMES:
                history = await registry.ref(name).history()
                assert history[0].content == f"hello {name}"
    written = {p.name for p in store_dir.iterdir()}
    assert written <= {"sessions.db", "sessions.db-wal", "sessions.db-shm"}
    assert sorted(os.listdir(tmp_path)) == ["store"]


async def test_replay_without_a_journal_says_the_events_are_gone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With durability="hibernate", replay from before a hibernation raises EventsExpiredError, not a silent gap."""
    agents = {"a": sa.Agent(model=ScriptedModel(["one", "two"]))}
    async with sa.open_registry(agents=agents, durability="hibernate") as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send("first")
            await ref.send("second")
            await ref.hibernate()
        state = await ref.state()
        with pytest.raises(sa.EventsExpiredError) as info:
            async with ref.subscribe(after=1):
                pass  # pragma: no cover
        assert info.value.oldest_seq > 1
        async with ref.subscribe(after=state.event_seq):  # resuming from the state works
            pass
