"""Model-based: operations through several workers on one Redis, with workers killed, keep
what was acknowledged, once, and every operation whole or not at all.

A plan is a list of operations on one session (turns with and without idempotency
keys, streamed turns, added messages, truncations, metadata edits, hibernations,
history reads), each made through one of two workers (the session's owner or not), and
optionally with the death of one of the two workers some (real) seconds after the
operation starts. A death is a kill -9: the worker's connections to Redis are closed
under it and its registry is cancelled, so it writes nothing more and releases nothing
(its leases lapse after ``lease_ttl``). The dead worker is restarted, under the id it
had or a fresh one, or not. A model of the session (messages, metadata) is advanced by
every operation that was answered; what another worker reads must equal it. An
operation that a death touched (its caller or its owner died), or that raised, must
have happened wholly or not at all, once: the session is then read through a live
worker and must be as the model was before the operation or as it is after it.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors.stores import JournalEntry, RedisStore
from sessionactors.testing import EchoModel, crash

pytestmark = pytest.mark.redis

TTL = 0.5
#: what one operation may take, deaths and lapsed leases included (a busy machine)
BOUND = 30.0

WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta"])
VIA = st.sampled_from([0, 1])
OPERATION = st.one_of(
    st.tuples(st.just("send"), WORDS, st.booleans(), VIA),
    st.tuples(st.just("stream"), WORDS, st.booleans(), VIA),
    st.tuples(st.just("add"), WORDS, VIA),
    st.tuples(st.just("truncate"), st.integers(0, 4), VIA),
    st.tuples(st.just("metadata"), st.sampled_from("ab"), st.none() | st.integers(0, 9), VIA),
    st.tuples(st.just("hibernate"), VIA),
    st.tuples(st.just("history"), VIA),
)
#: which worker dies, how many seconds after the operation starts, and how it comes back
#: (a moment is seconds after the start, or the start or end of the worker's n-th write)
MOMENT = st.floats(0, 0.3, allow_nan=False) | st.tuples(
    st.sampled_from(["before", "after"]), st.integers(0, 2)
)
DEATH = st.tuples(VIA, MOMENT, st.sampled_from(["same", "fresh", None]))
PLAN = st.lists(st.tuples(OPERATION, st.none() | DEATH), min_size=1, max_size=6)

Plan = list[tuple[tuple[Any, ...], tuple[int, float | tuple[str, int], str | None] | None]]


class Wire:
    """A loopback relay to Redis for one worker's life: ``cut()`` closes every connection
    and refuses new ones, as the kernel does for the sockets of a process killed -9."""

    def __init__(self, url: str) -> None:
        host_port = url.split("://", 1)[1].split("/", 1)[0]
        self._target = int(host_port.rsplit(":", 1)[1])
        self._scopes: set[trio.CancelScope] = set()
        self._carried = 0
        self._idle = trio.Event()
        self._idle.set()
        self.cut_off = False
        self.port = 0

    async def serve(self, task_status: trio.TaskStatus[None]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._carry, listeners)

    async def _carry(self, client: trio.SocketStream) -> None:
        if self.cut_off:
            await trio.aclose_forcefully(client)
            return
        scope = trio.CancelScope()
        self._scopes.add(scope)
        self._carried += 1
        self._idle = trio.Event()
        try:
            with scope:
                server = await trio.open_tcp_stream("127.0.0.1", self._target)
                try:
                    async with trio.open_nursery() as nursery:

                        async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
                            try:
                                while data := await source.receive_some(65536):
                                    await sink.send_all(data)
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                pass
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(pump, client, server)
                        nursery.start_soon(pump, server, client)
                finally:
                    await trio.aclose_forcefully(server)
        finally:
            await trio.aclose_forcefully(client)
            self._scopes.discard(scope)
            self._carried -= 1
            if not self._carried:
                self._idle.set()

    def cut_nowait(self) -> None:
        """Carry nothing more: every connection closes, and new ones are refused."""
        self.cut_off = True
        for scope in list(self._scopes):
            scope.cancel()

    async def cut(self) -> None:
        """Close every connection, refuse new ones, and wait until they are closed."""
        self.cut_nowait()
        await self._idle.wait()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class TrippingStore(RedisStore):
    """A RedisStore that calls ``trip(moment)`` just before and just after each of its
    writes (``moment`` is "before" or "after"): the harness kills its worker there."""

    trip: Callable[[str], None] | None = None

    async def _tripped(self, write: Callable[[], Awaitable[None]]) -> None:
        if self.trip is not None:
            self.trip("before")
            await trio.lowlevel.checkpoint()  # (a kill there cancels this worker)
        await write()
        if self.trip is not None:
            self.trip("after")
            await trio.lowlevel.checkpoint()

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._tripped(lambda: super(TrippingStore, self).create(session_id, snapshot, info))

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._tripped(
            lambda: super(TrippingStore, self).append(session_id, entries, info, fence=fence)
        )

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        await self._tripped(
            lambda: super(TrippingStore, self).write_snapshot(
                session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
            )
        )


class LosingStore(TrippingStore):
    """A store broken on purpose (a negative control): appends are acknowledged and not
    written."""

    async def append(
        self,
        session_id: str,
        entries: Any,
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await trio.lowlevel.checkpoint()


@attrs.define(eq=False)
class Worker:
    """One worker process: a registry over its own wire, run in its own task."""

    worker_id: str
    wire: Wire
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    nursery: trio.Nursery | None = None
    registry: sa.Registry | None = None
    ended: trio.Event = attrs.field(factory=trio.Event)
    dead: bool = False
    store: TrippingStore | None = None

    async def do(self, request: Callable[[sa.Registry], Awaitable[Any]]) -> tuple[str, Any]:
        """Make ``request`` in this worker: ("ok", answer), ("error", exc), or ("died", None)
        if the worker died first (its caller died with it)."""
        assert self.nursery is not None
        assert self.registry is not None
        registry = self.registry
        outcome: list[tuple[str, Any]] = []
        done = trio.Event()

        async def call() -> None:
            try:
                outcome.append(("ok", await request(registry)))
            except sa.SessionActorsError as exc:
                outcome.append(("error", exc))
            except Exception as exc:  # (a check of the test failed: raised by do())
                outcome.append(("bug", exc))
            finally:
                done.set()

        self.nursery.start_soon(call)
        await done.wait()
        if outcome and outcome[0][0] == "bug":
            raise outcome[0][1]
        return outcome[0] if outcome else ("died", None)

    def kill_nowait(self) -> None:
        """kill -9: its connections close, its tasks end, and it writes nothing more."""
        self.dead = True
        self.wire.cut_nowait()
        if self.registry is not None:
            crash(self.registry)
        self.scope.cancel()

    async def kill(self) -> None:
        self.kill_nowait()
        await self.wire.cut()
        await self.ended.wait()

    def kill_at_write(self, moment: str, count: int) -> None:
        """Kill this worker at ``moment`` ("before" or "after") of its ``count``-th next
        write (0: the first), or never if it writes less."""
        assert self.store is not None
        seen = 0

        def trip(now: str) -> None:
            nonlocal seen
            if now == moment:
                if seen == count:
                    self.kill_nowait()
                seen += 1

        self.store.trip = trip


@attrs.define
class Cluster:
    url: str
    prefix: str
    nursery: trio.Nursery
    store_type: type[TrippingStore] = TrippingStore
    options: dict[str, Any] = attrs.field(factory=dict)
    balance: bool = False
    ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    async def start(self, worker_id: str | None = None) -> Worker:
        wire = Wire(self.url)
        await self.nursery.start(wire.serve)
        worker = Worker(worker_id or f"w{next(self.ids)}", wire)
        await self.nursery.start(self._run, worker)
        return worker

    async def _run(self, worker: Worker, task_status: trio.TaskStatus[None]) -> None:
        store = worker.store = self.store_type(
            worker.wire.url(), prefix=self.prefix, balance=self.balance
        )
        agents = {"echo": sa.Agent(model=EchoModel(delay=0.2))}
        try:
            with worker.scope:
                async with (
                    sa.open_registry(
                        store=store,
                        agents=agents,
                        worker_id=worker.worker_id,
                        lease_ttl=TTL,
                        **self.options,
                    ) as registry,
                    trio.open_nursery() as nursery,
                ):
                    worker.registry, worker.nursery = registry, nursery
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            worker.ended.set()

    async def close(self, worker: Worker) -> None:
        """Close a live worker's registry cleanly."""
        worker.scope.cancel()  # (its registry closes as on a cancelled process' exit)
        await worker.ended.wait()


