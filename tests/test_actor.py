"""One session's actor: turn order, cancel, stop, failures, backpressure, reads, idempotency."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import MemoryStore
from sessionactors.testing import EchoModel, FaultyStore, Gate, Scripted, ScriptedModel


def pairs(history: Sequence[sa.Message]) -> list[tuple[str, str]]:
    """The history as (user text, reply text) pairs; fails unless it alternates user/assistant."""
    roles = [m.role for m in history]
    assert roles == [sa.Role.USER, sa.Role.ASSISTANT] * (len(history) // 2), roles
    return [(history[i].content, history[i + 1].content) for i in range(0, len(history), 2)]


def held(text: str, event: trio.Event, after: int = 1) -> Scripted:
    """A scripted answer that streams ``after`` words of ``text`` and then waits for ``event``."""
    return Scripted(text=text, wait=event, wait_after=after)


def echo_step(request: sa.ModelRequest) -> str:
    """A scripted step that answers with the last message's text."""
    return request.messages[-1].content


def agents_of(model: sa.Model) -> dict[str, sa.Agent]:
    return {"main": sa.Agent(model=model)}


async def collect(
    ref: sa.SessionRef, into: list[sa.Event], *, task_status: trio.TaskStatus
) -> None:
    """Subscribe to ``ref`` and append its events to ``into`` until cancelled."""
    async with ref.subscribe() as events:
        task_status.started()
        async for event in events:
            into.append(event)


# ---- ordering --------------------------------------------------------------------


