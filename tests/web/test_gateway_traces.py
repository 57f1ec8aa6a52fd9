"""The gateway and OpenTelemetry: a request that runs a turn names it on the request's
span (a turn is a trace of its own, and nothing else ties the two)."""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer

from sessionactors.otel import OpenTelemetry

from .servers import Serve
from .test_gateway import SSE, SSEReader

TURN_ID = "sessionactors.turn.id"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A tracer provider of the test's own, whose ended spans the exporter keeps."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def traced(tracer: Tracer) -> Any:
    """An ASGI app around the gateway that starts a server span, current while the
    gateway answers, for each HTTP request (as ASGI instrumentation does)."""

    def wrap(app: Any) -> Any:
        async def traced_app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            name = f"{scope['method']} {scope['path']}"
            with tracer.start_as_current_span(name, kind=SpanKind.SERVER):
                await app(scope, receive, send)

        return traced_app

    return wrap


def requests_of(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name and span.kind is SpanKind.SERVER]


async def test_a_request_that_runs_a_turn_names_it_on_its_span(
    serve: Serve, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """``POST /sessions/{name}/messages`` (JSON or streamed) and a review's ``POST``
    put ``sessionactors.turn.id`` on the request's span, the id of the turn, whose
    ``invoke_agent`` span is the root of a trace of its own; a request that runs no
    turn puts none."""
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    telemetry = OpenTelemetry(tracer_provider=provider)
    async with (
        serve(wrap=traced(tracer), telemetry=telemetry) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(20):
            r = await client.post("/sessions/t/messages", json={"text": "as JSON"})
            assert r.status_code == 200, r.text
            turns = [r.json()["turn_id"]]
            body = {"text": "streamed"}
            async with client.stream("POST", "/sessions/t/messages", json=body, headers=SSE) as s:
                reader = SSEReader(s)
                while True:
                    _, event = await reader.next()
                    if event["type"] == "TurnFinished":
                        turns.append(event["turn_id"])
                        break
            r = await client.post("/sessions/t/messages", json={"text": "refund A1"})
            [review] = r.json()["reviews"]
            turns.append(r.json()["turn_id"])
            r = await client.post(f"/sessions/t/reviews/{review['id']}", json={"approve": True})
            assert r.status_code == 200, r.text
            assert r.json()["turn_id"] == turns[-1]
            r = await client.get("/sessions/t")
            assert r.status_code == 200, r.text
    ended = list(exporter.get_finished_spans())
    sent = requests_of(ended, "POST /sessions/t/messages")
    assert [(span.attributes or {}).get(TURN_ID) for span in sent] == turns
    [reviewed] = requests_of(ended, f"POST /sessions/t/reviews/{review['id']}")
    assert (reviewed.attributes or {}).get(TURN_ID) == turns[-1]
    [read] = requests_of(ended, "GET /sessions/t")
    assert TURN_ID not in (read.attributes or {})
    agents = [span for span in ended if span.name.startswith("invoke_agent")]
    assert {(span.attributes or {}).get(TURN_ID) for span in agents} == set(turns)
    for span in agents:
        assert span.parent is None  # (a trace of its own)
