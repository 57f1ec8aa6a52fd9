"""An OpenTelemetry SDK set up for one test (the ``otel`` fixture): spans, ended and still
open, and metrics kept in memory."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sessionactors.otel import OpenTelemetry


class _Tracking(SimpleSpanProcessor):
    """Exports ended spans and keeps the ones started and not ended yet."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        super().__init__(exporter)
        self.open: dict[int, Span] = {}

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        self.open[span.context.span_id] = span

    def on_end(self, span: ReadableSpan) -> None:
        self.open.pop(span.context.span_id, None)
        super().on_end(span)


class Otel:
    """An SDK set up for one test: spans (ended and still open) and metrics in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.processor = _Tracking(self.exporter)
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(self.processor)
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = OpenTelemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def span(self, name: str) -> ReadableSpan:
        """The one ended span named ``name``."""
        [found] = [s for s in self.spans() if s.name == name]
        return found

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith(prefix)]

    def still_open(self) -> list[str]:
        return sorted(s.name for s in self.processor.open.values())

    def points(self, name: str) -> list[Any]:
        """The data points of metric ``name`` (empty if it recorded nothing)."""
        data = self.reader.get_metrics_data()
        out = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        out.extend(metric.data.data_points)
        return out

    def value(self, name: str) -> Any:
        """The value of metric ``name``'s one data point."""
        [point] = self.points(name)
        return point.value

    def by(self, name: str, key: str) -> dict[Any, Any]:
        """Metric ``name``'s points by the value of attribute ``key``."""
        return {p.attributes.get(key): p for p in self.points(name)}