@attrs.frozen
class Model:
    """What the session holds, as the callers were told."""

    messages: tuple[tuple[str, str], ...] = ()
    metadata: tuple[tuple[str, Any], ...] = ()


def seen(state: sa.SessionState) -> Model:
    return Model(
        messages=tuple((m.role.value, m.content.strip()) for m in state.messages),
        metadata=tuple(sorted(state.metadata.items())),
    )


def after(model: Model, operation: tuple[Any, ...]) -> Model:
    """The model once ``operation`` happened."""
    kind, *args = operation
    messages = list(model.messages)
    if kind in ("send", "stream"):
        messages += [("user", args[0]), ("assistant", args[0])]
    elif kind == "add":
        messages.append(("assistant", args[0]))
    elif kind == "truncate":  # at least the last n, from the user message that began a turn
        cut = max(0, len(messages) - args[0]) if args[0] else len(messages)
        users = [i for i, (role, _) in enumerate(messages) if role == "user" and i <= cut]
        messages = messages[users[-1] if users and cut < len(messages) else cut :]
    elif kind == "metadata":
        metadata = dict(model.metadata)
        if args[1] is None:
            metadata.pop(args[0], None)
        else:
            metadata[args[0]] = args[1]
        return attrs.evolve(model, metadata=tuple(sorted(metadata.items())))
    return attrs.evolve(model, messages=tuple(messages))


