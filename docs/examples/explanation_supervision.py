"""Explanation: a crashing actor is restarted from its last durable state."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, FaultyStore


async def main() -> None:
    store = FaultyStore()  # a MemoryStore whose operations fail when told to
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(store=store, agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat")
        await ref.send("first")
        other = await registry.spawn("bystander")
        seq_before = (await ref.state()).event_seq

        # The store fails while the turn is being made durable: that is not the agent's
        # fault, so the actor itself crashes. Its waiter is told; the supervisor restarts it.
        store.fail("append", session_id="chat", error=OSError("simulated disk fault"))
        try:
            await ref.send("second")
        except sa.SessionCrashedError as exc:
            print("crashed:", type(exc.__cause__).__name__, "-", exc.__cause__)

        # The restarted actor loaded its last durable state: the unacknowledged turn is gone.
        print("history:", [m.content for m in await ref.history()])
        print("restarts:", registry.statistics().restarts)

        # The restart happened in this process, whose event hub remembers every seq it
        # published: numbering goes on from there, never reusing a seq.
        print("seq still rising:", (await ref.state()).event_seq > seq_before)

        # The session carries on, and other sessions never noticed.
        print("next reply:", (await ref.send("third")).text)
        print("bystander:", (await other.send("unaffected")).text)


if __name__ == "__main__":
    trio.run(main)
