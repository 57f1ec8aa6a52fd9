"""Explanation: after a process dies, a session wakes from snapshot + journal tail,
and its seq jumps past anything the dead process may have published.

The program runs itself twice: a child process that is killed mid-conversation, then
the parent, which wakes the session from the same SQLite file.
"""

import os
import sys
import tempfile

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel

AGENTS = {"echo": sa.Agent(model=EchoModel())}


async def child(path: str) -> None:
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS) as registry:
        ref = await registry.spawn("chat")
        await ref.send("this turn is durable")  # returned: the turn is in the journal
        print((await ref.state()).event_seq, flush=True)
        os._exit(1)  # die at once: no shutdown, no hibernation, no snapshot


async def main() -> None:
    if len(sys.argv) > 1:
        await child(sys.argv[1])
        return
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "sessions.db")
        done = await trio.run_process(
            [sys.executable, __file__, path], check=False, capture_stdout=True
        )
        child_seq = int(done.stdout)
        print("child was killed; it had published up to seq", child_seq)

        async with sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS) as registry:
            state = await registry.ref("chat").state()
            print("woken with", len(state.messages), "messages")
            print("seq after waking:", state.event_seq)
            print("jumped by about 2**20:", state.event_seq > child_seq + 1_000_000)


if __name__ == "__main__":
    trio.run(main)