def request(
    operation: tuple[Any, ...], key: str, again: bool = False
) -> Callable[[sa.Registry], Awaitable[Any]]:
    """``operation`` as a request through a registry; ``key`` is its idempotency key if
    it is a keyed turn, which is sent ``again`` after it got no answer (then a stream
    yields nothing if the key's turn completed, as documented)."""
    kind, *args = operation

    async def make(registry: sa.Registry) -> Any:
        ref = registry.ref("s")
        if kind == "send":
            return await ref.send(args[0], idempotency_key=key if args[1] else None)
        if kind == "stream":
            events = []
            async with ref.stream(args[0], idempotency_key=key if args[1] else None) as stream:
                async for event in stream:
                    events.append(event)
            last = events[-1] if events else None
            if again and not events:
                return None
            assert isinstance(last, sa.TurnFinished), f"the stream of {operation} ended {events}"
            assert last.message.content.strip() == args[0]
            return last
        if kind == "add":
            return await ref.add_messages([sa.Message.create(sa.Role.ASSISTANT, args[0])])
        if kind == "truncate":
            return await ref.truncate(args[0])
        if kind == "metadata":
            return await ref.set_metadata({args[0]: args[1]})
        if kind == "hibernate":
            return await ref.hibernate()
        return await ref.state()

    return make


