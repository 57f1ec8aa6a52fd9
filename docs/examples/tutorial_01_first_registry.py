"""Tutorial step 1: open a registry, spawn a session, send it a message."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    # An agent is a frozen value: a model, a system prompt, tools and limits.
    # EchoModel streams the user's words back, so no network is needed.
    agent = sa.Agent(model=EchoModel(), system_prompt="Be brief.")

    # The registry is opened like a nursery; leaving the block shuts it down.
    # Without store=..., sessions live in a MemoryStore.
    async with sa.open_registry(agents={"support": agent}) as registry:
        ref = await registry.spawn("support-123", metadata={"tenant": "acme"})
        reply = await ref.send("Say hi to Ada.")
        print("reply:", reply.text)

        # A name is taken once; get_or_spawn returns the existing session.
        try:
            await registry.spawn("support-123")
        except sa.SessionExistsError as exc:
            print("spawn again:", exc)
        same = await registry.get_or_spawn("support-123")
        print("same session:", same == ref)


if __name__ == "__main__":
    trio.run(main)