async def test_concurrent_senders_each_get_their_reply_in_mailbox_order(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """100 concurrent senders to one session each get their own reply, and the history holds
    each user message followed by its reply, turn by turn in mailbox order."""
    gate = trio.Event()
    model = ScriptedModel([held("opening", gate), echo_step], repeat=True)
    accepted: list[str] = []
    replies: dict[str, sa.Reply] = {}
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("crowd")
        first = await ref.submit("opening")

        async def sender(text: str) -> None:
            # A ready session enqueues without yielding first, and senders that wait for
            # room are admitted first come, first served: this list is the mailbox order.
            accepted.append(text)
            replies[text] = await ref.send(text)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(sender, f"message {i}")
                await trio.testing.wait_all_tasks_blocked()
                assert len(accepted) == 100
                gate.set()
            await first.reply()
            history = await ref.history()

    assert all(replies[text].text == text for text in accepted)
    assert len({reply.turn_id for reply in replies.values()}) == 100
    assert pairs(history) == [("opening", "opening")] + [(t, t) for t in accepted]


# ---- cancel ---------------------------------------------------------------------


async def test_cancel_keeps_the_streamed_part_and_runs_the_next_turn() -> None:
    """cancel() fails the turn in flight with TurnCancelledError, keeps what it streamed as an
    interrupted assistant message, and the next queued turn then runs."""
    gate = trio.Event()
    model = ScriptedModel([held("one two three four", gate, after=2), "second answer"])
    events: list[sa.Event] = []
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("c")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(collect, ref, events)
                first = await ref.submit("first")
                second = await ref.submit("second")
                await trio.testing.wait_all_tasks_blocked()
                assert await ref.cancel() is True
                with pytest.raises(sa.TurnCancelledError) as info:
                    await first.reply()
                reply = await second.reply()
                assert await ref.cancel() is False  # nothing in flight now
                history = await ref.history()
                nursery.cancel_scope.cancel()
        assert registry.statistics().turns_cancelled == 1

    assert info.value.turn_id == first.id
    assert info.value.session_id == "c"
    assert reply.text == "second answer"
    assert [(m.role, m.content, m.interrupted) for m in history] == [
        (sa.Role.USER, "first", False),
        (sa.Role.ASSISTANT, "one two", True),
        (sa.Role.USER, "second", False),
        (sa.Role.ASSISTANT, "second answer", False),
    ]
    cancelled = [e for e in events if isinstance(e, sa.TurnCancelled)]
    assert [e.turn_id for e in cancelled] == [first.id]


async def test_a_stop_for_a_turn_that_just_ended_leaves_the_next_turn_running() -> None:
    """cancel(turn_id=...) that arrives after its turn ended, while the next queued turn (another
    caller's) runs, answers False and leaves that turn alone; with the running turn's id it
    cancels it."""
    gates = [trio.Event(), trio.Event()]
    model = ScriptedModel([held("tab a answer", gates[0]), held("tab b answer", gates[1])])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("tabs")
        with trio.fail_after(10):
            tab_a = await ref.submit("from tab a")
            tab_b = await ref.submit("from tab b")
            await trio.testing.wait_all_tasks_blocked()
            # queued, not in flight: not cancelled (it is not the turn being shown)
            assert await ref.cancel(turn_id=tab_b.id) is False
            gates[0].set()  # tab a's turn ends just as its user presses stop
            assert (await tab_a.reply()).text == "tab a answer"
            await trio.testing.wait_all_tasks_blocked()
            assert (await ref.turn_outcome(tab_b.id)).status is sa.TurnStatus.RUNNING
            assert await ref.cancel(turn_id=tab_a.id) is False  # (its stop came too late)
            assert await ref.cancel(turn_id="not a turn id") is False
            assert await ref.cancel(turn_id="\udc80" + "x" * 1000) is False
            assert (await ref.turn_outcome(tab_b.id)).status is sa.TurnStatus.RUNNING
            assert await ref.cancel(turn_id=tab_b.id) is True
            with pytest.raises(sa.TurnCancelledError):
                await tab_b.reply()
            assert await ref.cancel(turn_id=tab_b.id) is False
            assert (await ref.turn_outcome(tab_b.id)).status is sa.TurnStatus.CANCELLED


async def test_cancel_refuses_a_turn_id_that_is_not_a_str() -> None:
    """cancel(turn_id=...) with a turn id that is not a str raises TypeError naming the
    session, and cancels nothing."""
    gate = trio.Event()
    model = ScriptedModel([held("one two", gate)])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("typed")
        with trio.fail_after(10):
            turn = await ref.submit("hello")
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(TypeError, match="'typed'"):
                await ref.cancel(turn_id=42)  # type: ignore[arg-type]
            gate.set()
            assert (await turn.reply()).text == "one two"


# ---- stop -----------------------------------------------------------------------


async def test_stop_fails_queued_and_later_requests_and_survives_wake() -> None:
    """stop() lets the turn in flight finish, fails queued and later requests with
    SessionStoppedError, and the session stays stopped after hibernate and wake."""
    gate = trio.Event()
    model = ScriptedModel([held("in flight", gate)], repeat=False)
    store = MemoryStore()
    async with sa.open_registry(agents=agents_of(model), store=store, mailbox_size=3) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            first = await ref.submit("first")
            await trio.testing.wait_all_tasks_blocked()
            queued = [await ref.submit(f"queued {i}") for i in range(3)]

            async def parked() -> None:
                with pytest.raises(sa.SessionStoppedError):
                    await ref.submit("waiting for room")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(parked)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ref.stop)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(sa.SessionStoppedError):
                    await ref.submit("while stopping")
                gate.set()
            assert (await first.reply()).text == "in flight"
            for turn in queued:
                with pytest.raises(sa.SessionStoppedError):
                    await turn.reply()
            assert "s" not in registry.live()
            with pytest.raises(sa.SessionStoppedError):
                await ref.send("later")
            await ref.hibernate()  # not live: left alone
            with pytest.raises(sa.SessionStoppedError):
                await registry.ref("s").send("after wake")
            (info,) = await registry.sessions()
            assert info.status is sa.Status.STOPPED

    async with sa.open_registry(agents=agents_of(model), store=store) as registry:
        with trio.fail_after(10), pytest.raises(sa.SessionStoppedError):
            await registry.ref("s").send("in a new registry")


# ---- model failure ------------------------------------------------------------------


async def test_model_failure_fails_the_turn_not_the_session() -> None:
    """A model that raises fails that turn with TurnFailedError (its __cause__ the original)
    and a TurnFailed event, and the session answers the next message."""
    boom = ValueError("the model broke")
    model = ScriptedModel([boom, "recovered"])
    events: list[sa.Event] = []
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("m")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(collect, ref, events)
                with pytest.raises(sa.TurnFailedError) as info:
                    await ref.send("first")
                reply = await ref.send("second")
                nursery.cancel_scope.cancel()
            history = await ref.history()
        stats = registry.statistics()

    assert info.value.__cause__ is boom
    assert info.value.session_id == "m"
    (failed,) = [e for e in events if isinstance(e, sa.TurnFailed)]
    assert failed.turn_id == info.value.turn_id
    assert "the model broke" in failed.error
    assert reply.text == "recovered"
    # the failed turn leaves a marked "no reply" message: roles keep alternating
    assert [m.content for m in history] == [
        "first",
        "(no reply: this turn failed)",
        "second",
        "recovered",
    ]
    assert [m.interrupted for m in history] == [False, True, False, False]
    assert (stats.turns_failed, stats.turns_completed, stats.crashes) == (1, 1, 0)


