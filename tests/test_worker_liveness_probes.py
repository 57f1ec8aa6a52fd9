"""Liveness probes of the multi-worker layer: every caller and stream of a session on
another worker gets an outcome or a typed error in bounded time, and nothing
acknowledged is lost."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgpack
import pytest
import trio

import sessionactors as sa
from net_proxy import proxy_to
from redis_keys import session_key
from redis_workers import TTL, open_worker
from sessionactors.http import create_app
from sessionactors.testing import EchoModel, crash
from web.servers import serve_trio
from worker_spares import SpareProcess, open_worker_process, start_spares

pytestmark = pytest.mark.redis

WAKE = msgpack.packb({"op": "wake"})
SSE = {"accept": "text/event-stream"}


async def test_a_turn_submitted_nowait_to_a_session_live_elsewhere_reads_failed(
    redis_url: str,
) -> None:
    """A submit_nowait turn refused because its session is live on another worker reads failed (with why) from turn_outcome on the worker that refused it, not queued forever."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with (
            open_worker(redis_url, prefix, "a") as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            turn = b.ref("s").submit_nowait("hello")
            with pytest.raises(sa.SessionBusyError):
                await turn.reply()
            outcome = await b.ref("s").turn_outcome(turn.id)
            assert outcome.status is sa.TurnStatus.FAILED, outcome
            assert outcome.error is not None
            assert "another worker" in outcome.error
            assert await a.ref("s").history() == []  # it never ran


@contextlib.asynccontextmanager
async def worker_process(
    url: str, prefix: str, worker_id: str, names: list[str], word_delay: float
) -> AsyncIterator[SpareProcess]:
    """A tests/cluster_worker.py process whose echo model waits ``word_delay`` seconds
    per word, that has woken ``names`` (sessions stay where they woke); killed at the end."""
    args = [url, prefix, worker_id, str(TTL), "normal", str(word_delay), "fixed"]
    process = await open_worker_process(args)
    try:
        assert process.stdin is not None
        assert process.stdout is not None
        buffer = b""
        while buffer.count(b"\n") < 1:
            data = await process.stdout.receive_some(65536)
            assert data, "the worker process ended"
            buffer += data
        assert "ready" in json.loads(buffer.split(b"\n")[0])
        request = {"id": 1, "op": "spawn", "names": names}
        await process.stdin.send_all(json.dumps(request).encode() + b"\n")
        while buffer.count(b"\n") < 2:
            data = await process.stdout.receive_some(65536)
            assert data, "the worker process ended"
            buffer += data
        assert json.loads(buffer.split(b"\n")[1]).get("ok") is True
        yield process
    finally:
        process.kill()
        with trio.move_on_after(10):
            await process.wait()
        start_spares()


