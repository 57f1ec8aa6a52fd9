"""How-to: move every session of a store to another (SQLite to SQLite here; the same
command takes --to redis://host:port/db)."""

import os
import sys
import tempfile

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def sessions(*args: str) -> tuple[int, str]:
    """Run ``python -m sessionactors sessions ARGS``; its exit status and standard output."""
    done = await trio.run_process(
        [sys.executable, "-m", "sessionactors", "sessions", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return done.returncode, done.stdout.decode()


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        old, new = os.path.join(tmp, "old.db"), os.path.join(tmp, "new.db")
        agents = {"echo": sa.Agent(model=EchoModel())}
        async with sa.open_registry(store=sa.SQLiteStore(old), agents=agents) as registry:
            for name in ["chat-1", "chat-2", "chat-3"]:
                await (await registry.spawn(name)).send(f"Hello from {name}.")

        # The server on the old store has stopped: copy every session to the new one.
        copy = ["copy", "--store", f"sqlite:///{old}", "--to", f"sqlite:///{new}"]
        status, out = await sessions(*copy)
        print(out, end="")
        print(f"exit status {status}")

        # Run again (after an interruption, say): what is there already is skipped.
        status, out = await sessions(*copy)
        print(f"again: {out.splitlines()[-1]} (exit status {status})")

        reader = sa.SQLiteStore(new, readonly=True)
        seq = (await sa.read_session(reader, "chat-1")).event_seq  # as it was copied
        await reader.aclose()
        async with sa.open_registry(store=sa.SQLiteStore(new), agents=agents) as registry:
            ref = registry.ref("chat-1")
            # The copy holds the state, not the journal: no replay of events before it ...
            try:
                async with ref.subscribe(after=seq - 1) as events:
                    async for _ in events:
                        break
            except sa.EventsExpiredError:
                print("a replay from before the copy: EventsExpiredError")
            # ... while a subscriber at the seq it was copied at follows on.
            async with ref.subscribe(after=seq) as events:
                reply = await ref.send("Still there?")
                async for event in events:
                    if isinstance(event, sa.TurnFinished):
                        print(f"followed on to the reply: {event.message.content}")
                        break
            print(f"the copy answers: {reply.text} ({len(await ref.history())} messages)")


if __name__ == "__main__":
    trio.run(main)
