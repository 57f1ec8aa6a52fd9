"""Many workers at the edges: shutdowns, answers kept for requesters, channels."""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

TTL = 1.0


@attrs.frozen
class HangingModel:
    """Holds every turn open (until cancelled); ``started`` is set when one begins."""

    started: trio.Event

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.started.set()
        await trio.sleep_forever()
        yield sa.TextChunk("never")  # pragma: no cover


def open_worker(url: str, prefix: str, worker_id: str, model: Any, **options: Any) -> Any:
    """A registry on ``url`` under ``prefix`` whose sessions stay where they woke."""
    store = RedisStore(url, prefix=prefix, balance=False)
    options.setdefault("lease_ttl", TTL)
    agents = {"echo": sa.Agent(model=model)}
    return sa.open_registry(store=store, agents=agents, worker_id=worker_id, **options)


def user_texts(messages: list[sa.Message]) -> list[str]:
    return [m.content for m in messages if m.role is sa.Role.USER]


async def test_a_forwarded_turn_cut_by_its_owners_shutdown_is_not_run_again(
    redis_url: str,
) -> None:
    """A turn forwarded to a worker whose registry closes and cuts it after its shutdown grace fails with SessionStoppedError for its caller: it is not sent on to the session's next owner to run a second time."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    started = trio.Event()
    outcome: list[sa.Reply | sa.SessionActorsError] = []
    with trio.fail_after(30):
        async with open_worker(redis_url, prefix, "b", EchoModel()) as b:

            async def send() -> None:
                try:
                    outcome.append(await b.ref("s").send("only once"))
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            async with (
                trio.open_nursery() as nursery,
                open_worker(redis_url, prefix, "a", HangingModel(started), shutdown_grace=0.2) as a,
            ):
                await a.spawn("s")
                await a.ref("s").history()  # live on a
                nursery.start_soon(send)
                await started.wait()  # the forwarded turn runs on a
            # a closed, and cut the turn off after its grace
            texts = user_texts(await b.ref("s").history())
    assert texts == ["only once"]
    assert len(outcome) == 1
    assert isinstance(outcome[0], sa.SessionStoppedError), repr(outcome[0])
    assert outcome[0].session_id == "s"
    assert outcome[0].turn_id.startswith("turn_")  # it had started: it may be in the history


async def test_metadata_of_any_storable_size_is_set_through_another_worker(
    redis_url: str,
) -> None:
    """Metadata changes with more keys than a small map, and the merged metadata they answer with, cross workers like any other request: the caller gets the merged metadata, not a WorkerUnreachableError."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    many = {f"key-{i}": i for i in range(100)}
    more = {f"more-{i}": [i] * 3 for i in range(40)}
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            assert await b.ref("s").set_metadata(many) == many
            # a request of fewer keys whose answer (the merged metadata) has more
            assert await b.ref("s").set_metadata(more) == many | more
            assert b.live() == []  # it ran on a
            assert (await a.ref("s").state()).metadata == many | more


async def test_reads_through_another_worker_leave_no_copy_of_the_history_behind(
    redis_url: str,
) -> None:
    """Reading a session's history through another worker many times keeps no copy of each answer on the owner: the memory the two workers hold stays flat, whatever the number of reads."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    big = [sa.Message.create(sa.Role.USER, f"{i} " + "x" * 50_000) for i in range(4)]
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            await a.spawn("s")
            await a.ref("s").add_messages(big)  # live on a: about 200 KB of history
            assert len(await b.ref("s").history()) == 4
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                for _ in range(40):
                    assert len(await b.ref("s").history()) == 4
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            assert b.live() == []  # every read was answered by a
    # 40 kept answers would hold about 8 MB
    assert grown < 2_000_000, f"{grown / 1e6:.1f} MB held after 40 reads"


async def test_the_worker_channel_holds_no_memory_per_message(redis_url: str) -> None:
    """Answers too large for one socket read, read by the worker channel many times, leave nothing behind: the memory the two workers hold stays flat however many there were."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    big = [sa.Message.create(sa.Role.USER, f"{i} " + "x" * 50_000) for i in range(4)]
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            await a.spawn("s")
            await a.ref("s").add_messages(big)  # live on a: about 200 KB, several reads each
            for _ in range(5):
                assert len(await b.ref("s").history()) == 4
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                for _ in range(400):
                    assert len(await b.ref("s").history()) == 4
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
    # (what one answer in flight holds is well under this; a few KB per answer is not)
    assert grown < 1_500_000, f"{grown / 1e6:.1f} MB held after 400 reads"
