"""A server process holding sessions, for the tests of ``python -m sessionactors sessions``.

Usage: ``python sessions_server.py STORE`` with STORE ``sqlite:PATH`` (the file opened
exclusively, as a server does by default), ``sqlite-shared:PATH`` (``shared=True``:
leases on) or a ``redis://`` URL. It opens a registry with one agent, ``echo``, prints
``ready`` and answers each line of stdin with one line:

- ``spawn NAME KEY=VALUE ...`` -> ``ok`` (a session with that metadata),
- ``send NAME TEXT...`` -> the reply's text (one turn; the session stays live),
- ``hibernate NAME`` -> ``ok``,
- ``live`` -> the names of its live sessions, sorted, separated by spaces,
- ``exit`` (or the end of stdin) closes the registry and ends.
"""

import sys

import trio

import sessionactors as sa
from sessionactors.stores import Store
from sessionactors.testing import EchoModel


def open_store(spec: str) -> Store:
    if spec.startswith("redis://"):
        from sessionactors.stores import RedisStore

        return RedisStore(spec)
    kind, _, path = spec.partition(":")
    return sa.SQLiteStore(path, shared=kind == "sqlite-shared")


async def main(spec: str) -> None:
    agents = {"echo": sa.Agent(model=EchoModel(), system_prompt="Echo.")}
    async with sa.open_registry(store=open_store(spec), agents=agents) as registry:
        print("ready", flush=True)
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            command, _, rest = line.strip().partition(" ")
            if command in ("", "exit"):
                return
            if command == "spawn":
                name, *pairs = rest.split()
                metadata = dict(pair.split("=", 1) for pair in pairs)
                await registry.spawn(name, metadata=metadata)
                print("ok", flush=True)
            elif command == "send":
                name, _, text = rest.partition(" ")
                reply = await registry.ref(name).send(text)
                print(reply.text, flush=True)
            elif command == "live":
                print(" ".join(sorted(registry.live())), flush=True)
            elif command == "hibernate":
                await registry.ref(rest).hibernate()
                print("ok", flush=True)
            else:
                raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