# ---- abandoned wait -------------------------------------------------------------------


async def test_abandoned_wait_does_not_cancel_the_turn(autojump_clock: trio.abc.Clock) -> None:
    """A caller cancelled while waiting for its reply only abandons the wait: the turn runs on
    and its reply is in the history."""
    async with sa.open_registry(agents={"slow": sa.Agent(model=EchoModel(delay=1.0))}) as registry:
        ref = await registry.spawn("a")
        with trio.move_on_after(2.5) as scope:
            await ref.send("one two three four five")
        assert scope.cancelled_caught
        with trio.fail_after(30):
            await ref.send("next")
            history = await ref.history()
        assert registry.statistics().turns_cancelled == 0

    assert pairs(history) == [
        ("one two three four five", "one two three four five"),
        ("next", "next"),
    ]


# ---- mailbox bound ----------------------------------------------------------------------


async def test_full_mailbox_rejects_nowait_and_backpressures_submit() -> None:
    """With the mailbox full, submit_nowait raises MailboxFullError, submit waits for room,
    and the mailbox never holds more than mailbox_size requests."""
    gate = trio.Event()
    model = ScriptedModel([held("held", gate), echo_step], repeat=True)
    async with sa.open_registry(agents=agents_of(model), mailbox_size=3) as registry:
        ref = await registry.spawn("box")
        with trio.fail_after(10):
            first = await ref.submit("held")
            await trio.testing.wait_all_tasks_blocked()  # the held turn left the mailbox
            accepted = [ref.submit_nowait(f"nowait {i}") for i in range(3)]
            for _ in range(3):  # full at mailbox_size, however often it is tried
                with pytest.raises(sa.MailboxFullError) as info:
                    ref.submit_nowait("one too many")
            assert info.value.session_id == "box"

            late: list[sa.Turn] = []

            async def submitter() -> None:
                late.append(await ref.submit("waited for room"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(submitter)
                await trio.testing.wait_all_tasks_blocked()
                assert late == []  # backpressure: waiting for room
                with pytest.raises(sa.MailboxFullError):
                    ref.submit_nowait("still full")
                gate.set()
            replies = [await t.reply() for t in [first, *accepted, *late]]

    assert [r.text for r in replies] == [
        "held",
        "nowait 0",
        "nowait 1",
        "nowait 2",
        "waited for room",
    ]


# ---- out-of-band reads ---------------------------------------------------------------------


async def test_reads_are_answered_while_turns_are_queued() -> None:
    """history() and state() answer at once while turns queue behind a held one, and the held
    turn's user message is in the history from the moment the turn starts."""
    gate = trio.Event()
    model = ScriptedModel([held("held reply", gate)])
    model.add("a", "b")
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("r")
        with trio.fail_after(10):
            first = await ref.submit("held")
            queued = [await ref.submit("queued a"), await ref.submit("queued b")]
            await trio.testing.wait_all_tasks_blocked()
        # No await below may wait behind the queue: zero virtual or real time allowed.
        with trio.fail_after(1):
            history = await ref.history()
            state = await ref.state()
        gate.set()
        with trio.fail_after(10):
            texts = [(await t.reply()).text for t in [first, *queued]]

    assert [(m.role, m.content) for m in history] == [(sa.Role.USER, "held")]
    assert state.status is sa.Status.RUNNING
    assert [m.content for m in state.messages] == ["held"]
    assert texts == ["held reply", "a", "b"]


# ---- idempotency -----------------------------------------------------------------------------


async def test_idempotent_retry_returns_the_stored_reply() -> None:
    """A retried send with the same idempotency_key returns the stored reply without a second
    turn, also after the session hibernated and woke."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("i")
        with trio.fail_after(10):
            first = await ref.send("pay 10", idempotency_key="k1")
            again = await ref.send("pay 10", idempotency_key="k1")
            await ref.hibernate()
            assert registry.live() == []
            woken = await registry.ref("i").send("pay 10", idempotency_key="k1")
            other = await ref.send("pay 10", idempotency_key="k2")
            history = await ref.history()
        assert registry.statistics().turns_completed == 2

    assert again.turn_id == woken.turn_id == first.turn_id
    assert again.message == woken.message == first.message
    assert other.turn_id != first.turn_id
    assert pairs(history) == [("pay 10", "pay 10"), ("pay 10", "pay 10")]


async def test_concurrent_submits_with_one_key_share_one_turn() -> None:
    """Two concurrent submits with the same idempotency_key share one turn and one reply."""
    gate = trio.Event()
    model = ScriptedModel([held("only once", gate)])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("k")
        with trio.fail_after(10):
            one = await ref.submit("do it", idempotency_key="same")
            two = await ref.submit("do it", idempotency_key="same")
            three = ref.submit_nowait("do it", idempotency_key="same")
            gate.set()
            replies = [await t.reply() for t in (one, two, three)]
            history = await ref.history()

    assert one.id == two.id == three.id
    assert {r.turn_id for r in replies} == {one.id}
    assert len({r.message.id for r in replies if r.message is not None}) == 1
    assert pairs(history) == [("do it", "only once")]
    assert len(model.requests) == 1


async def test_simultaneous_submits_with_one_key_run_one_turn() -> None:
    """Submits with the same idempotency_key made in the same instant by several tasks get
    one reply from one turn."""
    model = ScriptedModel(["only once"])
    replies: list[sa.Reply] = []
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("k")

        async def sender() -> None:
            replies.append(await ref.send("do it", idempotency_key="same"))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(sender)
            history = await ref.history()

    assert len({(r.turn_id, r.text) for r in replies}) == 1
    assert len(replies) == 5
    assert pairs(history) == [("do it", "only once")]
    assert len(model.requests) == 1


@pytest.mark.parametrize("loaded", [True, False], ids=["loaded", "hibernated"])
@pytest.mark.parametrize("way", ["send", "submit", "submit_nowait"])
async def test_a_replayed_turn_looks_replayed_however_it_was_submitted(
    way: str, loaded: bool
) -> None:
    """A request whose idempotency key completed is the original turn, whichever way it was
    submitted and whether or not its session was loaded: replayed, the original id, and the
    original outcome."""
    model = ScriptedModel(["paid"])
    async with sa.open_registry(agents=agents_of(model)) as registry:
        ref = await registry.spawn("r")
        with trio.fail_after(10):
            first = await ref.send("pay 10", idempotency_key="k")
            if not loaded:
                await ref.hibernate()
                assert registry.live() == []
            ref = registry.ref("r")
            turn: sa.Turn | None = None
            if way == "send":
                reply = await ref.send("pay 10", idempotency_key="k")
            else:
                if way == "submit":
                    turn = await ref.submit("pay 10", idempotency_key="k")
                else:
                    turn = ref.submit_nowait("pay 10", idempotency_key="k")
                at_once = turn.id  # (a waking session has not looked the key up yet)
                reply = await turn.reply()
                assert await ref.turn_outcome(at_once) == await ref.turn_outcome(turn.id)
            outcome = await ref.turn_outcome(reply.turn_id if turn is None else turn.id)
            history = await ref.history()

    assert reply.turn_id == first.turn_id
    assert reply.message == first.message
    if turn is not None:
        assert turn.replayed
        assert turn.id == first.turn_id
    assert outcome.status is sa.TurnStatus.FINISHED
    assert outcome.turn_id == first.turn_id
    assert outcome.message == first.message
    assert pairs(history) == [("pay 10", "paid")]
    assert len(model.requests) == 1


async def test_a_keyed_submit_behind_a_submit_nowait_to_a_waking_session_is_replayed() -> None:
    """A submit or stream whose key completed is replayed when it returns, even when a
    submit_nowait with that key reached the waking session first."""
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("w")
        with trio.fail_after(10):
            first = await ref.send("pay", idempotency_key="k")
            await ref.hibernate()
            early = ref.submit_nowait("pay", idempotency_key="k")
            turn = await ref.submit("pay", idempotency_key="k")
            replayed_at_once = turn.replayed, turn.id
            async with ref.stream("pay", idempotency_key="k") as events:
                streamed = [event async for event in events]
            await early.reply()

    assert replayed_at_once == (True, first.turn_id)
    assert streamed == []
    assert (early.replayed, early.id) == (True, first.turn_id)


@contextlib.asynccontextmanager
async def full_mailbox() -> AsyncIterator[tuple[sa.SessionRef, trio.Event, sa.Turn, sa.Turn]]:
    """Session "q" with ``mailbox_size=1``: its turn "held" runs until the gate opens and
    "filler" fills the mailbox, so the next submit waits for room. Yields the ref, the
    gate and the two turns."""
    gate = trio.Event()
    model = ScriptedModel([held("held", gate), echo_step], repeat=True)
    async with sa.open_registry(agents=agents_of(model), mailbox_size=1) as registry:
        ref = await registry.spawn("q")
        first = await ref.submit("held")
        await trio.testing.wait_all_tasks_blocked()
        yield ref, gate, first, await ref.submit("filler")


async def test_same_key_submits_waiting_for_room_share_one_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Same-key submits that all wait for mailbox room share one turn: one id, its reply and
    its outcome, and a stream of it ends with that turn's outcome."""
    turns: list[sa.Turn] = []
    streamed: list[sa.Event] = []
    async with full_mailbox() as (ref, gate, first, filler):
        with trio.fail_after(10):

            async def submitter() -> None:
                turns.append(await ref.submit("pay", idempotency_key="k"))

            async def streamer() -> None:
                async with ref.stream("pay", idempotency_key="k") as events:
                    streamed.extend([event async for event in events])

            async with trio.open_nursery() as nursery:
                for task in (submitter, submitter, streamer):
                    nursery.start_soon(task)
                    await trio.testing.wait_all_tasks_blocked()
                gate.set()
            await first.reply()
            await filler.reply()
            replies = [await turn.reply() for turn in turns]
            outcomes = [await ref.turn_outcome(turn.id) for turn in turns]
            history = await ref.history()

    assert turns[0].id == turns[1].id == replies[0].turn_id == replies[1].turn_id
    assert [o.status for o in outcomes] == [sa.TurnStatus.FINISHED] * 2
    assert isinstance(streamed[-1], sa.TurnFinished)
    assert streamed[-1].turn_id == turns[0].id
    assert pairs(history) == [("held", "held"), ("filler", "filler"), ("pay", "pay")]


# ---- crashes -------------------------------------------------------------------------------


async def test_crash_restarts_from_the_last_completed_turn() -> None:
    """A store fault crashes the actor: the waiter and the queued requests get
    SessionCrashedError, and the restarted session keeps only completed turns and answers."""
    store = FaultyStore()
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}, store=store) as r:
        ref = await r.spawn("x")
        with trio.fail_after(10):
            await ref.send("kept")
            store.fail("append", session_id="x")
            doomed = await ref.submit("lost")
            queued = await ref.submit("queued")
            with pytest.raises(sa.SessionCrashedError) as info:
                await doomed.reply()
            with pytest.raises(sa.SessionCrashedError):
                await queued.reply()
            reply = await ref.send("again")
            history = await ref.history()
        stats = r.statistics()

    assert store.injected == 1  # negative control: the fault really fired, once
    assert isinstance(info.value.__cause__, OSError)
    assert reply.text == "again"
    assert pairs(history) == [("kept", "kept"), ("again", "again")]
    assert (stats.crashes, stats.restarts, stats.failed) == (1, 1, 0)


