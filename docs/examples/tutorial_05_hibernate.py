"""Tutorial step 5: hibernate a session and wake it with the next request."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    # idle_timeout: seconds without a request before a session hibernates by itself.
    async with sa.open_registry(agents={"echo": agent}, idle_timeout=0.1) as registry:
        ref = await registry.spawn("chat-1")
        await ref.send("Remember me.")
        print("live:", registry.live())

        # Hibernate by hand: the state is written to the store and the task exits.
        await ref.hibernate()
        print("after hibernate, live:", registry.live())

        # registry.ref() is cheap and does no I/O; the first request wakes the session.
        ref = registry.ref("chat-1")
        print("history after waking:", [m.content for m in await ref.history()])
        print("live again:", registry.live())

        # Left alone for idle_timeout seconds, it hibernates again.
        await trio.sleep(0.5)
        print("after idling, live:", registry.live())
        (info,) = await registry.sessions()
        print("status:", info.status.value)

        # A name that was never spawned is not found.
        try:
            await registry.ref("nobody").history()
        except sa.SessionNotFoundError as exc:
            print("not found:", exc)


if __name__ == "__main__":
    trio.run(main)
