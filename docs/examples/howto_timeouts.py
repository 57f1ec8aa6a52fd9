"""How-to: bound waits with trio's own timeouts, and cancel a turn."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, Scripted, ScriptedModel


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

    # A limit of the agent's own: a turn that runs past turn_timeout (a model that
    # stopped answering, a tool that hangs) is cut and fails, whoever waits for it.
    never = trio.Event()
    stalls = ScriptedModel([Scripted(text="two words then silence", wait=never, wait_after=2)])
    limited = sa.Agent(model=stalls, turn_timeout=0.5)
    async with sa.open_registry(agents={"limited": limited}) as registry:
        ref = await registry.spawn("stalled")
        try:
            await ref.send("hello?")
        except sa.TurnFailedError as exc:
            print("cut by the agent's limit:", type(exc.__cause__).__name__)
        last = (await ref.history())[-1]
        print(f"kept: {last.content!r} interrupted={last.interrupted}")


if __name__ == "__main__":
    trio.run(main)
