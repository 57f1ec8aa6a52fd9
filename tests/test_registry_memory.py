"""What the registry keeps after a wave of sessions: generation nurseries, tables, counters."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import sessionactors as sa
from faults import FaultyStore
from sessionactors._registry import GENERATION_PEAK
from sessionactors.stores import MemoryStore

GENERATION = "sessions generation"


def generations(registry: sa.Registry) -> set[trio.Nursery]:
    """The generation nurseries that are open now."""
    return {
        nursery
        for task in registry._nursery.child_tasks
        if task.name == GENERATION
        for nursery in task.child_nurseries
    }


def host(registry: sa.Registry, name: str) -> trio.Nursery:
    """The nursery that runs session ``name``'s task."""
    wanted = f"session {name!r}"
    nurseries = [registry._nursery, *generations(registry)]
    found = [n for n in nurseries for task in n.child_tasks if task.name == wanted]
    assert len(found) == 1, (name, found)
    return found[0]


async def wave(registry: sa.Registry, size: int, keep: int) -> list[sa.SessionRef]:
    """Spawn ``size`` sessions, then hibernate all but the first ``keep``."""
    refs = [await registry.spawn(f"w{i}") for i in range(size)]
    for ref in refs[keep:]:
        await ref.hibernate()
    await trio.testing.wait_all_tasks_blocked()
    return refs


async def test_after_a_wave_new_sessions_start_in_a_fresh_generation(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Once a wave falls to an eighth of its peak, new and woken sessions run in a fresh
    generation nursery, the sessions left in the old one keep answering and are still
    restarted after a crash, and the old nursery ends with its last session."""
    store = FaultyStore()
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents, store=store) as registry:
            (first,) = generations(registry)
            refs = await wave(registry, GENERATION_PEAK, keep=GENERATION_PEAK // 16)
            assert generations(registry) == {first}  # kept open by the sessions left in it
            assert host(registry, "w0") is first

            await registry.spawn("late")  # opens the next generation
            await trio.testing.wait_all_tasks_blocked()
            (second,) = generations(registry) - {first}
            later = await registry.spawn("later")
            assert (await refs[-1].send("back")).text == "back"  # woken
            await trio.testing.wait_all_tasks_blocked()
            assert host(registry, "later") is second
            assert host(registry, refs[-1].session_id) is second

            # a session of the old generation answers, and is restarted after a crash
            assert (await refs[0].send("still here")).text == "still here"
            store.faults["w0"] = 1
            with pytest.raises(sa.SessionCrashedError, match="restarted"):
                await refs[0].send("crash")
            assert (await refs[0].send("again")).text == "again"
            assert host(registry, "w0") is first
            assert store.injected == 1  # negative control: the fault fired

            for ref in refs[: GENERATION_PEAK // 16]:
                await ref.hibernate()
            await trio.testing.wait_all_tasks_blocked()
            assert generations(registry) == {second}  # the old one ended with its sessions
            assert (await later.send("new")).text == "new"
            stats = registry.statistics()
        assert registry.live() == []

    assert (stats.spawned, stats.crashes, stats.restarts) == (GENERATION_PEAK + 2, 1, 1)
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            assert [m.content for m in await registry.ref("w0").history()] == [
                "still here",
                "still here",
                "again",
                "again",
            ]
            assert len(await registry.ref("later").history()) == 2


async def test_closing_hibernates_the_sessions_of_every_generation(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Leaving the registry hibernates the sessions of a retired generation and of the
    current one alike, and nothing they were told is lost."""
    store = MemoryStore()
    keep = GENERATION_PEAK // 16
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents, store=store) as registry:
            refs = await wave(registry, GENERATION_PEAK, keep=keep)
            new = [await registry.spawn(f"n{i}") for i in range(3)]
            await trio.testing.wait_all_tasks_blocked()
            assert len(generations(registry)) == 2
            for ref in [*refs[:keep], *new]:
                await ref.submit(f"{ref.session_id} last words")
        assert registry.live() == []

    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            for ref in [*refs[:keep], *new]:
                history = await registry.ref(ref.session_id).history()
                assert [m.content for m in history] == [f"{ref.session_id} last words"] * 2


async def test_cancelling_the_registry_block_ends_every_generation(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Cancelling the block around the registry, with sessions in a retired and a current
    generation, ends it promptly, and a later request fails with SessionStoppedError."""
    with trio.fail_after(60):
        with trio.CancelScope() as scope:
            async with sa.open_registry(agents=echo_agents) as registry:
                refs = await wave(registry, GENERATION_PEAK, keep=GENERATION_PEAK // 16)
                await registry.spawn("late")
                await trio.testing.wait_all_tasks_blocked()
                assert len(generations(registry)) == 2
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        with pytest.raises(sa.SessionStoppedError):
            await refs[0].send("after close")


class Stop(BaseException):
    """Not an Exception: a session does not handle it."""


class StopModel:
    """A model whose turn raises ``Stop``."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await trio.lowlevel.checkpoint()
        raise Stop
        yield sa.TextChunk("never")  # pragma: no cover - makes this an async generator


async def test_an_exception_escaping_a_session_leaves_the_registry_in_one_group() -> None:
    """A BaseException that escapes a session's task ends the registry and comes out of
    ``open_registry`` in one exception group, as from the registry's own nursery."""
    with trio.fail_after(10), pytest.RaisesGroup(Stop):
        async with sa.open_registry(agents={"stop": sa.Agent(model=StopModel())}) as registry:
            ref = await registry.spawn("s")
            await ref.send("stop")


async def test_a_wave_leaves_the_registry_tables_and_counters_as_they_were(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """After a wave has hibernated, the registry's tables are the same dicts at their
    empty size, and its counters are exact."""
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents) as registry:
            live, hubs = registry._live, registry._hubs
            refs = [await registry.spawn(f"w{i}") for i in range(GENERATION_PEAK)]
            async with refs[0].subscribe():  # a hub, kept while subscribed
                for ref in refs:
                    await ref.hibernate()
                await trio.testing.wait_all_tasks_blocked()
                assert list(registry._hubs) == ["w0"]
            assert registry._live is live
            assert registry._hubs is hubs
            assert sys.getsizeof(live) == sys.getsizeof(hubs) == sys.getsizeof({})
            stats = registry.statistics()
    assert (stats.live, stats.spawned, stats.hibernated) == (0, GENERATION_PEAK, GENERATION_PEAK)
    assert repr(registry.stats).startswith(f"Counters(spawned={GENERATION_PEAK}, woken=0, ")