async def test_restart_intensity_marks_the_session_failed(autojump_clock: trio.abc.Clock) -> None:
    """Past max_restarts crashes within restart_window the session is marked failed and fails
    fast with SessionCrashedError, while the registry and other sessions carry on."""
    store = FaultyStore()
    async with sa.open_registry(
        agents={"echo": sa.Agent(model=EchoModel())}, store=store, restart_window=5.0
    ) as registry:
        ref = await registry.spawn("bad")
        other = await registry.spawn("good")
        with trio.fail_after(30):
            # Crashes spread over more than the window never reach the limit.
            store.fail("append", session_id="bad")
            for _ in range(5):
                with pytest.raises(sa.SessionCrashedError, match="restarted"):
                    await ref.send("spread out")
                store.fail("append", session_id="bad")
                await trio.sleep(2)
            store.fail("append", session_id="bad", times=0)
            assert (await ref.send("fine")).text == "fine"
            await trio.sleep(6)
        store.fail("append", session_id="bad", times=None)
        with trio.fail_after(10):
            for _ in range(3):
                with pytest.raises(sa.SessionCrashedError, match="restarted"):
                    await ref.send("crash")
            with pytest.raises(sa.SessionCrashedError, match="marked failed"):
                await ref.send("crash")
            injected = store.injected
            with pytest.raises(sa.SessionCrashedError, match="marked failed"):
                await ref.send("fails fast")
            assert store.injected == injected  # no actor ran for it
            assert (await other.send("still here")).text == "still here"
            infos = {i.session_id: i for i in await registry.sessions()}
            stats = registry.statistics()
            assert "bad" not in registry.live()
            await registry.delete("bad")  # a failed name can be deleted and spawned afresh
            store.fail("append", session_id="bad", times=0)
            assert (await (await registry.spawn("bad")).send("new")).text == "new"

    assert infos["bad"].status is sa.Status.FAILED
    assert (stats.failed, stats.failed_sessions) == (1, 1)
    assert stats.crashes == 9


