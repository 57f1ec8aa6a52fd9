"""Tutorial step 6: keep sessions in SQLite and carry on after a restart."""

import os
import tempfile

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def first_run(path: str, agent: sa.Agent) -> None:
    async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as registry:
        ref = await registry.spawn("chat-1")
        await ref.send("Before the restart.")
    # Leaving the block hibernated every live session into the file.


async def second_run(path: str, agent: sa.Agent) -> None:
    # A new registry and a new store object over the same file: as after a process restart.
    # The agents are found again by their names ("echo").
    async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as registry:
        ref = registry.ref("chat-1")
        reply = await ref.send("After the restart.")
        print("reply:", reply.text)
        print("history:", [m.content for m in await ref.history()])

        # The message-level events are kept in the store with their seq numbers.
        kinds = []
        async with ref.subscribe(after=0) as events:
            with trio.move_on_after(0.5):
                async for event in events:
                    kinds.append(type(event).__name__)
                    if isinstance(event, sa.TurnFinished) and event.turn_id == reply.turn_id:
                        break
        print("replayed:", kinds.count("TurnFinished"), "finished turns")


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "sessions.db")
        await first_run(path, agent)
        await second_run(path, agent)


if __name__ == "__main__":
    trio.run(main)
