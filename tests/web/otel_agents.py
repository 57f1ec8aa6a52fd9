"""The gateway tests' agents (``chat_agents``), in an application that sets up the
OpenTelemetry SDK as its module loads, as an app served by ``serve --otel`` does: the
name of each span that ends is appended to the file ``SPANS_FILE`` names."""

import os
from collections.abc import Sequence

from chat_agents import agents
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

__all__ = ["agents"]


class _NamesToFile(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(os.environ["SPANS_FILE"], "a", encoding="utf-8") as file:
            file.writelines(f"{span.name}\n" for span in spans)
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(_NamesToFile()))
trace.set_tracer_provider(_provider)