async def subscribe_until_error(
    ref: sa.SessionRef,
    ended: list[BaseException],
    seen: Callable[[sa.Event], None] = lambda event: None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Subscribe to ``ref`` (started once subscribed) and call ``seen`` with each event
    until the subscription raises; its error goes to ``ended``."""
    try:
        async with ref.subscribe() as events:
            task_status.started()
            async for event in events:
                seen(event)
    except sa.SessionActorsError as exc:
        ended.append(exc)


def answering_after_review() -> tuple[trio.Event, Callable[[sa.Event], None]]:
    """An event set at the first Delta after a ReviewResolved (the approved turn is
    answering), and the ``seen`` of ``subscribe_until_error`` that sets it."""
    answering = trio.Event()
    resolved: list[sa.Event] = []

    def seen(event: sa.Event) -> None:
        if isinstance(event, sa.ReviewResolved):
            resolved.append(event)
        elif resolved and isinstance(event, sa.Delta):
            answering.set()

    return answering, seen


async def wait_for_an_end(ended: list[BaseException], within: float) -> None:
    """Until a subscription put its error in ``ended``; TooSlowError after ``within`` s."""
    with trio.fail_after(within):
        while not ended:
            await trio.sleep(0.05)


async def test_subscribers_elsewhere_hear_of_a_worker_killed_mid_turn(redis_url: str) -> None:
    """When the worker running a turn is killed (SIGKILL) and no worker takes the session over, a subscription to it on another worker ends with SubscriberLaggedError at its last event within a few lease lifetimes (nothing will publish the turn's outcome), ref.stream of the turn raises the SessionCrashedError its send would, and a subscription made again with after= wakes the session and raises EventsExpiredError (the store kept nothing of the turn)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(50))
    ended: dict[str, BaseException] = {}
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            ref = b.ref("s")
            first_delta = trio.Event()

            async def subscribe(task_status: trio.TaskStatus[None]) -> None:
                try:
                    async with ref.subscribe() as events:
                        task_status.started()
                        async for _event in events:
                            pass
                except sa.SessionActorsError as exc:
                    ended["subscribe"] = exc

            async def stream() -> None:
                try:
                    async with ref.stream(text) as events:
                        async for event in events:
                            if isinstance(event, sa.Delta):
                                first_delta.set()
                except sa.SessionActorsError as exc:
                    ended["stream"] = exc

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe)
                nursery.start_soon(stream)
                await first_delta.wait()
                a.kill()  # SIGKILL, mid-turn
                with trio.fail_after(8 * TTL):
                    while len(ended) < 2:
                        await trio.sleep(0.05)
            lagged = ended["subscribe"]
            assert isinstance(lagged, sa.SubscriberLaggedError), repr(lagged)
            assert isinstance(ended["stream"], sa.SessionCrashedError), repr(ended["stream"])
            with pytest.raises(sa.EventsExpiredError) as expired:
                async with ref.subscribe(after=lagged.last_seq):
                    pass
            assert expired.value.oldest_seq > lagged.last_seq
            assert b.live() == ["s"]  # woken here: its shard's lease lapsed
            assert [m.content for m in await ref.history()] == []  # the turn was not durable
            assert (await ref.send("again")).text == "again"


async def test_a_second_live_worker_with_the_same_worker_id_is_refused(redis_url: str) -> None:
    """A registry opened with the worker_id of another live worker on the same store fails with StoreConfigurationError (both would take its leases and run the same sessions), while the first one keeps serving; once the first closed, the id can be used again."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with open_worker(redis_url, prefix, "w") as first:
            await first.spawn("s")
            assert (await first.ref("s").send("one")).text == "one"

            async def second_worker() -> None:
                async with open_worker(redis_url, prefix, "w") as second:
                    await second.ref("s").send("two")

            with pytest.raises(sa.StoreConfigurationError, match="worker_id 'w'"):
                await second_worker()
            assert (await first.ref("s").send("three")).text == "three"
            assert first.live() == ["s"]
        async with open_worker(redis_url, prefix, "w") as again:
            history = await again.ref("s").history()
    assert [m.content for m in history] == ["one", "one", "three", "three"]


class CheckFaults:
    """What a link to redis does to a worker that starts under a live worker's id: its
    first look fails ("look": the registry opens without it, and its announcement checks
    the id), or finds no one there (as when the two start at the same moment) and then
    the link fails in its announcement's check of the id, as it sends the wake to the
    live one ("wake": on both connections it tries) or puts back the live one's
    announcement ("put back")."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.own: bytes | None = None  # its own incarnation, from its SUBSCRIBE
        self.looked = False
        self.cuts = 0

    def __call__(self, words: list[bytes]) -> list[bytes] | None:
        command = words[0].upper()
        if command == b"SUBSCRIBE":
            self.own = words[1].rsplit(b":in:", 1)[1]
        if command == b"GET" and words[1].endswith(b":alive") and not self.looked:
            self.looked = True
            return None if self.where == "look" else [b"GET", words[1] + b":nobody"]
        if self.own is None:
            return words
        put_back = (  # an announcement of another incarnation than its own
            command == b"EVALSHA"
            and any(w.endswith(b":alive") for w in words)
            and self.own not in words
        )
        wake = command == b"PUBLISH" and not words[1].endswith(b":in:" + self.own)
        if (self.where == "put back" and put_back and self.cuts < 1) or (
            self.where == "wake" and wake and self.cuts < 2
        ):
            self.cuts += 1
            return None
        return words


@pytest.mark.parametrize("where", ["look", "wake", "put back"])
async def test_a_store_fault_in_the_worker_id_check_lets_no_second_worker_through(
    redis_url: str, where: str
) -> None:
    """A worker started under the id of a live worker whose check of the id meets a store
    fault (its first look, the wake sent to the live one, or the put-back of its
    announcement) is still refused with StoreConfigurationError (after its first look
    failed: its registry, opened without waiting, ends with it), and the live one keeps
    serving."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    faults = CheckFaults(where)
    ttl = 30.0  # (the live one announces itself again only after the check's retry)
    with trio.fail_after(30):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(redis_url, prefix, "w", lease_ttl=ttl) as a,
        ):
            await a.spawn("s")
            assert (await a.ref("s").send("one")).text == "one"
            proxy.edit = faults
            with pytest.raises(sa.StoreConfigurationError, match="worker_id 'w'"):
                async with open_worker(proxied, prefix, "w", lease_ttl=ttl):
                    await trio.sleep(5)  # (the refusal ends it; else: the failure)
            assert faults.looked, proxy.commands
            assert faults.cuts == {"look": 0, "wake": 2, "put back": 1}[where], proxy.commands
            assert (await a.ref("s").send("three")).text == "three"
            assert a.live() == ["s"]


def held_requests_lost(words: list[bytes]) -> list[bytes]:
    """Every "held" request a worker sends (for the events of a turn that a session's
    owner holds) reaches its owner as a wake, which asks for nothing: the owner never
    answers it (and says, when pinged, that it never got it)."""
    if words[0].upper() == b"PUBLISH" and b"\xa2op\xa4held" in words[2]:
        return [words[0], words[1], msgpack.packb({"op": "wake"})]
    return words


async def test_a_replay_whose_held_request_the_owner_never_answers_goes_on_within_its_bound(
    redis_url: str,
) -> None:
    """A subscription opened with after= on a worker whose session runs on another, which
    asks the owner for the events it holds and never hears back, replays the durable
    events from the journal after a third of lease_ttl, not after the request's own
    deadline (two lease lifetimes)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    ttl = 3.0  # the bound: 1 s; the request's own deadline: 6 s
    with trio.fail_after(30):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(redis_url, prefix, "a", lease_ttl=ttl) as a,
        ):
            await a.spawn("s")
            first = await a.ref("s").send("one")
            await a.ref("s").send("two")
            proxy.edit = held_requests_lost
            async with open_worker(proxied, prefix, "b", lease_ttl=ttl) as b:
                replayed: list[sa.Event] = []
                with trio.fail_after(ttl):  # (the bound and the journal's read)
                    async with b.ref("s").subscribe(after=0) as events:
                        async for event in events:
                            replayed.append(event)
                            if isinstance(event, sa.TurnFinished):
                                break
                assert b.live() == []  # (it ran on a all along)
            asked = [c for c in proxy.commands if c[0] == b"PUBLISH" and c[2] == WAKE]
            assert asked, "the held request was sent (and lost on the way)"
    finished = replayed[-1]
    assert isinstance(finished, sa.TurnFinished)
    assert finished.turn_id == first.turn_id
    assert [e.seq for e in replayed] == sorted(e.seq for e in replayed)


