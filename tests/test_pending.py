"""The result slot of a request: every waiter gets the outcome, cancelled ones leave.

(trio runs woken tasks in no fixed order, so no test asserts one.)
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from sessionactors._actor import Pending


async def test_every_waiter_gets_the_result() -> None:
    pending = Pending()
    got: list[tuple[int, object]] = []

    async def wait(i: int) -> None:
        got.append((i, await pending.wait()))

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(wait, i)
            await trio.testing.wait_all_tasks_blocked()
        pending.set_result("r")
        pending.set_result("ignored: the first outcome stays")
    assert sorted(got) == [(0, "r"), (1, "r"), (2, "r"), (3, "r")]
    assert await pending.wait() == "r"  # after the fact: at once


@pytest.mark.parametrize("cancelled", [0, 1, 2])
async def test_a_cancelled_waiter_leaves_and_the_others_still_get_it(cancelled: int) -> None:
    pending = Pending()
    got: list[int] = []
    scopes = [trio.CancelScope() for _ in range(4)]

    async def wait(i: int) -> None:
        with scopes[i]:
            await pending.wait()
            got.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(wait, i)
            await trio.testing.wait_all_tasks_blocked()
        scopes[cancelled].cancel()
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, 3)  # one more arrives after the cancel
        await trio.testing.wait_all_tasks_blocked()
        pending.set_result(None)
    assert sorted(got) == sorted({0, 1, 2, 3} - {cancelled})


async def test_an_error_is_raised_to_every_waiter() -> None:
    pending = Pending()
    errors: list[BaseException] = []

    async def wait() -> None:
        try:
            await pending.wait()
        except KeyError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        pending.set_error(KeyError("k"))
    assert len(errors) == 2


async def test_waiting_on_a_done_slot_is_still_a_checkpoint() -> None:
    pending = Pending.resolved(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await pending.wait()


def _idle(pending: Pending) -> bool:
    """Nothing of a waiter is left behind (the point of parking directly)."""
    return pending._task is None and not pending._others


@pytest.mark.parametrize("order", ["cancel first", "set first"])
@pytest.mark.parametrize("error", [False, True])
async def test_a_cancel_and_the_outcome_in_the_same_tick(order: str, error: bool) -> None:
    pending = Pending()
    got: dict[int, str] = {}
    scopes = [trio.CancelScope() for _ in range(2)]

    async def wait(i: int) -> None:
        with scopes[i]:
            try:
                got[i] = await pending.wait()
            except KeyError:
                got[i] = "error"
            return
        got[i] = "cancelled"

    def settle() -> None:
        if error:
            pending.set_error(KeyError("k"))
        else:
            pending.set_result("r")

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(wait, i)
            await trio.testing.wait_all_tasks_blocked()
        if order == "cancel first":
            scopes[0].cancel()
            settle()
        else:
            settle()
            scopes[0].cancel()
    outcome = "error" if error else "r"
    # a waiter already woken keeps its outcome; a cancelled one was withdrawn first
    assert got == {0: "cancelled" if order == "cancel first" else outcome, 1: outcome}
    assert _idle(pending)


async def test_a_waiter_cancelled_before_it_waits_leaves_nothing_and_can_wait_again() -> None:
    pending = Pending()
    with trio.CancelScope() as scope:
        scope.cancel()
        await pending.wait()
    assert scope.cancelled_caught
    assert _idle(pending)

    async def settle_soon() -> None:
        await trio.testing.wait_all_tasks_blocked()
        pending.set_result("r")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(settle_soon)
        assert await pending.wait() == "r"  # the same task as above
    assert _idle(pending)
