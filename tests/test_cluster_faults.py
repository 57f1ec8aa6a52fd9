"""Many workers while redis fails under them: every caller gets an answer or a typed error."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import coredis
import pytest
import trio

import sessionactors as sa
from net_proxy import proxy_to
from redis_workers import open_worker
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

TTL = 1.0
TIMEOUT = 0.5  # RedisStore(timeout=): well below the faults' length
AGENTS = {"echo": sa.Agent(model=EchoModel())}
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")
#: No caller may wait longer than this (a generous bound: the check is "no hang").
NO_HANG = 60


@attrs.define
class Outcome:
    """What one send got: its reply, or the error it raised."""

    text: str
    key: str | None
    reply: sa.Reply | None = None
    error: type[sa.SessionActorsError] | None = None  # (not the error: it holds frames)


@attrs.define
class Traffic:
    """Senders on two workers, one of which runs the session, until told to stop."""

    outcomes: list[Outcome] = attrs.Factory(list)
    stop: trio.Event = attrs.Factory(trio.Event)
    replies: int = 0
    ended: int = 0  # sends that ended, with a reply or an error
    progress: trio.Event = attrs.Factory(trio.Event)

    async def sender(self, registry: sa.Registry, tag: str) -> None:
        for i in range(10_000):
            if self.stop.is_set():
                return
            text = f"{tag} {i}"
            outcome = Outcome(text, key=text if i % 2 else None)
            self.outcomes.append(outcome)
            try:
                outcome.reply = await registry.ref("s").send(text, idempotency_key=outcome.key)
                self.replies += 1
            except sa.SessionActorsError as exc:  # typed: the caller can act on it
                outcome.error = type(exc)
                await trio.sleep(0.05)
            finally:
                self.ended += 1
                self.progress.set()
                self.progress = trio.Event()

    async def wait_until(self, check: Callable[[], bool]) -> None:
        while not check():
            await self.progress.wait()


def untyped(outcomes: list[Outcome]) -> list[Outcome]:
    """Outcomes that are neither a reply nor a sessionactors error (none should be)."""
    return [o for o in outcomes if o.reply is None and o.error is None]


async def pid_of(url: str) -> int:
    async with coredis.Redis.from_url(url) as client:
        info = await client.info("server")
    return int(info["process_id"])


@contextlib.asynccontextmanager
async def two_workers(url: str, **options: Any) -> AsyncIterator[tuple[sa.Registry, sa.Registry]]:
    """Registries "a" (runs session "s") and "b" on one redis, with short deadlines."""
    options = {"lease_ttl": TTL, "agents": AGENTS, "shutdown_grace": 1.0, **options}
    async with (
        sa.open_registry(store=RedisStore(url, timeout=TIMEOUT), worker_id="a", **options) as a,
        sa.open_registry(store=RedisStore(url, timeout=TIMEOUT), worker_id="b", **options) as b,
    ):
        await (await a.spawn("s")).send("hello")
        yield a, b


async def run_through(
    url: str, fault: Callable[[], Any], *, stores_survive: bool = True
) -> tuple[Traffic, Counter[str]]:
    """Traffic from both workers while ``fault`` runs, then until more replies come.
    Returns the traffic and the stored user texts (counted), read by a third worker."""
    traffic = Traffic()
    with trio.fail_after(NO_HANG):
        async with two_workers(url) as (a, b), trio.open_nursery() as nursery:
            for registry, tag in ((a, "a"), (b, "b"), (b, "b2")):
                nursery.start_soon(traffic.sender, registry, tag)
            await traffic.wait_until(lambda: traffic.replies >= 6)
            await fault()
            replies, ended = traffic.replies, traffic.ended
            if stores_survive:  # it recovers
                await traffic.wait_until(lambda: traffic.replies >= replies + 6)
            else:  # every sender hears back again
                await traffic.wait_until(lambda: traffic.ended >= ended + 9)
            traffic.stop.set()
        texts: Counter[str] = Counter()
        if stores_survive:
            async with sa.open_registry(
                store=RedisStore(url, timeout=TIMEOUT), agents=AGENTS, lease_ttl=TTL
            ) as c:
                history = await c.ref("s").history()
            texts.update(m.content for m in history if m.role is sa.Role.USER)
    return traffic, texts


def lost_or_repeated(traffic: Traffic, texts: Counter[str]) -> list[str]:
    """Acknowledged turns missing from the store; keyed turns stored more than once."""
    problems = [
        f"acknowledged {o.text!r} is missing"
        for o in traffic.outcomes
        if o.reply and not texts[o.text]
    ]
    problems += [
        f"keyed {o.text!r} ran {texts[o.text]} times"
        for o in traffic.outcomes
        if o.key is not None and texts[o.text] > 1
    ]
    return problems


@pytest.mark.soak  # (a fault run: make soak)
async def test_redis_frozen_past_the_timeout(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """Redis frozen by SIGSTOP for longer than the store's timeout and the lease: every send ends with a reply or a typed error, nothing acknowledged is lost, no keyed turn runs twice."""
    with private_redis_server(config=AOF_ALWAYS) as url:
        pid = await pid_of(url)

        async def freeze() -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                await trio.sleep(4 * TTL)
            finally:
                os.kill(pid, signal.SIGCONT)

        traffic, texts = await run_through(url, freeze)
    assert untyped(traffic.outcomes) == []
    assert lost_or_repeated(traffic, texts) == []
    assert any(
        o.error and issubclass(o.error, sa.StoreError | sa.WorkerUnreachableError)
        for o in traffic.outcomes
    )


