"""Tutorial step 4: watch a turn's events as they happen."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat-1")

        # subscribe(): every event of the session from now on, for as long as you read.
        seqs = []
        async with ref.subscribe() as events:
            turn = await ref.submit("one two three")
            async for event in events:
                print(f"seq {event.seq}: {type(event).__name__}")
                seqs.append(event.seq)
                if isinstance(event, sa.TurnFinished) and event.turn_id == turn.id:
                    break
        print("reply:", (await turn.reply()).text)
        print("seqs one apart:", seqs == list(range(seqs[0], seqs[0] + len(seqs))))

        # stream(): submit a turn and read that turn's events only; it ends by itself.
        words = []
        async with ref.stream("four five six") as events:
            async for event in events:
                if isinstance(event, sa.Delta):
                    words.append(event.text)
        print("streamed:", "".join(words))


if __name__ == "__main__":
    trio.run(main)
