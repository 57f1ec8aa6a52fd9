"""How-to: trace turns and read metrics and token usage with OpenTelemetry."""

import trio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import sessionactors as sa
from sessionactors.otel import OpenTelemetry
from sessionactors.testing import Scripted, ScriptedModel

# The application sets up the SDK. In production: an OTLP exporter behind a
# BatchSpanProcessor and a PeriodicExportingMetricReader; here, memory.
spans = InMemorySpanExporter()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
metrics = InMemoryMetricReader()
meter_provider = MeterProvider(metric_readers=[metrics])
app_tracer = tracer_provider.get_tracer("shop")


@sa.tool
async def lookup_order(order_id: str) -> str:
    """Look up an order by its id."""
    with app_tracer.start_as_current_span("orders.select"):  # nests under execute_tool
        return f"order {order_id}: shipped"


async def main() -> None:
    call = sa.ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A1001"}')
    model = ScriptedModel(
        [
            Scripted(tool_calls=[call], usage=sa.Usage(input_tokens=120, output_tokens=18)),
            Scripted(text="It shipped.", usage=sa.Usage(input_tokens=160, output_tokens=4)),
        ]
    )
    agent = sa.Agent(model=model, tools=[lookup_order])
    # Without an SDK set up, or without telemetry=, nothing is traced or measured.
    telemetry = OpenTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    async with sa.open_registry(agents={"support": agent}, telemetry=telemetry) as registry:
        ref = await registry.spawn("customer-7")
        reply = await ref.send("Where is A1001?")
        print("reply:", reply.text)

        # Token usage: per answer on the message, summed in the state and the listing.
        print("this answer:", reply.message.usage if reply.message else None)
        state = await ref.state()
        print("session total:", state.usage.total_tokens, "tokens")
        [info] = await registry.sessions()
        print("listed:", info.usage.input_tokens, "in,", info.usage.output_tokens, "out")

    # One turn is one trace; print it as a tree.
    finished = spans.get_finished_spans()
    children: dict[int | None, list[str]] = {}
    ids = {s.context.span_id: s.name for s in finished}
    for s in finished:
        children.setdefault(s.parent.span_id if s.parent else None, []).append(s.name)

    def show(name: str, depth: int) -> None:
        print("  " * depth + name)
        span_id = next(i for i, n in ids.items() if n == name)
        for child in sorted(children.get(span_id, [])):
            show(child, depth + 1)

    for root in children[None]:
        show(root, 0)

    # Metrics, as an exporter would see them.
    data = metrics.get_metrics_data()
    for metric in data.resource_metrics[0].scope_metrics[0].metrics if data else ():
        if metric.name in ("sessionactors.turns", "gen_ai.client.token.usage"):
            for point in metric.data.data_points:
                value = getattr(point, "value", None)
                value = point.sum if value is None else value
                kind = point.attributes.get(
                    "sessionactors.turn.outcome", point.attributes.get("gen_ai.token.type")
                )
                print(f"{metric.name} {kind}: {value}")


if __name__ == "__main__":
    trio.run(main)
