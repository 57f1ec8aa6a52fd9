"""Tutorial step 3: read a session's history, state and the registry's listing."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    agent = sa.Agent(model=EchoModel(), system_prompt="Repeat after the user.")
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat-1", metadata={"tenant": "acme"})
        await ref.send("Hello there.")
        await ref.send("How are you?")

        # history() is a list of Message records: user and assistant, in order.
        # The system prompt is not part of it; the model sees it first on every turn.
        for message in await ref.history():
            print(f"{message.role.value:>9}: {message.content}")

        # state() is the whole durable state: status, metadata, the last event seq, ...
        state = await ref.state()
        print("status:", state.status.value, "| messages:", len(state.messages))

        # sessions() describes every session, live or stored.
        for info in await registry.sessions():
            print("listed:", info.session_id, info.message_count, dict(info.metadata))


if __name__ == "__main__":
    trio.run(main)
