"""How-to: keep long conversations inside the model's context with Compaction."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, ScriptedModel


async def main() -> None:
    # The summarizer is any Model; here a scripted one that always gives the same summary.
    summarizer = ScriptedModel(["The user counted upwards."], repeat=True)
    agent = sa.Agent(
        model=EchoModel(),
        compaction=sa.Compaction(
            max_tokens=80,  # when a request is estimated above this many tokens...
            keep_last=4,  # ...summarize all but the last 4, from a user message on
            summarizer=summarizer,  # default: the agent's own model
        ),
    )
    async with sa.open_registry(agents={"echo": agent}) as registry:
        ref = await registry.spawn("long-chat")
        for i in range(8):
            await ref.send(f"this is message number {i} of a long conversation")
        print("compactions:", len(summarizer.requests))
        state = await ref.state()
        print("messages kept:", len(state.messages), "| summary:", state.summary)
        print("the summarizer saw:", summarizer.requests[0].messages[1].content.splitlines()[0])


if __name__ == "__main__":
    trio.run(main)