@pytest.mark.soak  # (slow: run by make soak)
async def test_a_keyed_stream_follows_its_turn_sent_on_after_its_worker_was_killed(
    redis_url: str,
) -> None:
    """ref.stream with idempotency_key through another worker, whose worker is killed (SIGKILL) mid-turn, follows the turn sent again to the session's next worker to its TurnFinished, however long that turn runs: the end of the dead worker's events does not end the stream."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(30))
    seen: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b", EchoModel(delay=0.2)) as b,
        ):
            async with b.ref("s").stream(text, idempotency_key="k1") as events:
                async for event in events:
                    seen.append(event)
                    if isinstance(event, sa.Delta) and len(seen) == 3:
                        a.kill()  # SIGKILL, mid-turn
            history = await b.ref("s").history()
    starts = [e for e in seen if isinstance(e, sa.TurnStarted)]
    assert len(starts) == 2, seen  # the turn, then the turn sent again on b
    last = seen[-1]
    assert isinstance(last, sa.TurnFinished), seen
    assert last.turn_id == starts[-1].turn_id
    assert [m.content for m in history] == [text, text]


async def test_a_keyed_message_streamed_over_http_follows_its_turn_sent_on_after_its_worker_was_killed(
    redis_url: str,
) -> None:
    """A message with an idempotency key POSTed as an event stream to the gateway of a
    worker that does not run the session, whose worker is killed (SIGKILL) mid-turn, ends
    with the outcome of the turn the key runs again on the session's next worker (a
    second TurnStarted, its deltas, its TurnFinished), as ref.stream does: the stream
    does not wait past the turn, with heartbeats, for an outcome under the first id."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(30))
    seen: list[dict[str, Any]] = []
    body = {"text": text, "idempotency_key": "k1"}
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b", EchoModel(delay=0.2)) as b,
            serve_trio(create_app(b)) as url,
            httpx.AsyncClient(base_url=url, timeout=None) as client,
            client.stream("POST", "/sessions/s/messages", json=body, headers=SSE) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    seen.append(json.loads(line.removeprefix("data:")))
                    if seen[-1]["type"] == "Delta" and len(seen) == 3:
                        a.kill()  # SIGKILL, mid-turn
            history = await b.ref("s").history()
    starts = [e for e in seen if e["type"] == "TurnStarted"]
    assert len(starts) == 2, seen  # the turn, then the turn sent again on b
    last = seen[-1]
    assert last["type"] == "TurnFinished", seen
    assert last["turn_id"] == starts[-1]["turn_id"] != starts[0]["turn_id"]
    assert [m.content for m in history] == [text, text]


