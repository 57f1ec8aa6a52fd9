"""Probes of what the stores hold and write over a session's long life."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, journal_events

_KEEP = 6


@asynccontextmanager
async def _store(
    kind: str, tmp_path: Path, redis_url: Callable[[], str]
) -> AsyncIterator[sa.Store]:
    if kind == "memory":
        yield sa.MemoryStore()
    elif kind == "sqlite":
        store = sa.SQLiteStore(tmp_path / "sessions.db")
        try:
            yield store
        finally:
            await store.aclose()
    else:
        store = RedisStore(redis_url(), prefix=f"grow-{uuid.uuid4().hex}")
        try:
            yield store
        finally:
            await store.aclose()


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Each store in turn."""
    kind: str = request.param
    return kind


@pytest.fixture
def lazy_redis_url(request: pytest.FixtureRequest) -> Callable[[], str]:
    """The redis URL, started only by the tests that use it."""

    def url() -> str:
        value: str = request.getfixturevalue("redis_url")
        return value

    return url


async def test_a_session_that_hibernates_after_every_turn_keeps_a_bounded_journal(
    store_kind: str, tmp_path: Path, lazy_redis_url: Callable[[], str]
) -> None:
    """Many short wake / turn / hibernate cycles leave a journal of about
    journal_keep_events events, not one that grows with every cycle; a resume from
    within the kept events still replays them."""
    agent = sa.Agent(model=EchoModel())
    async with (
        _store(store_kind, tmp_path, lazy_redis_url) as store,
        sa.open_registry(
            store=store, agents={"echo": agent}, journal_keep_events=_KEEP, snapshot_every=1
        ) as registry,
    ):
        ref = await registry.spawn("chatty")
        for i in range(40):
            with trio.fail_after(10):
                await ref.send(f"turn {i}")
                await ref.hibernate()
        kept = await journal_events(store, "chatty")
        assert _KEEP <= len(kept) <= 3 * _KEEP
        with trio.fail_after(10):
            async with ref.subscribe(after=kept[-_KEEP].seq - 1) as events:
                first = await events.__anext__()
        assert first.seq == kept[-_KEEP].seq
