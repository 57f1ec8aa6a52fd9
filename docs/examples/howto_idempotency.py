"""How-to: retry a request safely with an idempotency key."""

import trio

import sessionactors as sa
from sessionactors.testing import ScriptedModel


async def main() -> None:
    model = ScriptedModel(["Your order ships tomorrow.", "Anything else?"])
    agent = sa.Agent(model=model)
    async with sa.open_registry(agents={"shop": agent}) as registry:
        ref = await registry.spawn("customer-7")

        # The key names the request, for instance the id of the HTTP request that carries it.
        key = "req-2f1c"
        first = await ref.send("When does my order ship?", idempotency_key=key)

        # The client did not get the answer (a timeout, a dropped connection) and retries.
        retry = await ref.send("When does my order ship?", idempotency_key=key)
        print(
            "same reply:", retry.text == first.text, "| same turn:", retry.turn_id == first.turn_id
        )
        print("model asked:", len(model.requests), "time(s)")
        print("history:", len(await ref.history()), "messages")

        # submit() tells you whether the key had already completed.
        turn = await ref.submit("When does my order ship?", idempotency_key=key)
        print("replayed:", turn.replayed)

        # Two callers racing with the same key while the turn runs share that one turn.
        key = "req-9a0b"
        a = await ref.submit("Thanks!", idempotency_key=key)
        b = await ref.submit("Thanks!", idempotency_key=key)
        print("joined:", a.id == b.id, (await a.reply()).text == (await b.reply()).text)
        print("history:", len(await ref.history()), "messages")


if __name__ == "__main__":
    trio.run(main)
