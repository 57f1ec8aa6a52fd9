"""How-to: edit a conversation's history: truncate, summarize, rewind, fork."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


def contents(history: list[sa.Message]) -> list[str]:
    return [m.content for m in history if m.role is sa.Role.USER]


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat")
        for i in range(5):
            await ref.send(f"message {i}")
        history = await ref.history()
        print("user messages:", contents(history))

        # fork: a new session with the history up to a message (and its agent, metadata,
        # system prompt and summary). The original is untouched.
        fork = await registry.fork("chat", "chat-what-if", at=history[3].id)
        print("fork:", contents(await fork.history()))

        # rewind: drop every message after the given one.
        removed = await ref.rewind(history[5].id)
        print(f"rewind removed {removed}:", contents(await ref.history()))

        # truncate: keep only the last few messages (a tool call stays with its results)...
        removed = await ref.truncate(keep_last=2)
        print(f"truncate removed {removed}:", contents(await ref.history()))

        # ...and tell the model what came before, in a summary it sees after the system prompt.
        await ref.set_summary("The user counted from 0 to 1.")
        print("summary:", (await ref.state()).summary)


if __name__ == "__main__":
    trio.run(main)
