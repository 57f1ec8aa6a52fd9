"""Tutorial step 2: submit turns without waiting, then collect their replies."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat-1")

        # submit() puts the turn in the session's mailbox and returns a Turn at once.
        turns = [await ref.submit(f"message {i}") for i in range(3)]
        print("submitted:", len(turns), "turns")

        # The turns run one at a time, in mailbox order; each caller gets its own reply.
        for turn in turns:
            reply = await turn.reply()
            print(f"{reply.text!r} answered turn {reply.turn_id == turn.id}")

        # submit_nowait() never waits for room in the mailbox: it raises instead.
        turn = ref.submit_nowait("one more")
        print("nowait:", (await turn.reply()).text)


if __name__ == "__main__":
    trio.run(main)
