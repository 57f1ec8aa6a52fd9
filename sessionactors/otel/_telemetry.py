"""OpenTelemetry traces and metrics of a registry, after the GenAI semantic conventions.

A plug-in: it implements the core's :class:`~sessionactors.Telemetry` seam with
``opentelemetry-api`` (the ``otel`` extra); the application brings the SDK and
its exporters. Nothing in the core imports it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextvars import Token
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .._model import Model, ModelRequest
from .._records import ToolCall, Usage, storable
from .._telemetry import ModelCallTrace, Telemetry, ToolCallTrace, TurnTrace
from .._tools import stops

log = logging.getLogger("sessionactors")

__all__ = ["METRICS", "OpenTelemetry"]

_SCOPE: Final = "sessionactors"

#: Every metric this plug-in records: name -> (instrument, unit, what it measures).
METRICS: Final[dict[str, tuple[str, str, str]]] = {
    "sessionactors.turns": (
        "counter",
        "{turn}",
        "turns that ended, by sessionactors.turn.outcome (finished, failed, cancelled,"
        " waiting, crashed) and gen_ai.agent.name",
    ),
    "sessionactors.turn.duration": (
        "histogram",
        "s",
        "how long a turn ran, from its start to its outcome being durable; same attributes",
    ),
    "gen_ai.client.operation.duration": (
        "histogram",
        "s",
        "how long one model call took (gen_ai.operation.name=chat, gen_ai.request.model,"
        " error.type when it failed)",
    ),
    "sessionactors.tool.calls": (
        "counter",
        "{call}",
        "tool calls, by gen_ai.tool.name, with error.type when the tool failed (the model "
        "is told the error and the turn goes on)",
    ),
    "gen_ai.client.operation.time_to_first_chunk": (
        "histogram",
        "s",
        "from a model call's start to its first chunk (the time to the first token)",
    ),
    "gen_ai.client.token.usage": (
        "histogram",
        "{token}",
        "tokens a model call reported, by gen_ai.token.type (input or output)",
    ),
    "sessionactors.sessions.live": (
        "observable up-down counter",
        "{session}",
        "sessions whose actors run now, over the instrumented registries",
    ),
    "sessionactors.turns.running": (
        "observable up-down counter",
        "{turn}",
        "turns under way now (not waiting on a review), over the instrumented registries",
    ),
    "sessionactors.sessions.hibernations": (
        "observable counter",
        "{session}",
        "sessions hibernated (state written to the store, actor gone) since the registries opened",
    ),
    "sessionactors.sessions.wakes": (
        "observable counter",
        "{session}",
        "sessions whose actor started from the store since the registries opened (a "
        "hibernated one woken, a spawned one at its first request)",
    ),
    "sessionactors.sessions.unclean_wakes": (
        "observable counter",
        "{session}",
        "sessions woken after an unclean stop (the process that ran them was killed or "
        "crashed, or lost their lease, before storing them: the turns it had accepted and "
        "not stored are lost) since the registries opened",
    ),
    "sessionactors.mailbox.refused": (
        "observable counter",
        "{request}",
        "requests refused because their session's mailbox was full (MailboxFullError) "
        "since the registries opened",
    ),
    "sessionactors.turn.queue_wait": (
        "histogram",
        "s",
        "how long a turn waited before it started, from its acceptance into the mailbox"
        " (behind the session's other turns, or while the session woke), by"
        " gen_ai.agent.name",
    ),
    "sessionactors.mailbox.depth": (
        "histogram",
        "{request}",
        "requests waiting in a session's mailbox as each turn starts",
    ),
    "sessionactors.subscribers.lagged": (
        "counter",
        "{subscriber}",
        "subscribers cut off because they fell behind (SubscriberLaggedError)",
    ),
    "sessionactors.store.write.duration": (
        "histogram",
        "s",
        "how long one store write took, by sessionactors.store.operation (append or"
        " snapshot) and error.type when it failed, or was cut short because its session"
        " was stopped at once (FencedOutError: its lease lost; SessionNotFoundError:"
        " deleted)",
    ),
}

# The GenAI conventions' advice for durations (seconds) and token counts.
_SECONDS: Final = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
_SECONDS_WIDE: Final = (*_SECONDS, 40.96, 81.92, 163.84, 327.68)
_WAIT_SECONDS: Final = (0.001, 0.005, *_SECONDS_WIDE)  # (most turns wait for nothing)
_STORE_SECONDS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
_TOKENS: Final = tuple(4.0**i for i in range(14))  # 1, 4, 16, ... 67108864
_DEPTHS: Final = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


#: The longest exception message, and stack trace, a span carries (characters).
_MAX_MESSAGE: Final = 1024
_MAX_STACKTRACE: Final = 8192
#: The longest tool call id a span carries (a model's ids are short; a buggy one's not).
_MAX_ID: Final = 256


def _error_type(error: BaseException | None) -> str:
    return "_OTHER" if error is None else type(error).__qualname__


def _model_name(model: Model) -> str:
    """The model's own name if it has one (``OpenAIChatModel.model``), else its class.

    A wrapper whose ``model`` is a model itself (the asyncio host wraps an asyncio
    model so) is named after the model it wraps."""
    named: object = model
    for _ in range(4):
        name = getattr(named, "model", None)
        if isinstance(name, str) and name:
            return name
        if not callable(getattr(name, "stream", None)):
            break
        named = name
    return type(named).__name__


class OpenTelemetry(Telemetry):
    """Traces and metrics through OpenTelemetry: ``open_registry(..., telemetry=OpenTelemetry())``.

    Spans follow the GenAI semantic conventions: one trace per turn, rooted at an
    ``invoke_agent {agent}`` span (``gen_ai.conversation.id`` = the session's name,
    ``sessionactors.turn.id``, and ``sessionactors.turn.queue_wait``: the seconds it
    waited in the mailbox), with a ``chat {model}`` span per model call and an
    ``execute_tool {tool}`` span per tool call. The turn's span is current while
    the turn runs and a tool's while it runs, so spans that tools make nest under
    them. Failures set the span's status to ERROR and ``error.type``.

    Metrics are listed in :data:`METRICS`. ``tracer_provider`` and
    ``meter_provider`` default to the global ones (set by the application's SDK
    setup); without an SDK every call is OpenTelemetry's no-op. One instance may
    serve several registries.

    A failed span records what its exception says (its message, in the status, the
    ``exception`` event and its stack trace), which may quote what a user wrote (a
    provider's error that repeats the prompt, a tool's error about its arguments).
    With ``exception_messages=False`` it records none of it: the exception's type
    and the frames of its trace only, and a tool's error result by ``error.type``.
    """

    def __init__(
        self,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        exception_messages: bool = True,
    ) -> None:
        if not isinstance(exception_messages, bool):
            raise TypeError(
                f"OpenTelemetry: exception_messages must be True or False, not "
                f"{exception_messages!r:.60}"
            )
        self._messages = exception_messages
        self._tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, meter_provider=meter_provider)
        self._registries: list[Any] = []
        self._closed: dict[str, int] = {}  # what closed registries counted, by field
        self._lock = threading.Lock()  # (the registries' list and _closed change together)
        self._spans_failed = False  # (said once: a span that failed to start or end)

        def histogram(name: str, bounds: Iterable[float]) -> metrics.Histogram:
            _, unit, description = METRICS[name]
            return meter.create_histogram(
                name, unit, description, explicit_bucket_boundaries_advisory=list(bounds)
            )

        def counter(name: str) -> metrics.Counter:
            _, unit, description = METRICS[name]
            return meter.create_counter(name, unit, description)

        self.turns = counter("sessionactors.turns")
        self.turn_duration = histogram("sessionactors.turn.duration", _SECONDS_WIDE)
        self.call_duration = histogram("gen_ai.client.operation.duration", _SECONDS_WIDE)
        self.first_chunk = histogram("gen_ai.client.operation.time_to_first_chunk", _SECONDS)
        self.tokens = histogram("gen_ai.client.token.usage", _TOKENS)
        self.queue_wait = histogram("sessionactors.turn.queue_wait", _WAIT_SECONDS)
        self.mailbox_depth = histogram("sessionactors.mailbox.depth", _DEPTHS)
        self.lagged = counter("sessionactors.subscribers.lagged")
        self.tool_calls = counter("sessionactors.tool.calls")
        self.store_writes = histogram("sessionactors.store.write.duration", _STORE_SECONDS)
        for name, field in (
            ("sessionactors.sessions.live", "live"),
            ("sessionactors.turns.running", "turns_running"),
            ("sessionactors.sessions.hibernations", "hibernated"),
            ("sessionactors.sessions.wakes", "woken"),
            ("sessionactors.sessions.unclean_wakes", "unclean_wakes"),
            ("sessionactors.mailbox.refused", "requests_refused"),
        ):
            kind, unit, description = METRICS[name]
            make = (
                meter.create_observable_up_down_counter
                if kind.endswith("up-down counter")
                else meter.create_observable_counter
            )
            make(name, [self._observer(field)], unit, description)

    def __repr__(self) -> str:
        return f"<OpenTelemetry registries={len(self._registries)}>"

    def _start(self, name: str, **options: Any) -> Span:
        """A span started by the tracer; a span that records nothing if the trace
        pipeline raised (a span processor's ``on_start``): the metrics go on."""
        try:
            return self._tracer.start_span(name, **options)
        except Exception as exc:
            self._span_failed(exc)
            return trace.INVALID_SPAN

    def _end(self, span: Span) -> None:
        """End ``span``; the trace pipeline raising (an ``on_end``) is said once."""
        try:
            span.end()
        except Exception as exc:
            self._span_failed(exc)

    def _span_failed(self, exc: Exception) -> None:
        if not self._spans_failed:
            self._spans_failed = True
            log.warning(
                "the tracer raised as a span started or ended (%s: %s), so spans are "
                "missing; the metrics go on (later failures of spans are not logged)",
                type(exc).__name__,
                exc,
            )

    def _observer(self, field: str) -> Any:
        # (called in the metric reader's thread, a periodic reader's own one included)
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                stats = [registry.statistics() for registry in self._registries]
                total = self._closed.get(field, 0) + sum(getattr(s, field) for s in stats)
            return [Observation(total)]

        return observe

    # ---- the seam ------------------------------------------------------------------

    def registry_opened(self, registry: Any) -> None:
        with self._lock:
            self._registries.append(registry)

    def registry_closed(self, registry: Any) -> None:
        # The counters go on from what the closed registry counted (its closing
        # hibernations included): a counter that fell back when a registry closed
        # would read as a reset, and a backend would count the others' totals again.
        stats = registry.statistics()
        with self._lock, contextlib.suppress(ValueError):
            self._registries.remove(registry)
            for field in ("hibernated", "woken", "unclean_wakes", "requests_refused"):
                self._closed[field] = self._closed.get(field, 0) + getattr(stats, field)

    def turn(
        self, *, session_id: str, turn_id: str, agent: str | None, queued: int
    ) -> TurnTrace | None:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": session_id,
            "sessionactors.turn.id": turn_id,
        }
        if agent is not None:
            attributes["gen_ai.agent.name"] = agent
        span = self._start(
            f"invoke_agent {agent}" if agent else "invoke_agent",
            # a root: one turn is one trace, whoever's context started the actor
            context=otel_context.Context(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        self.mailbox_depth.record(queued)
        return _Turn(self, span, agent)

    def store_write(self, *, operation: str, seconds: float, error: BaseException | None) -> None:
        attributes = {"sessionactors.store.operation": operation}
        if error is not None:
            attributes["error.type"] = _error_type(error)
        self.store_writes.record(seconds, attributes)

    def subscriber_lagged(self, *, session_id: str) -> None:
        self.lagged.add(1)


class _Turn(TurnTrace):
    __slots__ = ("_agent", "_otel", "_span", "_start")

    def __init__(self, otel: OpenTelemetry, span: Span, agent: str | None) -> None:
        self._otel = otel
        self._span = span
        self._agent = agent
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        with trace.use_span(
            self._span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            yield

    def waited(self, seconds: float) -> None:
        self._span.set_attribute("sessionactors.turn.queue_wait", seconds)
        agent = self._agent
        attributes = None if agent is None else {"gen_ai.agent.name": agent}
        self._otel.queue_wait.record(seconds, attributes)

    def model_call(self, model: Model, request: ModelRequest) -> ModelCallTrace:
        name = _model_name(model)
        span = self._otel._start(
            f"chat {name}",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": name},
        )
        # current until the call ends (in this task): the spans the model's own code
        # makes (an instrumented HTTP client's) nest under it
        token = otel_context.attach(trace.set_span_in_context(span))
        return _ModelCall(self._otel, span, name, token)

    @contextlib.contextmanager
    def tool_call(self, call: ToolCall) -> Iterator[ToolCallTrace]:
        span = self._otel._start(
            f"execute_tool {call.name}",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.INTERNAL,
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": call.name,
                "gen_ai.tool.call.id": _bounded(call.id, _MAX_ID),  # (the model's)
                "gen_ai.tool.type": "function",
            },
        )
        traced = _ToolCall(span, self._otel._messages)
        counted = True
        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                yield traced
        except Exception as exc:  # (a tool's own errors come through ``failed``)
            _fail(span, exc, self._otel._messages)
            traced.error_type = _error_type(exc)
            raise
        except BaseException:  # cancelled (its turn cut off): no call that ran or failed
            counted = False
            raise
        finally:
            self._otel._end(span)
            if counted:
                attributes = {"gen_ai.tool.name": call.name}
                if traced.error_type is not None:
                    attributes["error.type"] = traced.error_type
                self._otel.tool_calls.add(1, attributes)

    def end(self, outcome: str, error: BaseException | None) -> None:
        span = self._span
        attributes: dict[str, Any] = {"sessionactors.turn.outcome": outcome}
        if self._agent is not None:
            attributes["gen_ai.agent.name"] = self._agent
        try:
            span.set_attribute("sessionactors.turn.outcome", outcome)
            if error is not None and outcome in ("failed", "crashed"):
                attributes["error.type"] = _error_type(error)
                _fail(span, error, self._otel._messages)
        finally:
            self._otel._end(span)
        self._otel.turns.add(1, attributes)
        self._otel.turn_duration.record(time.perf_counter() - self._start, attributes)


class _ModelCall(ModelCallTrace):
    __slots__ = ("_name", "_otel", "_span", "_start", "_token")

    def __init__(
        self, otel: OpenTelemetry, span: Span, name: str, token: Token[otel_context.Context]
    ) -> None:
        self._otel = otel
        self._span = span
        self._name = name
        self._token = token
        self._start = time.perf_counter()

    def first_chunk(self) -> None:
        self._otel.first_chunk.record(
            time.perf_counter() - self._start,
            {"gen_ai.operation.name": "chat", "gen_ai.request.model": self._name},
        )

    def finished(self, reason: str) -> None:
        self._span.set_attribute("gen_ai.response.finish_reasons", (reason,))

    def end(self, usage: Usage | None, error: BaseException | None) -> None:
        span = self._span
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": self._name,
        }
        try:
            if usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
            if error is not None and not stops(error):  # (a cancellation is no failure)
                attributes["error.type"] = _error_type(error)
                _fail(span, error, self._otel._messages)
        finally:
            self._otel._end(span)
            otel_context.detach(self._token)
        if usage is not None:
            tokens = self._otel.tokens
            tokens.record(usage.input_tokens, {**attributes, "gen_ai.token.type": "input"})
            tokens.record(usage.output_tokens, {**attributes, "gen_ai.token.type": "output"})
        self._otel.call_duration.record(time.perf_counter() - self._start, attributes)


class _ToolCall(ToolCallTrace):
    __slots__ = ("_messages", "_span", "error_type")

    def __init__(self, span: Span, messages: bool) -> None:
        self._span = span
        self._messages = messages  # (see OpenTelemetry's exception_messages)
        self.error_type: str | None = None  # (the call's failure, for its count)

    def failed(self, error: BaseException | None, message: str) -> None:
        span = self._span
        if error is not None:
            _fail(span, error, self._messages)
            self.error_type = _error_type(error)
        else:
            self.error_type = "_OTHER"
            span.set_attribute("error.type", "_OTHER")
            said = storable(message[:200]) if self._messages else "the tool's error result"
            span.set_status(Status(StatusCode.ERROR, said))


def _bounded(text: str, limit: int) -> str:
    """``text`` as a span can carry it: valid Unicode, at most about ``limit`` characters."""
    if len(text) > limit:
        half = limit // 2
        cut = len(text) - 2 * half
        text = f"{text[:half]}\n[... {cut:,} characters ...]\n{text[-half:]}"
    return storable(text)


def _fail(span: Span, error: BaseException, messages: bool) -> None:
    """Mark ``span`` failed by ``error``: its type, status and an ``exception`` event.

    The event is what ``Span.record_exception`` records, made here so that what an
    exception says (a model's megabyte response body, a tool's argument with a lone
    surrogate, a ``__str__`` that raises) reaches the exporter bounded and valid UTF-8.
    A model call cut by a cancellation (``trio.Cancelled``) is not failed: like the
    turn it cuts (outcome ``cancelled``), it is not an error. Without ``messages``,
    nothing the exception says is recorded: its type, and the frames of its trace.
    """
    kind = type(error)
    module = kind.__module__
    name = kind.__qualname__ if module in (None, "builtins") else f"{module}.{kind.__qualname__}"
    span.set_attribute("error.type", _error_type(error))
    event = {"exception.type": name, "exception.escaped": "False"}
    if messages:
        try:
            message = str(error)
        except Exception:  # its own str() failed
            message = "(its message could not be read)"
        message = _bounded(message, _MAX_MESSAGE)
        stacktrace = "".join(traceback.format_exception(error))
        status = f"{kind.__name__}: {message}"[:200]
        event["exception.message"] = message
    else:
        stacktrace = "".join(traceback.format_tb(error.__traceback__)) + name
        status = kind.__name__
    event["exception.stacktrace"] = _bounded(stacktrace, _MAX_STACKTRACE)
    span.add_event("exception", event)
    span.set_status(Status(StatusCode.ERROR, status))