async def run_plan(
    url: str,
    plan: Plan,
    store_type: type[TrippingStore] = TrippingStore,
    balance: bool = False,
    **options: Any,
) -> None:
    """Run ``plan`` on two workers over ``url`` (a fresh prefix), checking the model."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    model = Model()
    async with trio.open_nursery() as nursery:
        cluster = Cluster(url, prefix, nursery, store_type, options, balance)
        workers = [await cluster.start(), await cluster.start()]
        with trio.fail_after(BOUND):
            await workers[0].do(lambda registry: registry.spawn("s"))
        for number, (operation, death) in enumerate(plan):
            via = operation[-1]
            kind = operation[0]
            key = f"k{number}"
            owner = next((w for w in workers if w.registry and "s" in w.registry.live()), None)
            with trio.fail_after(BOUND):
                async with trio.open_nursery() as killing:
                    if death is not None:
                        victim, moment = workers[death[0]], death[1]
                        if isinstance(moment, tuple):
                            victim.kill_at_write(*moment)
                        else:

                            async def die(victim: Worker = victim, delay: float = moment) -> None:
                                await trio.sleep(delay)
                                await victim.kill()

                            killing.start_soon(die)
                    answer, value = await workers[via].do(request(operation, key))
                    if death is not None and isinstance(death[1], tuple):
                        assert victim.store is not None
                        victim.store.trip = None
                        if victim.dead:
                            await victim.kill()  # (wait for its end)
            killed = death is not None and workers[death[0]].dead
            if killed and currently_in_test_context():
                role = "+".join(
                    name
                    for name, worker in (("caller", workers[via]), ("owner", owner))
                    if worker is victim
                )
                event(f"{kind}: killed {role or 'a bystander'}; the caller: {answer}")
            if killed:
                assert death is not None
                slot, _, comeback = death
                other = workers[1 - slot]
                if comeback is not None or other is victim:
                    old = victim.worker_id
                    workers[slot] = await cluster.start(old if comeback == "same" else None)
                    if other.dead:  # it served both
                        workers[1 - slot] = workers[slot]
                else:
                    workers[slot] = other  # the survivor serves both
            candidates = [model, after(model, operation)]
            if answer == "ok":
                model = after(model, operation)
                if kind == "history":
                    assert seen(value) == model, f"{operation} read {seen(value)}, not {model}"
            elif answer == "error" and not killed and kind != "hibernate":
                raise AssertionError(f"{operation} of {plan} raised without a death: {value!r}")
            reader = workers[via] if killed else workers[(via + 1) % 2]
            keyed = kind in ("send", "stream") and operation[2]
            if keyed and answer != "ok":  # its caller sends it again, with its key
                with trio.fail_after(BOUND):
                    again, value = await reader.do(request(operation, key, again=True))
                assert again == "ok", f"{operation} of {plan} sent again: {again} {value!r}"
                answer, model = "ok", after(model, operation)
            if answer == "died":  # its request may still be on its way to the owner
                await trio.sleep(TTL)
            with trio.fail_after(BOUND):
                while True:  # (a turn whose caller died runs on where its session runs)
                    outcome, state = await reader.do(lambda registry: registry.ref("s").state())
                    assert outcome == "ok", f"a read after {operation} of {plan}: {state!r}"
                    if state.status is not sa.Status.RUNNING:
                        break
                    await trio.sleep(0.05)
            found = seen(state)
            if answer == "ok":
                assert found == model, (
                    f"{operation} of {plan} was answered; the next read found {found}, not {model}"
                )
            else:
                assert found in candidates, (
                    f"{operation} of {plan} ({answer}: {value!r}) left {found}; it may leave "
                    f"one of {candidates}"
                )
                model = found
        # the end: every worker killed, a new one finds what was answered in the store
        for worker in workers:
            if not worker.dead:
                await worker.kill()
        last = await cluster.start()
        with trio.fail_after(BOUND):
            outcome, state = await last.do(lambda registry: registry.ref("s").state())
        assert outcome == "ok", f"the read after {plan}: {state!r}"
        assert seen(state) == model, (
            f"after {plan} and every worker killed, the store held {seen(state)}, not {model}"
        )
        nursery.cancel_scope.cancel()


def real_run(url: str, plan: Plan, **options: Any) -> None:
    trio.run(lambda: run_plan(url, plan, **options))


@pytest.mark.parametrize(
    "balance", [False, pytest.param(True, marks=pytest.mark.soak)], ids=["fixed", "balanced"]
)
# a few plans in `make test` (each takes real seconds); the search is the soak test below
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=PLAN)
def test_operations_through_two_workers_with_kills_are_kept_whole_and_once(
    redis_url: str, balance: bool, plan: Plan
) -> None:
    """Every operation through either of two workers, one of which may be killed while it
    runs, is kept whole or not at all, once, and every answered one is kept."""
    real_run(redis_url, plan, balance=balance)


@pytest.mark.soak
@pytest.mark.parametrize("balance", [False, True], ids=["fixed", "balanced"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=PLAN)
def test_soak_operations_through_two_workers_with_kills(
    redis_url: str, balance: bool, plan: Plan
) -> None:
    """The same property as above, searched longer."""
    real_run(redis_url, plan, balance=balance)


#: an answered turn on worker 0, then worker 0 killed while worker 1 reads
KILLED_AFTER_AN_ANSWER: Plan = [
    (("send", "alpha", False, 0), None),
    (("history", 1), (0, 0.0, None)),
]


@pytest.mark.parametrize("flaw", ["lose_appends", "ack_early"])
def test_the_property_catches_a_store_that_loses_answered_writes(redis_url: str, flaw: str) -> None:
    """The negative controls: a store whose appends are acknowledged and not written, and
    a registry that answers before the turn is durable (durability="hibernate"), each fail
    a plan that passes as it should be."""
    real_run(redis_url, KILLED_AFTER_AN_ANSWER)
    options: dict[str, Any] = (
        {"store_type": LosingStore} if flaw == "lose_appends" else {"durability": "hibernate"}
    )
    with pytest.raises(BaseExceptionGroup) as caught:
        real_run(redis_url, KILLED_AFTER_AN_ANSWER, **options)
    assert caught.group_contains(
        AssertionError, match=r"was answered; the next read found|\) read Model"
    )


OWNER_KILLED_OPERATIONS = [
    ("send", "beta", False, 1),
    ("send", "beta", True, 1),
    ("stream", "beta", False, 1),
    ("stream", "beta", True, 1),
    ("add", "beta", 1),
    ("truncate", 1, 1),
    ("metadata", "a", 1, 1),
    ("hibernate", 1),
]


@pytest.mark.soak
@pytest.mark.parametrize("comeback", ["same", "fresh", None])
@pytest.mark.parametrize("moment", [("before", 0), ("after", 0), ("before", 1), ("after", 1)])
@pytest.mark.parametrize("operation", OWNER_KILLED_OPERATIONS, ids=repr)
def test_soak_an_operation_through_a_worker_whose_owner_is_killed_at_a_write(
    redis_url: str, operation: tuple[Any, ...], moment: tuple[str, int], comeback: str | None
) -> None:
    """An operation through another worker than the session's owner, whose owner is killed
    at the start or end of one of its writes, is kept whole or not at all, once."""
    plan: Plan = [
        (("send", "alpha", False, 0), None),  # live on worker 0
        (operation, (0, moment, comeback)),
        (("history", 1), None),
    ]
    real_run(redis_url, plan)


async def test_a_keyed_stream_through_another_worker_whose_owner_is_killed_after_its_first_write_ends(
    redis_url: str,
) -> None:
    """ref.stream with an idempotency key through another worker than the session's owner,
    whose owner is killed (-9) just after the turn's first write, ends with the turn's
    TurnFinished once the turn runs again on the session's next owner: it does not wait
    forever."""
    await run_plan(
        redis_url,
        [
            (("send", "alpha", False, 0), None),  # live on worker 0
            (("stream", "beta", True, 1), (0, ("after", 0), None)),
        ],
    )


@pytest.mark.parametrize("waker", ["subscriber's worker", "a new worker"])
async def test_a_subscription_elsewhere_gets_the_outcome_its_killed_owner_wrote_and_never_published(
    redis_url: str, waker: str
) -> None:
    """A subscription on another worker than the session's owner, whose owner is killed
    (-9) just after it wrote a turn's outcome and before publishing it, gets that
    TurnFinished once the session wakes elsewhere, even if nothing runs there after."""
    seen: list[sa.Event] = []
    async with trio.open_nursery() as nursery:
        cluster = Cluster(redis_url, f"sa-test:{uuid.uuid4().hex}", nursery)
        owner, subscriber = await cluster.start(), await cluster.start()
        with trio.fail_after(BOUND):
            await owner.do(lambda registry: registry.spawn("s"))
            await owner.do(lambda registry: registry.ref("s").send("alpha"))  # live there
            started = trio.Event()

            async def subscribe(registry: sa.Registry) -> None:
                async with registry.ref("s").subscribe() as events:
                    started.set()
                    async for event in events:
                        seen.append(event)
                        if isinstance(event, sa.TurnFinished):
                            return

            nursery.start_soon(subscriber.do, subscribe)
            await started.wait()
            owner.kill_at_write("after", 0)  # the write of the turn's outcome
            assert await owner.do(lambda registry: registry.ref("s").send("beta")) == (
                "died",
                None,
            )
            await owner.kill()
            waking = subscriber if waker == "subscriber's worker" else await cluster.start()
            await waking.do(lambda registry: registry.ref("s").history())
            while not seen or not isinstance(seen[-1], sa.TurnFinished):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert isinstance(seen[0], sa.TurnStarted)
    assert isinstance(seen[-1], sa.TurnFinished)
    assert seen[-1].turn_id == seen[0].turn_id


class CorruptReadsStore(TrippingStore):
    """With ``corrupt``, every journal entry it reads back with ``read_journal`` is
    garbage (a corrupt journal, as a damaged server or a foreign writer leaves it)."""

    corrupt = False

    async def read_journal(self, session_id: str, after: int = 0) -> Any:
        trimmed, entries = await super().read_journal(session_id, after)
        if self.corrupt:
            entries = [JournalEntry(e.seq, b"\xc1 not msgpack") for e in entries]
        return trimmed, entries


async def test_a_corrupt_journal_behind_a_killed_owner_ends_the_subscription_not_the_worker(
    redis_url: str,
) -> None:
    """As above, but the journal that the subscriber's worker reads the unpublished
    outcome from is corrupt: the subscription ends (SubscriberLaggedError: subscribe
    again, and hear what is wrong) instead of waiting for events, and that worker goes on
    serving its other sessions."""
    ended: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        cluster = Cluster(redis_url, f"sa-test:{uuid.uuid4().hex}", nursery, CorruptReadsStore)
        owner, subscriber = await cluster.start(), await cluster.start()
        with trio.fail_after(BOUND):
            await owner.do(lambda registry: registry.spawn("s"))
            await owner.do(lambda registry: registry.ref("s").send("alpha"))  # live there
            started = trio.Event()

            async def subscribe(registry: sa.Registry) -> None:
                try:
                    async with registry.ref("s").subscribe() as events:
                        started.set()
                        async for _ in events:
                            pass
                except sa.SessionActorsError as exc:
                    ended.append(exc)
                    raise

            nursery.start_soon(subscriber.do, subscribe)
            await started.wait()
            owner.kill_at_write("after", 0)  # the write of the turn's outcome
            assert await owner.do(lambda registry: registry.ref("s").send("beta")) == (
                "died",
                None,
            )
            await owner.kill()
            assert isinstance(subscriber.store, CorruptReadsStore)
            subscriber.store.corrupt = True
            await subscriber.do(lambda registry: registry.ref("s").history())
            while not ended:
                await trio.sleep(0.05)
            subscriber.store.corrupt = False
            await subscriber.do(lambda registry: registry.spawn("other"))
            status, reply = await subscriber.do(lambda registry: registry.ref("other").send("hi"))
        nursery.cancel_scope.cancel()
    assert isinstance(ended[0], sa.SubscriberLaggedError)
    assert status == "ok", reply
    assert reply.text.strip() == "hi"
