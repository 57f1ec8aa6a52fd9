"""How-to: write a model adapter for a provider's streaming API.

The provider here is a stand-in: `FakeProvider.stream` yields the events an
Anthropic-style messages API streams (blocks of text or of tool use, the JSON of
a call's input in pieces, the usage, a stop reason). An adapter for a real
provider has the same shape, with its SDK's client in place of the fake.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

import trio

import sessionactors as sa

# ---- the provider (a stand-in for its SDK) -------------------------------------------


class ProviderError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status


class FakeProvider:
    """Answers with the scripted event lists, one list per request."""

    def __init__(self, *answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    async def stream(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        for event in self.answers.pop(0):
            await trio.lowlevel.checkpoint()  # (a network read)
            yield event


# ---- the adapter ----------------------------------------------------------------------

#: The stop reasons of an answer that ended of its own accord: no FinishChunk for them.
NATURAL_ENDS = {"end_turn", "tool_use", "stop_sequence"}


def provider_messages(messages: Any) -> tuple[str, list[dict[str, Any]]]:
    """The history in the provider's format: the system prompt apart, a tool result
    as a user message, an assistant message's calls as tool_use blocks."""
    system, out = "", []
    for m in messages:
        if m.role is sa.Role.SYSTEM:
            system = m.content
        elif m.role is sa.Role.TOOL:
            block = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}
            out.append({"role": "user", "content": [block]})
        elif m.role is sa.Role.ASSISTANT:
            blocks: list[dict[str, Any]] = []
            if m.content:  # (a provider may refuse empty text blocks)
                blocks.append({"type": "text", "text": m.content})
            for call in m.tool_calls:
                try:  # arguments are stored as the model sent them, valid JSON or not
                    arguments = json.loads(call.arguments)
                except ValueError:
                    arguments = {}
                blocks.append(
                    {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}
                )
            out.append({"role": "assistant", "content": blocks or "(no reply)"})
        else:
            out.append({"role": "user", "content": m.content})
    return system, out


class ProviderModel:
    """A model on the provider's streaming API."""

    def __init__(self, client: FakeProvider, model: str, max_tokens: int = 1024) -> None:
        self.client, self.model, self.max_tokens = client, model, max_tokens

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        system, messages = provider_messages(request.messages)
        tools = [
            {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
            for t in request.tools
        ]
        events = self.client.stream(
            model=self.model,
            system=system,
            messages=messages,
            tools=tools,
            max_tokens=self.max_tokens,
        )
        input_tokens = output_tokens = 0
        stop_reason = None
        try:
            async for event in events:
                kind = event["type"]
                if kind == "message_start":
                    input_tokens = event["usage"]["input_tokens"]
                elif kind == "content_block_start" and event["block"]["type"] == "tool_use":
                    block = event["block"]  # a call begins: its index, id and name
                    yield sa.ToolCallChunk(index=event["index"], id=block["id"], name=block["name"])
                elif kind == "content_block_delta":
                    delta = event["delta"]
                    if delta["type"] == "text_delta":
                        yield sa.TextChunk(delta["text"])
                    elif delta["type"] == "input_json_delta":  # a piece of a call's JSON
                        yield sa.ToolCallChunk(
                            index=event["index"], arguments=delta["partial_json"]
                        )
                elif kind == "message_delta":
                    stop_reason = event["delta"].get("stop_reason")
                    output_tokens = event["usage"]["output_tokens"]
        except ProviderError as exc:  # the provider's failure fails the turn, typed
            raise sa.ModelError(str(exc), status_code=exc.status) from exc
        finally:
            await events.aclose()  # (cancelled, the turn closes this generator: so is the SDK's)
        # one UsageChunk with the answer's totals (several are added up)
        yield sa.UsageChunk(input_tokens=input_tokens, output_tokens=output_tokens)
        if stop_reason is not None and stop_reason not in NATURAL_ENDS:
            yield sa.FinishChunk(stop_reason)  # cut short: kept on the reply's metadata


# ---- using it --------------------------------------------------------------------------


@sa.tool
async def order_status(order_id: str) -> str:
    """The status of an order."""
    return f"order {order_id} is shipped"


def began(input_tokens: int) -> dict[str, Any]:
    return {"type": "message_start", "usage": {"input_tokens": input_tokens}}


def block(index: int, **block: Any) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "block": block}


def delta(index: int, **delta: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def ended(stop: str, output_tokens: int) -> dict[str, Any]:
    usage = {"output_tokens": output_tokens}
    return {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": usage}


def text_answer(text: str, stop: str, output_tokens: int) -> list[dict[str, Any]]:
    words = [delta(0, type="text_delta", text=word + " ") for word in text.split(" ")]
    return [began(20), block(0, type="text"), *words, ended(stop, output_tokens)]


CALL = [
    began(12),
    block(0, type="tool_use", id="tu_1", name="order_status"),
    delta(0, type="input_json_delta", partial_json='{"order_'),
    delta(0, type="input_json_delta", partial_json='id": "A1001"}'),
    ended("tool_use", 9),
]


async def main() -> None:
    provider = FakeProvider(
        CALL,
        text_answer("Order A1001 is shipped.", "end_turn", 6),
        text_answer("It left the warehouse on", "max_tokens", 5),
    )
    agent = sa.Agent(model=ProviderModel(provider, "some-model"), tools=[order_status])
    async with sa.open_registry(agents={"shop": agent}) as registry:
        ref = await registry.spawn("customer-7")
        reply = await ref.send("Where is order A1001?")
        print("reply:", reply.text.strip())
        print("roles:", [m.role.value for m in await ref.history()])
        print("usage:", (await ref.state()).usage)
        cut = await ref.send("When did it leave?")
        print("cut short:", cut.text.strip(), cut.message.metadata if cut.message else None)
        # what the provider was sent last: the call and its result, in its format
        print("sent:", [m["role"] for m in provider.requests[-1]["messages"]])


if __name__ == "__main__":
    trio.run(main)