async def test_redis_flushed(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """FLUSHALL under traffic (everything stored is gone): every send still ends with a reply or a typed error, none waits forever."""
    with private_redis_server() as url:

        async def flush() -> None:
            async with coredis.Redis.from_url(url) as client:
                await client.flushall()

        traffic, _ = await run_through(url, flush, stores_survive=False)
    assert untyped(traffic.outcomes) == []


#: A forwarded send's caller hears back within the store's timeout plus two lease
#: lifetimes without word (WorkerUnreachableError); this leaves room on a busy machine.
FROZEN_DEADLINE = TIMEOUT + 2 * TTL + 2.0


async def send_while_frozen(url: str, timeout: float) -> list[sa.Reply | BaseException]:
    """Worker "b" sends to session "s", which worker "a" runs in a slow turn, and redis is
    frozen while the send waits; what the send got within ``FROZEN_DEADLINE`` (nothing if
    it still waits), then redis thaws."""
    slow = {"echo": sa.Agent(model=EchoModel(delay=0.2))}  # 0.2 s per word
    options: dict[str, Any] = {"lease_ttl": TTL, "agents": slow, "shutdown_grace": 1.0}
    pid = await pid_of(url)
    outcome: list[sa.Reply | BaseException] = []
    async with (
        sa.open_registry(store=RedisStore(url, timeout=timeout), worker_id="a", **options) as a,
        sa.open_registry(store=RedisStore(url, timeout=timeout), worker_id="b", **options) as b,
    ):
        await (await a.spawn("s")).send("hello")
        assert (await b.ref("s").send("forwarded")).text == "forwarded"
        assert b.live() == []  # it ran on a: the send was forwarded

        async def send() -> None:
            try:
                outcome.append(await b.ref("s").send("frozen"))
            except sa.SessionActorsError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.sleep(0.1)  # the request is in a's turn (or on its way)
            os.kill(pid, signal.SIGSTOP)
            try:
                with trio.move_on_after(FROZEN_DEADLINE):
                    while not outcome:
                        await trio.sleep(0.05)
                heard = list(outcome)
            finally:
                os.kill(pid, signal.SIGCONT)
    return heard


@pytest.mark.parametrize(
    ("timeout", "bounded"),
    [
        pytest.param(TIMEOUT, True, id="store-timeout"),
        pytest.param(10.0**6, False, id="control-without-a-usable-timeout", marks=pytest.mark.soak),
    ],
)
async def test_a_forwarded_send_with_redis_frozen_ends_within_its_deadline(
    private_redis_server: Callable[..., AbstractContextManager[str]],
    timeout: float,
    bounded: bool,
) -> None:
    """Redis frozen by SIGSTOP while a send forwarded to another worker waits for its answer: the caller gets a reply or a typed error within the store's timeout plus two lease lifetimes. Control (the deadline comes from the timeout of every call, the worker channel's included): with a timeout too long to matter, the send still waits when that deadline has passed."""
    with private_redis_server(config=AOF_ALWAYS) as url, trio.fail_after(NO_HANG):
        heard = await send_while_frozen(url, timeout)
    if not bounded:
        assert heard == []
        return
    assert len(heard) == 1
    got = heard[0]
    assert isinstance(got, sa.Reply | sa.StoreError | sa.WorkerUnreachableError), repr(got)


async def test_a_subscriber_elsewhere_hears_a_session_woken_as_soon_as_redis_thaws(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """Redis frozen (SIGSTOP) past the lease while a subscriber on another worker follows the session, which a request wakes again on its worker as soon as redis answers, before the subscriber's worker renewed its watch (which lapsed with the freeze): the subscriber still gets the turns that follow (or SubscriberLaggedError), never a silence without end."""
    options: dict[str, Any] = {"lease_ttl": TTL, "agents": AGENTS, "shutdown_grace": 1.0}
    fixed: dict[str, Any] = {"timeout": TIMEOUT, "balance": False}  # "s" stays on a
    with private_redis_server(config=AOF_ALWAYS) as url, trio.fail_after(NO_HANG):
        pid = await pid_of(url)
        async with (
            sa.open_registry(store=RedisStore(url, **fixed), worker_id="a", **options) as a,
            sa.open_registry(store=RedisStore(url, **fixed), worker_id="b", **options) as b,
        ):
            ref = await a.spawn("s")
            await ref.send("hello")
            async with b.ref("s").subscribe() as stream:
                os.kill(pid, signal.SIGSTOP)
                try:
                    await trio.sleep(3 * TTL)  # the lease lapses: the session stops on a
                finally:
                    os.kill(pid, signal.SIGCONT)
                while True:  # a request wakes it again at once
                    try:
                        await ref.send("after")
                        break
                    except (sa.StoreError, sa.SessionCrashedError, sa.WorkerUnreachableError):
                        await trio.sleep(0.05)
                await ref.send("later")
                heard: list[str] = []
                with trio.move_on_after(10 * TTL):
                    try:
                        async for event in stream:
                            if isinstance(event, sa.TurnFinished):
                                heard.append(event.message.content)
                                if heard[-1] == "later":
                                    break
                    except sa.SubscriberLaggedError:
                        heard.append("lagged")
    assert heard in (["after", "later"], ["lagged"]), heard


#: After a worker's connections to redis go silent, its sends get replies again
#: within this (a generous bound: the check is that it recovers at all).
RECOVERED_WITHIN = 20 * TTL


@pytest.mark.parametrize("silenced", ["sender", "sender, one way", "owner", "idle owner"])
async def test_a_worker_whose_connections_went_silent_recovers(
    private_redis_server: Callable[..., AbstractContextManager[str]], silenced: str
) -> None:
    """Every connection one worker holds to redis goes silent at once, both ends still open (a half-open path: a firewall or NAT that lost its state); connections made afterwards work. That worker sends turns to the session the other runs ("sender"; "one way": only what it sends is lost, redis' replies and pushes still come, so its channel still hears itself and only the bound on its own messages notices), or runs the session the other sends to, under traffic ("owner") or with nothing in flight ("idle owner": only its own checks can notice). Sends fail with typed errors for a while, then every sender gets replies again; nothing acknowledged is lost and no keyed turn runs twice."""
    with private_redis_server(config=AOF_ALWAYS) as url, trio.fail_after(NO_HANG):
        traffic = Traffic()
        options: dict[str, Any] = {"lease_ttl": TTL, "agents": AGENTS, "shutdown_grace": 1.0}
        fixed: dict[str, Any] = {"timeout": TIMEOUT, "balance": False}  # the owner keeps "s"
        async with (
            proxy_to(url) as (proxy, proxied),
            sa.open_registry(store=RedisStore(url, **fixed), worker_id="a", **options) as a,
            sa.open_registry(store=RedisStore(proxied, **fixed), worker_id="b", **options) as b,
        ):
            owner, sender = (a, b) if silenced.startswith("sender") else (b, a)
            silence = proxy.blackhole_up if silenced == "sender, one way" else proxy.blackhole
            await (await owner.spawn("s")).send("hello")
            assert (await sender.ref("s").send("forwarded")).text == "forwarded"
            assert sender.live() == []  # its sends are forwarded
            if silenced == "idle owner":
                await trio.sleep(TTL)  # b's checks have seen its channel work
                assert proxy.blackhole() >= 2  # b's store client and its worker channel
            since = len(traffic.outcomes)

            def recovered() -> bool:  # every sender has replies since the silence
                later = traffic.outcomes[since:]
                return all(
                    sum(1 for o in later if o.reply and o.text.split()[0] == tag) >= 3
                    for tag in ("x", "y")
                )

            async with trio.open_nursery() as nursery:
                for tag in ("x", "y"):
                    nursery.start_soon(traffic.sender, sender, tag)
                if silenced != "idle owner":
                    await traffic.wait_until(lambda: traffic.replies >= 6)
                    assert silence() >= 2
                    since = len(traffic.outcomes)
                with trio.move_on_after(RECOVERED_WITHIN):
                    await traffic.wait_until(recovered)
                traffic.stop.set()
            history = await a.ref("s").history()
    texts = Counter(m.content for m in history if m.role is sa.Role.USER)
    assert recovered(), f"a sender had no replies for {RECOVERED_WITHIN} s after"
    assert untyped(traffic.outcomes) == []
    assert lost_or_repeated(traffic, texts) == []


@attrs.frozen
class GatedEcho:
    """Echoes; a turn whose text is "only once" waits for ``release`` first (once set,
    no more)."""

    started: trio.Event
    release: trio.Event

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        text = request.messages[-1].content
        if text == "only once" and not self.release.is_set():
            self.started.set()
            await self.release.wait()
        yield sa.TextChunk(text)


#: More answers than a worker keeps for requesters that ask after theirs.
FLOOD = 10_500


@pytest.mark.soak
async def test_a_turn_whose_answer_was_lost_and_then_forgotten_does_not_run_again(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """A forwarded turn without idempotency key whose answer is lost on the way (its requester's connections went silent) and then dropped by its owner (more answers since than it keeps) does not run a second time when the requester asks after it: the requester gets a typed error that says it may have run."""
    model = GatedEcho(trio.Event(), trio.Event())
    ttl = 30.0  # the requester asks after its request a third of this after the silence
    options: dict[str, Any] = {
        "lease_ttl": ttl,
        "agents": {"echo": sa.Agent(model=model)},
        "shutdown_grace": 1.0,
    }
    fixed: dict[str, Any] = {"timeout": 2.0, "balance": False}  # the owner keeps "s"
    outcome: list[sa.Reply | sa.SessionActorsError] = []
    with private_redis_server(config=AOF_ALWAYS) as url, trio.fail_after(4 * ttl):
        async with (
            proxy_to(url) as (proxy, proxied),
            sa.open_registry(store=RedisStore(url, **fixed), worker_id="a", **options) as a,
            sa.open_registry(store=RedisStore(proxied, **fixed), worker_id="b", **options) as b,
            sa.open_registry(store=RedisStore(url, **fixed), worker_id="c", **options) as c,
        ):
            for name in ("s", "t"):
                await (await a.spawn(name)).history()  # live on a
            assert (await c.ref("t").send("warm up")).text == "warm up"
            assert (sorted(a.live()), b.live(), c.live()) == (["s", "t"], [], [])

            async def send() -> None:
                try:
                    outcome.append(await b.ref("s").send("only once"))
                except sa.SessionActorsError as exc:
                    outcome.append(exc)

            async def flood(count: int) -> None:  # answers a keeps, one per request
                for _ in range(count):
                    await c.ref("t").cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await model.started.wait()  # the turn runs on a
                assert proxy.blackhole() >= 2  # b's store client and its worker channel
                model.release.set()  # a answers into b's silent channel
                while len(await a.ref("s").history()) < 2:  # (answered once stored)
                    await trio.sleep(0.01)
                with trio.fail_after(ttl / 3):  # before b asks after its turn
                    async with trio.open_nursery() as flooding:
                        for _ in range(20):
                            flooding.start_soon(flood, FLOOD // 20)
            texts = [m.content for m in await a.ref("s").history() if m.role is sa.Role.USER]
    assert texts.count("only once") == 1, texts
    assert len(outcome) == 1
    assert isinstance(outcome[0], sa.SessionCrashedError), repr(outcome[0])
    assert "may have run" in str(outcome[0])


async def drain_and_send(
    redis_url: str, drain: float, requester_grace: float
) -> tuple[list[sa.Reply | sa.SessionActorsError], list[str], float]:
    """Worker a runs a turn of "s" that takes ``drain`` seconds and shuts down meanwhile
    (its grace is longer); half a second in, worker b (``requester_grace``) sends "s" a
    turn. What b's send got, the history, and how long b's send took."""
    model = GatedEcho(trio.Event(), trio.Event())
    prefix = f"sa-test:{uuid.uuid4().hex}"
    outcome: list[sa.Reply | sa.SessionActorsError] = []
    took = 0.0

    def worker(worker_id: str, grace: float) -> Any:
        return open_worker(redis_url, prefix, worker_id, model, lease_ttl=TTL, shutdown_grace=grace)

    with trio.fail_after(2 * drain + 30):
        async with worker("b", requester_grace) as b, trio.open_nursery() as nursery:

            async def send_through_b() -> None:
                nonlocal took
                started = trio.current_time()
                try:
                    outcome.append(await b.ref("s").send("after the drain"))
                except sa.SessionActorsError as exc:
                    outcome.append(exc)
                took = trio.current_time() - started

            async def run_a(task_status: trio.TaskStatus[None]) -> None:
                async with worker("a", 2 * drain) as a:
                    ref = await a.spawn("s")
                    nursery.start_soon(ref.send, "only once")  # a long turn, on a
                    await model.started.wait()
                    task_status.started()
                # (leaving the block: a shuts down, draining the turn: its grace is long)

            await nursery.start(run_a)
            await trio.sleep(0.5)
            nursery.start_soon(send_through_b)
            with trio.move_on_after(drain):
                while not outcome:
                    await trio.sleep(0.05)
            model.release.set()
            with trio.fail_after(requester_grace + 10 * TTL):
                while not outcome:
                    await trio.sleep(0.05)
            history = [m.content for m in await b.ref("s").history() if m.role is sa.Role.USER]
    return outcome, history, took


@pytest.mark.soak
async def test_a_request_to_a_session_whose_worker_drains_a_long_turn_waits_for_it(
    redis_url: str,
) -> None:
    """A turn sent through another worker to a session whose worker is shutting down while a turn runs there (a rolling restart, under a long shutdown grace) waits until that worker lets the session go, then runs on the next one: it neither fails after a fixed number of "moved" answers nor says the session crashed."""
    drain = 20.0  # longer than the 200 "moved" answers once took at lease_ttl=1
    outcome, history, took = await drain_and_send(redis_url, drain, requester_grace=2 * drain)
    assert isinstance(outcome[0], sa.Reply), repr(outcome[0])
    assert outcome[0].text == "after the drain"
    assert took > drain - 1  # it waited for the drain
    assert history == ["only once", "after the drain"]


async def test_a_request_to_a_session_whose_worker_drains_too_long_says_it_did_not_run(
    redis_url: str,
) -> None:
    """A turn sent through another worker to a session whose worker keeps draining a turn for longer than the sender's own shutdown grace (and two lease lifetimes) ends with SessionStoppedError saying it did not run, and it did not."""
    outcome, history, took = await drain_and_send(redis_url, drain=8.0, requester_grace=1.0)
    error = outcome[0]
    assert isinstance(error, sa.SessionStoppedError), repr(error)
    assert error.session_id == "s"
    assert "did not run" in str(error)
    assert 1.0 + 2 * TTL <= took < 1.0 + 2 * TTL + 2  # its grace and two lease lifetimes
    assert history == ["only once"]
