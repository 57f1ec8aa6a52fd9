"""How-to: shut a registry down gracefully with shutdown_grace."""

import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


async def main() -> None:
    never = trio.Event()  # the slow model waits on this forever
    agents = {
        # Three words, 0.05 s apart: done well inside the grace period.
        "quick": sa.Agent(model=ScriptedModel([Scripted(text="done in time", delay=0.05)])),
        # Streams two words, then hangs.
        "slow": sa.Agent(
            model=ScriptedModel([Scripted(text="this never finishes", wait=never, wait_after=2)])
        ),
    }
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=agents, shutdown_grace=0.5) as registry:
        quick = await registry.spawn("quick-1", agent="quick")
        slow = await registry.spawn("slow-1", agent="slow")
        quick_turn = await quick.submit("hi")
        slow_turn = await slow.submit("hi")
        queued_turn = await slow.submit("and then?")  # waits behind the slow turn
    # Leaving the block: no new requests; accepted turns get up to shutdown_grace seconds;
    # then the turn still running is cut off (it fails with SessionStoppedError, what it
    # streamed kept), whatever is queued fails, and every live session is hibernated.
    print("quick:", (await quick_turn.reply()).text)
    for name, turn in [("slow", slow_turn), ("queued", queued_turn)]:
        try:
            await turn.reply()
        except sa.SessionStoppedError as exc:
            print(f"{name}: SessionStoppedError: {exc}")

    # What the slow turn streamed is kept, marked interrupted. The turn did not end by
    # a cancel: it failed, and its TurnFailed (what its subscribers saw) and its outcome
    # say that its worker stopped, so that a client knows to send the message again.
    async with sa.open_registry(store=store, agents=agents) as registry:
        slow = registry.ref("slow-1")
        last = (await slow.history())[-1]
        print(f"kept: {last.content!r} interrupted={last.interrupted}")
        outcome = await slow.turn_outcome(slow_turn.id)
        print("outcome:", outcome.status.value, "|", outcome.error)


if __name__ == "__main__":
    trio.run(main)
