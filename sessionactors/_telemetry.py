"""The instrumentation seam: what a registry reports about its work, for traces and metrics.

The core calls these hooks and knows nothing of what is behind them; with no
``telemetry=`` given to ``open_registry`` it calls none of them (a turn pays for
one ``is None`` test at each hook point). ``sessionactors.otel`` implements them
with OpenTelemetry; an application may implement them for anything else.

Every hook is synchronous and must return at once: it runs in the actor's task,
in the middle of a turn. A hook that raises is logged and ignored (``guarded``):
telemetry watches the work and never fails it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from ._model import Model, ModelRequest
from ._records import ToolCall, Usage

__all__ = ["ModelCallTrace", "Telemetry", "ToolCallTrace", "TurnTrace", "guarded"]

log = logging.getLogger("sessionactors")

T = TypeVar("T")


class ToolCallTrace:
    """One tool call of a turn (what :meth:`TurnTrace.tool_call` yields)."""

    def failed(self, error: BaseException | None, message: str) -> None:
        """The call's result is an error: ``error`` is what the tool raised (None
        for arguments that do not fit, or an error result the tool returned), and
        ``message`` what the model is told."""


class ModelCallTrace:
    """One model call of a turn (made by :meth:`TurnTrace.model_call`)."""

    def first_chunk(self) -> None:
        """The model's first chunk arrived."""

    def finished(self, reason: str) -> None:
        """The model cut its answer short, saying why (its ``FinishChunk``: ``"length"``,
        ``"content_filter"``): called before :meth:`end`, only for such an answer."""

    def end(self, usage: Usage | None, error: BaseException | None) -> None:
        """The call ended: the tokens the model reported (if it did), or its error."""


