"""How-to: a tool that acts for the session's user, knowing its session, turn and call."""

import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel

ORDERS = {"ada": ["A1001 (shipped)", "A1002 (open)"], "bob": ["B2001 (open)"]}


@sa.tool
async def my_orders(status: str, context: sa.ToolContext) -> list[str]:
    """List the orders of the customer in this conversation.

    Args:
        status: "open", "shipped" or "all".
    """
    # The model sends only `status`: which customer is the session's, set by the app.
    customer = context.metadata["customer"]
    # context.turn_id and context.call_id tag the work done for this call (a log line, a
    # request sent on): the reply's turn_id and the tool message's tool_call_id name them.
    print(f"[tool for {context.session_id}, call {context.call_id}]")
    return [o for o in ORDERS[customer] if status == "all" or o.endswith(f"({status})")]


async def main() -> None:
    # A stand-in for a real model: it calls the tool, then answers with the result.
    def answer(request: sa.ModelRequest) -> str:
        return f"Your orders: {request.messages[-1].content}"

    lookup = sa.ToolCall(id="call-7", name="my_orders", arguments='{"status": "open"}')
    model = ScriptedModel([Scripted(tool_calls=[lookup]), answer])
    print(my_orders.spec.parameters["properties"])  # what the model is told of

    agents = {"support": sa.Agent(model=model, tools=[my_orders])}
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("chat-42", agent="support", metadata={"customer": "ada"})
        reply = await ref.send("What are my open orders?")
        print(reply.text)

    # The tool alone, in a test: give it the context a turn would.
    context = sa.ToolContext(session_id="s", turn_id="t", call_id="c", metadata={"customer": "bob"})
    print(await my_orders.invoke('{"status": "all"}', context=context))


if __name__ == "__main__":
    trio.run(main)
