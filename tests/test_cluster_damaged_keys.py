"""Many workers over a session's key changed behind the store's back: it fails that
session's part in it, and every other session goes on, on every worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio

import sessionactors as sa
from redis_keys import admin_client, replace_with_list, session_key
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

AGENTS = {"echo": sa.Agent(model=EchoModel())}


def open_worker(url: str, prefix: str, worker_id: str) -> Any:
    """A registry on ``url`` under ``prefix`` whose sessions stay where they woke."""
    store = RedisStore(url, prefix=prefix, balance=False)
    return sa.open_registry(store=store, agents=AGENTS, worker_id=worker_id, lease_ttl=1.0)


def only_error(error: BaseException) -> BaseException:
    """The one error that ``error`` is or that its groups hold."""
    while isinstance(error, BaseExceptionGroup):
        assert len(error.exceptions) == 1, repr(error)
        error = error.exceptions[0]
    return error


def check_damaged(error: BaseException, name: str, key: str) -> None:
    """``error`` says that session ``name``'s ``key`` holds another type of value, and
    to remove that key: an error of that session, not of the store."""
    error = only_error(error)
    assert isinstance(error, sa.SnapshotCorruptError), repr(error)
    assert not isinstance(error, sa.StoreError)
    assert error.session_id == name
    message = str(error)
    assert f"session {name!r}" in message
    assert f"{key!r} holds a list" in message
    assert "remove that key" in message


async def until_error(events: Any) -> BaseException:
    """Read a subscription to its end; the error that ended it."""
    try:
        async for _ in events:
            pass
    except Exception as exc:
        return exc
    pytest.fail("the subscription ended without an error")


async def until_finished(events: Any, turn_id: str) -> None:
    async for event in events:
        if isinstance(event, sa.TurnFinished) and event.turn_id == turn_id:
            return


async def heard_elsewhere(watcher: sa.Registry, sender: sa.Registry, name: str) -> None:
    """A turn ``sender`` sends to ``name`` reaches a subscription on ``watcher``."""
    async with watcher.ref(name).subscribe() as events:
        turn = await sender.ref(name).submit("heard?")
        await until_finished(events, turn.id)
        assert (await turn.reply()).text == "heard?"


async def check_working(w1: sa.Registry, w2: sa.Registry) -> None:
    """Sessions "a" and "b" (live on w1) answer both workers; b's turns reach
    subscriptions on both, and a's its owner's."""
    for registry in (w1, w2):
        for name in ("a", "b"):
            assert (await registry.ref(name).send(f"to {name}")).text == f"to {name}"
    for sender in (w1, w2):
        await heard_elsewhere(w2, sender, "b")
        await heard_elsewhere(w1, sender, "b")
        await heard_elsewhere(w1, sender, "a")
    assert sorted(w1.live()) == ["a", "b"]


async def test_a_damaged_event_stream_fails_the_sessions_subscriptions_elsewhere_only(
    any_redis_url: str,
) -> None:
    """A session whose event stream key holds another type of value (a list) fails a
    subscription to it from another worker with SnapshotCorruptError naming the session
    and the key and saying to remove it; both workers stay up, the session answers
    both, and the other session's events reach both. Once the key is removed, the
    session's events reach the other worker again."""
    redis_url = any_redis_url
    prefix = f"sa-test:{uuid.uuid4().hex}"
    key = session_key(prefix, "a", "ev")
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "w1") as w1,
            open_worker(redis_url, prefix, "w2") as w2,
        ):
            for name in ("a", "b"):
                await (await w1.spawn(name)).send("hello")
            assert sorted(w1.live()) == ["a", "b"]
            await replace_with_list(redis_url, key)
            try:
                async with w2.ref("a").subscribe() as events:
                    assert (await w2.ref("a").send("through w2")).text == "through w2"
                    error = await until_error(events)
            except Exception as exc:
                error = exc
            check_damaged(error, "a", key)
            await check_working(w1, w2)
            async with admin_client(redis_url) as client:  # as the error says
                await client.delete([key])
            await heard_elsewhere(w2, w1, "a")


async def test_a_stream_damaged_while_read_elsewhere_ends_that_sessions_subscription_only(
    any_redis_url: str,
) -> None:
    """A session's event stream key replaced by a list while another worker reads it
    with other sessions' streams ends that session's subscription there with
    SnapshotCorruptError naming it; the other session's subscription on that worker
    hears its turns on, and both workers stay up. Once the key is removed, the
    session's events reach the other worker again."""
    redis_url = any_redis_url
    prefix = f"sa-test:{uuid.uuid4().hex}"
    key = session_key(prefix, "a", "ev")
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "w1") as w1,
            open_worker(redis_url, prefix, "w2") as w2,
        ):
            for name in ("a", "b"):
                await (await w1.spawn(name)).send("hello")
            async with w2.ref("a").subscribe() as a_events, w2.ref("b").subscribe() as b_events:
                for name, events in (("a", a_events), ("b", b_events)):
                    turn = await w1.ref(name).submit("before")
                    await until_finished(events, turn.id)
                await replace_with_list(redis_url, key)
                assert (await w1.ref("a").send("after")).text == "after"
                turn = await w1.ref("b").submit("after")
                await until_finished(b_events, turn.id)
                check_damaged(await until_error(a_events), "a", key)
                turn = await w2.ref("b").submit("and on")
                await until_finished(b_events, turn.id)
            await check_working(w1, w2)
            async with admin_client(redis_url) as client:  # as the error says
                await client.delete([key])
            for sender in (w1, w2):
                await heard_elsewhere(w2, sender, "a")
