"""The result slot of one request: the caller waits on it, the actor fills it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import outcome
import trio

from ._nesting import refuse_within

__all__ = ["Append", "Pending"]

#: An append of journal entries with the session's info: (entries, info, fence).
Append = Callable[[Sequence[Any], bytes, "int | None"], Awaitable[None]]


class Pending:
    """The result slot of one request; any number of callers may wait on it.

    Its first waiter parks directly (no ``trio.Event``): a request in flight
    keeps as few objects alive as it can, which matters to the collector when
    thousands are in flight. Further waiters (callers joining a turn by its
    idempotency key) queue behind it. Cancelling a wait only abandons it.
    """

    __slots__ = (
        "_others",
        "_task",
        "done",
        "error",
        "owner",
        "renamed",
        "result",
        "write_outcome",
    )

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None  # the first waiter
        self._others: dict[trio.lowlevel.Task, None] | None = None  # the rest, in order
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        #: Set by a router for a turn another worker asked for: called with the turn's
        #: reply, it returns the call that journals the turn's outcome in place of the
        #: store's ``append`` (the same arguments but the session), or None.
        self.write_outcome: Callable[[Any], Append | None] | None = None
        #: ``(registry's sessions, session name)`` of a turn submitted from within a
        #: turn (see ``_nesting``): a wait on it from within its session's turn is refused.
        self.owner: tuple[object, str] | None = None
        #: Set by a router for a turn another worker accepted and then sent on to the
        #: session's next worker (it closed before starting it): the turn's id there.
        self.renamed: str | None = None

    @classmethod
    def resolved(cls, result: Any) -> Pending:
        p = cls()
        p.result = result
        p.done = True
        return p

    def set_result(self, result: Any) -> None:
        if not self.done:
            self.result = result
            self._finish()

    def set_error(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self._finish()

    def _finish(self) -> None:
        self.done = True
        task, others = self._task, self._others
        self._task = self._others = None
        if task is not None:  # parked in trio's wait itself: it returns what this sends
            error = self.error
            trio.lowlevel.reschedule(
                task, outcome.Value(self.result) if error is None else outcome.Error(error)
            )
        if others is not None:
            for task in others:
                trio.lowlevel.reschedule(task)

    def _abort_first(self, _: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wait(self) -> Awaitable[Any]:
        """The result (or raise the error), parking until it is known: to await at once.

        A wait that finds the result already known still checkpoints. Not a
        coroutine of its own: the first waiter parks in trio's wait, which returns
        the result (a turn waiting for its commit keeps one frame less alive, and
        a thousand of them wait at once).
        """
        if self.owner is not None and not self.done:
            refuse_within(*self.owner)
        if self.done or self._task is not None:
            return self._wait_known_or_behind()
        self._task = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(self._abort_first)  # noqa: ASYNC105

    async def _wait_known_or_behind(self) -> Any:
        if self.done:
            await trio.lowlevel.checkpoint()
        else:
            task = trio.lowlevel.current_task()
            others = self._others
            if others is None:
                others = self._others = {}
            others[task] = None

            def abort(_: object) -> trio.lowlevel.Abort:
                if self._others is not None:
                    del self._others[task]
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if self.error is not None:
            raise self.error
        return self.result