async def test_turn_outcomes_asked_through_another_worker_come_from_the_owner(
    redis_url: str,
) -> None:
    """turn_outcome asked through a worker that does not run the session answers as the owner would: a finished turn with its reply, and, once the worker that had a turn in its mailbox was killed and the session woke on a third worker, lost (not queued forever)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
        ):
            done = await b.ref("s").send("quick")
            finished = await b.ref("s").turn_outcome(done.turn_id)
            assert finished.status is sa.TurnStatus.FINISHED
            assert finished.message is not None
            assert finished.message.content == "quick"
            running = await b.ref("s").submit(" ".join(["word"] * 30))
            queued = await b.ref("s").submit("queued behind it")
            status = (await b.ref("s").turn_outcome(queued.id)).status
            assert status is sa.TurnStatus.QUEUED
            a.kill()  # SIGKILL, with one turn running and one queued
            for turn in (running, queued):
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
            await c.ref("s").history()  # it wakes on c
            assert c.live() == ["s"]
            for turn in (running, queued):
                outcome = await b.ref("s").turn_outcome(turn.id)
                assert outcome.status is sa.TurnStatus.LOST, (turn, outcome)


async def test_a_subscription_opened_mid_turn_hears_of_a_worker_killed_then(
    redis_url: str,
) -> None:
    """A subscription opened on another worker while a turn is already under way (a browser's GET /events mid-reply), whose worker is then killed (SIGKILL) before the subscription read any event of the turn, ends with SubscriberLaggedError within a few lease lifetimes: its mirror knows of the turn from the owner's answer, not only from a TurnStarted it read."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(50))
    ended: list[BaseException] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.5) as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            ref = b.ref("s")
            turn = await ref.submit(text)
            await trio.sleep(1.0)  # under way on a
            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, ended)
                a.kill()  # SIGKILL, mid-turn
                with pytest.raises(sa.SessionActorsError):
                    await turn.reply()
                await wait_for_an_end(ended, 8 * TTL)
            assert isinstance(ended[0], sa.SubscriberLaggedError), repr(ended[0])