class TurnTrace:
    """One turn's instrumentation (made by :meth:`Telemetry.turn`).

    A turn paused for a review and resumed later is traced again when it resumes.
    """

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Make the turn current in this task while the turn loop runs (its tools
        and their child tasks run inside)."""
        yield

    def waited(self, seconds: float) -> None:
        """The turn waited ``seconds`` before it started: from when its id was issued
        to now. Called once, right after :meth:`Telemetry.turn` made this trace, for a
        turn that starts from the mailbox; not for a turn resumed (after a review, or
        found open on wake), a ``retry()`` or a stop that ends a turn waiting on a review.

        An id is issued as the turn is accepted into the mailbox (also while its
        session wakes, so the wake is part of the wait), or, when the mailbox is full,
        as the caller begins to wait for room (that wait is part of it); a turn that
        another worker forwarded may run under the id that worker issued as it sent
        the turn on, so its wait counts from then, by that worker's clock.
        """

    def model_call(self, model: Model, request: ModelRequest) -> ModelCallTrace:
        """The turn asks ``model``; its result hears how the call goes."""
        return ModelCallTrace()

    @contextlib.contextmanager
    def tool_call(self, call: ToolCall) -> Iterator[ToolCallTrace]:
        """Wraps the run of one tool call, in the task that runs it: the tool's own
        work happens inside."""
        yield ToolCallTrace()

    def end(self, outcome: str, error: BaseException | None) -> None:
        """The turn ended: ``outcome`` is ``"finished"``, ``"failed"``,
        ``"cancelled"``, ``"waiting"`` (paused for a review) or ``"crashed"`` (the
        session crashed, or was deleted or fenced out, in the middle of it);
        ``error`` is what failed it."""


class Telemetry:
    """What a registry reports as it works; every hook does nothing here.

    Subclass it and pass an instance as ``open_registry(..., telemetry=...)``;
    ``sessionactors.otel.OpenTelemetry`` is the one that ships.
    """

    def registry_opened(self, registry: Any) -> None:
        """A registry (a ``sessionactors.Registry``) opened with this telemetry."""

    def registry_closed(self, registry: Any) -> None:
        """That registry closed."""

    def turn(
        self, *, session_id: str, turn_id: str, agent: str | None, queued: int
    ) -> TurnTrace | None:
        """A turn starts (``queued``: requests waiting behind it in the mailbox);
        what follows it, or None to follow nothing."""
        return None

    def store_write(self, *, operation: str, seconds: float, error: BaseException | None) -> None:
        """The store took ``seconds`` for one write: ``operation`` is ``"append"``
        (journal entries) or ``"snapshot"``; ``error`` is what it raised, or, for a
        write cut short because its session was stopped at once, why it was: its lease
        lost (``FencedOutError``) or the session deleted (``SessionNotFoundError``)."""

    def subscriber_lagged(self, *, session_id: str) -> None:
        """A subscriber of the session fell behind and was cut off."""


def guarded(telemetry: Telemetry) -> Telemetry:
    """``telemetry`` with each hook's exceptions logged and ignored (what the registry
    calls): a buggy hook or exporter costs its own report, never a turn, a store
    write or a session. The first failure of each hook is logged with its traceback;
    later ones of the same hook are not, so a hook that fails every turn does not
    flood the log."""
    return _Telemetry(telemetry, _Failures())


class _Failures:
    """The hooks that raised already (reported once each)."""

    __slots__ = ("hooks",)

    def __init__(self) -> None:
        self.hooks: set[str] = set()

    def report(self, hook: str) -> None:
        if hook not in self.hooks:
            self.hooks.add(hook)
            log.warning(
                "the telemetry hook %s raised; ignored (later failures of this hook are "
                "not logged)",
                hook,
                exc_info=True,
            )


@contextlib.contextmanager
def _safe_context(
    failures: _Failures, hook: str, make: Callable[[], AbstractContextManager[T]], default: T
) -> Iterator[T]:
    """The hook's context manager around the work, its failures reported: the work
    runs whether or not the hook could enter, and its own exception goes on as it is
    (never replaced, never swallowed by the hook)."""
    try:
        manager = make()
        value = manager.__enter__()
    except Exception:
        failures.report(hook)
        entered = False
    else:
        entered = True
    if not entered:  # (outside the handler: the work's errors carry no hook error)
        yield default
        return
    try:
        yield value
    except BaseException as exc:
        try:
            manager.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as hook_error:
            if hook_error is not exc:
                failures.report(hook)
        raise
    try:
        manager.__exit__(None, None, None)
    except Exception:
        failures.report(hook)


class _Telemetry(Telemetry):
    __slots__ = ("_failures", "_inner")

    def __init__(self, inner: Telemetry, failures: _Failures) -> None:
        self._inner = inner
        self._failures = failures

    def registry_opened(self, registry: Any) -> None:
        try:
            self._inner.registry_opened(registry)
        except Exception:
            self._failures.report("Telemetry.registry_opened")

    def registry_closed(self, registry: Any) -> None:
        try:
            self._inner.registry_closed(registry)
        except Exception:
            self._failures.report("Telemetry.registry_closed")

    def turn(
        self, *, session_id: str, turn_id: str, agent: str | None, queued: int
    ) -> TurnTrace | None:
        try:
            trace = self._inner.turn(
                session_id=session_id, turn_id=turn_id, agent=agent, queued=queued
            )
        except Exception:
            self._failures.report("Telemetry.turn")
            return None
        return None if trace is None else _TurnTrace(trace, self._failures)

    def store_write(self, *, operation: str, seconds: float, error: BaseException | None) -> None:
        try:
            self._inner.store_write(operation=operation, seconds=seconds, error=error)
        except Exception:
            self._failures.report("Telemetry.store_write")

    def subscriber_lagged(self, *, session_id: str) -> None:
        try:
            self._inner.subscriber_lagged(session_id=session_id)
        except Exception:
            self._failures.report("Telemetry.subscriber_lagged")


class _TurnTrace(TurnTrace):
    __slots__ = ("_failures", "_inner")

    def __init__(self, inner: TurnTrace, failures: _Failures) -> None:
        self._inner = inner
        self._failures = failures

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        with _safe_context(self._failures, "TurnTrace.activate", self._inner.activate, None):
            yield

    def waited(self, seconds: float) -> None:
        try:
            self._inner.waited(seconds)
        except Exception:
            self._failures.report("TurnTrace.waited")

    def model_call(self, model: Model, request: ModelRequest) -> ModelCallTrace:
        try:
            return _ModelCallTrace(self._inner.model_call(model, request), self._failures)
        except Exception:
            self._failures.report("TurnTrace.model_call")
            return ModelCallTrace()

    @contextlib.contextmanager
    def tool_call(self, call: ToolCall) -> Iterator[ToolCallTrace]:
        make = functools.partial(self._inner.tool_call, call)
        hook = "TurnTrace.tool_call"
        with _safe_context(self._failures, hook, make, ToolCallTrace()) as traced:
            yield _ToolCallTrace(traced, self._failures)

    def end(self, outcome: str, error: BaseException | None) -> None:
        try:
            self._inner.end(outcome, error)
        except Exception:
            self._failures.report("TurnTrace.end")


class _ModelCallTrace(ModelCallTrace):
    __slots__ = ("_failures", "_inner")

    def __init__(self, inner: ModelCallTrace, failures: _Failures) -> None:
        self._inner = inner
        self._failures = failures

    def first_chunk(self) -> None:
        try:
            self._inner.first_chunk()
        except Exception:
            self._failures.report("ModelCallTrace.first_chunk")

    def finished(self, reason: str) -> None:
        finished = getattr(self._inner, "finished", None)  # (a trace written before it)
        if finished is None:
            return
        try:
            finished(reason)
        except Exception:
            self._failures.report("ModelCallTrace.finished")

    def end(self, usage: Usage | None, error: BaseException | None) -> None:
        try:
            self._inner.end(usage, error)
        except Exception:
            self._failures.report("ModelCallTrace.end")


class _ToolCallTrace(ToolCallTrace):
    __slots__ = ("_failures", "_inner")

    def __init__(self, inner: ToolCallTrace, failures: _Failures) -> None:
        self._inner = inner
        self._failures = failures

    def failed(self, error: BaseException | None, message: str) -> None:
        try:
            self._inner.failed(error, message)
        except Exception:
            self._failures.report("ToolCallTrace.failed")
