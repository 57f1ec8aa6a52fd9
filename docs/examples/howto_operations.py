"""How-to: operate a store: read a session without waking it, list, export and import."""

import json
import os
import sys
import tempfile

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def sessions(*args: str, stdin: bytes = b"") -> str:
    """Run ``python -m sessionactors sessions ARGS``; its standard output."""
    done = await trio.run_process(
        [sys.executable, "-m", "sessionactors", "sessions", *args],
        stdin=stdin,
        capture_stdout=True,
    )
    return done.stdout.decode()


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sessions.db")
        store_url = f"sqlite:///{path}"
        agent = sa.Agent(model=EchoModel())
        async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as reg:
            for name, tenant in [("chat-1", "acme"), ("chat-2", "globex"), ("chat-3", "acme")]:
                ref = await reg.spawn(name, metadata={"tenant": tenant})
                await ref.send(f"Hello from {name}.")

            # This registry holds the file while we read it: from Python, read-only ...
            reader = sa.SQLiteStore(path, readonly=True)
            state = await sa.read_session(reader, "chat-1")
            await reader.aclose()
            print(f"read without waking: {state.session_id} {len(state.messages)} messages")

            # ... and with the command line, from another process.
            rows = json.loads(
                await sessions("list", "--store", store_url, "--meta", "tenant=acme", "--json")
            )
            print("acme's sessions:", [row["name"] for row in rows])
            exported = await sessions("export", "chat-1", "--store", store_url)
            document = json.loads(exported)
            print(f"export format {document['format']} version {document['version']}")

        # Nothing serves the file now: import the export under a new name, then delete.
        print((await sessions("import", "-", "--as", "chat-1-copy", "--store", store_url,
                              stdin=exported.encode())).strip())  # fmt: skip
        print((await sessions("delete", "chat-1", "--yes", "--store", store_url)).strip())
        async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as reg:
            reply = await reg.ref("chat-1-copy").send("Still there?")
            history = await reg.ref("chat-1-copy").history()
            print(f"the copy answers: {reply.text} ({len(history)} messages)")


if __name__ == "__main__":
    trio.run(main)
