"""Many workers at the edges: shutdowns, answers kept for requesters, channels."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import coredis
import msgpack
import pytest
import trio

import sessionactors as sa
from net_proxy import proxy_to
from redis_keys import session_key
from redis_workers import TTL, open_worker
from sessionactors.stores import RedisStore, dump_info, load_events
from sessionactors.testing import EchoModel, Scripted, ScriptedModel
from stream_checks import stream_problems

pytestmark = pytest.mark.redis


@attrs.frozen
class HangingModel:
    """Holds every turn open (until cancelled); ``started`` is set when one begins."""

    started: trio.Event

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.started.set()
        await trio.sleep_forever()
        yield sa.TextChunk("never")  # pragma: no cover


def user_texts(messages: list[sa.Message]) -> list[str]:
    return [m.content for m in messages if m.role is sa.Role.USER]


async def test_a_forwarded_turn_cut_by_its_owners_shutdown_is_not_run_again(
    redis_url: str,
) -> None:
    """A turn forwarded to a worker whose registry closes and cuts it after its shutdown grace fails with SessionStoppedError for its caller, saying that worker stopped and that a turn sent again goes to the session's next owner (not to wait for a registry to open: the caller's is): it is not sent on by itself to run a second time, and sent again it runs there."""
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
            assert len(outcome) == 1
            error = outcome[0]
            assert isinstance(error, sa.SessionStoppedError), repr(error)
            assert "worker 'a', which ran it, stopped" in str(error), error
            assert "the worker that runs the session next" in str(error), error
            assert "once a registry is open" not in str(error), error
            assert (await b.ref("s").send("sent again")).text == "sent again"
            assert b.live() == ["s"]  # the next owner: b, a having left
    assert texts == ["only once"]
    assert error.session_id == "s"
    assert error.turn_id.startswith("turn_")  # it had started: it may be in the history


async def test_a_turn_cut_by_its_owners_shutdown_ends_failed_for_a_watcher_elsewhere(
    redis_url: str,
) -> None:
    """A subscriber on another worker that follows a session whose owner closes and cuts its
    turn off after the shutdown grace sees that turn end with a TurnFailed of kind
    SessionStoppedError telling to send the message again (not a TurnCancelled, which a
    user's cancel publishes), and turn_outcome on that worker reads it failed."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    started = trio.Event()
    seen: list[sa.Event] = []
    outcomes = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)

    async def watch(ref: sa.SessionRef, *, task_status: trio.TaskStatus[None]) -> None:
        async with ref.subscribe() as events:
            task_status.started()
            async for event in events:
                seen.append(event)
                if isinstance(event, outcomes):
                    return

    with trio.fail_after(30):
        async with open_worker(redis_url, prefix, "b", EchoModel()) as b:
            async with (
                trio.open_nursery() as watching,
                open_worker(redis_url, prefix, "a", HangingModel(started), shutdown_grace=0.2) as a,
            ):
                await a.spawn("s")
                await a.ref("s").history()  # live on a
                await watching.start(watch, b.ref("s"))
                turn = await a.ref("s").submit("cut short")
                await started.wait()
            # a closed, and cut the turn off after its grace (the watcher read its end)
            with pytest.raises(sa.SessionStoppedError):
                await turn.reply()
            told = await b.ref("s").turn_outcome(turn.id)
    outcome = seen[-1]
    assert isinstance(outcome, sa.TurnFailed), seen
    assert (outcome.turn_id, outcome.error_kind) == (turn.id, "SessionStoppedError")
    assert outcome.error_public
    assert not outcome.lost
    assert "send the message again" in outcome.error, outcome.error
    assert told.status is sa.TurnStatus.FAILED, told
    assert told.error == outcome.error


