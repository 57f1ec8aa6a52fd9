"""How-to: use sessionactors from asyncio, with a model and a tool written for asyncio."""

import asyncio
from collections.abc import AsyncIterator

import sessionactors as sa
import sessionactors.aio


class ShopModel:
    """A model written for asyncio, as one built on an AsyncOpenAI client would be."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        last = request.messages[-1]
        if last.role is sa.Role.TOOL:  # the tool answered: tell the user
            answer = f"Order A1001 is {last.content.split(': ')[1]}."
        elif last.content.startswith("Where is"):  # ask the tool
            arguments = '{"order_id": "A1001"}'
            yield sa.ToolCallChunk(0, id="c1", name="lookup_order", arguments=arguments)
            return
        else:
            answer = last.content
        for word in answer.split(" "):
            await asyncio.sleep(0.01)  # the network, in asyncio
            yield sa.TextChunk(word + " ")


@sa.tool
async def lookup_order(order_id: str) -> str:
    """Look up an order by its id."""
    await asyncio.sleep(0.01)  # an asyncpg query, an aiohttp call...
    return f"order {order_id}: shipped"


async def main() -> None:
    agent = sa.Agent(model=ShopModel(), tools=[lookup_order])
    async with sessionactors.aio.open_registry(agents={"shop": agent}) as registry:
        ref = await registry.spawn("web-1")
        reply = await ref.send("Where is my order?")
        print("reply:", reply.text.strip())
        print("roles:", [m.role.value for m in await ref.history()])

        async with ref.stream("streamed word by word") as events:
            words = [event.text async for event in events if isinstance(event, sa.Delta)]
        print("streamed:", words)

        # The caller owns time: asyncio.timeout abandons the wait, the turn runs on.
        try:
            async with asyncio.timeout(0.02):
                await ref.send("a reply that takes a while to write")
        except TimeoutError:
            print("gave up waiting")
        await ref.send("next")  # queued behind the turn that ran on
        print("kept:", [m.content.strip() for m in await ref.history()][-4])

        # Library errors arrive as themselves.
        try:
            await registry.ref("nobody").send("hi")
        except sa.SessionNotFoundError as exc:
            print("not found:", exc)


if __name__ == "__main__":
    asyncio.run(main())
