"""How-to: test what a new process finds after the old one died (crash) or was cancelled."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, crash

AGENTS = {"echo": sa.Agent(model=EchoModel())}


async def history(store: sa.MemoryStore) -> list[str]:
    """What a new process over ``store`` finds of session "s"."""
    async with sa.open_registry(store=store, agents=AGENTS) as registry:
        return [m.content for m in await registry.ref("s").history()]


async def main() -> None:
    for end in ("cancelled", "crashed"):
        store = sa.MemoryStore()
        with trio.CancelScope() as process:
            # durability="hibernate": answered turns are written only when it hibernates
            async with sa.open_registry(
                store=store, agents=AGENTS, durability="hibernate"
            ) as registry:
                ref = await registry.spawn("s")
                await ref.send("hello")
                if end == "crashed":
                    crash(registry)  # the process dies here, as with kill -9
                process.cancel()
        print(f"{end}: the next process finds {await history(store)}")


if __name__ == "__main__":
    trio.run(main)