@pytest.mark.parametrize("way", ["submit", "send"])
async def test_a_turn_whose_owner_had_not_answered_when_its_callers_registry_closed_names_it(
    redis_url: str, way: str
) -> None:
    """A turn submitted or sent to another worker, which runs it, and still unanswered
    when the caller's registry closes (its shutdown grace ran out) fails with
    SessionStoppedError naming the turn and asking for that turn's outcome by its id
    before it is sent again."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    started = trio.Event()
    outcome: list[sa.Reply | sa.SessionActorsError] = []
    with trio.fail_after(30):
        async with open_worker(
            redis_url, prefix, "a", HangingModel(started), shutdown_grace=0.2
        ) as a:
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            async with (
                trio.open_nursery() as nursery,
                open_worker(redis_url, prefix, "b", EchoModel(), shutdown_grace=0.2) as b,
            ):

                async def send() -> None:
                    try:
                        if way == "submit":
                            turn = await b.ref("s").submit("still running")
                            outcome.append(await turn.reply())
                        else:
                            outcome.append(await b.ref("s").send("still running"))
                    except sa.SessionActorsError as exc:
                        outcome.append(exc)

                nursery.start_soon(send)
                await started.wait()  # the forwarded turn runs on a
    [error] = outcome
    assert isinstance(error, sa.SessionStoppedError), repr(error)
    assert "the registry closed before worker 'a'" in str(error), error
    assert error.turn_id.startswith("turn_"), repr(error)
    assert f"ref.turn_outcome({error.turn_id!r})" in str(error), error


def forwarded_turn_ids(sent: list[str], instead: list[str]) -> Callable[[list[bytes]], list[bytes]]:
    """An edit of the commands a worker sends (see net_proxy): the turn id that each turn
    it forwards carries is noted in ``sent`` and replaced by the first of ``instead``,
    taken from it (left as sent once ``instead`` is empty)."""

    def edit(words: list[bytes]) -> list[bytes]:
        if words[0].upper() != b"PUBLISH":
            return words
        body = msgpack.unpackb(words[2], raw=False)
        if not isinstance(body, dict) or body.get("op") != "turn" or "t" not in body:
            return words
        sent.append(body["t"])
        if instead:
            body["t"] = instead.pop(0)
        return [words[0], words[1], msgpack.packb(body, use_bin_type=True)]

    return edit


async def test_a_forwarded_turn_runs_under_the_id_sent_with_it_only_if_its_session_could_issue_it(
    redis_url: str,
) -> None:
    """A turn sent or submitted through another worker runs under the turn id that worker
    sent with it, and under an id of its owner's own when the one sent could not name a
    new turn of the session (garbage, another session's, one the session already used,
    one stamped days from now, or minutes from now: within the clocks' leeway, but ahead
    of the owner's clock, it would make the session's own later ids read as forgotten
    once its record is dropped): its reply, its turn and its outcome name that one, and
    the id already used still names its own turn."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    sent: list[str] = []
    instead: list[str] = []
    with trio.fail_after(30):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(redis_url, prefix, "a") as a,
        ):
            await a.spawn("s")
            await a.spawn("other")
            first = await a.ref("s").send("first")
            other = await a.ref("other").send("elsewhere")
            _, tag, stamp, process = first.turn_id.split("_")  # turn_<tag>_<time>_<process>
            days_later = f"{int(stamp, 16) + 3 * 86_400 * 10**6:x}"
            minutes_later = f"{int(stamp, 16) + 5 * 60 * 10**6:x}"
            refused = [
                "nonsense",
                other.turn_id,
                first.turn_id,
                f"turn_{tag}_{days_later}_{process}",
                f"turn_{tag}_{minutes_later}_{process}",
            ]
            proxy.edit = forwarded_turn_ids(sent, instead)
            async with open_worker(proxied, prefix, "b") as b:
                ref = b.ref("s")
                taken = [(await ref.send("as sent")).turn_id]
                taken.append((await ref.submit("submitted as sent")).id)
                assert taken == sent, (taken, sent)
                assert sent[0] != sent[1]
                for n, turn_id in enumerate(refused):
                    instead.append(turn_id)
                    if n % 2:
                        turn = await ref.submit(f"submitted {n}")
                        reply = await turn.reply()
                        assert turn.id == reply.turn_id
                    else:
                        reply = await ref.send(f"sent {n}")
                    assert reply.turn_id not in (turn_id, sent[-1]), (turn_id, reply.turn_id)
                    outcome = await ref.turn_outcome(reply.turn_id)
                    assert outcome.status is sa.TurnStatus.FINISHED, outcome
                    assert outcome.message == reply.message
                assert not instead
                assert len(sent) == 2 + len(refused)
                kept = await ref.turn_outcome(first.turn_id)
                assert kept.message is not None
                assert kept.message.content == "first"
                assert b.live() == []  # (it ran on a all along)


