"""Probes of the stores' and the codec's limits, and of what a session keeps over time."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import MAX_SNAPSHOT_BYTES
from sessionactors.testing import EchoModel

# One turn of EchoModel adds its input twice (the user's message and the echo).
_BIG_TEXT = "x" * (1024 * 1024 - 64)
_TURNS_OVER_LIMIT = MAX_SNAPSHOT_BYTES // (2 * len(_BIG_TEXT)) + 1


async def _grow_past_the_snapshot_limit(ref: sa.SessionRef) -> None:
    for _ in range(_TURNS_OVER_LIMIT):
        await ref.send(_BIG_TEXT)


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_hibernating_a_session_too_large_to_snapshot_says_so_and_keeps_it_live(
    durability: str,
) -> None:
    """hibernate() of a session whose snapshot would pass the limit raises a SnapshotError
    naming it, and the session stays live and healthy: no crash, no restart, never failed."""
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}, durability=durability) as registry:
        ref = await registry.spawn("big")
        await _grow_past_the_snapshot_limit(ref)
        for _ in range(5):  # more than the restart intensity allows
            with pytest.raises(sa.SnapshotError, match="'big'.*truncate") as caught:
                await ref.hibernate()
            assert caught.value.session_id == "big"
        stats = registry.statistics()
        assert (stats.crashes, stats.restarts, stats.failed) == (0, 0, 0)
        assert registry.live() == ["big"]
        assert (await ref.state()).status is sa.Status.IDLE
        await ref.truncate(2)
        await ref.hibernate()
        assert registry.live() == []
        assert len(await ref.history()) == 2


async def test_an_idle_session_too_large_to_snapshot_stays_live_without_crashing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle timeout's hibernation of a session too large to snapshot leaves it live,
    serving requests, instead of crashing and reloading it from the store each time."""
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}, idle_timeout=5) as registry:
        ref = await registry.spawn("big")
        await _grow_past_the_snapshot_limit(ref)
        await trio.sleep(60)
        stats = registry.statistics()
        assert (stats.crashes, stats.restarts, stats.woken) == (0, 0, 1)  # (the spawn)
        with trio.fail_after(5):
            assert (await ref.send("small")).text == "small"
        assert registry.live() == ["big"]
