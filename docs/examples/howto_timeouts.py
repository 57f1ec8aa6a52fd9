"""How-to: bound waits with trio's own timeouts, and cancel a turn."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    # Each word takes 0.1 s: a slow model.
    agent = sa.Agent(model=EchoModel(delay=0.1))
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat")

        # No timeout= parameters anywhere: the caller owns time. The same holds for
        # `with trio.fail_after(...): await ref.send(...)`.
        turn = await ref.submit("one two three four five six")
        try:
            with trio.fail_after(0.25):
                await turn.reply()
        except trio.TooSlowError:
            print("gave up waiting after 0.25 s")

        # Giving up only abandons the wait: the turn runs on, like a GenServer call
        # that timed out, and its reply is kept.
        reply = await turn.reply()
        print("finished anyway:", reply.text)

        # To stop a turn, cancel it. cancel() is out of band: it does not queue.
        async with ref.subscribe() as events:
            turn = await ref.submit("seven eight nine ten eleven twelve")
            async for event in events:
                if isinstance(event, sa.Delta):
                    break  # the turn is under way
        # (naming the turn: if it ended meanwhile, the next one is left alone)
        print("cancelled one:", await ref.cancel(turn_id=turn.id))
        try:
            await turn.reply()
        except sa.TurnCancelledError:
            print("the waiter gets TurnCancelledError")
        last = (await ref.history())[-1]
        print(f"kept so far: {last.content!r} interrupted={last.interrupted}")


if __name__ == "__main__":
    trio.run(main)