async def test_a_forwarded_turn_stamped_before_the_records_its_session_drops_reads_queued(
    redis_url: str,
) -> None:
    """A turn sent through another worker whose clock is behind (its id is stamped
    before every outcome the session keeps, but after those it forgot), queued behind
    turns whose outcomes make the session forget records stamped after it, reads queued
    while it waits (not forgotten), and finished once it ran."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    gates = {"hold 1": trio.Event(), "hold 2": trio.Event()}

    def answer(request: sa.ModelRequest) -> Scripted:
        words = request.messages[-1].content
        return Scripted(text=words, wait=gates.get(words))

    model = ScriptedModel([answer], repeat=True)
    sent: list[str] = []
    instead: list[str] = []
    with trio.fail_after(60):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(redis_url, prefix, "a", model) as a,
            open_worker(proxied, prefix, "b") as b,
            trio.open_nursery() as nursery,
        ):
            ref = a.ref("s")
            await a.spawn("s")
            kept = [(await ref.send(f"{n}")).turn_id for n in range(256)]  # every record kept
            _, tag, stamp, process = kept[0].split("_")  # turn_<tag>_<time>_<process>
            behind = f"turn_{tag}_{int(stamp, 16) - 1:x}_{process}"
            held = [await ref.submit("hold 1"), await ref.submit("hold 2")]
            proxy.edit = forwarded_turn_ids(sent, instead)
            instead.append(behind)
            replies: list[sa.Reply] = []

            async def send_behind() -> None:
                replies.append(await b.ref("s").send("behind"))

            nursery.start_soon(send_behind)
            while (await ref.turn_outcome(behind)).status is not sa.TurnStatus.QUEUED:
                await trio.sleep(0.01)  # (lost until it reaches a's mailbox)
            gates["hold 1"].set()
            await held[0].reply()  # its record is the 257th: the oldest one is dropped
            assert (await ref.turn_outcome(behind)).status is sa.TurnStatus.QUEUED
            assert (await b.ref("s").turn_outcome(behind)).status is sa.TurnStatus.QUEUED
            gates["hold 2"].set()
            await held[1].reply()
            while not replies:
                await trio.sleep(0.01)
            assert replies[0].turn_id == behind
            assert (await ref.turn_outcome(behind)).status is sa.TurnStatus.FINISHED
            with pytest.raises(sa.TurnNotFoundError):  # (dropped: older than those kept)
                await ref.turn_outcome(kept[0])


SECRET = "card 4111-1111"


#: How often a worker publishes an answer that nobody hears before it leaves it to the
#: requester to ask after it.
ANSWER_ATTEMPTS = 5


def answers_lost(lost: trio.Event) -> Callable[[list[bytes]], list[bytes]]:
    """An edit of the commands a worker sends (see net_proxy): every answer to another
    worker's request that holds ``SECRET`` (a publish, or the journal write a turn's
    answer goes with) goes to a channel nobody listens to, as an answer lost on the way
    does; ``lost`` is set once such an answer was published (and so kept) as often as
    the worker publishes an answer: its requester now has to ask after it."""
    published = 0

    def edit(words: list[bytes]) -> list[bytes]:
        nonlocal published
        if len(words) < 3 or SECRET.encode() not in words[-1]:
            return words
        try:
            body = msgpack.unpackb(words[-1], raw=False)
        except Exception:
            return words
        if not isinstance(body, dict) or "re" not in body:
            return words
        if words[0].upper() == b"PUBLISH":
            published += 1
            if published >= ANSWER_ATTEMPTS:
                lost.set()
        return [*words[:-2], b"nobody-listens", words[-1]]

    return edit


@pytest.mark.parametrize("erase", ["delete", "rewind", "set_metadata"])
async def test_a_request_asked_again_after_an_erasure_gets_none_of_what_it_erased(
    redis_url: str, erase: str
) -> None:
    """A request forwarded to the worker that runs its session, whose answer (a reply, or
    the metadata) is lost on the way and then erased there (the session deleted, its
    history truncated, the value removed from its metadata) before its requester asks
    after it, gets a typed error that says what became of it when asked again, never the
    erased text, and is not run again."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    lost = trio.Event()
    outcome: list[Any] = []
    with trio.fail_after(30):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(proxied, prefix, "a", lease_ttl=2.0) as a,
            open_worker(redis_url, prefix, "b", lease_ttl=2.0) as b,
            trio.open_nursery() as nursery,
        ):
            owner = await a.spawn("s", metadata={"tenant": "acme"})
            await owner.send("hello")  # live on a

            async def ask() -> None:
                try:
                    if erase == "set_metadata":
                        outcome.append(await b.ref("s").set_metadata({"email": SECRET}))
                    else:
                        outcome.append(await b.ref("s").send(f"my {SECRET}"))
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            proxy.edit = answers_lost(lost)
            nursery.start_soon(ask)
            await lost.wait()  # a ran it and kept its answer, which went nowhere
            if erase == "delete":
                await a.delete("s")
            elif erase == "rewind":
                assert await owner.rewind((await owner.history())[1].id) == 2
            else:
                await owner.set_metadata({"email": None})
            proxy.edit = None  # b asks after its request, and hears what a says now
            while not outcome:
                await trio.sleep(0.05)
            if erase != "delete":
                state = await owner.state()
                assert state.metadata == {"tenant": "acme"}  # (not set again)
                assert [m.content for m in state.messages] == ["hello"] * 2  # (nor sent again)
    [told] = outcome
    assert SECRET not in repr(told), told
    if erase == "delete":
        assert isinstance(told, sa.SessionNotFoundError), repr(told)
        assert "was deleted" in str(told), told
    else:
        assert isinstance(told, sa.SessionCrashedError), repr(told)
        assert "erased" in str(told), told