@pytest.mark.parametrize("taker", ["a third worker", "its own worker"])
async def test_a_subscription_hears_that_a_turn_was_lost_when_a_worker_took_over(
    redis_url: str, taker: str
) -> None:
    """When the worker running a turn is killed (SIGKILL) before the turn was durable and another worker takes the session over with an ordinary request (a third one, or the subscription's own, whose subscription then goes on from the session's hub there), a subscription on another worker does not wait forever for the turn's outcome (its new owner never heard of the turn, and turn_outcome reads lost): it ends with SubscriberLaggedError naming the lost turn; a subscription made again with after= its last seq, on the new owner or elsewhere, raises EventsExpiredError (the events after it are lost), and one after the reloaded state goes on."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(50))
    ended: list[BaseException] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
        ):
            ref = b.ref("s")
            new_owner = c if taker == "a third worker" else b
            first_delta = trio.Event()

            def seen(event: sa.Event) -> None:
                if isinstance(event, sa.Delta):
                    first_delta.set()

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, ended, seen)
                turn = await ref.submit(text)
                await first_delta.wait()
                a.kill()  # SIGKILL, mid-turn: nothing of the turn is durable
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
                await new_owner.ref("s").history()  # it takes the session over
                assert new_owner.live() == ["s"]
                await wait_for_an_end(ended, 6 * TTL)
            lagged = ended[0]
            assert isinstance(lagged, sa.SubscriberLaggedError), repr(lagged)
            assert turn.id in str(lagged), str(lagged)
            assert "lost" in str(lagged), str(lagged)
            assert (await ref.turn_outcome(turn.id)).status is sa.TurnStatus.LOST
            with pytest.raises(sa.EventsExpiredError):  # (elsewhere too: the new owner
                # published nothing yet, and its hub knows it jumped over that seq)
                async with ref.subscribe(after=lagged.last_seq):
                    pass
            async with ref.subscribe(after=(await ref.state()).event_seq) as events:
                await new_owner.ref("s").send("again")
                async for event in events:
                    if isinstance(event, sa.TurnFinished):
                        break


async def test_subscribers_elsewhere_hear_of_a_worker_killed_after_a_review(
    redis_url: str,
) -> None:
    """A turn that paused on a review and goes on once approved (the tool runs, the model answers), whose worker is killed (SIGKILL) mid-answer: a subscription to the session on another worker, opened before the turn, ends with SubscriberLaggedError within a few lease lifetimes instead of waiting forever (its mirror watches the rest of the turn from the ReviewResolved on)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = "review " + " ".join(f"w{i}" for i in range(50))
    ended: list[BaseException] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            ref = b.ref("s")
            answering, seen = answering_after_review()

            async def approve(review_id: str) -> None:
                with contextlib.suppress(sa.SessionActorsError):
                    await ref.review(review_id, True)

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, ended, seen)
                paused = await ref.send(text)
                assert len(paused.reviews) == 1, paused
                nursery.start_soon(approve, paused.reviews[0].id)
                await answering.wait()
                a.kill()  # SIGKILL, mid-answer after the review
                await wait_for_an_end(ended, 8 * TTL)
            assert isinstance(ended[0], sa.SubscriberLaggedError), repr(ended[0])


@pytest.mark.parametrize(
    ("taker", "then", "key"),
    [
        ("a third worker", "leaves it waiting", None),
        ("its own worker", "leaves it waiting", None),
        ("a third worker", "approves it again", None),
        ("a third worker", "approves it again", "k1"),
    ],
)
async def test_a_subscription_hears_that_an_approved_turns_answer_was_lost_when_a_worker_took_over(
    redis_url: str, taker: str, then: str, key: str | None
) -> None:
    """A turn that paused on a review and goes on once approved, whose worker is killed (SIGKILL) mid-answer, before the answer was durable; another worker then takes the session over (a third one, or the subscription's own), and the turn is back where the store has it: waiting on its review (the new owner may approve it again at once, and run it to its end before the subscription's worker asks what became of it). A subscription on another worker, which read the lost answer's deltas, ends with SubscriberLaggedError at the last of them, naming the turn, before any event of the new owner, with or without an idempotency key: it never passes from the lost deltas on to the new owner's events in silence (they would read as one answer; the turn goes on under its id, with no TurnStarted of its own to tell a client to drop the lost part). Left waiting, subscribing again after it is refused as expired."""
    from cluster_worker import EchoOrFail, _guarded

    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = "review " + " ".join(f"w{i}" for i in range(50))
    ended: list[BaseException] = []
    events: list[sa.Event] = []
    tools = [sa.Tool(name="guarded", fn=_guarded, requires_review=True)]
    fast = {"echo": sa.Agent(model=EchoOrFail(delay=0.0), tools=tools)}
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c", agents=fast) as c,
        ):
            ref = b.ref("s")
            new_owner = c if taker == "a third worker" else b
            answering, answer_seen = answering_after_review()

            def seen(event: sa.Event) -> None:
                events.append(event)
                answer_seen(event)

            async def approve(through: sa.SessionRef, review_id: str) -> None:
                with contextlib.suppress(sa.SessionActorsError):
                    await through.review(review_id, True)

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, ended, seen)
                paused = await ref.send(text, idempotency_key=key)
                [review] = paused.reviews
                nursery.start_soon(approve, ref, review.id)
                await answering.wait()
                a.kill()  # SIGKILL, mid-answer after the review
                state = await new_owner.ref("s").state()  # it takes the session over
                assert new_owner.live() == ["s"]
                assert [r.id for r in state.reviews] == [review.id], state.reviews
                if then == "approves it again":
                    nursery.start_soon(approve, new_owner.ref("s"), review.id)
                with trio.move_on_after(6 * TTL):
                    await wait_for_an_end(ended, 6 * TTL)
                nursery.cancel_scope.cancel()
            last = max(e.seq for e in events if isinstance(e, sa.Delta))
            assert ended, f"no error; after the lost answer came {_jumped(events, last)}"
            lagged = ended[0]
            assert isinstance(lagged, sa.SubscriberLaggedError), repr(lagged)
            assert lagged.last_seq == last == events[-1].seq, (lagged, events[-3:])
            assert paused.turn_id in str(lagged), str(lagged)
            if then == "leaves it waiting":
                with pytest.raises(sa.EventsExpiredError):
                    async with ref.subscribe(after=lagged.last_seq):
                        pass


