"""Waiting for a turn's reply: every waiter gets the outcome, cancelled ones leave.

(trio runs woken tasks in no fixed order, so no test asserts one.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


@asynccontextmanager
async def held_turn(
    outcome: str | BaseException = "the reply",
) -> AsyncIterator[tuple[sa.Turn, trio.Event]]:
    """A turn held open until the event is set; it then answers ``outcome`` (or raises it)."""
    release = trio.Event()
    if isinstance(outcome, BaseException):
        step = Scripted(text="partial", wait=release, wait_after=1, error=outcome)
    else:
        step = Scripted(text=outcome, wait=release)
    model = ScriptedModel([step])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        turn = await ref.submit("hello")
        yield turn, release


async def test_every_waiter_gets_the_reply() -> None:
    """Every task waiting on a turn's reply gets it, and a reply asked for afterwards comes at once."""
    got: list[tuple[int, str]] = []
    with trio.fail_after(10):
        async with held_turn() as (turn, release):

            async def wait(i: int) -> None:
                got.append((i, (await turn.reply()).text))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(wait, i)
                    await trio.testing.wait_all_tasks_blocked()
                release.set()
            assert (await turn.reply()).text == "the reply"
    assert sorted(got) == [(i, "the reply") for i in range(4)]


@pytest.mark.parametrize("cancelled", [0, 1, 2])
async def test_a_cancelled_waiter_leaves_and_the_others_still_get_the_reply(cancelled: int) -> None:
    """A waiter cancelled while it waits leaves; the others, and one that comes later, get the reply."""
    got: list[int] = []
    scopes = [trio.CancelScope() for _ in range(4)]
    with trio.fail_after(10):
        async with held_turn() as (turn, release):

            async def wait(i: int) -> None:
                with scopes[i]:
                    await turn.reply()
                    got.append(i)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(wait, i)
                    await trio.testing.wait_all_tasks_blocked()
                scopes[cancelled].cancel()
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(wait, 3)  # one more arrives after the cancel
                await trio.testing.wait_all_tasks_blocked()
                release.set()
    assert sorted(got) == sorted({0, 1, 2, 3} - {cancelled})


async def test_a_failure_is_raised_to_every_waiter() -> None:
    """Every waiter of a turn that fails gets TurnFailedError."""
    errors: list[BaseException] = []
    with trio.fail_after(10):
        async with held_turn(ValueError("the model broke")) as (turn, release):

            async def wait() -> None:
                with pytest.raises(sa.TurnFailedError) as info:
                    await turn.reply()
                errors.append(info.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                release.set()
    assert len(errors) == 2
    assert all(isinstance(e.__cause__, ValueError) for e in errors)


async def test_waiting_on_a_finished_turn_is_still_a_checkpoint() -> None:
    """reply() of a turn already answered still honours a cancellation."""
    with trio.fail_after(10):
        async with held_turn() as (turn, release):
            release.set()
            await turn.reply()
            with trio.CancelScope() as scope:
                scope.cancel()
                with pytest.raises(trio.Cancelled):
                    await turn.reply()


async def cancel_racing_the_reply() -> dict[int, str]:
    """Two waiters; the first is cancelled in the tick its turn is answered. What each got."""
    got: dict[int, str] = {}
    scopes = [trio.CancelScope() for _ in range(2)]
    with trio.fail_after(10):
        async with held_turn() as (turn, release):

            async def wait(i: int) -> None:
                with scopes[i]:
                    got[i] = (await turn.reply()).text
                    return
                got[i] = "cancelled"

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(wait, i)
                    await trio.testing.wait_all_tasks_blocked()
                release.set()
                while not turn.done:
                    await trio.lowlevel.checkpoint()
                scopes[0].cancel()
    return got


async def test_a_cancel_racing_the_reply_either_cancels_the_wait_or_delivers_it() -> None:
    """A waiter cancelled in the tick its turn is answered either was cancelled or got the
    reply, and the other waiter gets the reply; the race is decided by trio's scheduling, so
    it is run many times."""
    for _ in range(30):
        got = await cancel_racing_the_reply()
        assert got[1] == "the reply"
        assert got[0] in ("the reply", "cancelled")


async def test_a_waiter_cancelled_before_it_waits_can_wait_again() -> None:
    """A reply() cancelled before it waits ends at once, and the same task can wait again."""
    with trio.fail_after(10):
        async with held_turn() as (turn, release):
            with trio.CancelScope() as scope:
                scope.cancel()
                await turn.reply()
            assert scope.cancelled_caught

            async def answer_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                release.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_soon)
                assert (await turn.reply()).text == "the reply"
