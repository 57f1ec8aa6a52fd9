"""How-to: run an agent on an OpenAI-compatible server with OpenAIChatModel.

To keep this example offline, the HTTP client is given a fake server (an httpx
MockTransport) that speaks the chat completions protocol. Against a real server,
drop ``client=`` and point ``base_url`` at it.
"""

import json

import httpx
import trio

import sessionactors as sa
from sessionactors.models import OpenAIChatModel


def fake_server(request: httpx.Request) -> httpx.Response:
    """Answer POST /v1/chat/completions as a server-sent event stream."""
    body = json.loads(request.content)
    last = body["messages"][-1]
    if last["content"].startswith("Describe"):
        # An answer cut off by the server's limit of output tokens (max_tokens).
        deltas = [{"content": word} for word in ["It ", "left ", "the"]]
        finish = "length"
    elif last["role"] == "user" and body.get("tools"):
        # First ask for a tool call, streamed in fragments as OpenAI does.
        call = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id":'},
        }
        more = {"index": 0, "function": {"arguments": ' "A1001"}'}}
        deltas = [{"tool_calls": [call]}, {"tool_calls": [more]}]
        finish = "tool_calls"
    else:
        # Then answer with the tool's result, word by word.
        deltas = [{"content": word} for word in ["Order ", "A1001 ", "is ", last["content"]]]
        finish = "stop"
    events = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse)


@sa.tool
async def lookup_order(order_id: str) -> str:
    """Look up an order's status by its id."""
    return "shipped"


async def main() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake_server)) as client:
        model = OpenAIChatModel(
            base_url="http://127.0.0.1:8000/v1",  # the API root, usually ending in /v1
            model="llama3",  # the model name the server knows
            api_key=None,  # sent as a Bearer token when given
            extra_body={"temperature": 0.2},  # more request fields
            client=client,  # optional: a shared httpx.AsyncClient
        )
        agent = sa.Agent(model=model, system_prompt="You help with orders.", tools=[lookup_order])
        async with sa.open_registry(agents={"support": agent}) as registry:
            ref = await registry.spawn("support-1")
            with trio.fail_after(30):  # the caller owns time: no timeout parameters
                reply = await ref.send("Where is order A1001?")
            print("reply:", reply.text)
            print("roles:", [m.role.value for m in await ref.history()])
            # A reply the server cut short says why in its message's metadata.
            reply = await ref.send("Describe its journey.")
            print("cut short:", reply.text, reply.message.metadata if reply.message else None)


if __name__ == "__main__":
    trio.run(main)
