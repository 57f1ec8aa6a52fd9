"""How-to: test what your code does when the store fails, stalls, or loses what it was given.

Each ``test_*`` function below is a test as pytest-trio collects it (``trio_mode = true``);
``main`` runs them all, so this file also runs on its own.
"""

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import MemoryStore, Store
from sessionactors.testing import EchoModel, FaultyStore, FlawedStore, crash, journal_events

AGENTS = {"echo": sa.Agent(model=EchoModel())}


async def save_order(registry: sa.Registry, order: str) -> str:
    """The application code under test: record an order in the customer's session."""
    ref = await registry.get_or_spawn("customer-1")
    reply = await ref.send(f"order {order}")
    return reply.text


async def test_a_store_fault_crashes_the_session_and_it_restarts() -> None:
    """FaultyStore.fail makes the next write fail: the turn's caller hears the session
    crashed, and the session restarts from what the store kept."""
    store = FaultyStore(MemoryStore())
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        with trio.fail_after(5):
            await save_order(registry, "A1")
            store.fail("append", session_id="customer-1")  # the next journal write fails
            with pytest.raises(sa.SessionCrashedError):
                await save_order(registry, "A2")
            assert await save_order(registry, "A3") == "order A3"
            history = await registry.ref("customer-1").history()
    assert store.injected == 1  # the fault really fired
    assert [m.content for m in history] == ["order A1", "order A1", "order A3", "order A3"]


async def test_a_stalled_store_holds_the_reply_until_the_write_lands() -> None:
    """FaultyStore.hold makes writes wait: a reply comes only once its turn is stored."""
    store = FaultyStore(MemoryStore())
    replies: list[str] = []

    async def order(text: str) -> None:
        replies.append(await save_order(registry, text))

    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        with trio.fail_after(5):
            await order("A1")
            gate = store.hold("append")  # journal writes wait until gate.open()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(order, "A2")
                await trio.testing.wait_all_tasks_blocked()
                assert gate.waiting == 1  # the turn ran; its write is held, and its reply
                assert replies == ["order A1"]
                gate.open()
            assert replies == ["order A1", "order A2"]
    events = await journal_events(store, "customer-1")  # what a restart would find
    finished = [e.message.content for e in events if isinstance(e, sa.TurnFinished)]
    assert finished == ["order A1", "order A2"]


async def orders_survive_a_crash(store: Store) -> bool:
    """A durability check: is every order acknowledged before a process dies still there?

    A process death is crash(registry) and a cancel scope around the registry: nothing
    more is written, and nothing after it runs.
    """
    with trio.CancelScope() as process:
        async with sa.open_registry(store=store, agents=AGENTS) as registry:
            for order in ("A1", "A2"):
                await save_order(registry, order)
            crash(registry)
            process.cancel()
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        history = await registry.ref("customer-1").history()
    return [m.content for m in history if m.role is sa.Role.USER] == ["order A1", "order A2"]


async def test_the_durability_check_passes_and_catches_a_store_that_loses_writes() -> None:
    """The check holds for a sound store and fails for FlawedStore("lose_appends"), a store
    that acknowledges writes and drops them: so a pass means something."""
    with trio.fail_after(5):
        assert await orders_survive_a_crash(MemoryStore())
        assert not await orders_survive_a_crash(FlawedStore("lose_appends", MemoryStore()))


async def main() -> None:
    tests = [
        test_a_store_fault_crashes_the_session_and_it_restarts,
        test_a_stalled_store_holds_the_reply_until_the_write_lands,
        test_the_durability_check_passes_and_catches_a_store_that_loses_writes,
    ]
    for test in tests:
        await test()
        print("passed:", test.__name__)
    print("flaws:", ", ".join(FlawedStore.FLAWS))


if __name__ == "__main__":
    trio.run(main)
