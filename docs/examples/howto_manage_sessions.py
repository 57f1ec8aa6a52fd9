"""How-to: list, inspect and manage stored sessions from a script, without agents."""

import tempfile
from pathlib import Path

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def serve(path: Path) -> None:
    """The app: it runs turns, so it has the agents."""
    agents = {"support": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        for i in range(7):
            tier = "gold" if i % 3 == 0 else "free"
            ref = await registry.spawn(f"customer-{i}", metadata={"tenant": "acme", "tier": tier})
            await ref.send(f"Hello from customer {i}.")


async def manage(path: Path) -> None:
    """An operator's script: no agents, so it reads and manages, but runs no turns."""
    async with sa.open_registry(store=sa.SQLiteStore(path)) as registry:
        # newest activity first, a page at a time: pass the last name as after=
        page = await registry.sessions(limit=3)
        print("page 1:", [info.session_id for info in page])
        page = await registry.sessions(limit=3, after=page[-1].session_id)
        print("page 2:", [info.session_id for info in page])

        # filters: a status, and metadata key=value pairs that must all match
        gold = await registry.sessions(metadata={"tier": "gold"})
        print("gold:", [info.session_id for info in gold])
        hibernated = await registry.sessions(status="hibernated", limit=100)
        print("hibernated:", len(hibernated))

        # metadata is merged: keys given are set, a key given as None is removed
        ref = registry.ref("customer-1")
        print("metadata:", await ref.set_metadata({"tier": "gold", "tenant": None}))
        print("history:", [m.content for m in await ref.history()][:1])

        await registry.delete("customer-2")
        try:
            await ref.send("Are you there?")
        except sa.AgentNotFoundError as exc:
            print("no turn:", str(exc).split(";")[0])

        gold = await registry.sessions(metadata={"tier": "gold"})
        print("gold now:", sorted(info.session_id for info in gold))


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sessions.db"
        await serve(path)
        await manage(path)


if __name__ == "__main__":
    trio.run(main)
