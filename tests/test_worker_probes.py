"""Probes of the multi-worker layer: requests through another worker when the owner
closes, dies or is slow; every caller gets the answer or error it would get locally."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

TTL = 1.0


def open_worker(url: str, prefix: str, worker_id: str, model: Any, **options: Any) -> Any:
    """A registry on ``url`` under ``prefix`` whose sessions stay where they woke."""
    store = RedisStore(url, prefix=prefix, balance=False)
    options.setdefault("lease_ttl", TTL)
    agents = {"echo": sa.Agent(model=model)}
    return sa.open_registry(store=store, agents=agents, worker_id=worker_id, **options)


def last_user_text(request: sa.ModelRequest) -> str:
    return next(m.content for m in reversed(request.messages) if m.role is sa.Role.USER)


class HoldLong:
    """Holds a turn whose text is "long" open until cancelled; echoes any other."""

    def __init__(self) -> None:
        self.started = trio.Event()

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        text = last_user_text(request)
        if text == "long":
            self.started.set()
            await trio.sleep_forever()
        for word in text.split():
            await trio.lowlevel.checkpoint()
            yield sa.TextChunk(word + " ")


class RateLimited:
    """Fails a turn whose text starts with "fail" as an HTTP 429 from a model would."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        text = last_user_text(request)
        await trio.lowlevel.checkpoint()
        if text.startswith("fail"):
            raise sa.ModelError("the model's server said 429: slow down", status_code=429)
        yield sa.TextChunk(text)


async def test_a_stream_through_another_worker_follows_its_turn_sent_on_when_its_owner_closes(
    redis_url: str,
) -> None:
    """ref.stream() through another worker, whose turn waits in the owner's mailbox when the owner closes and is sent on to the session's next worker, yields that turn's events to its outcome: it never ends empty without one."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    model = HoldLong()
    seen: list[sa.Event] = []
    text = "queued behind the long turn"
    with trio.fail_after(30):
        async with open_worker(redis_url, prefix, "b", EchoModel()) as b:
            async with (
                trio.open_nursery() as nursery,
                open_worker(redis_url, prefix, "a", model, shutdown_grace=0.3) as a,
            ):
                await a.spawn("s")
                await a.ref("s").history()  # live on a

                async def long_turn() -> None:
                    with pytest.raises(sa.SessionStoppedError):  # cut off by a's close
                        await a.ref("s").send("long")

                nursery.start_soon(long_turn)
                await model.started.wait()

                async def stream(task_status: trio.TaskStatus[None]) -> None:
                    async with b.ref("s").stream(text) as events:
                        task_status.started()  # accepted into a's mailbox
                        async for event in events:
                            seen.append(event)

                await nursery.start(stream)
            # a closed (then the stream ended): the turn a never started ran on b
            history = await b.ref("s").history()
    assert [m.content for m in history if m.role is sa.Role.USER] == ["long", text]
    assert [type(e) for e in seen[:1]] == [sa.TurnStarted]
    last = seen[-1]
    assert isinstance(last, sa.TurnFinished), seen
    assert last.turn_id == seen[0].turn_id
    assert last.message.content.strip() == text


async def test_a_turn_failed_through_another_worker_keeps_its_cause(redis_url: str) -> None:
    """A turn sent through another worker whose model fails raises TurnFailedError with the model's error as its __cause__ (type, message, status_code), as it does on the owner's own worker."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", RateLimited()) as a,
            open_worker(redis_url, prefix, "b", RateLimited()) as b,
        ):
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            errors = []
            for registry in (a, b):
                with pytest.raises(sa.TurnFailedError) as caught:
                    await registry.ref("s").send("fail please")
                errors.append(caught.value)
            assert b.live() == []  # it ran on a
    local, remote = errors
    assert isinstance(local.__cause__, sa.ModelError)
    cause = remote.__cause__
    assert isinstance(cause, sa.ModelError), repr(cause)
    assert str(cause) == str(local.__cause__)
    assert cause.status_code == 429
    assert remote.session_id == "s"