def _jumped(events: list[sa.Event], last: int) -> list[sa.Event]:
    """The events of ``events`` a wake's seq jump past seq ``last`` numbered."""
    return [e for e in events if e.seq > last + (1 << 19)]


@pytest.mark.parametrize("taker", ["a third worker", "its own worker"])
async def test_a_subscription_hears_that_a_turn_was_lost_before_the_next_owners_events(
    redis_url: str, taker: str
) -> None:
    """When the worker running a turn is killed (SIGKILL) before the turn was durable and another worker takes the session over with the next message (a third one, or the subscription's own), a subscription on another worker, which reads the new owner's events after the wake's seq jump, ends with SubscriberLaggedError at the last event of the lost turn naming it, before any of those events: it never passes from the lost turn's deltas to the next turn in silence."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(50))
    ended: list[BaseException] = []
    events: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
        ):
            ref = b.ref("s")
            new_owner = c if taker == "a third worker" else b
            first_delta = trio.Event()

            def seen(event: sa.Event) -> None:
                events.append(event)
                if isinstance(event, sa.Delta):
                    first_delta.set()

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, ended, seen)
                turn = await ref.submit(text)
                await first_delta.wait()
                a.kill()  # SIGKILL, mid-turn: nothing of the turn is durable
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
                reply = await new_owner.ref("s").send("next")  # it takes the session over
                assert new_owner.live() == ["s"]
                with trio.move_on_after(6 * TTL):
                    await wait_for_an_end(ended, 6 * TTL)
                nursery.cancel_scope.cancel()
            last = max(e.seq for e in events if getattr(e, "turn_id", None) == turn.id)
            assert ended, f"no error; after the lost turn came {_jumped(events, last)}"
            lagged = ended[0]
            assert isinstance(lagged, sa.SubscriberLaggedError), repr(lagged)
            assert lagged.last_seq == last == events[-1].seq, (lagged, events[-3:])
            assert turn.id in str(lagged), str(lagged)
            assert "lost" in str(lagged), str(lagged)
            # subscribing again after it: refused as expired, and the reloaded state goes on
            with pytest.raises(sa.EventsExpiredError):
                async with ref.subscribe(after=lagged.last_seq):
                    pass
            state = await ref.state()
            assert state.messages[-1].id == reply.message.id


async def collect_until(
    ref: sa.SessionRef,
    events: list[sa.Event],
    done: Callable[[sa.Event], bool],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Subscribe to ``ref`` (started once subscribed) and collect its events into
    ``events`` until ``done`` says so of one; an error ends it as it is."""
    async with ref.subscribe() as subscription:
        task_status.started()
        async for event in subscription:
            events.append(event)
            if done(event):
                return


