"""How-to: test what your code does when the store fails, and prove a check can fail.

Each ``test_*`` function below is a test as pytest-trio collects it (``trio_mode = true``);
``main`` runs them all, so this file also runs on its own.
"""

import pytest
import trio

import sessionactors as sa
from sessionactors.stores import Store
from sessionactors.testing import EchoModel, FaultyStore, FlawedStore, journal_events

AGENTS = {"echo": sa.Agent(model=EchoModel())}


async def test_a_store_fault_crashes_the_session_and_it_recovers() -> None:
    """FaultyStore fails the operations a test names; the rest reach the store it wraps."""
    store = FaultyStore()  # over a new MemoryStore
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        ref = await registry.spawn("ada")
        with trio.fail_after(5):
            await ref.send("one")
            store.fail("append", session_id="ada")  # the next journal write of "ada" fails
            with pytest.raises(sa.SessionCrashedError):
                await ref.send("two")
            assert store.injected == 1  # the fault fired: the test tested something
            # The actor restarted from its durable state: the failed turn is not in it.
            assert (await ref.send("three")).text == "three"
            assert [m.content for m in await ref.history()] == ["one", "one", "three", "three"]
        assert registry.statistics().restarts == 1


async def reply_is_journaled(store: Store) -> bool:
    """The check under test: is a turn in the store by the time its reply returns?"""
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        ref = await registry.spawn("ada")
        reply = await ref.send("Remember this.")
        # journal_events reads the store as a restarted process would, without waking "ada".
        events = await journal_events(store, "ada")
    return any(isinstance(e, sa.TurnFinished) and e.turn_id == reply.turn_id for e in events)


async def test_a_reply_returns_once_its_turn_is_durable() -> None:
    """The check passes over a sound store."""
    with trio.fail_after(5):
        assert await reply_is_journaled(sa.MemoryStore())


async def test_the_check_fails_over_a_store_that_loses_appends() -> None:
    """FlawedStore breaks one promise of the store contract: the check must catch it."""
    with trio.fail_after(5):
        assert not await reply_is_journaled(FlawedStore("lose_appends"))


async def main() -> None:
    tests = [
        test_a_store_fault_crashes_the_session_and_it_recovers,
        test_a_reply_returns_once_its_turn_is_durable,
        test_the_check_fails_over_a_store_that_loses_appends,
    ]
    for test in tests:
        await test()
        print("passed:", test.__name__)


if __name__ == "__main__":
    trio.run(main)
