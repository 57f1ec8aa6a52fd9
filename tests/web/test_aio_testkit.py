"""The test kit with sessionactors.aio: crash, journal_events and gates from asyncio tests,
and from a sync test of a Starlette app (its TestClient runs the loop in a thread of its own)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.stores import MemoryStore
from sessionactors.testing import (
    EchoModel,
    FaultyStore,
    Gate,
    Scripted,
    ScriptedModel,
    crash,
    journal_events,
)

ECHO = {"echo": sa.Agent(model=EchoModel())}


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` under asyncio.run, bounded in time."""

    async def bounded() -> Any:
        async with asyncio.timeout(20):
            return await main()

    return asyncio.run(bounded())


def test_crash_stops_an_aio_registry_as_its_process_death_would() -> None:
    """crash() of an aio registry stops its sessions where they are: the caller of the
    turn in flight hears of the crash, and leaving the block writes nothing."""
    store = FaultyStore(MemoryStore())
    gate = Gate()
    model = ScriptedModel(["one", Scripted(text="partial reply", wait=gate, wait_after=1)])

    async def main() -> None:
        async with aio.open_registry(store=store, agents={"m": sa.Agent(model=model)}) as reg:
            ref = await reg.spawn("s")
            await ref.send("one")
            turn = await ref.submit("two")
            while gate.waiting == 0:  # the model streamed its first word and waits
                await asyncio.sleep(0.001)
            written = (store.calls["append"], store.calls["write_snapshot"])
            crash(reg)
        # (a clean exit would have hibernated the session: a snapshot)
        assert (store.calls["append"], store.calls["write_snapshot"]) == written
        with pytest.raises(sa.SessionStoppedError, match="crashed"):
            await turn.reply()
        async with aio.open_registry(store=store, agents={"m": sa.Agent(model=model)}) as reg:
            history = await reg.ref("s").history()
            outcome = await reg.ref("s").turn_outcome(turn.id)
        assert [m.content for m in history][:2] == ["one", "one"]
        assert outcome.status is not sa.TurnStatus.FINISHED

    run(main)


def test_crash_refuses_an_aio_registry_from_another_thread() -> None:
    """crash() of an aio registry called off its loop's thread raises, and crashes nothing."""
    errors: list[BaseException] = []

    async def main() -> None:
        async with aio.open_registry(agents=ECHO) as reg:
            ref = await reg.spawn("s")
            try:
                await asyncio.to_thread(crash, reg)
            except RuntimeError as exc:
                errors.append(exc)
            assert (await ref.send("still here")).text == "still here"

    run(main)
    (error,) = errors
    assert "asyncio loop" in str(error)


def test_journal_events_reads_a_store_from_asyncio() -> None:
    """journal_events awaited in asyncio code reads the store, in and after a registry's block."""
    store = MemoryStore()

    async def main() -> tuple[list[sa.Event], list[sa.Event]]:
        async with aio.open_registry(store=store, agents=ECHO) as reg:
            await (await reg.spawn("s")).send("hi")
            inside = await journal_events(store, "s")
        return inside, await journal_events(store, "s")

    inside, after = run(main)
    finished = [e.message.content for e in after if isinstance(e, sa.TurnFinished)]
    assert finished == ["hi"]
    assert inside == after[: len(inside)]
    assert any(isinstance(e, sa.TurnFinished) for e in inside)


def held_turn_app(model: ScriptedModel) -> Starlette:
    """An app whose POST /submit starts a turn and answers after its first word, and whose
    POST /reply waits for that turn's reply (503 and the error's words if it fails)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with aio.open_registry(agents={"m": sa.Agent(model=model)}) as registry:
            app.state.registry = registry
            yield

    async def submit(request: Request) -> JSONResponse:
        ref = await request.app.state.registry.get_or_spawn("s")
        async with ref.subscribe() as events:
            request.app.state.turn = await ref.submit("hi")
            async for event in events:
                if isinstance(event, sa.Delta):
                    break
        return JSONResponse({"turn": request.app.state.turn.id})

    async def reply(request: Request) -> JSONResponse:
        try:
            return JSONResponse({"text": (await request.app.state.turn.reply()).text})
        except sa.SessionActorsError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)

    return Starlette(
        routes=[
            Route("/submit", submit, methods=["POST"]),
            Route("/reply", reply, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def test_a_gate_opened_by_a_sync_test_lets_a_held_model_answer_go_on() -> None:
    """A sync test lets a ScriptedModel answer held at a Gate go on with gate.open(),
    though the app's loop and its trio run live in the TestClient's thread."""
    gate = Gate()
    model = ScriptedModel([Scripted(text="a b c", wait=gate, wait_after=1)])
    with TestClient(held_turn_app(model)) as client:
        assert client.post("/submit").status_code == 200
        gate.open()
        assert client.post("/reply").json() == {"text": "a b c"}


def test_a_sync_test_crashes_the_app_registry_on_the_test_clients_loop() -> None:
    """crash() of an app's registry, called on the TestClient's loop, stops the turn in
    flight and its waiter hears of the crash."""
    gate = Gate()
    model = ScriptedModel([Scripted(text="a b c", wait=gate, wait_after=1)])
    app = held_turn_app(model)
    with TestClient(app) as client:
        assert client.post("/submit").status_code == 200
        client.portal.call(crash, app.state.registry)
        answer = client.post("/reply")
    assert answer.status_code == 503
    assert "crashed" in answer.json()["error"]
