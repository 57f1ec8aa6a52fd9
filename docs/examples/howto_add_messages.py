"""How-to: put messages into a history without a turn: add_messages and replace_history."""

import datetime

import trio

import sessionactors as sa
from sessionactors.testing import ScriptedModel

USER, ASSISTANT, SYSTEM, TOOL = sa.Role.USER, sa.Role.ASSISTANT, sa.Role.SYSTEM, sa.Role.TOOL


async def main() -> None:
    model = ScriptedModel(["Your parcel arrives tomorrow."])
    agent = sa.Agent(model=model, system_prompt="You are the support bot.")
    async with sa.open_registry(agents={"support": agent}) as registry:
        ref = await registry.spawn("support-7")

        # A conversation imported from elsewhere, with its own ids and times, a tool
        # call and its result among them. No model is called.
        at = datetime.datetime(2025, 3, 1, 9, 0, tzinfo=datetime.UTC)
        lookup = sa.ToolCall(id="call_1", name="track", arguments='{"order": "A1"}')
        await ref.add_messages(
            [
                sa.Message(id="old-1", role=USER, content="Where is order A1?", created_at=at),
                sa.Message(
                    id="old-2", role=ASSISTANT, content="", tool_calls=(lookup,), created_at=at
                ),
                sa.Message(
                    id="old-3",
                    role=TOOL,
                    content="in transit",
                    tool_call_id="call_1",
                    created_at=at,
                ),
            ]
        )

        # A person takes over the chat: their reply joins the history as it is.
        await ref.add_messages(
            [
                sa.Message.create(SYSTEM, "Ada (human agent) joined the chat."),
                sa.Message.create(ASSISTANT, "Hi, Ada here. It is on its way."),
            ]
        )
        for m in await ref.history():
            print(f"{m.role.value:>9}: {m.content or m.tool_calls[0].name}")

        # The next turn's model request holds every message added.
        await ref.send("When will it arrive?")
        print("the model saw", len(model.requests[0].messages), "messages")

        # A tool call without its result would break the history: refused, nothing written.
        try:
            await ref.add_messages(
                [
                    sa.Message(
                        id="late", role=ASSISTANT, content="", tool_calls=(lookup,), created_at=at
                    )
                ]
            )
        except sa.InvalidHistoryError as exc:
            print("refused:", str(exc).split(": ", 1)[1])

        # replace_history swaps the whole history, here for a redacted copy.
        redacted = [m for m in await ref.history() if m.role in (USER, ASSISTANT) and m.content]
        await ref.replace_history(redacted)
        print("after replace:", len(await ref.history()), "messages")


if __name__ == "__main__":
    trio.run(main)
