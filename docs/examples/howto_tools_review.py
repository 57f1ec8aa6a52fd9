"""How-to: give an agent tools, and make a person approve the risky ones."""

import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel

ORDERS = {"A1001": {"status": "delivered", "total": 42.0}}
REFUNDS: list[str] = []


@sa.tool
async def lookup_order(order_id: str) -> dict[str, object]:
    """Look up an order by its id.

    Args:
        order_id: The order's id, such as "A1001".
    """
    return ORDERS.get(order_id, {"error": f"no order {order_id}"})


async def do_refund(order_id: str, reason: str = "") -> str:
    REFUNDS.append(order_id)
    return f"refunded {order_id}"


# A tool can also be built explicitly: this one needs a person's approval for every call,
# and running it twice is not harmless.
refund = sa.Tool(
    name="refund",
    fn=do_refund,
    description="Refund an order in full.",
    requires_review=True,
    idempotent=False,
)


def call(call_id: str, name: str, arguments: str) -> Scripted:
    """A scripted model answer that calls one tool."""
    return Scripted(tool_calls=[sa.ToolCall(id=call_id, name=name, arguments=arguments)])


async def main() -> None:
    # The scripted model plays what a real model would: call tools, then answer.
    model = ScriptedModel(
        [
            call("call_1", "lookup_order", '{"order_id": "A1001"}'),
            call("call_2", "refund", '{"order_id": "A1001", "reason": "damaged"}'),
            "Order A1001 is refunded.",
        ]
    )
    agent = sa.Agent(model=model, tools=[lookup_order, refund], max_steps=8)
    print("the model is told about:", [spec.name for spec in agent.tool_specs])
    print("lookup_order's schema:", lookup_order.spec.parameters["properties"])

    async with sa.open_registry(agents={"support": agent}) as registry:
        ref = await registry.spawn("support-1")
        reply = await ref.send("Refund order A1001, it arrived broken.")

        # The turn paused before the refund ran: the reply lists what it waits on.
        print("waiting on reviews:", len(reply.reviews), "| refunds so far:", REFUNDS)
        pending = await registry.pending_reviews()  # every session's, oldest first
        review = pending[0]
        print("review:", review.session_id, review.tool_call.name, review.tool_call.arguments)

        # While a review is pending, the session takes no new turn.
        try:
            await ref.send("Hello?")
        except sa.SessionBusyError:
            print("busy: resolve the review first")

        # A person approves; the tool runs and the turn goes on to its reply.
        reply = await ref.review(review.id, approve=True, note="ok by Ada")
        print("reply:", reply.text, "| refunds:", REFUNDS)

        for message in await ref.history():
            calls = [c.name for c in message.tool_calls]
            print(f"  {message.role.value:>9}: {message.content or calls}")


if __name__ == "__main__":
    trio.run(main)
