"""How-to: test code that uses sessionactors with the fake models.

Each ``test_*`` function below is a test as pytest-trio collects it (``trio_mode = true``);
``main`` runs them all, so this file also runs on its own.
"""

import pytest
import trio

import sessionactors as sa
from sessionactors.testing import EchoModel, Scripted, ScriptedModel


async def greet(registry: sa.Registry, name: str) -> str:
    """The application code under test: greet a user in their own session."""
    ref = await registry.get_or_spawn(name)
    reply = await ref.send(f"Say hello to {name}.")
    return reply.text


async def test_greet_replies_in_the_session() -> None:
    """EchoModel answers with the user's words, so the reply is predictable."""
    agent = sa.Agent(model=EchoModel(prefix="echo: "))
    async with sa.open_registry(agents={"echo": agent}) as registry:
        with trio.fail_after(5):
            assert await greet(registry, "ada") == "echo: Say hello to ada."
        assert registry.live() == ["ada"]


async def test_the_model_sees_the_system_prompt_first() -> None:
    """ScriptedModel plays set answers and records every request it gets."""
    model = ScriptedModel(["Hello, Ada!"])
    agent = sa.Agent(model=model, system_prompt="Be warm.")
    async with sa.open_registry(agents={"bot": agent}) as registry:
        with trio.fail_after(5):
            assert await greet(registry, "ada") == "Hello, Ada!"
    (request,) = model.requests
    assert [m.role for m in request.messages] == [sa.Role.SYSTEM, sa.Role.USER]
    assert request.messages[0].content == "Be warm."


async def test_a_model_failure_fails_the_turn_not_the_session() -> None:
    """An exception in the script is raised by the model; the next turn works."""
    model = ScriptedModel([RuntimeError("model is down"), "Back again."])
    agent = sa.Agent(model=model)
    async with sa.open_registry(agents={"bot": agent}) as registry:
        ref = await registry.spawn("ada")
        with trio.fail_after(5):
            with pytest.raises(sa.TurnFailedError) as failure:
                await ref.send("Hi")
            assert isinstance(failure.value.__cause__, RuntimeError)
            assert (await ref.send("Hi again")).text == "Back again."


async def test_a_turn_held_open_can_be_cancelled() -> None:
    """Scripted(wait=...) holds a turn in flight until the test lets it go."""
    release = trio.Event()
    model = ScriptedModel([Scripted(text="partial answer", wait=release, wait_after=1)])
    agent = sa.Agent(model=model)
    async with sa.open_registry(agents={"bot": agent}) as registry:
        ref = await registry.spawn("ada")
        with trio.fail_after(5):
            async with ref.subscribe() as events:
                turn = await ref.submit("Hi")
                async for event in events:
                    if isinstance(event, sa.Delta):
                        break  # the first word is out; the model now waits on `release`
            assert (await ref.state()).status is sa.Status.RUNNING
            assert await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            last = (await ref.history())[-1]
            assert last.interrupted
            assert last.content == "partial"


async def main() -> None:
    tests = [
        test_greet_replies_in_the_session,
        test_the_model_sees_the_system_prompt_first,
        test_a_model_failure_fails_the_turn_not_the_session,
        test_a_turn_held_open_can_be_cancelled,
    ]
    for test in tests:
        await test()
        print("passed:", test.__name__)


if __name__ == "__main__":
    trio.run(main)