#: Lease lifetimes a worker keeps an answer to another worker's request for, at most.
ANSWER_LIFETIMES = 4


async def test_a_worker_keeps_its_answers_to_other_workers_for_a_bounded_time(
    redis_url: str,
) -> None:
    """The answers a worker keeps for requesters that ask again (a turn's reply: the
    session's words) are let go once no requester can ask any more, a few lease
    lifetimes after they were given: a worker that ran a session and hibernated it (or
    handed it over, which no later delete of the session reaches) holds none of its
    replies after that, however few requests came since."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = "x" * 1_000_000
    turns = 10
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "a") as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            tracemalloc.start()
            try:
                for _ in range(turns):
                    reply = await b.ref("s").send(text)  # run on a, which keeps its answer
                    assert len(reply.text.strip()) == len(text)
                del reply
                assert a.live() == ["s"]
                await a.ref("s").hibernate()  # (a holds its history no more)
                gc.collect()
                given = tracemalloc.get_traced_memory()[0]
                await trio.sleep(ANSWER_LIFETIMES * TTL + 1)
                gc.collect()
                later = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
    assert given - later > turns * len(text) * 0.8, (given, later)


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


async def held_after(reads: int, read: Callable[[], Awaitable[list[sa.Message]]]) -> int:
    """Bytes still allocated after ``reads`` reads of a 4-message history (tracemalloc,
    after a collection)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(reads):
            assert len(await read()) == 4
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.soak  # (slow: run by make soak)
async def test_reads_through_another_worker_hold_no_memory_per_read(redis_url: str) -> None:
    """Reading a 200 KB history through another worker many times leaves nothing behind: the owner keeps no copy of each answer, and nothing else the two workers hold grows with the number of reads."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    big = [sa.Message.create(sa.Role.USER, f"{i} " + "x" * 50_000) for i in range(4)]
    with trio.fail_after(60):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            await a.spawn("s")
            await a.ref("s").add_messages(big)  # live on a: about 200 KB of history
            for _ in range(5):
                assert len(await b.ref("s").history()) == 4
            fewer = await held_after(400, b.ref("s").history)
            more = await held_after(800, b.ref("s").history)
            assert b.live() == []  # every read was answered by a
    # What 400 more reads hold: kept answers would hold about 200 KB each; what a run
    # holds whatever the number of reads (about 0.8 MB here, more after other tests:
    # caches, allocator state) cancels out
    grown = more - fewer
    assert grown < 1_000_000, f"{grown / 1e6:.1f} MB more held after 800 reads than 400"


async def redis_full(admin: coredis.Redis[bytes], full: bool) -> None:
    """Make redis refuse every write that needs memory (maxmemory reached, no eviction),
    or give it room again."""
    await admin.config_set({"maxmemory-policy": "noeviction", "maxmemory": 1 if full else 0})


@pytest.mark.parametrize("then", ["another turn", "nothing"])
async def test_events_redis_refuses_for_lack_of_memory_show_as_lag_never_as_a_gap(
    private_redis_server: Callable[..., AbstractContextManager[str]],
    then: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Events that redis refuses to a session's stream for lack of memory (maxmemory, noeviction) end a subscriber on another worker with SubscriberLaggedError at the last event it saw once redis has room again, whether another turn follows or not: never a silent gap, never a wait without end. The error (and the log's line) says that the session's events were interrupted on their way through the store, not that the subscriber fell behind."""
    caplog.set_level(logging.INFO, logger="sessionactors")
    prefix = f"sa-test:{uuid.uuid4().hex}"
    seqs: list[int] = []
    texts: list[str] = []
    error: BaseException | None = None
    finished = trio.Event()
    seen = trio.Event()
    with private_redis_server() as url, trio.fail_after(40):
        async with (
            # the turns write nothing to the store (redis refuses every write meanwhile)
            open_worker(url, prefix, "a", EchoModel(), lease_ttl=30, durability="hibernate") as a,
            open_worker(url, prefix, "b", EchoModel(), lease_ttl=30) as b,
            coredis.Redis.from_url(url) as admin,
            trio.open_nursery() as nursery,
        ):
            ref = await a.spawn("s")
            await ref.send("warm up")

            async def subscribe(task_status: trio.TaskStatus[None]) -> None:
                nonlocal error, seen
                with trio.move_on_after(20):
                    async with b.ref("s").subscribe() as stream:
                        task_status.started()
                        try:
                            async for event in stream:
                                seqs.append(event.seq)
                                if isinstance(event, sa.TurnFinished):
                                    texts.append(event.message.content)
                                    seen.set()
                                    seen = trio.Event()
                                    if event.message.content == "after":
                                        break
                        except sa.SubscriberLaggedError as exc:
                            error = exc
                finished.set()

            await nursery.start(subscribe)
            await ref.send("before")  # its events reach the subscriber through the stream
            while texts != ["before"]:
                await seen.wait()
            await redis_full(admin, True)
            try:
                assert (await ref.send("lost on the way")).text == "lost on the way"
                await trio.sleep(0.5)  # (the worker publishes its events meanwhile)
            finally:
                await redis_full(admin, False)
            if then == "another turn":
                await ref.send("after")
            with trio.move_on_after(10):
                await finished.wait()
            assert (a.live(), b.live()) == (["s"], [])
    assert stream_problems(seqs, error, "after" in texts) == []
    assert isinstance(error, sa.SubscriberLaggedError), (seqs, texts)
    assert "events of session 's' were interrupted after seq" in str(error)
    assert "fell behind" not in str(error)
    said = [r.getMessage() for r in caplog.records if r.name == "sessionactors"]
    assert [line for line in said if "events of session 's' were interrupted" in line]
    assert not [line for line in said if "fell behind" in line]