async def test_a_subscription_goes_on_to_the_next_owners_events_when_no_turn_was_under_way(
    redis_url: str,
) -> None:
    """When the worker running an idle session is killed (SIGKILL) and another worker takes the session over with the next message, a subscription on a third worker goes on from the last event it saw to the new owner's events after the wake's seq jump, without an error: nothing was lost."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    events: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.0) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
        ):
            ref = b.ref("s")
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    collect_until,
                    ref,
                    events,
                    lambda e: isinstance(e, sa.TurnFinished) and e.message.content == "next",
                )
                first = await ref.send("first")  # ran on a
                a.kill()  # SIGKILL, at rest
                await c.ref("s").send("next", idempotency_key="next")  # it takes it over
    finished = [e for e in events if isinstance(e, sa.TurnFinished)]
    assert finished[0].turn_id == first.turn_id
    assert [e.message.content for e in finished] == ["first", "next"]
    assert _jumped(events, finished[0].seq), events  # (it did wake with a jump)


def events_go_nowhere(key: str) -> Callable[[list[bytes]], list[bytes]]:
    """An edit of the commands a worker sends (see net_proxy): the events it publishes to
    the event stream ``key`` go to another key, as events that never reached the stream
    (its worker died before it published them) do."""
    stream = key.encode()

    def edit(words: list[bytes]) -> list[bytes]:
        # (the publishing script's call: that stream its only key, the entries after it)
        if words[0].upper() in (b"EVALSHA", b"EVAL") and words[2:4] == [b"1", stream]:
            return [*words[:3], stream + b":nowhere", *words[4:]]
        return words

    return edit


async def test_a_subscription_gets_a_stored_turn_whose_events_its_dead_owner_never_published(
    redis_url: str,
) -> None:
    """When the worker running a session dies after it stored a turn and before that
    turn's events reached the session's event stream, a subscription on another worker
    gets the turn's stored events (from the journal) before the next owner's, and goes
    on without an error: it never skips a stored turn in silence."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    events: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
            trio.open_nursery() as nursery,
        ):
            with trio.CancelScope() as process:
                async with open_worker(proxied, prefix, "a") as a:
                    await a.spawn("s")
                    await a.ref("s").history()  # live on a
                    await nursery.start(
                        collect_until,
                        b.ref("s"),
                        events,
                        lambda e: isinstance(e, sa.TurnFinished) and e.message.content == "next",
                    )
                    proxy.edit = events_go_nowhere(session_key(prefix, "s", "ev"))
                    first = await b.ref("s").send("first")  # stored on a, its events lost
                    crash(a)
                    process.cancel()
            await c.ref("s").send("next")  # it takes the session over
    finished = [e for e in events if isinstance(e, sa.TurnFinished)]
    assert [e.message.content for e in finished] == ["first", "next"], events
    assert finished[0].turn_id == first.turn_id
    assert [e.seq for e in events] == sorted(e.seq for e in events)


async def test_a_subscription_follows_a_turn_sent_again_under_its_key_after_the_jump(
    redis_url: str,
) -> None:
    """When the worker running a turn sent with an idempotency key through another worker is killed (SIGKILL) mid-turn, that worker sends it again under its key to the session's next owner: a subscription on that worker follows the turn sent again after the wake's seq jump to its TurnFinished, without an error."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    text = " ".join(f"w{i}" for i in range(30))
    events: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
        ):
            ref = b.ref("s")
            first_delta = trio.Event()

            def done(event: sa.Event) -> bool:
                if isinstance(event, sa.Delta):
                    first_delta.set()
                return isinstance(event, sa.TurnFinished)

            async with trio.open_nursery() as nursery:
                await nursery.start(collect_until, ref, events, done)
                turn = await ref.submit(text, idempotency_key="k1")
                await first_delta.wait()
                a.kill()  # SIGKILL, mid-turn: the turn is sent again under its key
                reply = await turn.reply()
    starts = [e for e in events if isinstance(e, sa.TurnStarted)]
    assert [e.idempotency_key for e in starts] == ["k1", "k1"], events
    assert _jumped(events, starts[0].seq)[0].seq < starts[1].seq
    last = events[-1]
    assert isinstance(last, sa.TurnFinished), events
    assert last.turn_id == starts[1].turn_id == reply.turn_id
    assert last.message.content == text


async def test_a_subscription_follows_a_turn_its_next_owner_resumed_after_the_jump(
    redis_url: str,
) -> None:
    """A turn whose worker is killed (SIGKILL) while it runs a tool that is not idempotent (the turn's start is durable): when another worker takes the session over with the next message, it resumes the turn, and a subscription on a third worker follows it after the wake's seq jump to its TurnFinished and then the next turn, without an error."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    events: list[sa.Event] = []
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b") as b,
            open_worker(redis_url, prefix, "c") as c,
        ):
            ref = b.ref("s")
            calling = trio.Event()

            def done(event: sa.Event) -> bool:
                if isinstance(event, sa.ToolCallStarted):
                    calling.set()
                return isinstance(event, sa.TurnFinished) and event.message.content == "next"

            async with trio.open_nursery() as nursery:
                await nursery.start(collect_until, ref, events, done)
                turn = await ref.submit("slow tool")
                await calling.wait()
                a.kill()  # SIGKILL, mid-tool
                with pytest.raises(sa.SessionCrashedError):
                    await turn.reply()
                await c.ref("s").send("next", idempotency_key="next")  # it takes it over
    finished = [e for e in events if isinstance(e, sa.TurnFinished)]
    assert [e.turn_id for e in finished] == [turn.id, finished[-1].turn_id], events
    assert finished[0].seq in [e.seq for e in _jumped(events, 0)]


