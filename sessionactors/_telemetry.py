"""The instrumentation seam: what a registry reports about its work, for traces and metrics.

The core calls these hooks and knows nothing of what is behind them; with no
``telemetry=`` given to ``open_registry`` it calls none of them (a turn pays for
one ``is None`` test at each hook point). ``sessionactors.otel`` implements them
with OpenTelemetry; an application may implement them for anything else.

Every hook is synchronous and must return at once, without raising: it runs in
the actor's task, in the middle of a turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._model import Model, ModelRequest
from ._records import ToolCall, Usage

__all__ = ["ModelCallTrace", "Telemetry", "ToolCallTrace", "TurnTrace"]


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
        (journal entries) or ``"snapshot"``; ``error`` is what it raised."""

    def subscriber_lagged(self, *, session_id: str) -> None:
        """A subscriber of the session fell behind and was cut off."""
