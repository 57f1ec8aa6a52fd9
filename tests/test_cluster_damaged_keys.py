"""Many workers over a session's key changed behind the store's back: it fails that
session's part in it, and every other session goes on, on every worker."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import sessionactors as sa
from redis_keys import admin_client, replace_with_list, session_key, worker_key
from redis_workers import open_worker

pytestmark = pytest.mark.redis


@contextlib.asynccontextmanager
async def two_workers(
    url: str, prefix: str, *, b_on: str
) -> AsyncIterator[tuple[sa.Registry, sa.Registry]]:
    """Workers "w1" and "w2" (see ``open_worker``) with sessions "a", live on w1, and
    "b", live on ``b_on``, each sent "hello"."""
    async with open_worker(url, prefix, "w1") as w1, open_worker(url, prefix, "w2") as w2:
        await (await w1.spawn("a")).send("hello")
        await (await (w1 if b_on == "w1" else w2).spawn("b")).send("hello")
        yield w1, w2


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
        async with two_workers(redis_url, prefix, b_on="w1") as (w1, w2):
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
        async with two_workers(redis_url, prefix, b_on="w1") as (w1, w2):
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


async def damage_key(url: str, key: str, damage: str) -> None:
    """Put ``damage`` at a worker's ``key``: a list, or a string of garbage bytes."""
    if damage == "list":
        await replace_with_list(url, key)
        return
    async with admin_client(url) as client:
        await client.delete([key])
        await client.set(key, b"\xc1\xff garbage")


async def wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> logging.LogRecord:
    """The first record logged that says ``text`` (waiting for it)."""
    while True:
        for record in caplog.records:
            if text in record.getMessage():
                return record
        await trio.sleep(0.05)


async def check_serving(w1: sa.Registry, w2: sa.Registry) -> None:
    """Sessions "a" (live on w1) and "b" (live on w2) answer both workers, and each
    one's turns reach a subscription on the other worker."""
    for registry in (w1, w2):
        for name in ("a", "b"):
            assert (await registry.ref(name).send(name)).text == name
    await heard_elsewhere(w2, w1, "a")
    await heard_elsewhere(w1, w2, "b")
    assert (w1.live(), w2.live()) == (["a"], ["b"])


@pytest.mark.parametrize(
    ("part", "damage", "kept"),
    [("inbox", "list", "stream"), ("inbox", "string", "stream"), ("alive", "list", "string")],
)
async def test_a_worker_whose_own_key_is_damaged_repairs_it_and_goes_on(
    any_redis_url: str, part: str, damage: str, kept: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose own inbox or liveness key holds another type of value (a list, or
    garbage bytes in a string where its inbox stream is) logs it at WARNING, naming the
    worker and the key, removes it (the worker writes what it keeps there again) and
    goes on serving: requests reach its sessions from another worker and its
    subscriptions hear other workers' sessions."""
    redis_url = any_redis_url
    prefix = f"sa-test:{uuid.uuid4().hex}"
    key = worker_key(prefix, "w2", part)
    with trio.fail_after(60):
        async with two_workers(redis_url, prefix, b_on="w2") as (w1, w2):
            async with w2.ref("a").subscribe() as events:  # w2 reads a's stream now
                await damage_key(redis_url, key, damage)
                turn = await w1.ref("a").submit("after")
                await until_finished(events, turn.id)
            record = await wait_for_log(caplog, repr(key))
            assert record.levelname == "WARNING", record
            assert "worker 'w2'" in record.getMessage()
            async with admin_client(redis_url) as client:
                found = await client.type(key)
                assert (found.decode() if isinstance(found, bytes) else found) in (kept, "none")
            await check_serving(w1, w2)


async def test_entries_of_another_form_in_a_worker_s_inbox_are_logged_and_passed_over(
    any_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries in a worker's inbox stream that the workers never write (a field of
    another name, or bytes that are no message) are logged at WARNING and passed over:
    the worker's reader moves past them and goes on serving."""
    redis_url = any_redis_url
    prefix = f"sa-test:{uuid.uuid4().hex}"
    key = worker_key(prefix, "w2", "inbox")
    with trio.fail_after(60):
        async with two_workers(redis_url, prefix, b_on="w2") as (w1, w2):
            async with admin_client(redis_url) as client:
                await client.xadd(key, {"m": b"\xc1 not a message"})
                await client.xadd(key, {"x": "another application's"})
            record = await wait_for_log(caplog, "in its inbox")
            assert record.levelname == "WARNING", record
            assert "worker 'w2'" in record.getMessage()
            await check_serving(w1, w2)
            told = [r for r in caplog.records if "in its inbox" in r.getMessage()]
            assert len(told) == 2, [r.getMessage() for r in told]


async def xread_calls(client: Any) -> int:
    """How many XREADs the server has run."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def test_an_entry_of_another_form_last_in_a_worker_s_inbox_is_read_once(
    private_redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose inbox ends with an entry the workers never write moves past it and
    waits for the next one: while idle it reads its inbox a few times a second, not
    over and over (hundreds of reads a second when it did not)."""
    prefix = "sa-test"
    with private_redis_server() as redis_url, trio.fail_after(60):
        async with open_worker(redis_url, prefix, "w") as worker:
            await (await worker.spawn("s")).send("hello")  # (the worker is running)
            async with admin_client(redis_url) as client:
                await client.xadd(worker_key(prefix, "w", "inbox"), {"x": "another's"})
                await wait_for_log(caplog, "in its inbox")
                before = await xread_calls(client)
                await trio.sleep(1.0)  # three of its reads' waits (lease_ttl / 3 each)
                reads = await xread_calls(client) - before
            assert reads < 50, reads
            assert (await worker.ref("s").send("still")).text == "still"