async def test_a_subscription_elsewhere_ends_when_its_deleted_sessions_end_was_refused(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """A session deleted while redis refuses to mark the end of its events (out of memory) still ends a subscription to it on another worker, saying that it was deleted, soon after redis has room again."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    ended = trio.Event()
    errors: list[sa.SessionActorsError] = []
    with private_redis_server() as url, trio.fail_after(40):
        async with (
            open_worker(url, prefix, "a", EchoModel()) as a,
            open_worker(url, prefix, "b", EchoModel()) as b,
            coredis.Redis.from_url(url) as admin,
            trio.open_nursery() as nursery,
        ):
            ref = await a.spawn("s")
            await ref.send("hello")
            assert (a.live(), b.live()) == (["s"], [])

            async def subscribe(task_status: trio.TaskStatus[None]) -> None:
                try:
                    async with b.ref("s").subscribe() as stream:
                        task_status.started()
                        async for _ in stream:
                            pass
                except sa.SessionActorsError as exc:
                    errors.append(exc)
                ended.set()

            await nursery.start(subscribe)
            await ref.hibernate()  # live nowhere: the subscription waits for its next owner
            await trio.sleep(TTL)  # (it has followed the session by now)
            await redis_full(admin, True)
            try:
                await a.delete("s")  # deleted; the end of its events could not be marked
            finally:
                await redis_full(admin, False)
            with trio.move_on_after(4 * TTL):
                await ended.wait()
            assert ended.is_set(), "the subscription on b never ended"
            with pytest.raises(sa.SessionNotFoundError):
                await b.ref("s").history()
    assert [type(e) for e in errors] == [sa.SessionNotFoundError], errors
    assert "session 's' was deleted" in str(errors[0])


#: The longest text a message may hold (sessionactors' limit): about 1 MB.
MAX_TEXT = 1024 * 1024


def _big_messages(count: int, start: int) -> list[sa.Message]:
    """``count`` assistant messages of about 1 MB each, numbered from ``start``."""
    return [
        sa.Message.create(sa.Role.ASSISTANT, f"{i}:".ljust(MAX_TEXT, "x"))
        for i in range(start, start + count)
    ]


async def test_an_answer_larger_than_redis_pubsub_limit_reaches_another_worker(
    any_redis_url: str,
) -> None:
    """A history larger than Redis's 32 MB limit for a pub/sub client's output reads whole through another worker, and the channels of both workers go on carrying requests."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(120):
        async with (  # (leases that outlast writing 36 MB to a busy machine's redis)
            open_worker(any_redis_url, prefix, "a", EchoModel(), lease_ttl=10) as a,
            open_worker(any_redis_url, prefix, "b", EchoModel(), lease_ttl=10) as b,
        ):
            ref = await a.spawn("s")
            for start in (0, 12, 24):  # (a journal entry holds at most 16 MB)
                await ref.add_messages(_big_messages(12, start))
            assert (a.live(), b.live()) == (["s"], [])
            history = await b.ref("s").history()  # an answer of about 36 MB
            assert [m.content.split(":", 1)[0] for m in history] == [str(i) for i in range(36)]
            assert (await b.ref("s").send("still there")).text == "still there"
            assert a.live() == ["s"]


async def test_a_subscription_following_its_session_elsewhere_never_hears_one_made_again_under_its_name(
    redis_url: str,
) -> None:
    """A subscription whose session left its worker (hibernated there) and was then deleted and made again under its name on another worker ends, saying that its session was deleted: it follows the session it subscribed to, not whichever one holds the name when it next reads."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    texts: list[str] = []
    ended: sa.SessionNotFoundError | None = None
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            ref = await b.spawn("s")
            await ref.send("old one")
            async with b.ref("s").subscribe(after=0) as stream:
                async for event in stream:
                    if isinstance(event, sa.TurnStarted):
                        texts.append(event.text)
                    if isinstance(event, sa.TurnFinished):
                        break
                await b.ref("s").hibernate()  # it leaves b: the subscription follows it
                await a.delete("s")
                ref = await a.spawn("s")
                for i in range(6):  # (past the seqs the deleted session used)
                    await ref.send(f"new {i}")
                with trio.move_on_after(4 * TTL) as waited:
                    try:
                        async for event in stream:
                            if isinstance(event, sa.TurnStarted):
                                texts.append(event.text)
                    except sa.SessionNotFoundError as exc:
                        ended = exc
    assert texts == ["old one"]
    assert not waited.cancelled_caught  # it ended
    assert "session 's' was deleted" in str(ended)


async def test_a_session_created_before_1970_is_followed_from_another_worker(
    redis_url: str,
) -> None:
    """A stored session whose creation time is before 1970 (imported from elsewhere) can be subscribed to from another worker like any other."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    long_ago = datetime.datetime(1960, 1, 1, tzinfo=datetime.UTC)
    state = sa.SessionState(session_id="s", agent="echo", created_at=long_ago, updated_at=long_ago)
    info = sa.SessionInfo(
        session_id="s", agent="echo", status=state.status, message_count=0, updated_at=long_ago
    )
    store = RedisStore(redis_url, prefix=prefix)
    await store.create("s", sa.dump_snapshot(state), dump_info(info))
    await store.aclose()
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            await a.ref("s").send("one")  # live on a
            async with b.ref("s").subscribe() as stream:
                await a.ref("s").send("two")
                async for event in stream:
                    if isinstance(event, sa.TurnStarted):
                        assert event.text == "two"
                        break


async def test_a_sessions_event_stream_keeps_the_entry_format_of_earlier_versions(
    redis_url: str,
) -> None:
    """While another worker subscribes, the entries of a session's event stream in Redis keep the format that workers of the previous version read (a rolling upgrade runs both): an event's ``d`` field holds the codec's bytes of the event, and the session's creation time (which tells sessions of one name apart) is a field of its own."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
        ):
            ref = await a.spawn("s")
            await ref.send("one")
            async with b.ref("s").subscribe() as stream:
                await ref.send("two")
                async for event in stream:
                    if isinstance(event, sa.TurnFinished):
                        break
            entries = []
            async with coredis.Redis.from_url(redis_url) as raw:
                async for key in raw.scan_iter(match=f"{prefix}:*:ev", count=1000):
                    entries += await raw.xrange(key)  # (the session's event stream)
    events = [e for e in entries if b"d" in e.field_values]
    assert events, entries
    decoded = [load_events(bytes(e.field_values[b"d"]), session_id="s") for e in events]
    texts = [e.text for found in decoded for e in found if isinstance(e, sa.TurnStarted)]
    assert texts == ["two"]
    assert {len(e.field_values[b"b"]) for e in events} == {8}  # the creation time


async def test_a_subscription_elsewhere_to_a_deleted_session_never_hears_one_made_again_under_its_name(
    any_redis_url: str,
) -> None:
    """A subscription on another worker to a session that is deleted and at once made again under the same name ends with the deleted one, saying it was deleted: it never delivers the new session's events as if they were the old one's (on a cluster the end marked at the delete is gone before the subscriber's worker looks: it reads each slot's streams in turn, and the new session's spawn resets the stream)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    rounds = 5  # (a race: the end may still be there when the reader looks)
    heard: dict[str, list[str]] = {}
    ended: dict[str, bool] = {}
    errors: dict[str, str] = {}
    with trio.fail_after(60):
        async with (
            open_worker(any_redis_url, prefix, "a", EchoModel()) as a,
            open_worker(any_redis_url, prefix, "b", EchoModel()) as b,
            trio.open_nursery() as nursery,
        ):
            for n in range(rounds):
                name = f"s{n}"
                seen: list[sa.Event] = []
                done = trio.Event()
                ref = await a.spawn(name)
                await ref.send("old one")

                async def subscribe(
                    name: str,
                    seen: list[sa.Event],
                    done: trio.Event,
                    task_status: trio.TaskStatus[None],
                ) -> None:
                    try:
                        async with b.ref(name).subscribe() as stream:
                            task_status.started()
                            async for event in stream:
                                seen.append(event)
                    except sa.SessionNotFoundError as exc:
                        errors[name] = str(exc).split(":")[0]
                    done.set()

                await nursery.start(subscribe, name, seen, done)
                await ref.send("old two")
                while not any(isinstance(e, sa.TurnFinished) for e in seen):
                    await trio.sleep(0.01)
                await a.delete(name)
                ref = await a.spawn(name)
                for i in range(6):  # (past the seqs the deleted session used)
                    await ref.send(f"new {i}")
                with trio.move_on_after(4 * TTL):
                    await done.wait()
                heard[name] = [e.text for e in seen if isinstance(e, sa.TurnStarted)]
                ended[name] = done.is_set()
            nursery.cancel_scope.cancel()
    names = [f"s{n}" for n in range(rounds)]
    assert heard == {name: ["old two"] for name in names}
    assert ended == {name: True for name in names}
    assert errors == {name: f"session {name!r} was deleted" for name in names}


#: How long a deleted session's event stream is kept for its subscribers (ms), at most.
END_TTL_MS = 60_000


class HeldPublishStore(RedisStore):
    """A RedisStore whose worker holds a publish to the event stream of session "s"
    while ``holding`` is set, until ``release`` is set: a batch of its events in flight
    while the session is deleted. ``held`` is set as one waits, ``published`` once the
    one held was published."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.holding = False
        self.held, self.release, self.published = trio.Event(), trio.Event(), trio.Event()

    async def open_router(self, host: Any, nursery: trio.Nursery) -> Any:
        router = await super().open_router(host, nursery)
        transport = router.transport
        publish = transport.publish

        async def held_publish(batches: Any, keep: int) -> None:
            if not (self.holding and "s" in batches):
                await publish(batches, keep)
                return
            self.held.set()
            await self.release.wait()
            try:
                await publish(batches, keep)
            finally:
                self.published.set()

        transport.publish = held_publish
        return router


@contextlib.asynccontextmanager
async def followed_elsewhere(
    ref: sa.SessionRef, other: sa.Registry
) -> AsyncIterator[AsyncIterator[sa.Event]]:
    """A subscription through ``other`` to the session of ``ref`` (live on its own
    worker, which so publishes to the session's event stream), read up to the end of a
    turn of it: the events after that turn come next."""
    await ref.send("hello")
    async with other.ref(ref.session_id).subscribe() as events:
        turn = await ref.submit("one")
        async for event in events:
            if isinstance(event, sa.TurnFinished) and event.turn_id == turn.id:
                break
        yield events


async def test_events_published_after_their_session_was_deleted_leave_its_end_short_lived(
    redis_url: str,
) -> None:
    """Events of a session that reach its event stream after the session was deleted
    (published late: in flight as the delete ended the stream) are dropped there and
    leave the stream's expiry as the delete set it (a minute for its subscribers), not
    the day that a stream written to is kept."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store = HeldPublishStore(redis_url, prefix=prefix, balance=False)
    agents = {"echo": sa.Agent(model=EchoModel())}
    key = session_key(prefix, "s", "ev")
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=store, agents=agents, worker_id="a", lease_ttl=TTL) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
            coredis.Redis.from_url(redis_url) as admin,
        ):
            ref = await a.spawn("s")
            async with followed_elsewhere(ref, b) as events:
                store.holding = True
                await ref.send("late")
                await store.held.wait()
                await a.delete("s")
                ended = await admin.pttl(key)
                assert 0 < ended <= END_TTL_MS
                store.release.set()
                await store.published.wait()
                assert 0 < await admin.pttl(key) <= ended
                with pytest.raises(sa.SessionNotFoundError, match="'s' was deleted"):
                    await anext(events)  # (nothing of "late": it ends)


async def test_a_deleted_sessions_end_is_not_kept_longer_by_a_delete_again(
    redis_url: str,
) -> None:
    """The end of a deleted session's event stream, marked by its delete, keeps the
    expiry that delete set when the name is deleted again (from either worker): a call
    that finds the end marked writes nothing, and stretches nothing."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    key = session_key(prefix, "s", "ev")
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a", EchoModel()) as a,
            open_worker(redis_url, prefix, "b", EchoModel()) as b,
            coredis.Redis.from_url(redis_url) as admin,
        ):
            ref = await a.spawn("s")
            async with followed_elsewhere(ref, b) as events:
                await a.delete("s")
                assert 0 < await admin.pttl(key) <= END_TTL_MS
                await admin.pexpire(key, 5_000)  # (as if most of its minute went by)
                for registry in (a, b):
                    with pytest.raises(sa.SessionNotFoundError):
                        await registry.delete("s")
                    assert 0 < await admin.pttl(key) <= 5_000
                with pytest.raises(sa.SessionNotFoundError, match="'s' was deleted"):
                    await anext(events)
