"""How-to: learn what became of a turn by its id, and retry a failed turn."""

import contextlib

import trio

import sessionactors as sa
from sessionactors.testing import Scripted, ScriptedModel


async def main() -> None:
    # The model fails once, part-way through its answer (a provider outage, say),
    # then answers.
    outage = Scripted(text="Your order", error=RuntimeError("provider unavailable"))
    model = ScriptedModel([outage, "It ships tomorrow."])
    async with sa.open_registry(agents={"shop": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("customer-9")

        # Keep the id of each turn you submit (in your database, in the client).
        turn = await ref.submit("When does my order ship?")
        with contextlib.suppress(sa.TurnFailedError):
            await turn.reply()

        # Later, possibly in another process: what became of it?
        outcome = await ref.turn_outcome(turn.id)
        print("status:", outcome.status.value, "|", outcome.error)

        # The failed turn kept what its model streamed, marked interrupted (a turn
        # that streamed nothing leaves a marked "(no reply: this turn failed)").
        for m in await ref.history():
            print(f"  {m.role.value}: {m.content} (interrupted={m.interrupted})")

        # Run it again: the same user message, answered by a new turn.
        reply = await ref.retry()
        print("retried:", reply.text)
        print("history:", [m.content for m in await ref.history()])
        print("now:", (await ref.turn_outcome(reply.turn_id)).status.value)

        # Retrying a turn that did not fail is refused.
        try:
            await ref.retry()
        except sa.NothingToRetryError as exc:
            print("nothing to retry:", type(exc).__name__)

        # An id this session never issued is a typed error, too.
        try:
            await ref.turn_outcome("turn_made_up")
        except sa.TurnNotFoundError:
            print("unknown id: TurnNotFoundError")


if __name__ == "__main__":
    trio.run(main)