async def test_a_session_failed_by_its_store_is_tried_again_after_the_window(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A session marked failed because its store kept failing (StoreError: a store can come back, as after a failover) rests for restart_window; then the next request starts it again from its durable state. One that crashed for another cause (here a store that raises RuntimeError: a bug) stays failed until the process restarts or it is deleted.

    The first is said at WARNING, in one line that says it rests (a failover marked
    every session so, each at ERROR with its traceback, as if it had stopped for good);
    the second at ERROR, with its traceback."""
    store = FaultyStore()
    async with sa.open_registry(
        agents={"echo": sa.Agent(model=EchoModel())}, store=store, restart_window=5.0
    ) as registry:
        flaky, buggy = await registry.spawn("flaky"), await registry.spawn("buggy")
        for ref in (flaky, buggy):
            await ref.send("kept")
        store.fail("append", session_id="flaky", times=None)
        store.fail("append", session_id="buggy", times=None, error=RuntimeError("a bug"))
        with trio.fail_after(10):
            for ref in (flaky, buggy):
                for _ in range(3):
                    with pytest.raises(sa.SessionCrashedError, match="restarted"):
                        await ref.send("crash")
                with pytest.raises(sa.SessionCrashedError, match="marked failed"):
                    await ref.send("crash")
        store.fail("append", session_id="flaky", times=0)
        store.fail("append", session_id="buggy", times=0)
        with pytest.raises(sa.SessionCrashedError, match="tried again"):
            await flaky.send("too early")
        await trio.sleep(5)
        with trio.fail_after(10):
            assert (await flaky.send("back")).text == "back"
            with pytest.raises(sa.SessionCrashedError, match="marked failed"):
                await buggy.send("still failed")
        assert pairs(await flaky.history()) == [("kept", "kept"), ("back", "back")]
        infos = {i.session_id: i.status for i in await registry.sessions()}
    assert infos == {"flaky": sa.Status.IDLE, "buggy": sa.Status.FAILED}
    marked = {r.getMessage().split("'")[1]: r for r in caplog.records if "marked" in r.getMessage()}
    assert (marked["flaky"].levelname, marked["flaky"].exc_info) == ("WARNING", None)
    assert "tried again" in marked["flaky"].getMessage()
    assert marked["buggy"].levelname == "ERROR"
    assert marked["buggy"].exc_info


async def test_sharing_an_abandoned_keyed_submit_does_not_wait_forever(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A submit that joined a same-key submit still waiting for mailbox room gets an answer
    even when that first submit is abandoned before its request reached the mailbox."""
    async with full_mailbox() as (ref, gate, first, filler):
        with trio.fail_after(10):

            async def impatient() -> None:
                with trio.move_on_after(1):
                    await ref.submit("pay", idempotency_key="k")

            joined: list[sa.Turn] = []

            async def joiner() -> None:
                joined.append(await ref.submit("pay", idempotency_key="k"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(impatient)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(joiner)
                await trio.sleep(2)  # the impatient submit gives up waiting for room
                gate.set()
            await first.reply()
            await filler.reply()
            reply = await joined[0].reply()
            retried = await ref.send("pay", idempotency_key="k")
            history = await ref.history()

    assert reply.turn_id == retried.turn_id
    assert pairs(history) == [("held", "held"), ("filler", "filler"), ("pay", "pay")]


async def test_statistics_count_the_turns_running_now() -> None:
    """``turns_running`` counts the sessions whose turn is under way now, on this
    registry: what an operator watches to find turns that hang (the ``turns`` counters
    move only when turns end)."""
    gate = Gate()
    model = ScriptedModel(
        [Scripted(text="slow", wait=gate), Scripted(text="slow", wait=gate), "quick"]
    )
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        refs = [await registry.spawn(f"s{i}") for i in range(3)]
        assert registry.statistics().turns_running == 0
        held = [await refs[0].submit("one"), await refs[1].submit("two")]
        while gate.waiting < 2:
            await trio.sleep(0.01)
        assert registry.statistics().turns_running == 2
        await refs[2].send("three")  # (done: counted no longer)
        assert registry.statistics().turns_running == 2
        gate.open()
        for turn in held:
            await turn.reply()
        stats = registry.statistics()
        assert (stats.turns_running, stats.turns_completed) == (0, 3)