async def test_a_failed_renewal_of_the_leases_is_logged_once_in_plain_words(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A round of lease renewals that the store refuses is logged at WARNING in one
    sentence that says once what failed, with the number of sessions in agreement
    ("1 session", never "1 sessions")."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    ttl = 3.0  # (a renewal each second)

    def refuse_renewals(words: list[bytes]) -> list[bytes]:
        if words[0].upper() in (b"EVALSHA", b"EVAL") and any(b":shard" in w for w in words):
            return [b"NOSUCHCOMMAND"]  # (the store is told an error for it)
        return words

    with trio.fail_after(30):
        async with (
            proxy_to(redis_url) as (proxy, proxied),
            open_worker(proxied, prefix, "w", lease_ttl=ttl) as registry,
        ):
            await registry.spawn("s")
            assert (await registry.ref("s").send("one")).text == "one"  # (live here)
            proxy.edit = refuse_renewals
            while not any("renew" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.1)
            proxy.edit = None
    [record] = [r for r in caplog.records if "renew" in r.getMessage()][:1]
    message = record.getMessage()
    assert record.levelname == "WARNING", message
    assert message.count("renew the lease") == 1, message
    assert "1 session" in message, message
    assert "1 sessions" not in message, message


async def test_a_review_resolved_as_its_worker_dies_is_told_to_be_resolved_again(
    redis_url: str,
) -> None:
    """A review approved through another worker whose worker is killed (SIGKILL) as it
    answers raises SessionCrashedError saying to resolve the review again the same way
    (it said to send the request again with an idempotency key, which a review takes
    none of); resolved again, it runs on the session's next owner."""
    from cluster_worker import EchoOrFail, _guarded

    prefix = f"sa-test:{uuid.uuid4().hex}"
    tools = [sa.Tool(name="guarded", fn=_guarded, requires_review=True)]
    agents = {"echo": sa.Agent(model=EchoOrFail(), tools=tools)}
    text = "review " + " ".join(f"w{i}" for i in range(50))
    with trio.fail_after(60):
        async with (
            worker_process(redis_url, prefix, "a", ["s"], 0.2) as a,
            open_worker(redis_url, prefix, "b", agents=agents) as b,
        ):
            ref = b.ref("s")
            answering, seen = answering_after_review()

            paused = await ref.send(text)
            [review] = paused.reviews
            crashed: list[sa.SessionCrashedError] = []

            async def approve() -> None:
                try:
                    await ref.review(review.id, True)
                except sa.SessionCrashedError as exc:
                    crashed.append(exc)

            async with trio.open_nursery() as nursery:
                await nursery.start(subscribe_until_error, ref, [], seen)
                nursery.start_soon(approve)
                await answering.wait()  # a resolved it and answers
                a.kill()  # SIGKILL: the approval is never answered
                while not crashed:
                    await trio.sleep(0.05)
                told = str(crashed[0])
                assert f"resolve it with ref.review({review.id!r}, approve=...) again" in told
                assert "idempotency_key" not in told
                while True:  # (as told: again, until the session's next owner takes it)
                    with contextlib.suppress(sa.SessionCrashedError):
                        reply = await ref.review(review.id, True)
                        break
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
            assert reply.turn_id == paused.turn_id
            history = await ref.history()
            assert [m.content for m in history if m.role is sa.Role.TOOL] == ["done"]
