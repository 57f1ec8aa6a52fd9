"""How-to: an orchestrator agent whose tool asks worker sessions, in one registry."""

import json
from collections.abc import AsyncIterator

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


class Orchestrator:
    """A stand-in for a real model: for "ask NAMES: QUESTION" it calls the tool
    ``ask_workers``, then answers with what the tool returned."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        last = request.messages[-1]
        if last.role is sa.Role.TOOL:
            yield sa.TextChunk(f"The workers said: {last.content}")
            return
        names, _, question = last.content.removeprefix("ask ").partition(": ")
        arguments = json.dumps({"workers": names.split(","), "question": question})
        yield sa.ToolCallChunk(index=0, id="call-1", name="ask_workers", arguments=arguments)


# The tool reaches the registry the app opened (set once it is open).
REGISTRY: list[sa.Registry] = []


@sa.tool
async def ask_workers(workers: list[str], question: str) -> dict[str, str]:
    """Ask worker sessions a question, all at once.

    Args:
        workers: The worker sessions' names.
        question: What to ask them.
    """
    registry = REGISTRY[0]
    answers: dict[str, str] = {}
    asked: dict[str, str] = {}  # worker -> the id of the turn that asks it

    async def ask(name: str) -> None:
        try:
            turn = await registry.ref(name).submit(question)
            asked[name] = turn.id
            answers[name] = (await turn.reply()).text
        except sa.TurnFailedError as exc:  # told in your words: its text may quote secrets
            answers[name] = f"(failed: {type(exc.__cause__).__name__})"
        except sa.SessionBusyError as exc:  # its own session, or one waiting on this turn
            answers[name] = f"(refused: {str(exc)[:60]}...)"
        except sa.SessionActorsError as exc:  # any other (a crash, the store): the rest go on
            answers[name] = f"(failed: {type(exc).__name__})"

    try:
        async with trio.open_nursery() as nursery:  # the workers answer concurrently
            for name in workers:
                nursery.start_soon(ask, name)
    except BaseException:  # (cancelled: it comes in the nursery's exception group)
        # This turn was cancelled (ref.cancel(), its turn_timeout, the registry's close):
        # cancel the workers' turns too, or they run on. Shielded: this task is cancelled.
        with trio.CancelScope(shield=True):
            for name, turn_id in asked.items():
                await registry.ref(name).cancel(turn_id=turn_id)
        raise
    return {name: answers[name] for name in workers}  # (in the order asked)


async def main() -> None:
    agents = {
        "orchestrator": sa.Agent(model=Orchestrator(), tools=[ask_workers], turn_timeout=60),
        "worker": sa.Agent(model=EchoModel(prefix="on it: ")),
    }
    async with sa.open_registry(agents=agents) as registry:
        REGISTRY.append(registry)
        boss = await registry.spawn("boss", agent="orchestrator")
        for name in ("w1", "w2"):
            await registry.spawn(name, agent="worker")

        reply = await boss.send("ask w1,w2: summarise the report")
        print(reply.text)

        # A tool cannot wait on its own session's turn (the request would queue behind
        # the turn that waits on it): refused at once, the turn goes on.
        reply = await boss.send("ask boss,w1: and you?")
        print(reply.text)


if __name__ == "__main__":
    trio.run(main)
