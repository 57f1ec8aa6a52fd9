"""What the registry keeps after a wave of sessions: the memory it took, and sessions that
still answer, restart and close as before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import sessionactors as sa
from memory import grow_trio_task_table, traced_memory
from sessionactors.stores import MemoryStore
from sessionactors.testing import FaultyStore

#: A wave of sessions large enough that the registry gives back what it took when the
#: wave falls to an eighth of its peak.
WAVE = 1024


async def wave(registry: sa.Registry, size: int, keep: int) -> list[sa.SessionRef]:
    """Spawn and wake ``size`` sessions, then hibernate all but the first ``keep``."""
    refs = [await registry.spawn(f"w{i}") for i in range(size)]
    for ref in refs:
        await ref.state()  # a spawned session's actor starts with its first request
    for ref in refs[keep:]:
        await ref.hibernate()
    await trio.testing.wait_all_tasks_blocked()
    return refs


async def test_after_a_wave_the_sessions_left_and_new_ones_answer_and_restart(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Once a wave falls to an eighth of its peak, new and woken sessions answer, the
    sessions left from the wave keep answering and are still restarted after a crash, and
    the counters are exact."""
    store = FaultyStore()
    keep = WAVE // 16
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents, store=store) as registry:
            refs = await wave(registry, WAVE, keep=keep)
            assert len(registry.live()) == keep
            late = await registry.spawn("late")
            later = await registry.spawn("later")
            assert (await refs[-1].send("back")).text == "back"  # woken
            assert (await late.send("late")).text == "late"

            # a session left from the wave answers, and is restarted after a crash
            assert (await refs[0].send("still here")).text == "still here"
            store.fail("append", session_id="w0")
            with pytest.raises(sa.SessionCrashedError, match="restarted"):
                await refs[0].send("crash")
            assert (await refs[0].send("again")).text == "again"
            assert store.injected == 1  # negative control: the fault fired

            for ref in refs[:keep]:
                await ref.hibernate()
            await trio.testing.wait_all_tasks_blocked()
            assert (await later.send("new")).text == "new"
            assert sorted(registry.live()) == sorted(["late", "later", refs[-1].session_id])
            stats = registry.statistics()
        assert registry.live() == []

    assert (stats.spawned, stats.crashes, stats.restarts) == (WAVE + 2, 1, 1)
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            assert [m.content for m in await registry.ref("w0").history()] == [
                "still here",
                "still here",
                "again",
                "again",
            ]
            assert len(await registry.ref("later").history()) == 2


async def test_closing_hibernates_the_sessions_left_from_a_wave_and_the_new_ones(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Leaving the registry hibernates the sessions left from a wave and those spawned after
    it alike, and nothing they were told is lost."""
    store = MemoryStore()
    keep = WAVE // 16
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents, store=store) as registry:
            refs = await wave(registry, WAVE, keep=keep)
            new = [await registry.spawn(f"n{i}") for i in range(3)]
            await trio.testing.wait_all_tasks_blocked()
            for ref in [*refs[:keep], *new]:
                await ref.submit(f"{ref.session_id} last words")
        assert registry.live() == []

    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            for ref in [*refs[:keep], *new]:
                history = await registry.ref(ref.session_id).history()
                assert [m.content for m in history] == [f"{ref.session_id} last words"] * 2


async def test_cancelling_the_registry_block_after_a_wave_ends_every_session(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """Cancelling the block around the registry, with sessions left from a wave and new
    ones, ends it promptly, and a later request fails with SessionStoppedError."""
    with trio.fail_after(60):
        with trio.CancelScope() as scope:
            async with sa.open_registry(agents=echo_agents) as registry:
                refs = await wave(registry, WAVE, keep=WAVE // 16)
                await registry.spawn("late")
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        with pytest.raises(sa.SessionStoppedError):
            await refs[0].send("after close")


class Stop(KeyboardInterrupt):
    """A Ctrl-C landing in a model: a session does not handle it (anything else a model
    raises, a bare BaseException too, fails its turn only)."""


class StopModel:
    """A model whose turn raises ``Stop``."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        await trio.lowlevel.checkpoint()
        raise Stop
        yield sa.TextChunk("never")  # pragma: no cover - makes this an async generator


async def test_an_exception_escaping_a_session_ends_the_registry_as_itself() -> None:
    """A KeyboardInterrupt that escapes a session's task ends the registry and comes out
    of ``open_registry`` as itself (alone, it is not wrapped in a group)."""

    async def run() -> None:
        async with sa.open_registry(agents={"stop": sa.Agent(model=StopModel())}) as registry:
            ref = await registry.spawn("s")
            await ref.send("stop")

    with trio.fail_after(10), pytest.raises(Stop):
        await run()


async def test_a_base_exception_in_one_session_ends_the_registry_while_others_are_live(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """A KeyboardInterrupt (a Ctrl-C landing in a model) escaping one session ends the registry
    at once, as itself, even while other sessions are live (they are shut down in a hurry
    and hibernated: their answered turns are kept)."""
    store = MemoryStore()
    agents = {**echo_agents, "stop": sa.Agent(model=StopModel())}

    async def run() -> None:
        async with sa.open_registry(agents=agents, store=store) as registry:
            other = await registry.spawn("other", agent=next(iter(echo_agents)))
            await other.send("still here")
            await (await registry.spawn("s", agent="stop")).submit("stop")
            await trio.sleep(5000)  # the application goes on: it must not

    start = trio.current_time()
    with trio.fail_after(60), pytest.raises(Stop):
        await run()
    assert trio.current_time() - start < 100
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        history = await registry.ref("other").history()
    assert [m.content for m in history] == ["still here"] * 2


async def test_a_wave_gives_back_the_memory_it_took(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """After a wave of sessions has woken and hibernated again (one subscriber kept), the
    registry holds at most a few bytes per session of the wave, besides what the store
    keeps, and its counters are exact."""
    store = MemoryStore()
    with trio.fail_after(60):
        async with sa.open_registry(agents=echo_agents, store=store) as registry:
            await wave(registry, WAVE, keep=0)
        await grow_trio_task_table(4 * WAVE)
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        refs = [registry.ref(f"w{i}") for i in range(WAVE)]
        async with traced_memory(store) as held:
            with trio.fail_after(60):
                for ref in refs:
                    await ref.history()  # wakes it
                async with refs[0].subscribe():  # kept while subscribed
                    for ref in refs:
                        await ref.hibernate()
        stats = registry.statistics()
    # A registry that kept its tables at the wave's size would hold about 100 bytes a session.
    assert held.bytes < 16 * WAVE, f"{held.bytes} bytes held after a wave of {WAVE} sessions"
    assert (stats.live, stats.subscribers, stats.woken, stats.hibernated) == (0, 0, WAVE, WAVE)
